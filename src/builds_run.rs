//! The one report of which kernel builds a test ran (tests only): every kernel
//! family (the CPU backend's lanes, canon's byte kernels) runs the builds of
//! [`Simd::all`], and a build this CPU lacks is printed as not run, by name.

use crate::backend::cpu::lanes::Simd;

/// The builds `test` runs: every one [`Simd::all`] gives on this CPU. Prints
/// `<test>: the <name> build NOT RUN: this CPU lacks it` for each of
/// [`Simd::NAMES`] it lacks, and fails the test when the comma-separated
/// `OMNIPREFIX_REQUIRE_SIMD` names one (as a CI machine known to have it should).
pub(crate) fn builds_run(test: &str) -> Vec<Simd> {
    let all = Simd::all();
    let have: Vec<&str> = all.iter().map(|s| s.name()).collect();
    let required = std::env::var("OMNIPREFIX_REQUIRE_SIMD").unwrap_or_default();
    let required: Vec<&str> = required.split(',').map(str::trim).collect();
    for name in Simd::NAMES.iter().filter(|name| !have.contains(name)) {
        eprintln!("{test}: the {name} build NOT RUN: this CPU lacks it");
        assert!(
            !required.contains(name),
            "{test}: OMNIPREFIX_REQUIRE_SIMD names {name}, which this CPU lacks"
        );
    }
    all
}
