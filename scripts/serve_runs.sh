# Sourced, from the repository root, by the scripts that compare `bench serve` settings
# (scripts/encoder_stall.sh, scripts/prefill_policy.sh; scripts/serve_runs.py reads their
# runs). Sets OMNIPREFIX to the binary to run, building the release one when it is unset,
# and defines `bench_serve_args`.

if [[ -z "${OMNIPREFIX:-}" ]]; then
    cargo build --quiet --release -p omniprefix-cli
    OMNIPREFIX="${CARGO_TARGET_DIR:-$(pwd)/target}/release/omniprefix"
fi

# bench_serve_args FLAGS...: sets the array `args` to `bench serve --json FLAGS...` and the
# words of $EXTRA (more bench serve flags from the environment), for runs to extend.
bench_serve_args() {
    args=(bench serve --json "$@")
    # shellcheck disable=SC2206
    args+=(${EXTRA:-})
}
