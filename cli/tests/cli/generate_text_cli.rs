//! `omniprefix generate --prompt` / `--messages` on the tiny checkpoints: the prompt's ids are
//! transformers' `apply_chat_template` ids (`chat_reference.json`), the reply's ids are those of
//! the same prompt given as ids (`--request`), the printed text is their decode, and bad text
//! input is a typed error.

use std::path::{Path, PathBuf};

use clap::Parser;
use clap::error::ErrorKind;
use serde_json::Value;

use super::common::{self, TestResult, fixture, p};
use omniprefix::Error;
use omniprefix_cli::HarnessError;
use omniprefix_cli::chat::{Chat, ChatError};
use omniprefix_cli::cli::{Cli, run};

fn scratch(test: &str) -> TestResult<PathBuf> {
    common::scratch("generate-text", test)
}

/// `generate --model <model> <args>` in process; stdout on success.
fn generate(model: &Path, args: &[&str]) -> Result<String, HarnessError> {
    let base = ["omniprefix", "generate", "--model", p(model), "--block-size", "4"];
    let mut out = Vec::new();
    run(Cli::try_parse_from(base.iter().chain(args))?, &mut out)?;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

fn json(stdout: &str) -> TestResult<Value> {
    Ok(serde_json::from_str(stdout.trim())?)
}

fn ids(value: &Value) -> TestResult<Vec<u32>> {
    Ok(serde_json::from_value(value.clone())?)
}

/// The reference case `name` of `model`'s chat_reference.json.
fn case(model: &str, name: &str) -> TestResult<Value> {
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture(model).join("chat_reference.json"))?)?;
    let cases = reference["chats"].as_array().ok_or("chats")?;
    Ok(cases.iter().find(|c| c["name"] == name).cloned().ok_or(name)?)
}

/// Checks a text run's report against an id run of transformers' prompt ids `want`.
fn same_as_id_run(model: &Path, report: &Value, want: &[u32], dir: &Path, max_tokens: &str) -> TestResult {
    assert_eq!(ids(&report["prompt_ids"])?, want, "prompt ids = transformers' apply_chat_template ids");
    assert_eq!(report["prompt_len"].as_u64(), Some(want.len() as u64));
    let request = dir.join("ids.json");
    std::fs::write(&request, serde_json::json!({"segments": [{"text": want}]}).to_string())?;
    let by_ids = json(&generate(model, &["--request", p(&request), "--max-tokens", max_tokens, "--json"])?)?;
    let tokens = ids(&report["tokens"])?;
    assert_eq!(tokens, ids(&by_ids["tokens"])?, "the reply's ids = the id run's");
    assert!(
        by_ids.get("text").is_none() && by_ids.get("prompt_ids").is_none(),
        "an id run prints no text: {by_ids}"
    );
    let text = report["text"].as_str().ok_or("text")?;
    assert_eq!(
        text,
        Chat::from_dir(model)?.decode(&tokens, true)?,
        "the printed text decodes the reply's ids"
    );
    Ok(())
}

#[test]
fn a_text_prompt_generates_what_its_ids_generate() -> TestResult {
    let dir = scratch("prompt")?;
    for model in ["qwen3_dense", "qwen2_dense", "omni_thinker"] {
        let reference = case(model, "one_user_turn")?;
        let prompt = reference["messages"][0]["content"].as_str().ok_or("content")?;
        let report =
            json(&generate(&fixture(model), &["--prompt", prompt, "--max-new-tokens", "7", "--json"])?)?;
        assert_eq!(ids(&report["tokens"])?.len(), 7, "{model}: {report}");
        same_as_id_run(&fixture(model), &report, &ids(&reference["ids"])?, &dir, "7")?;
    }
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

#[test]
fn a_messages_file_is_the_whole_chat() -> TestResult {
    let dir = scratch("messages")?;
    for model in ["qwen2_dense", "qwen3_dense"] {
        let reference = case(model, "system_and_history")?;
        let messages = dir.join(format!("{model}.json"));
        std::fs::write(&messages, reference["messages"].to_string())?;
        let report =
            json(&generate(&fixture(model), &["--messages", p(&messages), "--max-tokens", "5", "--json"])?)?;
        same_as_id_run(&fixture(model), &report, &ids(&reference["ids"])?, &dir, "5")?;
    }
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

#[test]
fn the_binary_prints_the_reply_as_text_and_ids() -> TestResult {
    let model = fixture("qwen3_dense");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_omniprefix"))
        .args([
            "generate",
            "--model",
            p(&model),
            "--prompt",
            "Hello! How are you today?",
            "--max-tokens",
            "8",
        ])
        .output()?;
    let stdout = String::from_utf8(out.stdout)?;
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let line = |key: &str| {
        stdout.lines().find_map(|l| l.strip_prefix(key)).ok_or_else(|| format!("{key} in {stdout}"))
    };
    let tokens: Vec<u32> = serde_json::from_str(line("tokens: ")?)?;
    let text: String = serde_json::from_str(line("text: ")?)?;
    assert_eq!(tokens.len(), 8);
    assert_eq!(text, Chat::from_dir(&model)?.decode(&tokens, true)?);
    let prompt: Vec<u32> = serde_json::from_str(line("prompt_ids: ")?)?;
    assert_eq!(prompt, ids(&case("qwen3_dense", "one_user_turn")?["ids"])?);
    Ok(())
}

#[test]
fn bad_text_input_is_a_typed_error() -> TestResult {
    let dir = scratch("bad")?;
    let model = fixture("qwen3_dense");
    let request = dir.join("req.json");
    std::fs::write(&request, r#"{"segments": [{"text": [1, 2, 3]}]}"#)?;
    let messages = dir.join("messages.json");
    std::fs::write(&messages, r#"[{"role": "user", "content": "hi"}]"#)?;

    // One prompt: ids or text, not both; and at least one.
    for args in [
        &["--prompt", "hi", "--request", p(&request)][..],
        &["--prompt", "hi", "--messages", p(&messages)],
        &["--messages", p(&messages), "--request", p(&request)],
    ] {
        let err = generate(&model, &[args, &["--max-tokens", "2"]].concat());
        assert!(
            matches!(&err, Err(HarnessError::Args(e)) if e.kind() == ErrorKind::ArgumentConflict),
            "{args:?}: {err:?}"
        );
    }
    let err = generate(&model, &["--max-tokens", "2"]);
    assert!(
        matches!(&err, Err(HarnessError::Args(e)) if e.kind() == ErrorKind::MissingRequiredArgument),
        "{err:?}"
    );

    // A checkpoint folder without a tokenizer, asked for text (the ids still work there).
    let bare = dir.join("bare");
    std::fs::create_dir_all(&bare)?;
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(model.join(file), bare.join(file))?;
    }
    let err = generate(&bare, &["--prompt", "hi", "--max-tokens", "2"]);
    assert!(matches!(&err, Err(HarnessError::Chat(ChatError::NoTokenizer { .. }))), "{err:?}");
    generate(&bare, &["--request", p(&request), "--max-tokens", "2"])?;

    // An unreadable messages file, a malformed one, a role the template refuses.
    let err = generate(&model, &["--messages", p(&dir.join("missing.json")), "--max-tokens", "2"]);
    assert!(matches!(&err, Err(HarnessError::Engine(Error::Io(_)))), "{err:?}");
    std::fs::write(&messages, r#"[{"role": "user"}]"#)?;
    let err = generate(&model, &["--messages", p(&messages), "--max-tokens", "2"]);
    assert!(
        matches!(&err, Err(HarnessError::Chat(ChatError::Messages { origin, .. })) if origin.ends_with("messages.json")),
        "{err:?}"
    );
    std::fs::write(&messages, r#"[{"role": "robot", "content": "hi"}]"#)?;
    let err = generate(&model, &["--messages", p(&messages), "--max-tokens", "2"]);
    assert!(matches!(&err, Err(HarnessError::Chat(ChatError::Template { .. }))), "{err:?}");

    // Through the binary: one `error:` line naming the folder's missing tokenizer.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_omniprefix"))
        .args(["generate", "--model", p(&bare), "--prompt", "hi", "--max-tokens", "2"])
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.lines().count() == 1 && stderr.contains("no tokenizer.json"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}
