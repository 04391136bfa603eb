//! Match measurement shared by `omniprefix bench match` and `benches/match.rs`:
//! a [`MatchFixture`] per workload (indexes warmed, each path one method) and
//! [`measure`], which takes medians of those paths into a [`MatchReport`].

mod fixture;
mod report;

pub use fixture::{BLOCK_SIZE, MODEL_ID, MatchFixture};
pub use report::{MatchOptions, MatchReport, PolicyFigures, measure, median_ns};
