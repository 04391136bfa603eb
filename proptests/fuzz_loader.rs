//! Fuzz target: the model loader. Mutated `config.json` files (fields
//! removed or replaced by values of every JSON type, absurd sizes included)
//! and mutated safetensors checkpoints (truncated, header length forged,
//! header bytes flipped, entries relabelled with random dtypes, shapes and
//! offsets) must load or fail with a typed error — never panic, never try to
//! allocate what the file does not hold.
//!
//! Cases default to 64; `scripts/fuzz.sh` runs it for a time budget.

use support::fuzz as fuzz_common;

use std::path::{Path, PathBuf};

use omniprefix::Error;
use omniprefix::backend::cpu::CpuBackend;
use omniprefix::error::{CheckpointError, IoError};
use omniprefix::model::{Config, SafetensorsSource, Thinker};
use proptest::prelude::*;
use serde_json::{Value, json};

const MODELS: [&str; 2] = ["fixtures/tiny/qwen3_dense", "fixtures/tiny/omni_thinker"];

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_default()
}

/// Loader errors a bad checkpoint may produce; anything else is a bug.
fn is_loader_error(e: &Error) -> bool {
    matches!(
        e,
        Error::Checkpoint(CheckpointError::ConfigParse(_))
            | Error::Checkpoint(CheckpointError::UnsupportedConfig { .. })
            | Error::Checkpoint(CheckpointError::Safetensors { .. })
            | Error::Checkpoint(CheckpointError::MissingTensor { .. })
            | Error::Checkpoint(CheckpointError::TensorShape { .. })
            | Error::Checkpoint(CheckpointError::TensorDtype { .. })
            | Error::Io(IoError { .. })
    )
}

fn load(config: &str, source: &SafetensorsSource) -> Result<(), Error> {
    let cfg = Config::from_json_str(config)?;
    Thinker::load(&CpuBackend::new(), cfg, source).map(|_| ())
}

/// JSON values of every type, sizes from tiny to absurd.
fn value() -> impl Strategy<Value = Value> {
    let sizes =
        vec![json!(1), json!(3), json!(16), json!(1u64 << 31), json!(1u64 << 40), json!(1.5), json!(-1e300)];
    let specific =
        [json!("yarn"), json!([1, 2, 3]), json!({"rope_type": "mrope", "mrope_section": [1, 2, 3]})];
    // 16 fixed values and one random integer, each as likely as the others.
    prop_oneof![
        16 => fuzz_common::json_value([sizes, specific.to_vec()].concat()),
        1 => any::<i64>().prop_map(|v| json!(v)),
    ]
}

#[derive(Debug, Clone)]
enum ConfigEdit {
    Remove(usize),
    Set(usize, Value),
    /// Replace a field inside `rope_parameters` / `thinker_config.text_config`.
    Nested(usize, Value),
}

fn apply_config_edits(config: &mut Value, edits: &[ConfigEdit]) {
    let text = config.pointer_mut("/thinker_config/text_config").is_some();
    let target = if text { config.pointer_mut("/thinker_config/text_config") } else { Some(config) };
    let Some(Value::Object(map)) = target else { return };
    for edit in edits {
        let keys: Vec<String> = map.keys().cloned().collect();
        let key = |i: usize| keys.get(i % keys.len().max(1)).cloned().unwrap_or_default();
        match edit {
            ConfigEdit::Remove(i) => {
                map.remove(&key(*i));
            }
            ConfigEdit::Set(i, v) => {
                map.insert(key(*i), v.clone());
            }
            ConfigEdit::Nested(i, v) => {
                let fields = ["rope_type", "mrope_section", "rope_theta", "interleaved", "mrope_interleaved"];
                let rope = map.entry("rope_parameters").or_insert_with(|| json!({}));
                if let Value::Object(rope) = rope {
                    rope.insert(fields[i % fields.len()].into(), v.clone());
                }
            }
        }
    }
}

#[test]
fn fuzz_config_json() {
    let sources: Vec<(String, SafetensorsSource)> = MODELS
        .iter()
        .filter_map(|dir| {
            let config = String::from_utf8(read(&Path::new(dir).join("config.json"))).ok()?;
            Some((config, SafetensorsSource::open_dir(Path::new(dir)).ok()?))
        })
        .collect();
    assert_eq!(sources.len(), MODELS.len(), "fixtures load");
    let edit = prop_oneof![
        any::<usize>().prop_map(ConfigEdit::Remove),
        (any::<usize>(), value()).prop_map(|(i, v)| ConfigEdit::Set(i, v)),
        (any::<usize>(), value()).prop_map(|(i, v)| ConfigEdit::Nested(i, v)),
    ];
    let strategy = (0..MODELS.len(), prop::collection::vec(edit, 1..4), any::<Option<usize>>());
    fuzz_common::fuzz("config", 64, strategy, |(model, edits, cut)| {
        let (text, source) = &sources[model];
        let mut config: Value = serde_json::from_str(text).map_err(|e| TestCaseError::fail(e.to_string()))?;
        apply_config_edits(&mut config, &edits);
        let mut json = config.to_string();
        if let Some(cut) = cut {
            // Truncated text, cut on a char boundary.
            let at = (0..=cut % (json.len() + 1)).rev().find(|&i| json.is_char_boundary(i)).unwrap_or(0);
            json.truncate(at);
        }
        if let Err(e) = load(&json, source) {
            prop_assert!(is_loader_error(&e), "unexpected error kind: {e:?}");
        }
        Ok(())
    });
}

#[derive(Debug, Clone)]
enum FileEdit {
    Truncate(usize),
    HeaderLength(u64),
    /// XOR a byte of the first 8 + header bytes.
    FlipHeader(usize, u8),
    /// XOR a byte anywhere.
    FlipAny(usize, u8),
    Dtype(usize, &'static str),
    Shape(usize, Vec<u64>),
    Offsets(usize, u64, u64),
}

fn file_edit() -> impl Strategy<Value = FileEdit> {
    let dtypes =
        prop::sample::select(vec!["F32", "F16", "BF16", "F64", "I64", "I32", "U8", "BOOL", "F8_E4M3", "X"]);
    let dim = prop_oneof![4 => 0u64..300, 1 => any::<u64>()];
    prop_oneof![
        any::<usize>().prop_map(FileEdit::Truncate),
        prop_oneof![0u64..5000, any::<u64>()].prop_map(FileEdit::HeaderLength),
        (any::<usize>(), 1u8..).prop_map(|(i, x)| FileEdit::FlipHeader(i, x)),
        (any::<usize>(), 1u8..).prop_map(|(i, x)| FileEdit::FlipAny(i, x)),
        (any::<usize>(), dtypes).prop_map(|(i, d)| FileEdit::Dtype(i, d)),
        (any::<usize>(), prop::collection::vec(dim, 0..4)).prop_map(|(i, s)| FileEdit::Shape(i, s)),
        (any::<usize>(), prop_oneof![0u64..600_000, any::<u64>()], prop_oneof![0u64..600_000, any::<u64>()])
            .prop_map(|(i, a, b)| FileEdit::Offsets(i, a, b)),
    ]
}

/// Splits a safetensors file into (header JSON, data) when it parses.
fn split(bytes: &[u8]) -> Option<(Value, &[u8])> {
    let n = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?) as usize;
    let header = serde_json::from_slice(bytes.get(8..8usize.checked_add(n)?)?).ok()?;
    Some((header, &bytes[8 + n..]))
}

fn join(header: &Value, data: &[u8]) -> Vec<u8> {
    let text = header.to_string();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    out.extend_from_slice(data);
    out
}

fn apply_file_edit(bytes: Vec<u8>, edit: &FileEdit) -> Vec<u8> {
    let mut bytes = bytes;
    let header_end = split(&bytes).map_or(8, |(h, _)| 8 + h.to_string().len()).min(bytes.len());
    match edit {
        FileEdit::Truncate(at) => bytes.truncate(at % (bytes.len() + 1)),
        FileEdit::HeaderLength(n) => {
            if bytes.len() >= 8 {
                bytes[..8].copy_from_slice(&n.to_le_bytes());
            }
        }
        FileEdit::FlipHeader(i, x) => {
            if header_end > 0 {
                bytes[i % header_end] ^= x;
            }
        }
        FileEdit::FlipAny(i, x) => {
            if !bytes.is_empty() {
                let n = bytes.len();
                bytes[i % n] ^= x;
            }
        }
        FileEdit::Dtype(i, _) | FileEdit::Shape(i, _) | FileEdit::Offsets(i, ..) => {
            let Some((mut header, data)) = split(&bytes) else { return bytes };
            let Some(map) = header.as_object_mut() else { return bytes };
            let names: Vec<String> = map.keys().filter(|k| *k != "__metadata__").cloned().collect();
            let Some(entry) = names.get(i % names.len().max(1)).and_then(|n| map.get_mut(n)) else {
                return bytes;
            };
            match edit {
                FileEdit::Dtype(_, d) => entry["dtype"] = json!(d),
                FileEdit::Shape(_, s) => entry["shape"] = json!(s),
                FileEdit::Offsets(_, a, b) => entry["data_offsets"] = json!([a, b]),
                _ => {}
            }
            bytes = join(&header, data);
        }
    }
    bytes
}

fn scratch_file() -> PathBuf {
    let thread =
        format!("{:?}", std::thread::current().id()).replace(|c: char| !c.is_ascii_alphanumeric(), "");
    std::env::temp_dir().join(format!("omniprefix-fuzz-loader-{}-{thread}.safetensors", std::process::id()))
}

#[test]
fn fuzz_safetensors_files() {
    let originals: Vec<(String, Vec<u8>)> = MODELS
        .iter()
        .map(|dir| {
            let config = String::from_utf8(read(&Path::new(dir).join("config.json"))).unwrap_or_default();
            (config, read(&Path::new(dir).join("model.safetensors")))
        })
        .collect();
    let path = scratch_file();
    let strategy = (0..MODELS.len(), prop::collection::vec(file_edit(), 1..4));
    fuzz_common::fuzz("safetensors", 64, strategy, |(model, edits)| {
        let (config, original) = &originals[model];
        let bytes = edits.iter().fold(original.clone(), apply_file_edit);
        std::fs::write(&path, &bytes).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let result = SafetensorsSource::open_files(std::slice::from_ref(&path))
            .and_then(|source| load(config, &source));
        if let Err(e) = result {
            prop_assert!(is_loader_error(&e), "unexpected error kind: {e:?}");
        }
        Ok(())
    });
    let _ = std::fs::remove_file(&path);
}

/// Crashes the fuzzer found, kept as regression tests: sizes whose products
/// overflowed (or whose preallocation aborted) before any weight was read.
#[test]
fn regression_absurd_sizes_are_errors_not_panics() {
    let dir = Path::new(MODELS[1]);
    let text = String::from_utf8(read(&dir.join("config.json"))).unwrap_or_default();
    let source = SafetensorsSource::open_dir(dir);
    let Ok(source) = source else { panic!("fixture {dir:?} opens") };
    let cases: [(&str, Value, &str); 5] = [
        ("num_experts", json!(u64::MAX), "num_experts"),
        ("num_experts", json!(1u64 << 40), "num_experts"),
        ("num_hidden_layers", json!(1u64 << 40), "num_hidden_layers"),
        ("moe_intermediate_size", json!(u64::MAX / 2), "moe_intermediate_size"),
        (
            "rope_parameters",
            json!({"rope_type": "mrope", "mrope_section": [u64::MAX, 2, 2]}),
            "mrope_section",
        ),
    ];
    for (field, value, named) in cases {
        let mut config: Value = serde_json::from_str(&text).unwrap_or_default();
        let Some(Value::Object(map)) = config.pointer_mut("/thinker_config/text_config") else {
            panic!("omni config has a text config")
        };
        map.insert(field.into(), value.clone());
        let err = load(&config.to_string(), &source).err();
        assert!(
            matches!(err, Some(Error::Checkpoint(CheckpointError::UnsupportedConfig { field: f, .. })) if f == named),
            "{field} = {value}: {err:?}"
        );
    }
}
