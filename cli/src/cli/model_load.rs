//! What the benchmark commands share about their model: the thinker that
//! `--model DIR` names or the seeded random one they build.

use std::path::Path;

use omniprefix::backend::Backend;
use omniprefix::engine::tokens_from_config_file;
use omniprefix::model::{Config, Thinker};
use omniprefix::prompt::OmniTokens;

use super::runtime::DtypeArg;
use crate::error::Result;

/// The thinker in `dir` with its special ids, or (no `dir`) the seeded random
/// model `random` describes, matrices stored as `dtype`.
pub fn load_thinker<B: Backend>(
    backend: &B, dir: Option<&Path>, random: Config, seed: u64, dtype: DtypeArg,
) -> Result<(Thinker<B>, Option<OmniTokens>)> {
    Ok(match dir {
        Some(dir) => {
            (Thinker::from_dir_as(backend, dir, dtype.0)?, tokens_from_config_file(&dir.join("config.json"))?)
        }
        None => (Thinker::random_as(backend, random, seed, dtype.0)?, None),
    })
}
