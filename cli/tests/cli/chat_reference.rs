//! `omniprefix_cli::chat` against transformers: for every tiny checkpoint, the chat template
//! rendered, encoded and decoded as `fixtures/tiny/<model>/chat_reference.json` records
//! (`AutoTokenizer.from_pretrained(<folder>)`, `apply_chat_template`, `encode`, `decode`; made by
//! `fixtures/make_tokenizers.py`), and bad folders, templates and messages as typed errors.

use std::path::PathBuf;

use serde_json::{Map, Value};

use super::common::{TestResult, fixture};
use omniprefix_cli::chat::{Chat, ChatError, Messages};

const MODELS: [&str; 3] = ["qwen3_dense", "qwen2_dense", "omni_thinker"];

fn reference(model: &str) -> TestResult<Value> {
    Ok(serde_json::from_str(&std::fs::read_to_string(fixture(model).join("chat_reference.json"))?)?)
}

fn ids(value: &Value) -> TestResult<Vec<u32>> {
    let list = value.as_array().ok_or("ids are a list")?;
    Ok(list
        .iter()
        .map(|v| v.as_u64().and_then(|v| u32::try_from(v).ok()).ok_or("an id"))
        .collect::<Result<_, _>>()?)
}

fn text(value: &Value) -> TestResult<&str> {
    Ok(value.as_str().ok_or("a string")?)
}

/// `want` decodes as `case["decode"]`, and with special tokens skipped as
/// `case["decode_skip_special"]` (what transformers' `decode` gave for each).
fn assert_decodes(chat: &Chat, want: &[u32], case: &Value, what: &str) -> TestResult {
    assert_eq!(chat.decode(want, false)?, text(&case["decode"])?, "{what}: decode");
    assert_eq!(
        chat.decode(want, true)?,
        text(&case["decode_skip_special"])?,
        "{what}: decode, special skipped"
    );
    Ok(())
}

#[test]
fn chat_templates_render_and_encode_as_transformers_does() -> TestResult {
    for model in MODELS {
        let chat = Chat::from_dir(&fixture(model))?;
        let reference = reference(model)?;
        let cases = reference["chats"].as_array().ok_or("chats")?;
        assert!(cases.len() >= 5, "{model}");
        for case in cases {
            let name = format!("{model}/{}", text(&case["name"])?);
            let messages = Messages::parse(&case["messages"].to_string(), &name)?;
            let add_generation_prompt =
                case["add_generation_prompt"].as_bool().ok_or("add_generation_prompt")?;
            let kwargs: Map<String, Value> =
                case["template_kwargs"].as_object().cloned().ok_or("template_kwargs")?;
            let rendered = chat.render(&messages, add_generation_prompt, &kwargs)?;
            assert_eq!(rendered, text(&case["text"])?, "{name}: rendered text");
            let want = ids(&case["ids"])?;
            assert_eq!(chat.encode(&rendered)?, want, "{name}: ids");
            if add_generation_prompt && kwargs.is_empty() {
                assert_eq!(chat.prompt_ids(&messages)?, want, "{name}: prompt_ids");
            }
            assert_decodes(&chat, &want, case, &name)?;
        }
    }
    Ok(())
}

#[test]
fn texts_and_every_id_encode_and_decode_as_transformers_does() -> TestResult {
    for model in MODELS {
        let chat = Chat::from_dir(&fixture(model))?;
        let reference = reference(model)?;
        for case in reference["texts"].as_array().ok_or("texts")? {
            let source = text(&case["text"])?;
            let want = ids(&case["ids"])?;
            assert_eq!(chat.encode(source)?, want, "{model}: {source:?}");
            assert_decodes(&chat, &want, case, &format!("{model}: {source:?}"))?;
        }
        let every = &reference["every_id"];
        let all = ids(&every["ids"])?;
        assert_eq!(all, (0..256).collect::<Vec<u32>>(), "{model}: the whole vocabulary");
        assert_decodes(&chat, &all, every, &format!("{model}: every id"))?;
    }
    Ok(())
}

/// A scratch checkpoint folder holding `files` (name, contents).
fn scratch(test: &str, files: &[(&str, &str)]) -> TestResult<PathBuf> {
    let dir = std::env::temp_dir().join(format!("omniprefix-chat-{}-{test}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    for (name, contents) in files {
        std::fs::write(dir.join(name), contents)?;
    }
    Ok(dir)
}

fn chat_error(result: Result<impl std::fmt::Debug, ChatError>) -> TestResult<ChatError> {
    match result {
        Err(e @ ChatError::Io(_)) => Err(format!("want a chat error, got an io error: {e}").into()),
        Err(e) => Ok(e),
        other => Err(format!("want a ChatError, got {other:?}").into()),
    }
}

#[test]
fn bad_folders_templates_and_messages_are_typed_errors() -> TestResult {
    let tokenizer = std::fs::read_to_string(fixture("qwen3_dense").join("tokenizer.json"))?;
    let config = std::fs::read_to_string(fixture("qwen3_dense").join("tokenizer_config.json"))?;

    let empty = scratch("empty", &[])?;
    let err = chat_error(Chat::from_dir(&empty))?;
    assert!(matches!(&err, ChatError::NoTokenizer { dir } if dir.contains("omniprefix-chat")), "{err}");
    assert!(err.to_string().contains("no tokenizer.json"), "{err}");

    let broken = scratch("broken", &[("tokenizer.json", "{\"model\": 3}")])?;
    assert!(matches!(chat_error(Chat::from_dir(&broken))?, ChatError::Tokenizer { .. }));

    let untemplated = scratch(
        "untemplated",
        &[("tokenizer.json", &tokenizer), ("tokenizer_config.json", "{\"eos_token\": \"<|im_end|>\"}")],
    )?;
    assert!(matches!(chat_error(Chat::from_dir(&untemplated))?, ChatError::NoChatTemplate { .. }));

    let bad_syntax = scratch(
        "syntax",
        &[("tokenizer.json", &tokenizer), ("chat_template.jinja", "{% for m in messages %}")],
    )?;
    assert!(matches!(chat_error(Chat::from_dir(&bad_syntax))?, ChatError::Template { .. }));

    let bad_token = scratch(
        "token",
        &[
            ("tokenizer.json", &tokenizer),
            ("tokenizer_config.json", "{\"chat_template\": \"x\", \"eos_token\": 7}"),
        ],
    )?;
    let err = chat_error(Chat::from_dir(&bad_token))?;
    assert!(
        matches!(&err, ChatError::TokenizerConfig { problem, .. } if problem.contains("eos_token")),
        "{err}"
    );

    // chat_template.jinja wins over tokenizer_config.json's template, as in transformers.
    let jinja = "{{ eos_token }}{% for m in messages %}[{{ m.content | upper }}]{% endfor %}";
    let overridden = scratch(
        "jinja",
        &[("tokenizer.json", &tokenizer), ("tokenizer_config.json", &config), ("chat_template.jinja", jinja)],
    )?;
    let rendered = Chat::from_dir(&overridden)?.render(&Messages::user("hi"), true, &Map::new())?;
    assert_eq!(rendered, "<|im_end|>[HI]");

    // The fixture's template raises on a role it does not know.
    let chat = Chat::from_dir(&fixture("qwen3_dense"))?;
    let tool = Messages::parse(r#"[{"role": "tool", "content": "42"}]"#, "inline")?;
    let err = chat_error(chat.prompt_ids(&tool))?;
    assert!(
        matches!(&err, ChatError::Template { message, .. } if message.contains("Unknown role: tool")),
        "{err}"
    );

    for (json, problem) in [
        ("{", "not JSON"),
        (r#"{"role": "user"}"#, "not a JSON list"),
        ("[]", "empty"),
        ("[3]", "message 0 is not an object"),
        (r#"[{"content": "hi"}]"#, "no string \"role\""),
        (r#"[{"role": "user", "content": "a"}, {"role": "user"}]"#, "message 1 has no \"content\""),
        (r#"[{"role": "user", "content": 5}]"#, "not a string, a list or null"),
    ] {
        let err = Messages::parse(json, "inline").err().ok_or(json)?;
        assert!(
            matches!(&err, ChatError::Messages { problem: p, .. } if p.contains(problem)),
            "{json}: {err}"
        );
    }
    for dir in [empty, broken, untemplated, bad_syntax, bad_token, overridden] {
        std::fs::remove_dir_all(dir).ok();
    }
    Ok(())
}
