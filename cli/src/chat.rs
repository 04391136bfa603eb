//! Text in and out for a checkpoint folder: its `tokenizer.json`, run by Hugging Face's
//! `tokenizers` crate, and its chat template, rendered by minijinja as transformers'
//! `apply_chat_template` renders it with Jinja2.
//!
//! The template comes from `chat_template.jinja` in the folder if there is one (transformers
//! prefers that file), else from `chat_template` in `tokenizer_config.json` (a string, or a list
//! of `{name, template}` of which the `default` one is used). It sees what transformers gives it:
//! `messages`, `add_generation_prompt`, the special tokens of `tokenizer_config.json`
//! (`bos_token`, `eos_token`, `unk_token`, `pad_token`, where set), `tools` and `documents`
//! (none), any extra keyword arguments (`enable_thinking`, ...), and the functions
//! `raise_exception` and Python's string methods (`.split`, `.strip`, `.startswith`, ...).
//! Like transformers, the rendered text is encoded without adding special tokens (the template
//! writes them) and replies are decoded by the tokenizer's own decoder.
//!
//! ```
//! use omniprefix_cli::chat::{Chat, Messages};
//! let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tiny/qwen3_dense");
//! let chat = Chat::from_dir(&dir)?;
//! let ids = chat.prompt_ids(&Messages::user("Hello!"))?;
//! let text = "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n";
//! assert_eq!(chat.decode(&ids, false)?, text);
//! assert_eq!(chat.decode(&ids, true)?, "user\nHello!\nassistant\n");
//! # Ok::<(), omniprefix_cli::chat::ChatError>(())
//! ```

use std::path::{Path, PathBuf};

use minijinja::{Environment, ErrorKind};
use serde_json::{Map, Value};
use tokenizers::Tokenizer;

use omniprefix::error::IoError;

/// What can be wrong with a checkpoint's tokenizer, its chat template or the messages given to it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChatError {
    /// The folder has no `tokenizer.json`, so text cannot become ids.
    #[error("{dir} has no tokenizer.json, so it cannot take text (give token ids with --request instead)")]
    NoTokenizer { dir: String },
    /// `tokenizer.json` that the `tokenizers` crate cannot load.
    #[error("{path}: not a tokenizer the tokenizers crate can load: {message}")]
    Tokenizer { path: String, message: String },
    /// `tokenizer_config.json` that is not JSON, or whose special tokens or template have the wrong type.
    #[error("{path}: {problem}")]
    TokenizerConfig { path: String, problem: String },
    /// Neither `chat_template.jinja` nor a `chat_template` in `tokenizer_config.json`.
    #[error("{dir} has no chat template (no chat_template.jinja, no chat_template in tokenizer_config.json)")]
    NoChatTemplate { dir: String },
    /// A template that does not parse, or that fails while rendering (`raise_exception` included).
    #[error("chat template of {dir}: {message}")]
    Template { dir: String, message: String },
    /// Messages that are not a non-empty list of `{"role": string, "content": ...}` objects.
    #[error("messages {origin}: {problem}")]
    Messages { origin: String, problem: String },
    /// The tokenizer failed on text or ids.
    #[error("tokenizer of {dir} cannot {what}: {message}")]
    Tokenize { dir: String, what: &'static str, message: String },
    /// A file (messages, template, tokenizer config) that cannot be read; the harness
    /// reports it as the engine's [`IoError`], as it does every unreadable file.
    #[error(transparent)]
    Io(#[from] IoError),
}

/// The chat's result alias: chat code knows nothing of the harness above it.
pub type Result<T, E = ChatError> = std::result::Result<T, E>;

/// A chat: OpenAI-style messages, `[{"role": "user", "content": "Hi"}, ...]`, handed to the
/// template as they are (extra keys included), so a template reads what transformers would give it.
#[derive(Debug, Clone, PartialEq)]
pub struct Messages(Vec<Map<String, Value>>);

impl Messages {
    /// One user message.
    pub fn user(content: &str) -> Self {
        let mut message = Map::new();
        message.insert("role".into(), "user".into());
        message.insert("content".into(), content.into());
        Messages(vec![message])
    }

    /// Reads a messages file (a JSON list, see [`Messages::parse`]).
    pub fn load(path: &Path) -> Result<Self> {
        let json = std::fs::read_to_string(path).map_err(|e| IoError::read(path, e))?;
        Self::parse(&json, &path.display().to_string())
    }

    /// Parses and checks a JSON list of messages; `origin` names it in errors. Each message is an
    /// object with a string `role` and a `content` that is a string, a list (content parts) or null.
    ///
    /// ```
    /// use omniprefix_cli::chat::{ChatError, Messages};
    /// let chat = Messages::parse(r#"[{"role": "user", "content": "Hi"}]"#, "inline")?;
    /// assert_eq!(chat, Messages::user("Hi"));
    /// let err = Messages::parse(r#"[{"role": "user"}]"#, "inline").unwrap_err();
    /// assert!(matches!(err, ChatError::Messages { problem, .. } if problem == "message 0 has no \"content\""));
    /// # Ok::<(), ChatError>(())
    /// ```
    pub fn parse(json: &str, origin: &str) -> std::result::Result<Self, ChatError> {
        let bad = |problem: String| ChatError::Messages { origin: origin.to_string(), problem };
        let value: Value = serde_json::from_str(json).map_err(|e| bad(format!("not JSON: {e}")))?;
        let Value::Array(list) = value else {
            return Err(bad("not a JSON list of messages".into()));
        };
        if list.is_empty() {
            return Err(bad("the list is empty".into()));
        }
        let messages = list
            .into_iter()
            .enumerate()
            .map(|(i, message)| {
                let Value::Object(message) = message else {
                    return Err(bad(format!("message {i} is not an object")));
                };
                if !message.get("role").is_some_and(Value::is_string) {
                    return Err(bad(format!("message {i} has no string \"role\"")));
                }
                match message.get("content") {
                    Some(Value::String(_) | Value::Array(_) | Value::Null) => Ok(message),
                    Some(_) => Err(bad(format!("message {i}'s \"content\" is not a string, a list or null"))),
                    None => Err(bad(format!("message {i} has no \"content\""))),
                }
            })
            .collect::<std::result::Result<_, _>>()?;
        Ok(Messages(messages))
    }
}

/// The special tokens of `tokenizer_config.json` a template may read.
const TEMPLATE_TOKENS: [&str; 4] = ["bos_token", "eos_token", "unk_token", "pad_token"];
/// The name of the one template in [`Chat`]'s environment.
const TEMPLATE: &str = "chat_template";

/// A checkpoint's tokenizer and chat template.
pub struct Chat {
    dir: PathBuf,
    tokenizer: Tokenizer,
    env: Environment<'static>,
    /// `TEMPLATE_TOKENS` found in `tokenizer_config.json`, as strings.
    special: Map<String, Value>,
}

impl std::fmt::Debug for Chat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Chat").field("dir", &self.dir).field("special", &self.special).finish_non_exhaustive()
    }
}

impl Chat {
    /// Loads `dir/tokenizer.json` and the chat template (parsed now, so a broken one fails here).
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let shown = dir.display().to_string();
        let tokenizer_path = dir.join("tokenizer.json");
        if !tokenizer_path.is_file() {
            return Err(ChatError::NoTokenizer { dir: shown });
        }
        let tokenizer = Tokenizer::from_file(&tokenizer_path).map_err(|e| ChatError::Tokenizer {
            path: tokenizer_path.display().to_string(),
            message: e.to_string(),
        })?;
        let config = read_config(&dir.join("tokenizer_config.json"))?;
        let (template, special) = (template_source(dir, &config)?, special_tokens(dir, &config)?);
        let mut env = Environment::new();
        // transformers renders with trim_blocks and lstrip_blocks, and Python's string methods.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, format!("raise_exception: {message}")))
            },
        );
        env.add_template_owned(TEMPLATE, template)
            .map_err(|e| ChatError::Template { dir: shown.clone(), message: describe(&e) })?;
        Ok(Chat { dir: dir.to_path_buf(), tokenizer, env, special })
    }

    /// The template's text for `messages`; `kwargs` are extra template variables
    /// (transformers' `apply_chat_template(..., **kwargs)`, e.g. `enable_thinking`).
    ///
    /// ```
    /// use omniprefix_cli::chat::{Chat, Messages};
    /// let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tiny/qwen3_dense");
    /// let chat = Chat::from_dir(&dir)?;
    /// let mut kwargs = serde_json::Map::new();
    /// kwargs.insert("enable_thinking".into(), false.into());
    /// let text = chat.render(&Messages::user("Hi"), true, &kwargs)?;
    /// assert_eq!(text, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
    /// # Ok::<(), omniprefix_cli::chat::ChatError>(())
    /// ```
    pub fn render(
        &self, messages: &Messages, add_generation_prompt: bool, kwargs: &Map<String, Value>,
    ) -> Result<String> {
        let mut context = self.special.clone();
        context.insert("tools".into(), Value::Null);
        context.insert("documents".into(), Value::Null);
        context.extend(kwargs.clone());
        context
            .insert("messages".into(), Value::Array(messages.0.iter().cloned().map(Value::Object).collect()));
        context.insert("add_generation_prompt".into(), add_generation_prompt.into());
        let template = self.env.get_template(TEMPLATE).map_err(|e| self.template_error(&e))?;
        template.render(&context).map_err(|e| self.template_error(&e))
    }

    /// Ids of `text` as the tokenizer splits it, with no special tokens added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding =
            self.tokenizer.encode(text, false).map_err(|e| self.tokenize_error("encode the text", &*e))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The prompt of a chat: `messages` rendered with the assistant's header
    /// (`add_generation_prompt`), then encoded.
    pub fn prompt_ids(&self, messages: &Messages) -> Result<Vec<u32>> {
        self.encode(&self.render(messages, true, &Map::new())?)
    }

    /// The text of `ids`; `skip_special_tokens` leaves out the tokens the tokenizer marks special.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.tokenizer
            .decode(ids, skip_special_tokens)
            .map_err(|e| self.tokenize_error("decode the ids", &*e))
    }

    fn template_error(&self, e: &minijinja::Error) -> ChatError {
        ChatError::Template { dir: self.dir.display().to_string(), message: describe(e) }
    }

    fn tokenize_error(&self, what: &'static str, e: &(dyn std::error::Error + Send + Sync)) -> ChatError {
        ChatError::Tokenize { dir: self.dir.display().to_string(), what, message: e.to_string() }
    }
}

/// A minijinja error with its causes on one line.
fn describe(e: &minijinja::Error) -> String {
    let mut text = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        text.push_str(&format!(": {c}"));
        cause = c.source();
    }
    text
}

/// `tokenizer_config.json` as a JSON object; an empty one if the file does not exist.
fn read_config(path: &Path) -> Result<Map<String, Value>> {
    if !path.exists() {
        return Ok(Map::new());
    }
    let json = std::fs::read_to_string(path).map_err(|e| IoError::read(path, e))?;
    let bad = |problem: String| ChatError::TokenizerConfig { path: path.display().to_string(), problem };
    match serde_json::from_str(&json).map_err(|e| bad(format!("not JSON: {e}")))? {
        Value::Object(config) => Ok(config),
        _ => Err(bad("not a JSON object".into())),
    }
}

/// The template source: `chat_template.jinja`, else the config's `chat_template`.
fn template_source(dir: &Path, config: &Map<String, Value>) -> Result<String> {
    let file = dir.join("chat_template.jinja");
    if file.is_file() {
        return Ok(std::fs::read_to_string(&file).map_err(|e| IoError::read(&file, e))?);
    }
    let bad = |problem: &str| config_error(dir, problem.into());
    match config.get("chat_template") {
        None | Some(Value::Null) => Err(ChatError::NoChatTemplate { dir: dir.display().to_string() }),
        Some(Value::String(template)) => Ok(template.clone()),
        Some(Value::Array(named)) => named
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template")?.as_str())
            .map(str::to_string)
            .ok_or_else(|| {
                bad("chat_template is a list without a {\"name\": \"default\", \"template\": ...} entry")
            }),
        Some(_) => Err(bad("chat_template is neither a string nor a list of named templates")),
    }
}

/// The config's [`TEMPLATE_TOKENS`] as strings (a token is a string or an object with `content`).
fn special_tokens(dir: &Path, config: &Map<String, Value>) -> Result<Map<String, Value>> {
    let mut special = Map::new();
    for key in TEMPLATE_TOKENS {
        let content = match config.get(key) {
            None | Some(Value::Null) => continue,
            Some(Value::String(s)) => s.clone(),
            Some(Value::Object(token)) => match token.get("content") {
                Some(Value::String(s)) => s.clone(),
                _ => return Err(token_error(dir, key)),
            },
            Some(_) => return Err(token_error(dir, key)),
        };
        special.insert(key.into(), content.into());
    }
    Ok(special)
}

fn token_error(dir: &Path, key: &str) -> ChatError {
    config_error(dir, format!("{key} is neither a string nor an object with a string \"content\""))
}

/// A problem with `dir/tokenizer_config.json`.
fn config_error(dir: &Path, problem: String) -> ChatError {
    ChatError::TokenizerConfig { path: dir.join("tokenizer_config.json").display().to_string(), problem }
}
