//! The one report of which kernel builds a test ran (tests only): every build
//! family (the CPU backend's lanes, canon's byte kernels) names the builds it
//! knows and the ones this CPU has, and a build it lacks is printed as not run.

/// Prints `<test>: the <name> build NOT RUN: this CPU lacks it` for each of
/// `known` missing from `have`, and fails the test when the comma-separated
/// `OMNIPREFIX_REQUIRE_SIMD` names one (as a CI machine known to have it should).
pub(crate) fn report_missing(test: &str, known: &[&str], have: &[&str]) {
    let required = std::env::var("OMNIPREFIX_REQUIRE_SIMD").unwrap_or_default();
    let required: Vec<&str> = required.split(',').map(str::trim).collect();
    for name in known.iter().filter(|name| !have.contains(name)) {
        eprintln!("{test}: the {name} build NOT RUN: this CPU lacks it");
        assert!(
            !required.contains(name),
            "{test}: OMNIPREFIX_REQUIRE_SIMD names {name}, which this CPU lacks"
        );
    }
}
