//! The keyword options of `Engine.from_dir` / `Engine.random` and of the
//! standalone matcher, parsed into the engine's types.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use omniprefix::backend::Dtype;
use omniprefix::backend::auto::BackendKind;
use omniprefix::canon::FingerprintKey;
use omniprefix::engine::{EngineConfig, IndexKind};
use omniprefix::error::ConfigError;
use omniprefix::events::KvEventsOptions;
use omniprefix::index::ValidationPolicy;
use omniprefix::model::CaptureName;
use omniprefix::sched::PrefillCap;
use omniprefix::tier::tier_key;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyFloat, PyInt, PyString};

use crate::errors::to_py;

/// Which hidden states an engine captures, before the model's depth is known.
#[derive(Debug, Clone, Default)]
pub enum CaptureChoice {
    /// Layer 0, the middle layer and the final norm.
    #[default]
    Default,
    /// Every layer boundary and the final norm.
    All,
    List(Vec<CaptureName>),
}

impl CaptureChoice {
    /// The points for a model of `num_layers` layers (`None`: the engine's default).
    pub fn resolve(&self, num_layers: usize) -> Option<Vec<CaptureName>> {
        match self {
            CaptureChoice::Default => None,
            CaptureChoice::All => Some(CaptureName::every(num_layers)),
            CaptureChoice::List(points) => Some(points.clone()),
        }
    }
}

/// Everything the engine options say.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    pub config: EngineConfig,
    pub capture: CaptureChoice,
    pub backend: BackendKind,
}

/// The option names `Engine.from_dir` and `Engine.random` accept.
const ENGINE_OPTIONS: [&str; 28] = [
    "block_size",
    "num_blocks",
    "capture",
    "cache",
    "backend",
    "dtype",
    "kv_dtype",
    "fingerprint_key",
    "validation",
    "tenants",
    "max_tokens_per_step",
    "max_seqs_per_step",
    "prefill_cap",
    "token_granular_reuse",
    "index",
    "fingerprint_threads",
    "encoder_cache_bytes",
    "kv_events",
    "kv_replay",
    "kv_topic",
    "kv_buffer_steps",
    "kv_linger_s",
    "tier_dir",
    "tier_bytes",
    "speech",
    "talker_num_blocks",
    "talker_block_size",
    "audio_yield_s",
];

/// The disk tier's options as given: `tier_bytes` only means something with `tier_dir`.
#[derive(Default)]
struct TierOptions {
    dir: Option<PathBuf>,
    bytes: Option<u64>,
}

impl TierOptions {
    /// Sets the tier on `config`, as the CLI's `--tier-dir` / `--tier-bytes` do: without a
    /// `fingerprint_key` (`key_given` false) the engine takes the key kept in the directory, so
    /// a later engine (or another worker) on it finds the files this one writes. `tier_bytes`
    /// without `tier_dir` is a `ValueError`; a bound the tier cannot use (0, below one block)
    /// is left to the engine, whose `ConfigError` names `tier_bytes`.
    fn apply(self, config: &mut EngineConfig, key_given: bool) -> PyResult<()> {
        let Some(dir) = self.dir else {
            return match self.bytes {
                Some(_) => Err(PyValueError::new_err("tier_bytes needs tier_dir (the tier's directory) too")),
                None => Ok(()),
            };
        };
        if let Some(bytes) = self.bytes {
            config.tier_bytes = bytes;
        }
        if !key_given {
            config.fingerprint_key = tier_key(&dir).map_err(to_py)?;
        }
        config.tier_dir = Some(dir);
        Ok(())
    }
}

impl EngineOptions {
    /// Parses `**options`; an unknown name is a `TypeError`, a bad value a
    /// `TypeError` / `ValueError` naming the option.
    pub fn parse(options: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let mut out = EngineOptions {
            config: EngineConfig::default(),
            capture: CaptureChoice::Default,
            backend: BackendKind::Cpu,
        };
        let Some(options) = options else { return Ok(out) };
        let config = &mut out.config;
        let mut kv = KvEventsOptions::default();
        let mut tier = TierOptions::default();
        let mut key_given = false;
        for (key, value) in options.iter() {
            let name: String = key.extract()?;
            if value.is_none() {
                continue;
            }
            match name.as_str() {
                "block_size" => config.scheduler.block_size = count(&value, &name)?,
                "num_blocks" => config.scheduler.num_blocks = count(&value, &name)?,
                "max_tokens_per_step" => config.scheduler.max_tokens_per_step = count(&value, &name)?,
                "max_seqs_per_step" => config.scheduler.max_seqs_per_step = count(&value, &name)?,
                "prefill_cap" => config.scheduler.prefill_cap = PrefillCap::Tokens(count(&value, &name)?),
                "fingerprint_threads" => config.fingerprint_threads = count(&value, &name)?,
                "encoder_cache_bytes" => config.encoder_cache_bytes = count(&value, &name)?,
                "cache" => config.cache = flag(&value, &name)?,
                "token_granular_reuse" => config.scheduler.token_granular_reuse = flag(&value, &name)?,
                "index" => config.index = index_kind(&value)?,
                "capture" => out.capture = capture_choice(&value)?,
                "backend" => out.backend = backend_kind(&value)?,
                "dtype" => config.dtype = dtype(&value)?,
                "kv_dtype" => {
                    config.kv_dtype = dtype(&value)?
                        .ok_or_else(|| PyValueError::new_err("kv_dtype \"auto\": give f32, bf16 or f16"))?
                }
                "fingerprint_key" => {
                    config.fingerprint_key = fingerprint_key(&value, &name)?;
                    key_given = true;
                }
                "validation" => config.validation = validation(&value)?,
                "tenants" => {
                    config.known_tenants =
                        Some(value.extract().map_err(|_| {
                            PyTypeError::new_err("tenants must be a list of non-negative ints")
                        })?)
                }
                "kv_events" => kv.endpoint = Some(string(&value, &name)?),
                "kv_replay" => kv.replay_endpoint = Some(string(&value, &name)?),
                "kv_topic" => kv.topic = Some(string(&value, &name)?),
                "kv_buffer_steps" => kv.buffer_steps = Some(count(&value, &name)?),
                "kv_linger_s" => kv.linger_s = Some(number(&value, &name)?),
                "tier_dir" => tier.dir = Some(path(&value, &name)?),
                "tier_bytes" => tier.bytes = Some(count(&value, &name)?),
                "speech" => config.speech = flag(&value, &name)?,
                "talker_num_blocks" => config.talker_cache.num_blocks = count(&value, &name)?,
                "talker_block_size" => config.talker_cache.block_size = count(&value, &name)?,
                "audio_yield_s" => config.audio_yield = Some(seconds(&value, &name)?),
                other => {
                    return Err(PyTypeError::new_err(format!(
                        "unknown engine option {other:?}; options are {}",
                        ENGINE_OPTIONS.join(", ")
                    )));
                }
            }
        }
        config.kv_events = kv.config().map_err(kv_option_error)?;
        tier.apply(config, key_given)?;
        Ok(out)
    }
}

/// A [`KvEventsOptions::config`] error as a `ValueError` naming the option as Python spells it.
fn kv_option_error(e: ConfigError) -> PyErr {
    let ConfigError::Invalid { field, expected, found, .. } = &e else {
        return PyValueError::new_err(e.to_string());
    };
    let option = match *field {
        "replay_endpoint" => "kv_replay",
        "topic" => "kv_topic",
        "buffer_steps" => "kv_buffer_steps",
        "linger" => "kv_linger_s",
        other => other,
    };
    PyValueError::new_err(format!("{option} must be {expected}, found {found}"))
}

/// A bool option.
fn flag(value: &Bound<'_, PyAny>, name: &str) -> PyResult<bool> {
    value.extract().map_err(|_| PyTypeError::new_err(format!("{name} must be a bool")))
}

/// `"radix"` (the validated radix tree) or `"hashchain"` (vLLM's block hash chain, the baseline).
fn index_kind(value: &Bound<'_, PyAny>) -> PyResult<IndexKind> {
    let name = string(value, "index")?;
    serde_json::from_value(serde_json::Value::String(name.clone()))
        .map_err(|_| PyValueError::new_err(format!("index {name:?}: expected \"radix\" or \"hashchain\"")))
}

/// A non-negative int option (`usize` or `u64`).
fn count<T: for<'a, 'py> FromPyObject<'a, 'py>>(value: &Bound<'_, PyAny>, name: &str) -> PyResult<T> {
    if !value.is_instance_of::<PyInt>() {
        return Err(PyTypeError::new_err(format!("{name} must be an int")));
    }
    value.extract().map_err(|_| PyValueError::new_err(format!("{name} must be a non-negative int")))
}

/// A number of seconds as given (an int or a float).
fn number(value: &Bound<'_, PyAny>, name: &str) -> PyResult<f64> {
    if !value.is_instance_of::<PyFloat>() && !value.is_instance_of::<PyInt>() {
        return Err(PyTypeError::new_err(format!("{name} must be a number of seconds")));
    }
    value.extract()
}

/// A non-negative, finite number of seconds (an int or a float).
fn seconds(value: &Bound<'_, PyAny>, name: &str) -> PyResult<Duration> {
    let s = number(value, name)?;
    Duration::try_from_secs_f64(s).map_err(|_| {
        PyValueError::new_err(format!("{name} must be a finite number of seconds >= 0, found {s}"))
    })
}

/// A filesystem path: a `str` or an `os.PathLike` (`pathlib.Path`).
fn path(value: &Bound<'_, PyAny>, name: &str) -> PyResult<PathBuf> {
    value.extract().map_err(|_| PyTypeError::new_err(format!("{name} must be a str or an os.PathLike")))
}

fn string(value: &Bound<'_, PyAny>, name: &str) -> PyResult<String> {
    if !value.is_instance_of::<PyString>() {
        return Err(PyTypeError::new_err(format!("{name} must be a str")));
    }
    value.extract()
}

/// `"default"`, `"all"`, or a list of layer numbers, `"hidden.<L>"`, `"final"` / `"hidden.final"`.
fn capture_choice(value: &Bound<'_, PyAny>) -> PyResult<CaptureChoice> {
    if value.is_instance_of::<PyString>() {
        return match value.extract::<String>()?.as_str() {
            "default" => Ok(CaptureChoice::Default),
            "all" => Ok(CaptureChoice::All),
            other => Err(PyValueError::new_err(format!(
                "capture {other:?}: expected \"default\", \"all\" or a list of points"
            ))),
        };
    }
    let points = value
        .try_iter()
        .map_err(|_| {
            PyTypeError::new_err("capture must be \"default\", \"all\" or a list such as [0, 2, \"final\"]")
        })?
        .map(|point| capture_point(&point?))
        .collect::<PyResult<Vec<_>>>()?;
    Ok(CaptureChoice::List(points))
}

/// One capture point: an int layer or a name.
pub fn capture_point(point: &Bound<'_, PyAny>) -> PyResult<CaptureName> {
    if point.is_instance_of::<PyInt>() {
        let layer: usize = point
            .extract()
            .map_err(|_| PyValueError::new_err("a capture layer must be a non-negative int"))?;
        return Ok(CaptureName::Hidden(layer));
    }
    CaptureName::from_str(&string(point, "a capture point")?).map_err(to_py)
}

fn backend_kind(value: &Bound<'_, PyAny>) -> PyResult<BackendKind> {
    let name = string(value, "backend")?;
    BackendKind::from_str(&name).map_err(|_| {
        PyValueError::new_err(format!("backend {name:?}: expected \"cpu\", \"wgpu\" or \"auto\""))
    })
}

/// `"auto"` (the checkpoint's own dtype), `"f32"`, `"bf16"` or `"f16"`; numpy's
/// `"float32"`, `"bfloat16"` and `"float16"` too.
fn dtype(value: &Bound<'_, PyAny>) -> PyResult<Option<Dtype>> {
    let name = string(value, "dtype")?;
    let short = match name.as_str() {
        "float32" => "f32",
        "bfloat16" => "bf16",
        "float16" => "f16",
        other => other,
    };
    Dtype::parse_or_auto(short).map_err(|e| PyValueError::new_err(e.to_string()))
}

/// A fleet key given as 32 `bytes` or a `str` of 64 hex digits (option `name`).
pub fn fingerprint_key(value: &Bound<'_, PyAny>, name: &str) -> PyResult<FingerprintKey> {
    if value.is_instance_of::<PyString>() {
        let text: String = value.extract()?;
        return FingerprintKey::from_hex(&text).map_err(|e| PyValueError::new_err(format!("{name}: {e}")));
    }
    let bytes = value
        .cast::<PyBytes>()
        .map_err(|_| PyTypeError::new_err(format!("{name} must be 32 bytes or a str of 64 hex digits")))?
        .as_bytes();
    let key: [u8; 32] = bytes.try_into().map_err(|_| {
        PyValueError::new_err(format!(
            "{name} must be 32 bytes (or a str of 64 hex digits), found {} bytes",
            bytes.len()
        ))
    })?;
    Ok(FingerprintKey::from_bytes(key))
}

/// `"second_digest"`, `"exact_bytes"` or `"unvalidated"`.
pub fn validation(value: &Bound<'_, PyAny>) -> PyResult<ValidationPolicy> {
    match string(value, "validation")?.as_str() {
        "second_digest" => Ok(ValidationPolicy::SecondDigest),
        "exact_bytes" => Ok(ValidationPolicy::ExactBytes),
        "unvalidated" => Ok(ValidationPolicy::Unvalidated),
        other => Err(PyValueError::new_err(format!(
            "validation {other:?}: expected \"second_digest\", \"exact_bytes\" or \"unvalidated\""
        ))),
    }
}

/// The Python name of a policy.
pub fn validation_name(policy: ValidationPolicy) -> &'static str {
    match policy {
        ValidationPolicy::SecondDigest => "second_digest",
        ValidationPolicy::ExactBytes => "exact_bytes",
        ValidationPolicy::Unvalidated => "unvalidated",
    }
}
