//! What the benchmark commands share about their model: `--dtype`, and the
//! thinker that `--model DIR` names or the seeded random one they build.

use std::fmt;
use std::path::Path;
use std::str::FromStr;

use omniprefix::backend::{Backend, Dtype};
use omniprefix::engine::tokens_from_config_file;
use omniprefix::model::{Config, Thinker};
use omniprefix::prompt::OmniTokens;

use crate::error::Result;

/// `--dtype auto|f32|bf16|f16`: how weight matrices are stored. `auto` is the
/// checkpoint's own dtype (f32 for a random model, and on a backend that cannot
/// store the checkpoint's); products always accumulate in f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DtypeArg(pub Option<Dtype>);

impl FromStr for DtypeArg {
    type Err = omniprefix::backend::UnknownDtype;
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        Dtype::parse_or_auto(s).map(DtypeArg)
    }
}

impl fmt::Display for DtypeArg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0.map_or("auto", Dtype::name))
    }
}

/// The thinker in `dir` with its special ids, or (no `dir`) the seeded random
/// model `random` describes, matrices stored as `dtype`.
pub fn load_thinker<B: Backend>(
    backend: &B,
    dir: Option<&Path>,
    random: Config,
    seed: u64,
    dtype: DtypeArg,
) -> Result<(Thinker<B>, Option<OmniTokens>)> {
    Ok(match dir {
        Some(dir) => (Thinker::from_dir_as(backend, dir, dtype.0)?, tokens_from_config_file(&dir.join("config.json"))?),
        None => (Thinker::random_as(backend, random, seed, dtype.0)?, None),
    })
}
