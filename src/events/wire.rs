//! msgpack encoding of [`KvEventBatch`] byte for byte as vLLM 0.33 writes it
//! (`msgspec.msgpack.Encoder().encode(KVEventBatch(...))`).
//!
//! msgspec's rules, as the vectors in `fixtures/vllm_kv_events_vectors.json` show them:
//! * the batch is `array_like`: `[ts (float 64), events, data_parallel_rank or nil]`;
//! * events are tagged structs: maps whose first entry is `"type": <class name>`,
//!   then the fields in declaration order; optional fields equal to their default
//!   (`extra_keys`) are left out, required ones (`lora_id`, `medium`, `lora_name`) are
//!   written as nil;
//! * a struct that may write more than 15 entries, the tag included (`BlockStored`,
//!   with vLLM's optional fields past `extra_keys`) gets a map16 header whatever
//!   it writes; smaller ones a fixmap;
//! * integers, strings and arrays take their smallest msgpack form.

use super::{ItemRows, KvEvent, KvEventBatch};

/// Marker of a map with a 16-bit length.
const MAP16: u8 = 0xde;

impl KvEventBatch {
    /// The batch as vLLM's msgpack payload.
    ///
    /// ```
    /// use omniprefix::events::{KvEvent, KvEventBatch};
    /// let batch = KvEventBatch { ts: 1764576003.0, events: vec![KvEvent::AllBlocksCleared], data_parallel_rank: None };
    /// assert_eq!(hex::encode(batch.encode()), "93cb41da4b52c0c000009181a474797065b0416c6c426c6f636b73436c6561726564c0");
    /// ```
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.events.len() * 96);
        array_len(&mut out, 3);
        // Writes into a Vec cannot fail.
        let _ = rmp::encode::write_f64(&mut out, self.ts);
        array_len(&mut out, self.events.len());
        for event in &self.events {
            encode_event(event, &mut out);
        }
        match self.data_parallel_rank {
            Some(rank) => uint(&mut out, rank.into()),
            None => nil(&mut out),
        }
        out
    }
}

fn encode_event(event: &KvEvent, out: &mut Vec<u8>) {
    match event {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            medium,
            extra_keys,
        } => {
            let fields = 8 + usize::from(extra_keys.is_some());
            out.push(MAP16);
            out.extend_from_slice(&(fields as u16).to_be_bytes());
            tag(out, "BlockStored");
            key(out, "block_hashes");
            uints(out, block_hashes.iter().copied());
            key(out, "parent_block_hash");
            match parent_block_hash {
                Some(h) => uint(out, *h),
                None => nil(out),
            }
            key(out, "token_ids");
            uints(out, token_ids.iter().map(|&t| u64::from(t)));
            key(out, "block_size");
            uint(out, *block_size as u64);
            key(out, "lora_id");
            nil(out);
            key(out, "medium");
            str(out, medium.as_str());
            key(out, "lora_name");
            nil(out);
            if let Some(per_block) = extra_keys {
                key(out, "extra_keys");
                array_len(out, per_block.len());
                for block in per_block {
                    match block {
                        Some(rows) => item_rows(out, rows),
                        None => nil(out),
                    }
                }
            }
        }
        KvEvent::BlockRemoved { block_hashes, medium } => {
            map_len(out, 3);
            tag(out, "BlockRemoved");
            key(out, "block_hashes");
            uints(out, block_hashes.iter().copied());
            key(out, "medium");
            str(out, medium.as_str());
        }
        KvEvent::AllBlocksCleared => {
            map_len(out, 1);
            tag(out, "AllBlocksCleared");
        }
    }
}

/// A block's extra keys: the flat tuple `(marker, ..., mm_hash, first row, ...)`:
/// first the [`RoutingHash::marker`](super::RoutingHash::marker) of each routing
/// hash its items carry (once each, in the order of the rows), because Dynamo
/// 1.6.1 names a block's image run by the first key it parses as a marker;
/// then our own `(identity, first row)` pairs, as without routing hashes.
fn item_rows(out: &mut Vec<u8>, rows: &[ItemRows]) {
    let mut markers: Vec<super::RoutingHash> = Vec::new();
    for h in rows.iter().filter_map(|r| r.routing_hash) {
        if !markers.contains(&h) {
            markers.push(h);
        }
    }
    array_len(out, markers.len() + 2 * rows.len());
    for h in markers {
        str(out, &h.marker());
    }
    for r in rows {
        str(out, &r.mm_hash);
        uint(out, r.first_row.into());
    }
}

fn tag(out: &mut Vec<u8>, class: &str) {
    key(out, "type");
    str(out, class);
}

fn key(out: &mut Vec<u8>, name: &str) {
    str(out, name);
}

fn uints(out: &mut Vec<u8>, values: impl ExactSizeIterator<Item = u64>) {
    array_len(out, values.len());
    for v in values {
        uint(out, v);
    }
}

fn str(out: &mut Vec<u8>, s: &str) {
    let _ = rmp::encode::write_str(out, s);
}

fn uint(out: &mut Vec<u8>, v: u64) {
    let _ = rmp::encode::write_uint(out, v);
}

fn nil(out: &mut Vec<u8>) {
    let _ = rmp::encode::write_nil(out);
}

fn array_len(out: &mut Vec<u8>, n: usize) {
    let _ = rmp::encode::write_array_len(out, n as u32);
}

fn map_len(out: &mut Vec<u8>, n: u32) {
    let _ = rmp::encode::write_map_len(out, n);
}
