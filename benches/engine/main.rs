//! The engine's CPU benchmarks, one binary (one link in every test build
//! instead of six): scheduler overhead, radix matching, item fingerprints,
//! prefill with a cached prefix, the matmul kernels and CPU paged attention.
//!
//! `cargo bench --bench engine` runs them all; criterion's filter picks one by
//! its group: `sched`, `omni_prompt_match`, `u8_video_60MB` / `f32_mel_4MB`
//! (fingerprints), `prefill_512_tokens`, `matmul_t_`, `cpu_attention_`, e.g.
//! `cargo bench --bench engine -- cpu_attention_`. The wgpu attention bench
//! stays a binary of its own (`--bench attention`), which the GPU scripts build.

mod cpu_attention;
mod fingerprint;
mod matmul;
mod prefill;
mod radix_match;
mod sched;

criterion::criterion_main!(
    sched::benches,
    radix_match::benches,
    fingerprint::benches,
    prefill::benches,
    matmul::benches,
    cpu_attention::benches
);
