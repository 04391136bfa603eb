//! Every shader in `wgsl/` parses, validates and translates to SPIR-V, MSL and HLSL
//! with naga, on the CPU: a broken shader fails `cargo test` without any GPU. Every
//! kernel validates with no optional capabilities, except the subgroup decode kernel,
//! which validates with `Capabilities::SUBGROUP` (and only with it).

use std::path::{Path, PathBuf};

use naga::back::PipelineConstants;
use naga::valid::{Capabilities, ModuleInfo, ValidationFlags, Validator};
use omniprefix::backend::wgpu::Shader;

fn wgsl_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("wgsl")
}

/// The kernel files of `wgsl/` (every `.wgsl` but the preludes, `Shader::PRELUDES`, which
/// `Shader::source` composes before kernels).
fn shader_files() -> Vec<PathBuf> {
    let dir = wgsl_dir();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|entry| entry.expect("directory entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "wgsl"))
        .filter(|path| !Shader::PRELUDES.iter().any(|(name, _)| path.ends_with(name)))
        .collect();
    files.sort();
    files
}

/// The shader of a kernel file; every file of `wgsl/` must be one the backend compiles.
fn shader_of(path: &Path) -> Shader {
    *Shader::ALL
        .iter()
        .find(|s| path.ends_with(s.name()))
        .unwrap_or_else(|| panic!("{} is no `Shader` of backend::wgpu::pipelines", path.display()))
}

/// The capabilities a shader is validated with: none optional (no `enable f16;`) but the
/// f16 pair conversions when the f16 prelude is in, and subgroups only for the kernel
/// the backend compiles only on devices with `Features::SUBGROUP`.
fn capabilities(shader: Shader, f16_pairs: bool) -> Capabilities {
    let mut caps = Capabilities::empty();
    if f16_pairs {
        caps |= Capabilities::SHADER_FLOAT16_IN_FLOAT32;
    }
    if shader.needs_subgroups() {
        // Validator::new enables every subgroup operation set in compute with it.
        caps |= Capabilities::SUBGROUP;
    }
    caps
}

/// The source as the backend compiles it (`Shader::source`: preludes, then the kernel),
/// parsed and validated with [`capabilities`], then the override constants resolved to
/// their defaults as a pipeline would.
fn validated(path: &Path, f16_pairs: bool) -> (naga::Module, ModuleInfo) {
    let shader = shader_of(path);
    let source = shader.source(f16_pairs);
    let label = format!("{} ({})", path.display(), if f16_pairs { "f16 pairs" } else { "f16 stubs" });
    let module = naga::front::wgsl::parse_str(&source)
        .unwrap_or_else(|e| panic!("{}: parse error:\n{}", label, e.emit_to_string(&source)));
    let info = Validator::new(ValidationFlags::all(), capabilities(shader, f16_pairs))
        .validate(&module)
        .unwrap_or_else(|e| panic!("{}: validation error:\n{}", label, e.emit_to_string(&source)));
    let (module, info) = naga::back::pipeline_constants::process_overrides(
        &module,
        &info,
        None,
        &PipelineConstants::default(),
    )
    .unwrap_or_else(|e| panic!("{}: overrides: {e}", label));
    (module.into_owned(), info.into_owned())
}

#[test]
fn shader_directory_holds_every_kernel() {
    let names: Vec<String> = shader_files()
        .iter()
        .filter_map(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .collect();
    for expected in [
        "copy_blocks",
        "elementwise",
        "matmul",
        "moe",
        "paged_attention",
        "paged_decode_subgroup",
        "paged_rows",
        "rmsnorm",
        "rope",
        "rows",
    ] {
        assert!(names.iter().any(|n| n == expected), "wgsl/{expected}.wgsl missing; found {names:?}");
    }
    assert_eq!(names.len(), Shader::ALL.len(), "every kernel file is a Shader and back: {names:?}");
}

/// Only the subgroup decode kernel needs `Capabilities::SUBGROUP`: without it naga
/// rejects it (so the capability is what gates it), and every other kernel validates
/// without it (checked by the next test).
#[test]
fn only_the_subgroup_kernel_needs_subgroups() {
    let needing: Vec<&str> = Shader::ALL.iter().filter(|s| s.needs_subgroups()).map(|s| s.name()).collect();
    assert_eq!(needing, ["paged_decode_subgroup.wgsl"]);
    let source = Shader::PagedDecodeSubgroup.source(true);
    let module = naga::front::wgsl::parse_str(&source).expect("parses");
    let err = Validator::new(ValidationFlags::all(), Capabilities::SHADER_FLOAT16_IN_FLOAT32)
        .validate(&module)
        .expect_err("subgroup operations without Capabilities::SUBGROUP must not validate");
    assert!(format!("{err:?}").to_lowercase().contains("subgroup"), "{err:?}");
}

#[test]
fn every_shader_validates_and_translates_to_spirv_msl_hlsl() {
    let files = shader_files();
    assert!(!files.is_empty(), "no shaders found in wgsl/");
    for (path, f16_pairs) in files.iter().flat_map(|f| [true, false].map(|p| (f.clone(), p))) {
        let (module, info) = validated(&path, f16_pairs);
        assert!(!module.entry_points.is_empty(), "{}: no entry points", path.display());

        let spv = naga::back::spv::write_vec(&module, &info, &naga::back::spv::Options::default(), None)
            .unwrap_or_else(|e| panic!("{}: SPIR-V: {e}", path.display()));
        assert_eq!(spv.first(), Some(&0x0723_0203), "{}: SPIR-V magic", path.display());

        let msl_options = naga::back::msl::Options { lang_version: (2, 1), ..Default::default() };
        for ep in &module.entry_points {
            let pipeline = naga::back::msl::PipelineOptions {
                entry_point: Some((ep.stage, ep.name.clone())),
                ..Default::default()
            };
            let (msl, _) = naga::back::msl::write_string(&module, &info, &msl_options, &pipeline)
                .unwrap_or_else(|e| panic!("{}: MSL ({}): {e}", path.display(), ep.name));
            assert!(msl.contains("kernel"), "{}: MSL for {} has no kernel", path.display(), ep.name);
        }

        let hlsl_options = naga::back::hlsl::Options {
            shader_model: naga::back::hlsl::ShaderModel::V6_0,
            ..Default::default()
        };
        let hlsl_pipeline = naga::back::hlsl::PipelineOptions::default();
        let mut hlsl = String::new();
        naga::back::hlsl::Writer::new(&mut hlsl, &hlsl_options, &hlsl_pipeline)
            .write(&module, &info, None)
            .unwrap_or_else(|e| panic!("{}: HLSL: {e}", path.display()));
        assert!(hlsl.contains("[numthreads("), "{}: HLSL has no compute entry", path.display());
    }
}

/// Bytes of the workgroup variables entry point `ep` uses (naga writes only those into
/// its pipeline, as drivers count them).
fn workgroup_bytes(module: &naga::Module, info: &ModuleInfo, ep: usize) -> u32 {
    module
        .global_variables
        .iter()
        .filter(|&(handle, var)| {
            var.space == naga::AddressSpace::WorkGroup && !info.get_entry_point(ep)[handle].is_empty()
        })
        .map(|(_, var)| module.types[var.ty].inner.size(module.to_ctx()))
        .sum()
}

#[test]
fn every_entry_point_fits_the_webgpu_default_workgroup_memory() {
    let limit = wgpu::Limits::default().max_compute_workgroup_storage_size;
    for path in shader_files() {
        let (module, info) = validated(&path, true);
        for (ep, entry) in module.entry_points.iter().enumerate() {
            let bytes = workgroup_bytes(&module, &info, ep);
            assert!(
                bytes <= limit,
                "{} {}: {bytes} B of workgroup memory > {limit}",
                path.display(),
                entry.name
            );
        }
    }
}

/// Limit and size checks that need no device.
mod limits {
    use omniprefix::Error;
    use omniprefix::backend::wgpu::{PoolPlan, check_limits, plan_pool, prefill_slots, prefill_tiles};
    use omniprefix::error::GpuError;

    /// The prefill kernel's tiles fit its workgroup arrays (queries 1024 f32, a K/V tile
    /// 2048, scores 1024) and its 64 invocations (16 accumulated dims each at most).
    #[test]
    fn prefill_tiles_fit_the_kernels_workgroup_arrays() {
        assert_eq!(prefill_tiles(64), (16, 32));
        assert_eq!(prefill_tiles(128), (8, 16));
        assert_eq!(prefill_tiles(256), (4, 8));
        assert_eq!(prefill_tiles(40), (16, 51));
        for head_dim in 1..=256 {
            let (tq, kt) = prefill_tiles(head_dim);
            assert!(tq.is_power_of_two() && tq <= 16 && kt >= 1, "head_dim {head_dim}: {tq} x {kt}");
            assert!(tq * head_dim <= 1024 && kt * head_dim <= 2048 && tq * kt <= 1024, "head_dim {head_dim}");
            assert!((head_dim * tq).div_ceil(64) <= 16, "head_dim {head_dim}: dims per invocation");
            // A tile's query slots hold (row, head) pairs of one GQA group: never more than
            // TQ, every head of the group in some workgroup, at least one row per tile.
            for group in 1..=8 {
                let (rows, heads) = prefill_slots(tq, group);
                assert!(rows >= 1 && heads >= 1 && rows * heads <= tq, "head_dim {head_dim} group {group}");
                assert!(heads == group || (rows == 1 && heads == tq), "head_dim {head_dim} group {group}");
            }
        }
        assert_eq!(prefill_slots(16, 1), (16, 1));
        assert_eq!(prefill_slots(16, 8), (2, 8));
        assert_eq!(prefill_slots(16, 3), (5, 3));
        assert_eq!(prefill_slots(8, 8), (1, 8));
        assert_eq!(prefill_slots(4, 8), (1, 4)); // two workgroups of 4 heads
        assert_eq!(prefill_slots(4, 5), (1, 4)); // 4 heads, then 1
    }

    #[test]
    fn adapter_below_kernel_limits_is_named() {
        let mut limits = wgpu::Limits::downlevel_defaults();
        limits.max_storage_buffers_per_shader_stage = 4;
        let err = check_limits("tiny adapter", &limits).unwrap_err();
        assert!(
            matches!(&err, Error::Gpu(GpuError::Limit { adapter, limit: "max_storage_buffers_per_shader_stage", required: 7, available: 4 }) if adapter == "tiny adapter"),
            "{err}"
        );
        let limits = wgpu::Limits { max_compute_workgroup_storage_size: 12 * 1024, ..Default::default() };
        let err = check_limits("a", &limits).unwrap_err();
        assert!(
            matches!(
                err,
                Error::Gpu(GpuError::Limit {
                    limit: "max_compute_workgroup_storage_size",
                    required: 16384,
                    ..
                })
            ),
            "{err}"
        );
        assert!(check_limits("webgpu defaults", &wgpu::Limits::default()).is_ok());
    }

    #[test]
    fn pools_split_into_whole_blocks_and_refuse_what_cannot_be_bound() {
        // 10 blocks of 100 f32 (400 B) under a 1000 B binding: 2 blocks per chunk, 5 chunks.
        assert_eq!(
            plan_pool("a", "hidden", 10, 100, 1000, None).unwrap(),
            PoolPlan { blocks_per_chunk: 2, chunks: 5 }
        );
        assert_eq!(
            plan_pool("a", "kv", 10, 100, 4000, Some(2)).unwrap(),
            PoolPlan { blocks_per_chunk: 10, chunks: 1 }
        );
        let err = plan_pool("a", "kv", 10, 100, 1000, Some(2)).unwrap_err();
        assert!(matches!(err, Error::Gpu(GpuError::TooLarge { requested: 4000, max: 1600, .. })), "{err}");
        let err = plan_pool("a", "kv", 10, 1000, 1000, None).unwrap_err();
        assert!(matches!(err, Error::Gpu(GpuError::TooLarge { requested: 4000, max: 1000, .. })), "{err}");
    }
}
