//! The machine a report was measured on, so its numbers can be read in context.

use serde::Serialize;

/// Cores, CPU, memory, OS and the backend that ran the model.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    /// Threads the process may run on.
    pub cores: usize,
    pub cpu_model: String,
    pub memory_bytes: Option<u64>,
    pub os: String,
    /// `cpu`, or `wgpu: <adapter> (<api>)`.
    pub backend: String,
}

impl Machine {
    /// Describes this machine; `backend` names what runs the model. Facts the OS
    /// does not expose read `unknown` (or `None`).
    pub fn describe(backend: String) -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let os_release = std::fs::read_to_string("/etc/os-release").unwrap_or_default();
        Machine {
            cores: std::thread::available_parallelism().map_or(1, usize::from),
            cpu_model: field(&cpuinfo, "model name", ':').unwrap_or_else(|| "unknown".into()),
            memory_bytes: field(&meminfo, "MemTotal", ':')
                .and_then(|kb| kb.trim_end_matches("kB").trim().parse::<u64>().ok())
                .map(|kb| kb * 1024),
            os: format!(
                "{} {}",
                std::env::consts::OS,
                field(&os_release, "PRETTY_NAME", '=')
                    .map(|s| s.trim_matches('"').to_string())
                    .unwrap_or_default()
            )
            .trim()
            .to_string(),
            backend,
        }
    }
}

/// The value of the first `key<sep>value` line of `text`.
fn field(text: &str, key: &str, sep: char) -> Option<String> {
    text.lines().find_map(|line| {
        let (k, v) = line.split_once(sep)?;
        (k.trim() == key).then(|| v.trim().to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_read_by_key() {
        let text = "processor\t: 0\nmodel name\t: Some CPU @ 2GHz\nflags : x";
        assert_eq!(field(text, "model name", ':').as_deref(), Some("Some CPU @ 2GHz"));
        assert_eq!(field(text, "missing", ':'), None);
        let m = Machine::describe("cpu".into());
        assert!(m.cores >= 1);
        assert_eq!(m.backend, "cpu");
    }
}
