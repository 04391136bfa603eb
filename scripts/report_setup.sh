# Sourced by the scripts that write a machine's reports under one folder (scripts/cpu_report.sh,
# scripts/gpu_bench.sh). `report_setup USAGE ARGS...` takes exactly one argument, OUT_DIR: it
# makes the folder, sets `out` to its absolute path and `root` to the repository root, moves
# there, and sets `bin` to OMNIPREFIX_BIN (a built binary) or to the release CLI it builds.

report_setup() {
    local usage=$1
    shift
    if [[ $# -ne 1 ]]; then
        echo "usage: $usage" >&2
        exit 2
    fi
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    mkdir -p "$1"
    out=$(cd "$1" && pwd)
    cd "$root"
    bin=${OMNIPREFIX_BIN:-}
    if [[ -z "$bin" ]]; then
        cargo build --release --quiet -p omniprefix-cli
        bin="${CARGO_TARGET_DIR:-$root/target}/release/omniprefix"
    fi
}
