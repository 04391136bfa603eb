// Prelude of the attention kernels (paged_attention.wgsl, paged_decode_subgroup.wgsl),
// compiled after the f16 pair prelude: reading K/V pages through a block table.
// What these use is declared elsewhere in the composed source (module-scope names may be
// used before they are declared): `p` (AttnParams: blocks_per_chunk), composed from Rust;
// the bindings `row_info` and `k0`/`k1`/`v0`/`v1` (a pool in up to two chunks of whole
// blocks), in paged_decode.wgsl; the override constants HEAD_DIM, NUM_KV_HEADS,
// BLOCK_SIZE, KV_F16, in the kernel file.

// (chunk, element offset in chunk) of key j's row for kv head `kvh`.
fn kv_at(table_offset: u32, j: u32, kvh: u32) -> vec2<u32> {
    let block = row_info[table_offset + j / BLOCK_SIZE];
    let chunk = block / p.blocks_per_chunk;
    let slot = (block - chunk * p.blocks_per_chunk) * BLOCK_SIZE + j % BLOCK_SIZE;
    return vec2<u32>(chunk, (slot * NUM_KV_HEADS + kvh) * HEAD_DIM);
}

// The word of a page chunk that holds element i.
fn word_of(i: u32) -> u32 {
    return select(i, i >> 1u, KV_F16);
}

// Element i of a page chunk as f32, from the word that holds it.
fn page_elem(word: u32, i: u32) -> f32 {
    if (KV_F16) {
        return unpack_f16_pair(word)[i & 1u];
    }
    return bitcast<f32>(word);
}

fn load_k(at: vec2<u32>, d: u32) -> f32 {
    let i = at.y + d;
    if (at.x == 0u) {
        return page_elem(k0[word_of(i)], i);
    }
    return page_elem(k1[word_of(i)], i);
}

fn load_v(at: vec2<u32>, d: u32) -> f32 {
    let i = at.y + d;
    if (at.x == 0u) {
        return page_elem(v0[word_of(i)], i);
    }
    return page_elem(v1[word_of(i)], i);
}
