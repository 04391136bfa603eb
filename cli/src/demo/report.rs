//! The demo's report: one flat row per (workload, request, way) with ratios
//! against references from the same run, the model and the machine; printed
//! as one table per workload and serialised as JSON.

use std::io::Write;

use serde::Serialize;

use super::machine::Machine;
use super::pipeline::{RequestRun, Way};
use omniprefix::model::CaptureName;

/// The whole `demo --json` report.
#[derive(Debug, Clone, Serialize)]
pub struct DemoReport {
    /// Bumped when a field changes meaning.
    pub schema: u32,
    pub quick: bool,
    pub seed: u64,
    pub model: ModelInfo,
    pub machine: Machine,
    /// Tokens per KV block and the chunked-prefill budget of every way.
    pub block_size: usize,
    pub max_tokens_per_step: usize,
    /// What the item tensors are (real Qwen3-Omni shapes, or how they were scaled).
    pub media: MediaInfo,
    pub workloads: Vec<WorkloadReport>,
    /// The claims at a glance, from the rows above.
    pub summary: Summary,
    /// The spoken multi-round chat on a full Omni checkpoint (`demo --speech-model`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spoken_chat: Option<super::speech::SpokenChatReport>,
    /// Wall time of the whole demo (model build, media, every run).
    pub wall_s: f64,
}

/// The thinker that ran.
#[derive(Debug, Clone, Serialize)]
pub struct ModelInfo {
    /// `random` (seeded weights) or the checkpoint directory.
    pub source: String,
    pub model_type: String,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub vocab_size: usize,
    /// `true` for an M-RoPE (3-D positions) model.
    pub mrope: bool,
    pub moe_experts: Option<usize>,
}

/// The item tensors every workload draws from.
#[derive(Debug, Clone, Serialize)]
pub struct MediaInfo {
    /// `[raw shape, tokens]` per modality.
    pub image: (Vec<usize>, usize),
    pub audio: (Vec<usize>, usize),
    pub video: (Vec<usize>, usize),
    pub note: String,
}

/// One workload's rows.
#[derive(Debug, Clone, Serialize)]
pub struct WorkloadReport {
    pub name: String,
    pub rows: Vec<Row>,
}

/// One request of one workload run one way.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// Position of the request in the workload (round, or prompt of the batch).
    pub request: usize,
    pub way: Way,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    /// Raw item bytes + token-id bytes the request carries.
    pub input_bytes: usize,
    /// One plain single-threaded read of `input_bytes` (median).
    pub read_floor_ns: u64,
    pub match_ns: u64,
    pub match_over_read_floor: f64,
    /// Submission to full hidden states, as the engine measures it (every way,
    /// the hash chain included, preprocesses with omniprefix's fingerprints).
    pub ttft_ns: u64,
    /// This way's TTFT over the no-cache way's for the same request.
    pub ttft_over_no_cache: f64,
    /// `[rows, cols]` of each captured point's hidden states, with its name.
    pub hidden_shapes: Vec<(String, [usize; 2])>,
    /// max |this − no cache| / max |no cache| over every captured hidden state.
    pub max_rel_diff_hidden: f64,
    /// The same for the last position's logits (0 for a generated round, which returns none).
    pub max_rel_diff_logits: f64,
    /// A conversation round: tokens of the previous reply re-sent, and how many were found in the cache.
    pub reply_tokens: usize,
    pub reply_cached: usize,
    /// The tokens this way generated are the no-cache way's (true where nothing was generated).
    pub same_reply_as_no_cache: bool,
}

/// The demo's claims over every workload, for a newcomer to read at a glance.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Summary {
    /// Prompt tokens of every request, and those each way found in the cache.
    pub prompt_tokens: usize,
    pub radix_cached_tokens: usize,
    pub hash_chain_cached_tokens: usize,
    /// Median match time over the read floor in the `multi_round` rounds (the requests that carry
    /// media; a text prompt's floor is nanoseconds), radix and vLLM's path (hash chain + its media hashes).
    pub radix_match_over_floor: f64,
    pub hash_chain_match_over_floor: f64,
    /// Largest relative difference of any cached way's hidden states or logits to the no-cache way.
    pub max_rel_diff: f64,
    /// Every generated reply equals the no-cache way's.
    pub same_replies: bool,
    /// Radix TTFT over no-cache TTFT in the conversation's last round.
    pub last_round_ttft_ratio: f64,
    /// Tokens of earlier replies re-sent in later rounds, and those each way found in the cache.
    pub reply_tokens: usize,
    pub radix_reply_cached: usize,
    pub hash_chain_reply_cached: usize,
}

impl Summary {
    /// Sums and medians over `workloads`' rows.
    pub fn of(workloads: &[WorkloadReport]) -> Self {
        let rows = || workloads.iter().flat_map(|w| &w.rows);
        let of_way = |way: Way| rows().filter(move |r| r.way == way);
        let conversation =
            workloads.iter().find(|w| w.name == "multi_round").map(|w| w.rows.as_slice()).unwrap_or_default();
        let median_ratio = |way: Way| {
            crate::ttft::median(
                conversation.iter().filter(|r| r.way == way).map(|r| r.match_over_read_floor).collect(),
            )
        };
        let last_round = conversation.iter().rfind(|r| r.way == Way::Radix);
        Summary {
            prompt_tokens: of_way(Way::NoCache).map(|r| r.prompt_tokens).sum(),
            radix_cached_tokens: of_way(Way::Radix).map(|r| r.cached_tokens).sum(),
            hash_chain_cached_tokens: of_way(Way::HashChain).map(|r| r.cached_tokens).sum(),
            radix_match_over_floor: median_ratio(Way::Radix),
            hash_chain_match_over_floor: median_ratio(Way::HashChain),
            max_rel_diff: rows()
                .map(|r| r.max_rel_diff_hidden.max(r.max_rel_diff_logits))
                .fold(0.0, f64::max),
            same_replies: rows().all(|r| r.same_reply_as_no_cache),
            last_round_ttft_ratio: last_round.map_or(f64::NAN, |r| r.ttft_over_no_cache),
            reply_tokens: of_way(Way::NoCache).map(|r| r.reply_tokens).sum(),
            radix_reply_cached: of_way(Way::Radix).map(|r| r.reply_cached).sum(),
            hash_chain_reply_cached: of_way(Way::HashChain).map(|r| r.reply_cached).sum(),
        }
    }
}

/// Largest relative difference the summary still calls "equal" (f32 noise of a reordered sum).
pub const EQUAL_REL_DIFF: f64 = 1e-4;

/// Prints the summary: one line per claim.
pub fn print_summary(s: &Summary, out: &mut dyn Write) -> std::io::Result<()> {
    writeln!(out, "\n== summary ==")?;
    writeln!(
        out,
        "vs the vLLM path: radix reused {} of {} prompt tokens, the hash chain {}; matching multi_round took {:.2}x the read floor, vLLM's path {:.2}x (medians)",
        s.radix_cached_tokens,
        s.prompt_tokens,
        s.hash_chain_cached_tokens,
        s.radix_match_over_floor,
        s.hash_chain_match_over_floor
    )?;
    let equal = s.max_rel_diff <= EQUAL_REL_DIFF && s.same_replies;
    writeln!(
        out,
        "hidden states equal to uncached: {} (max relative difference {:.1e}; generated replies {})",
        if equal { "yes" } else { "NO" },
        s.max_rel_diff,
        if s.same_replies { "identical" } else { "DIFFER" }
    )?;
    writeln!(out, "TTFT, last multi_round round: {:.3}x uncached (radix)", s.last_round_ttft_ratio)?;
    writeln!(
        out,
        "reply reuse: {} of {} tokens of earlier replies found in the cache (radix), {} (hash chain)",
        s.radix_reply_cached, s.reply_tokens, s.hash_chain_reply_cached
    )
}

/// The per-request facts every way shares.
#[derive(Debug, Clone, Copy)]
pub struct RequestFacts {
    pub input_bytes: usize,
    pub read_floor_ns: u64,
}

/// Rows of one workload: each way's runs against the no-cache runs (the reference).
pub fn workload_rows(facts: &[RequestFacts], runs: &[(Way, Vec<RequestRun>)]) -> Vec<Row> {
    let reference =
        runs.iter().find(|(w, _)| *w == Way::NoCache).map(|(_, r)| r.as_slice()).unwrap_or_default();
    let mut rows = Vec::new();
    for (way, way_runs) in runs {
        for (request, run) in way_runs.iter().enumerate() {
            let facts =
                facts.get(request).copied().unwrap_or(RequestFacts { input_bytes: 0, read_floor_ns: 0 });
            let reference = reference.get(request);
            rows.push(Row {
                request,
                way: *way,
                prompt_tokens: run.prompt_tokens,
                cached_tokens: run.cached_tokens,
                input_bytes: facts.input_bytes,
                read_floor_ns: facts.read_floor_ns,
                match_ns: run.match_ns,
                match_over_read_floor: ratio(run.match_ns, facts.read_floor_ns),
                ttft_ns: run.ttft_ns,
                ttft_over_no_cache: reference.map_or(f64::NAN, |r| ratio(run.ttft_ns, r.ttft_ns)),
                hidden_shapes: run
                    .hidden
                    .iter()
                    .map(|(name, h)| (name.to_string(), [h.nrows(), h.ncols()]))
                    .collect(),
                max_rel_diff_hidden: reference.map_or(f64::NAN, |r| hidden_rel_diff(&run.hidden, &r.hidden)),
                max_rel_diff_logits: reference
                    .map_or(f64::NAN, |r| rel_diff(&run.last_logits, &r.last_logits)),
                reply_tokens: run.reply_tokens,
                reply_cached: run.reply_cached,
                same_reply_as_no_cache: reference.is_some_and(|r| r.generated == run.generated),
            });
        }
    }
    rows
}

fn ratio(num: u64, den: u64) -> f64 {
    num as f64 / den.max(1) as f64
}

/// Largest [`rel_diff`] over the captured points; infinite when they do not pair up.
fn hidden_rel_diff(
    a: &[(CaptureName, ndarray::Array2<f32>)], b: &[(CaptureName, ndarray::Array2<f32>)],
) -> f64 {
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    a.iter()
        .zip(b)
        .map(|((na, ha), (nb, hb))| {
            if na != nb || ha.dim() != hb.dim() {
                return f64::INFINITY;
            }
            rel_diff(ha.as_slice().unwrap_or_default(), hb.as_slice().unwrap_or_default())
        })
        .fold(0.0, f64::max)
}

/// `max |a − b| / max(max |b|, 1e-12)`; infinite for different lengths.
///
/// ```
/// use omniprefix_cli::demo::rel_diff;
/// assert_eq!(rel_diff(&[1.0, 2.0], &[1.0, 4.0]), 0.5);
/// assert!(rel_diff(&[1.0], &[1.0, 2.0]).is_infinite());
/// ```
pub fn rel_diff(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    let scale = b.iter().fold(0.0f64, |m, &x| m.max(f64::from(x).abs())).max(1e-12);
    let diff = a.iter().zip(b).fold(0.0f64, |m, (&x, &y)| m.max((f64::from(x) - f64::from(y)).abs()));
    diff / scale
}

/// Prints one table per workload.
pub fn print_tables(report: &DemoReport, out: &mut dyn Write) -> std::io::Result<()> {
    let m = &report.model;
    writeln!(
        out,
        "model: {} ({}), {} layers, hidden {}, {} heads / {} kv heads{}{}",
        m.model_type,
        m.source,
        m.num_layers,
        m.hidden_size,
        m.num_heads,
        m.num_kv_heads,
        if m.mrope { ", M-RoPE" } else { "" },
        m.moe_experts.map(|e| format!(", MoE {e} experts")).unwrap_or_default()
    )?;
    writeln!(out, "media: {}", report.media.note)?;
    for w in &report.workloads {
        writeln!(out, "\n== {} ==", w.name)?;
        writeln!(
            out,
            "{:>3} {:<10} {:>6} {:>6} {:>9} {:>9} {:>8} {:>9} {:>7} {:<22} {:>9}",
            "req",
            "way",
            "prompt",
            "cached",
            "match_ms",
            "floor_ms",
            "match/fl",
            "ttft_ms",
            "ttft/nc",
            "hidden",
            "max_rel"
        )?;
        for r in &w.rows {
            let shapes = r.hidden_shapes.iter().map(|(_, [a, b])| format!("[{a},{b}]")).collect::<Vec<_>>();
            let shapes = match shapes.split_first() {
                Some((first, rest)) if rest.iter().all(|s| s == first) => format!("{}x{first}", shapes.len()),
                _ => shapes.join(""),
            };
            writeln!(
                out,
                "{:>3} {:<10} {:>6} {:>6} {:>9.3} {:>9.3} {:>8.2} {:>9.1} {:>7.2} {:<22} {:>9.1e}",
                r.request,
                r.way.as_str(),
                r.prompt_tokens,
                r.cached_tokens,
                r.match_ns as f64 / 1e6,
                r.read_floor_ns as f64 / 1e6,
                r.match_over_read_floor,
                r.ttft_ns as f64 / 1e6,
                r.ttft_over_no_cache,
                shapes,
                r.max_rel_diff_hidden.max(r.max_rel_diff_logits)
            )?;
        }
    }
    if let Some(spoken) = &report.spoken_chat {
        super::speech::print_spoken_chat(spoken, out)?;
    }
    print_summary(&report.summary, out)?;
    if let Some(spoken) = &report.spoken_chat {
        writeln!(out, "{}", super::speech::spoken_summary_line(spoken))?;
    }
    writeln!(out, "\nwall time: {:.1} s", report.wall_s)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::array;

    fn run(ttft_ns: u64, value: f32) -> RequestRun {
        RequestRun {
            prompt_tokens: 2,
            cached_tokens: 1,
            match_ns: 10,
            ttft_ns,
            hidden: vec![(CaptureName::Final, array![[1.0, value], [2.0, 4.0]])],
            last_logits: vec![1.0, value],
            generated: vec![7],
            reply_tokens: 0,
            reply_cached: 0,
        }
    }

    #[test]
    fn rows_compare_each_way_with_the_no_cache_run() {
        let facts = [RequestFacts { input_bytes: 8, read_floor_ns: 5 }];
        let runs = vec![(Way::NoCache, vec![run(100, 2.0)]), (Way::Radix, vec![run(25, 3.0)])];
        let rows = workload_rows(&facts, &runs);
        assert_eq!(rows.len(), 2);
        let radix = &rows[1];
        assert_eq!(radix.way, Way::Radix);
        assert_eq!(radix.ttft_over_no_cache, 0.25);
        assert_eq!(radix.match_over_read_floor, 2.0);
        assert_eq!(radix.max_rel_diff_hidden, 0.25);
        assert_eq!(radix.max_rel_diff_logits, 0.5);
        assert_eq!(radix.hidden_shapes, vec![("final".to_string(), [2, 2])]);
        assert_eq!(rows[0].max_rel_diff_hidden, 0.0);
    }
}
