//! `omniprefix block-hashes`: the hashes an engine under the fleet key
//! publishes for a request's full blocks, computed from the request file alone
//! (no model): what a router's frontend computes before it picks a replica.

use std::io::Write;
use std::path::PathBuf;

use clap::Args;
use serde::Serialize;

use omniprefix::canon::FingerprintKey;
use omniprefix::engine::{request_block_hashes, tokens_from_config_file};
use omniprefix::prompt::OmniTokens;
use omniprefix::request_file::RequestFile;

use crate::error::{HarnessError, Result, output};

/// Arguments of `omniprefix block-hashes`.
#[derive(Debug, Clone, Args)]
pub struct BlockHashesArgs {
    /// The request file (JSON, see `docs/request-format.md`).
    #[arg(long)]
    pub request: PathBuf,
    /// The fleet key: 64 hex digits, the engines' `--fingerprint-key`.
    #[arg(long, value_name = "HEX")]
    pub fingerprint_key: String,
    /// Tokens per KV block (the engines' `--block-size`).
    #[arg(long, default_value_t = omniprefix::kv::DEFAULT_BLOCK_SIZE)]
    pub block_size: usize,
    /// The model's `config.json`, for its special ids (default: Qwen3-Omni's).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Print `{"block_hashes": [...]}` instead of one hash per line.
    #[arg(long)]
    pub json: bool,
}

/// What `block-hashes --json` prints.
#[derive(Debug, Serialize)]
struct Report {
    block_hashes: Vec<u64>,
}

/// Runs the command.
pub fn run(args: &BlockHashesArgs, out: &mut dyn Write) -> Result<()> {
    if args.block_size == 0 {
        return Err(HarnessError::Args(clap::Error::raw(
            clap::error::ErrorKind::ValueValidation,
            "--block-size 0: must be at least 1",
        )));
    }
    let key = FingerprintKey::from_hex(&args.fingerprint_key)?;
    let tokens = match &args.config {
        Some(path) => tokens_from_config_file(path)?.unwrap_or_else(OmniTokens::qwen3_omni),
        None => OmniTokens::qwen3_omni(),
    };
    let file = RequestFile::load(&args.request)?;
    let block_hashes = request_block_hashes(&file.request(&tokens), &key, args.block_size, &tokens)?;
    if args.json {
        let json = serde_json::to_string(&Report { block_hashes })
            .map_err(|source| HarnessError::Report { what: "the block hashes".into(), source })?;
        return writeln!(out, "{json}").map_err(output);
    }
    for h in block_hashes {
        writeln!(out, "{h}").map_err(output)?;
    }
    Ok(())
}
