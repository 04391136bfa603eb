// Prelude of every kernel on a device without DownlevelFlags::SHADER_F16_IN_F32, where
// the f16 conversions do not compile: the backend refuses f16 weights and pages there,
// so the kernels' f16 branches (override constants that stay false) never call these.

fn unpack_f16_pair(word: u32) -> vec2<f32> {
    return vec2<f32>(0.0);
}

fn pack_f16_pair(v: vec2<f32>) -> u32 {
    return 0u;
}
