//! Fuzz target: the request-file parser and everything between it and a
//! canonical prompt. Arbitrary JSON-ish text and structured mutations of a
//! valid request file (fields removed or replaced by values of every JSON
//! type, tensor names and files swapped, the text cut short) must parse or
//! fail with a typed error; what parses is fingerprinted and built into a
//! prompt, which again succeeds or fails with a typed error — never a panic.
//!
//! Cases default to 128; `scripts/fuzz.sh` runs it for a time budget.

use support::fuzz as fuzz_common;

use std::path::PathBuf;
use std::sync::Arc;

use omniprefix::Error;
use omniprefix::canon::{FingerprintKey, Fingerprinter};
use omniprefix::error::{IoError, RequestError, RequestFileError};
use omniprefix::index::ValidationPolicy;
use omniprefix::prompt::{OmniTokens, PromptBuilder};
use omniprefix::request_file::RequestFile;
use proptest::prelude::*;
use serde_json::{Value, json};

/// A folder with `media.safetensors` (pixels u8 [8, 12, 3], emb f32 [6, 4],
/// wave f32 [1600], mel f32 [2, 100]) that the request files point into.
fn media_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("omniprefix-fuzz-requests-{}-{tag}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    let f32s = |n: usize| -> Vec<u8> { (0..n).flat_map(|i| ((i % 13) as f32 * 0.1).to_le_bytes()).collect() };
    let (pixels, emb, wave, mel) = (vec![9u8; 8 * 12 * 3], f32s(24), f32s(1600), f32s(200));
    let tensors = [
        ("pixels", safetensors::Dtype::U8, vec![8, 12, 3], &pixels),
        ("emb", safetensors::Dtype::F32, vec![6, 4], &emb),
        ("wave", safetensors::Dtype::F32, vec![1600], &wave),
        ("mel", safetensors::Dtype::F32, vec![2, 100], &mel),
    ];
    let views: Vec<_> = tensors
        .into_iter()
        .filter_map(|(n, d, s, b)| safetensors::tensor::TensorView::new(d, s, b).ok().map(|v| (n, v)))
        .collect();
    if let Ok(bytes) = safetensors::serialize(views, &None) {
        let _ = std::fs::write(dir.join("media.safetensors"), bytes);
    }
    dir
}

fn valid_request() -> Value {
    json!({
        "tenant": 3,
        "segments": [
            {"text": [1, 2, 503]},
            {"item": {"modality": "image", "layout": {"kind": "image", "grid_thw": [1, 4, 6]},
                      "content": {"file": "media.safetensors", "tensor": "pixels"},
                      "embeddings": {"file": "media.safetensors", "tensor": "emb"}}},
            {"text": [504, 505]},
            {"item": {"modality": "audio", "layout": {"kind": "audio", "mel_frames": 100},
                      "content": {"file": "media.safetensors", "tensor": "wave"},
                      "embeddings": {"file": "media.safetensors", "tensor": "emb"}}},
            {"text": [506, 7]}
        ]
    })
}

/// Errors a bad request file may produce, up to a built prompt.
fn is_request_error(e: &Error) -> bool {
    matches!(
        e,
        Error::RequestFile(RequestFileError::Format { .. })
            | Error::RequestFile(RequestFileError::TensorNotInFile { .. })
            | Error::RequestFile(RequestFileError::Tensor { .. })
            | Error::RequestFile(RequestFileError::Safetensors { .. })
            | Error::Io(IoError { .. })
            // From fingerprinting the items and building the prompt:
            | Error::Request(RequestError::NonFinite { .. })
            | Error::Request(RequestError::EmptyItem { .. })
            | Error::Request(RequestError::ShapeMismatch { .. })
            | Error::Request(RequestError::GridNotMergeable { .. })
            | Error::Request(RequestError::InvalidLayout { .. })
            | Error::Request(RequestError::EmptyPrompt)
            | Error::Request(RequestError::StrayPlaceholder { .. })
            | Error::Request(RequestError::TokenOutOfVocab { .. })
            | Error::Request(RequestError::PlaceholderCountMismatch { .. })
            | Error::Request(RequestError::MissingItem { .. })
            | Error::Request(RequestError::UnusedItems { .. })
            | Error::Request(RequestError::ItemModalityMismatch { .. })
            | Error::Request(RequestError::MalformedAudioInVideo { .. })
            | Error::Request(RequestError::MalformedAtoms { .. })
    )
}

/// Parses, fingerprints and builds the prompt of a request file's text.
fn parse_and_build(text: &str, path: &std::path::Path) -> Result<(), Error> {
    let file = RequestFile::parse(text, path)?;
    let tokens = OmniTokens::tiny();
    let request = file.request(&tokens);
    let fingerprinter = Fingerprinter::new(FingerprintKey::fixed(4), 1, ValidationPolicy::ExactBytes)?;
    let items = request
        .items
        .iter()
        .enumerate()
        .map(|(i, item)| fingerprinter.identify(i, &item.spec).map(Arc::new))
        .collect::<Result<Vec<_>, _>>()?;
    let mut builder = PromptBuilder::new(tokens).with_tenant(request.tenant);
    builder.extend(&request.token_ids, &items, request.placeholders)?;
    builder.build().map(|_| ())
}

/// JSON values of every type, and the names, counts and layouts a request file uses.
fn value() -> impl Strategy<Value = Value> {
    let names = vec![
        json!(500),
        json!(2.5),
        json!("pixels"),
        json!("wave"),
        json!("mel"),
        json!("../media.safetensors"),
    ];
    let layouts = [
        json!("video"),
        json!([1, 500, 2]),
        json!([0, 0, 0]),
        json!({"kind": "video", "grid_thw": [2, 4, 4], "seconds_per_grid": 1.0}),
        json!({"kind": "audio", "mel_frames": 0}),
        json!({}),
    ];
    fuzz_common::json_value([names, layouts.to_vec()].concat())
}

/// Replaces the `pick`-th node (in a depth-first walk) of `v` by `new`, or removes it.
fn mutate(v: &mut Value, pick: &mut usize, new: &Option<Value>) -> bool {
    let children: Vec<String> = match v {
        Value::Object(m) => m.keys().cloned().collect(),
        Value::Array(a) => (0..a.len()).map(|i| i.to_string()).collect(),
        _ => return false,
    };
    for key in children {
        if *pick == 0 {
            match (v, new) {
                (Value::Object(m), Some(n)) => drop(m.insert(key, n.clone())),
                (Value::Object(m), None) => drop(m.remove(&key)),
                (Value::Array(a), Some(n)) => a[key.parse::<usize>().unwrap_or(0)] = n.clone(),
                (Value::Array(a), None) => drop(a.remove(key.parse::<usize>().unwrap_or(0))),
                _ => {}
            }
            return true;
        }
        *pick -= 1;
        let child = match v {
            Value::Object(m) => m.get_mut(&key),
            Value::Array(a) => key.parse::<usize>().ok().and_then(|i| a.get_mut(i)),
            _ => None,
        };
        if child.is_some_and(|c| mutate(c, pick, new)) {
            return true;
        }
    }
    false
}

/// The property of every case: `text` parses and builds, or is refused with a request
/// error (never another kind of error, never a panic).
fn builds_or_refused(text: &str, path: &std::path::Path) -> Result<(), TestCaseError> {
    if let Err(e) = parse_and_build(text, path) {
        prop_assert!(is_request_error(&e), "unexpected error kind: {e:?}");
    }
    Ok(())
}

#[test]
fn fuzz_request_files() {
    let dir = media_dir("mutations");
    let path = dir.join("request.json");
    let mutation = prop::collection::vec((0usize..64, prop::option::weighted(0.8, value())), 0..4);
    let strategy = (mutation, any::<Option<usize>>(), any::<bool>());
    fuzz_common::fuzz("request-file", 128, strategy, |(mutations, cut, expanded)| {
        let mut request = valid_request();
        if expanded {
            request["expanded"] = json!(true);
        }
        for (pick, new) in &mutations {
            let mut pick = *pick;
            mutate(&mut request, &mut pick, new);
        }
        let mut text = request.to_string();
        if let Some(cut) = cut {
            let at = (0..=cut % (text.len() + 1)).rev().find(|&i| text.is_char_boundary(i)).unwrap_or(0);
            text.truncate(at);
        }
        builds_or_refused(&text, &path)
    });
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn fuzz_request_bytes() {
    let dir = media_dir("bytes");
    let path = dir.join("request.json");
    let strategy = prop_oneof![
        prop::collection::vec(any::<u8>(), 0..200).prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
        "[{}\\[\\]\":,0-9a-z \\-]{0,200}",
    ];
    fuzz_common::fuzz("request-bytes", 256, strategy, |text| builds_or_refused(&text, &path));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn the_unmutated_request_file_builds() {
    let dir = media_dir("valid");
    let result = parse_and_build(&valid_request().to_string(), &dir.join("request.json"));
    let _ = std::fs::remove_dir_all(dir);
    assert!(result.is_ok(), "{result:?}");
}
