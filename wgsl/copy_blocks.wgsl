// Copy-on-write of whole blocks inside one pool chunk: block `pairs[2i]` is copied to
// block `pairs[2i + 1]` (chunk-local block numbers). Copies between different chunks
// are plain buffer-to-buffer copies on the host side. Destinations never overlap sources
// (checked by the host), so the order of the copies does not matter. The copy is of
// 32-bit words, whatever they hold (f32, or f16 pairs), so it is bit-exact.

const WG: u32 = 256u;

// p: CopyParams (uniform, binding 0), declared once in src/backend/wgpu/kernel_params.rs
// and composed before this file.
@group(0) @binding(1) var<storage, read> pairs: array<u32>;
@group(0) @binding(2) var<storage, read_write> pool: array<u32>;

@compute @workgroup_size(WG)
fn copy_blocks(inv: Invocation) {
    let idx = flat_index(inv);
    if (idx >= p.n_pairs * p.block_words) {
        return;
    }
    let pair = idx / p.block_words;
    let e = idx % p.block_words;
    pool[pairs[2u * pair + 1u] * p.block_words + e] = pool[pairs[2u * pair] * p.block_words + e];
}
