// Prelude of every kernel on a device with DownlevelFlags::SHADER_F16_IN_F32 (every
// WebGPU adapter; lavapipe only with SHADER_F16): f16 weights and K/V pages hold two
// halves per 32-bit word, element i in half i % 2 of word i / 2 (low half first).
// The core pack2x16float / unpack2x16float convert; no `enable f16;` is needed, and every
// product and sum stays f32.

fn unpack_f16_pair(word: u32) -> vec2<f32> {
    return unpack2x16float(word);
}

fn pack_f16_pair(v: vec2<f32>) -> u32 {
    return pack2x16float(v);
}
