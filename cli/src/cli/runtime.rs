//! `--threads`, `--backend`, `--dtype` and `--kv-dtype`: where and how the model
//! runs. `hidden`, `generate`, `bench ttft` and `bench serve` flatten the same
//! [`RuntimeArgs`](crate::cli::runtime::RuntimeArgs), and [`RuntimeArgs::run`](crate::cli::runtime::RuntimeArgs::run) is the one place that turns them
//! into a thread pool and an opened backend.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use clap::Args;

use omniprefix::backend::auto::{BackendKind, SelectedBackend, select};
use omniprefix::backend::{Backend, Dtype};
use omniprefix::error::Error;

use crate::error::Result;

/// Where the model runs and how its weights and K/V pages are stored.
#[derive(Debug, Clone, Args)]
pub struct RuntimeArgs {
    /// CPU threads for the forward (default: all).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Where the model runs: `cpu`, `wgpu` (an error without an adapter, never a
    /// silent CPU fallback) or `auto` (wgpu on a hardware adapter, else cpu).
    #[arg(long, default_value_t = BackendKind::Cpu)]
    pub backend: BackendKind,
    /// How weight matrices are stored: `auto` (the checkpoint's own dtype), `f32`, `bf16` or `f16`.
    #[arg(long, default_value_t = DtypeArg::default())]
    pub dtype: DtypeArg,
    /// The element type of the K/V pages: `f32`, `f16` or `bf16` (half the KV memory;
    /// attention widens each tile back to f32). The wgpu backend stores f32 or f16, not bf16.
    #[arg(long, default_value_t = Dtype::F32, value_parser = Dtype::parse_float)]
    pub kv_dtype: Dtype,
}

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

/// Work for whichever backend `--backend` opens (a trait, not a closure,
/// because the backend's type differs per choice).
pub trait BackendJob: Send {
    /// What the job hands back to its command.
    type Output: Send;
    /// Runs on the opened backend, inside the `--threads` pool.
    fn run<B: Backend + 'static>(self, backend: Arc<B>) -> Result<Self::Output>;
}

/// What a job returned, and why its backend was chosen (the `backend:` line).
#[derive(Debug)]
pub struct Ran<T> {
    pub reason: String,
    pub output: T,
}

impl RuntimeArgs {
    /// A pool of `--threads` workers (default: as many as rayon's global pool);
    /// `purpose` names them in the error when they cannot start.
    pub fn pool(&self, purpose: &'static str) -> Result<rayon::ThreadPool> {
        let mut pool = rayon::ThreadPoolBuilder::new();
        if let Some(n) = self.threads {
            pool = pool.num_threads(n);
        }
        let threads = self.threads.unwrap_or_else(rayon::current_num_threads);
        Ok(pool.build().map_err(|source| Error::ThreadPool { purpose, threads, source })?)
    }

    /// Opens the `--backend` and runs `job` on it inside [`pool`](Self::pool)`(purpose)`.
    pub fn run<J: BackendJob>(&self, purpose: &'static str, job: J) -> Result<Ran<J::Output>> {
        let pool = self.pool(purpose)?;
        let selection = select(self.backend)?;
        let output = pool.install(|| match selection.backend {
            SelectedBackend::Cpu(cpu) => job.run(Arc::new(cpu)),
            SelectedBackend::Wgpu(gpu) => job.run(Arc::new(gpu)),
        })?;
        Ok(Ran { reason: selection.reason, output })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Probe {
        #[command(flatten)]
        runtime: RuntimeArgs,
    }

    #[test]
    fn defaults_are_every_thread_the_cpu_the_checkpoints_dtype_and_f32_pages() {
        let RuntimeArgs { threads, backend, dtype, kv_dtype } =
            Probe::try_parse_from(["probe"]).unwrap().runtime;
        assert_eq!((threads, backend, dtype, kv_dtype), (None, BackendKind::Cpu, DtypeArg(None), Dtype::F32));
        let args = ["probe", "--threads", "3", "--backend", "auto", "--dtype", "bf16", "--kv-dtype", "f16"];
        let r = Probe::try_parse_from(args).unwrap().runtime;
        assert_eq!(
            (r.threads, r.backend, r.dtype, r.kv_dtype),
            (Some(3), BackendKind::Auto, DtypeArg(Some(Dtype::Bf16)), Dtype::F16)
        );
    }

    #[test]
    fn integer_dtypes_are_refused_like_unknown_names() {
        for (flag, name) in [
            ("--dtype", "u8"),
            ("--dtype", "i64"),
            ("--kv-dtype", "i32"),
            ("--kv-dtype", "u8"),
            ("--kv-dtype", "fp8"),
        ] {
            let err = Probe::try_parse_from(["probe", flag, name]).unwrap_err();
            assert_eq!(err.kind(), clap::error::ErrorKind::ValueValidation, "{flag} {name}");
            assert!(
                err.to_string().contains(&format!("dtype `{name}`: expected auto, f32, bf16 or f16")),
                "{flag} {name}: {err}"
            );
        }
    }

    /// A job that reports the pool it ran in.
    struct PoolSize;

    impl BackendJob for PoolSize {
        type Output = usize;
        fn run<B: Backend + 'static>(self, _: Arc<B>) -> Result<usize> {
            Ok(rayon::current_num_threads())
        }
    }

    #[test]
    fn jobs_run_on_the_chosen_backend_inside_the_threads_pool() {
        let r = Probe::try_parse_from(["probe", "--threads", "3"]).unwrap().runtime;
        let ran = r.run("test", PoolSize).unwrap();
        assert_eq!((ran.output, ran.reason.as_str()), (3, "cpu (asked for cpu)"));
    }
}
