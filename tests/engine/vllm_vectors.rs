//! Reproduces every digest in `fixtures/vllm_hash_vectors.json`, computed by
//! vLLM 0.33.0's own code: `NONE_HASH`, the `sha256_cbor` block chains (plain,
//! salted, multimodal) and `MultiModalHasher.hash_kwargs` for four media kinds.

use std::sync::Arc;

use ndarray::{ArrayD, IxDyn};
use omniprefix::canon::{Evidence, Fingerprint, ItemIdentity, ItemLayout, Modality, TensorView};
use omniprefix::index::hashchain::{
    BlockHash, BlockHasher, BlockKeyRequest, ExtraKey, HashChainIndex, HashFn, MmMedia, MmPlaceholder,
    hash_block_tokens, hash_mm_item, none_hash,
};
use omniprefix::prompt::{CanonicalPrompt, IndexMap, ItemSpan, Positions};
use serde_json::Value;

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn vectors() -> Result<Value, Box<dyn std::error::Error>> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/vllm_hash_vectors.json");
    Ok(serde_json::from_str(&std::fs::read_to_string(path)?)?)
}

fn str_of<'a>(v: &'a Value, what: &str) -> Result<&'a str, String> {
    v.as_str().ok_or_else(|| format!("{what} is not a string"))
}

fn tokens_of(case: &Value) -> Result<Vec<u32>, String> {
    case["tokens"]
        .as_array()
        .ok_or("tokens missing")?
        .iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()).ok_or_else(|| format!("bad token {t}")))
        .collect()
}

/// Asserts that `got`, as hex, is the case's `hashes` list (`label` names the case).
fn assert_chain_matches(got: &[BlockHash], case: &Value, label: &str) -> TestResult {
    let got: Vec<String> = got.iter().map(BlockHash::to_hex).collect();
    let want: Vec<&str> =
        case["hashes"].as_array().ok_or("hashes")?.iter().filter_map(Value::as_str).collect();
    assert_eq!(got, want, "{label}");
    Ok(())
}

/// One block's `extra_keys` as the fixture spells them (`null` or a list of tagged tuples).
fn extra_keys_of(v: &Value) -> Result<Vec<ExtraKey<'_>>, String> {
    let Some(keys) = v.as_array() else {
        return Ok(vec![]);
    };
    keys.iter()
        .map(|k| match k.as_array().map(Vec::as_slice) {
            Some([tag, salt]) if tag == "cache_salt" => Ok(ExtraKey::CacheSalt(str_of(salt, "salt")?)),
            Some([tag, name]) if tag == "lora" => Ok(ExtraKey::Lora(str_of(name, "lora")?)),
            Some([tag, hash, off]) if tag == "mm" => {
                Ok(ExtraKey::Mm { hash: str_of(hash, "mm hash")?, offset: off.as_i64().ok_or("mm offset")? })
            }
            _ => Err(format!("unknown extra key {k}")),
        })
        .collect()
}

#[test]
fn none_hash_matches() -> TestResult {
    let v = vectors()?;
    assert_eq!(v["hash_fn"], "sha256_cbor");
    let seed = str_of(&v["none_hash_seed"], "seed")?;
    assert_eq!(none_hash(HashFn::Sha256Cbor, seed).to_hex(), str_of(&v["none_hash_hex"], "none hash")?);
    Ok(())
}

/// `hash_block_tokens` with the fixture's own extra keys, chained block by block.
#[test]
fn block_chains_match_with_given_extra_keys() -> TestResult {
    let v = vectors()?;
    let bs = v["block_size"].as_u64().ok_or("block size")? as usize;
    let seed = str_of(&v["none_hash_seed"], "seed")?;
    let cases = v["block_chains"].as_array().ok_or("block_chains")?;
    assert_eq!(cases.len(), 3);
    for case in cases {
        let name = str_of(&case["name"], "name")?;
        let tokens = tokens_of(case)?;
        let keys = case["extra_keys"].as_array().ok_or("extra_keys")?;
        let want = case["hashes"].as_array().ok_or("hashes")?;
        assert_eq!(want.len(), tokens.len() / bs, "{name}");
        let mut parent = none_hash(HashFn::Sha256Cbor, seed);
        for (i, (block, want)) in tokens.chunks_exact(bs).zip(want).enumerate() {
            parent = hash_block_tokens(HashFn::Sha256Cbor, &parent, block, &extra_keys_of(&keys[i])?);
            assert_eq!(parent.to_hex(), str_of(want, "hash")?, "{name} block {i}");
        }
    }
    Ok(())
}

/// The same chains derived from request-level inputs: the hasher must place
/// the salt on block 0 and the mm item on exactly the blocks it overlaps.
#[test]
fn block_chains_match_from_request_inputs() -> TestResult {
    let v = vectors()?;
    let hasher = BlockHasher::new(HashFn::Sha256Cbor, 16, str_of(&v["none_hash_seed"], "seed")?)?;
    let mm_hash = "ab".repeat(32);
    for case in v["block_chains"].as_array().ok_or("block_chains")? {
        let name = str_of(&case["name"], "name")?;
        let tokens = tokens_of(case)?;
        let items = [MmPlaceholder { hash: &mm_hash, offset: 20, length: 20 }];
        let req = match name {
            "text_3_blocks" => BlockKeyRequest { tokens: &tokens, ..Default::default() },
            "salted" => {
                BlockKeyRequest { tokens: &tokens, cache_salt: Some("tenant-a"), ..Default::default() }
            }
            "mm_item_spanning_blocks_1_2" => {
                assert!(str_of(&case["note"], "note")?.contains("offset 20, length 20"));
                BlockKeyRequest { tokens: &tokens, mm_items: &items, ..Default::default() }
            }
            other => return Err(format!("unexpected case {other}").into()),
        };
        assert_chain_matches(&hasher.request_block_hashes(&req, usize::MAX), case, name)?;
    }
    Ok(())
}

/// The index's own path: a prompt whose item occupies positions 20..40, keyed by an explicit mm hash.
#[test]
fn index_block_hashes_match_the_mm_chain() -> TestResult {
    let v = vectors()?;
    let case = &v["block_chains"][2];
    let item = Arc::new(ItemIdentity {
        fingerprint: Fingerprint(1),
        evidence: Evidence::Unvalidated,
        modality: Modality::Image,
        layout: ItemLayout::Image { grid_thw: [1, 4, 20] },
        num_tokens: 20,
        content_bytes: 0,
    });
    let prompt = CanonicalPrompt {
        tenant: 0,
        atoms: vec![],
        token_ids: tokens_of(case)?,
        items: vec![item],
        index_map: IndexMap {
            placeholders: (20u32..40).collect(),
            spans: vec![
                ItemSpan { item: 0, rows: 0..8, start: 20 },
                ItemSpan { item: 0, rows: 8..20, start: 28 },
            ],
        },
        positions: Positions::linear(48),
    };
    let index = HashChainIndex::new(16)?;
    assert_chain_matches(&index.block_hashes(&prompt, &["ab".repeat(32)])?, case, "index")
}

/// A nested JSON array as (shape, values in C order).
fn nested(v: &Value) -> Result<(Vec<usize>, Vec<f64>), String> {
    let mut shape = Vec::new();
    let mut cur = v;
    while let Some(a) = cur.as_array() {
        shape.push(a.len());
        cur = a.first().ok_or("empty array")?;
    }
    let mut values = Vec::new();
    fn walk(v: &Value, out: &mut Vec<f64>) -> Result<(), String> {
        match v {
            Value::Array(a) => a.iter().try_for_each(|x| walk(x, out)),
            x => {
                out.push(x.as_f64().ok_or_else(|| format!("not a number: {x}"))?);
                Ok(())
            }
        }
    }
    walk(v, &mut values)?;
    if values.len() != shape.iter().product::<usize>() {
        return Err("ragged array".into());
    }
    Ok((shape, values))
}

#[test]
fn mm_item_hashes_match() -> TestResult {
    let v = vectors()?;
    let items = v["mm_items"].as_array().ok_or("mm_items")?;
    assert_eq!(items.len(), 4);
    for item in items {
        let name = str_of(&item["name"], "name")?;
        let model_id = str_of(&item["model_id"], "model_id")?;
        let want = str_of(&item["blake3_hex"], "blake3_hex")?;
        let array = if item["array"].is_null() { &item["array_hwc_u8"] } else { &item["array"] };
        let (shape, values) = nested(array)?;
        let u8s = ArrayD::from_shape_vec(IxDyn(&shape), values.iter().map(|&x| x as u8).collect())?;
        let f32s = ArrayD::from_shape_vec(IxDyn(&shape), values.iter().map(|&x| x as f32).collect())?;
        let got = match str_of(&item["kind"], "kind")? {
            "PIL RGB image" => {
                hash_mm_item(model_id, Modality::Image, MmMedia::PilRgb(u8s.view().into_dimensionality()?))?
            }
            "ndarray uint8 HWC" => {
                hash_mm_item(model_id, Modality::Image, MmMedia::Array(TensorView::U8(u8s.view())))?
            }
            "ndarray float32 waveform" => {
                hash_mm_item(model_id, Modality::Audio, MmMedia::Array(TensorView::F32(f32s.view())))?
            }
            "ndarray uint8 THWC" => {
                hash_mm_item(model_id, Modality::Video, MmMedia::Array(TensorView::U8(u8s.view())))?
            }
            other => return Err(format!("unknown kind {other}").into()),
        };
        assert_eq!(got, want, "{name}");
    }
    Ok(())
}
