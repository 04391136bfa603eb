#!/usr/bin/env bash
# Runs the proptest-based fuzz targets (proptests/fuzz_*.rs) for a bounded
# time and prints the executions of each. cargo-fuzz would need a nightly
# toolchain, which this project does not use; the targets are proptest
# strategies over structured mutations and arbitrary bytes instead, and any
# panic or untyped error fails the run with the minimal input and its seed.
#
#   FUZZ_SECONDS  total budget, split evenly over the targets (default 600)
#   FUZZ_SEED     first seed (default: seconds since the epoch; printed)
#   PROPTEST_CASES cases per batch (default 512)
set -euo pipefail
cd "$(dirname "$0")/.."

total=${FUZZ_SECONDS:-600}
seed=${FUZZ_SEED:-$(date +%s)}
cases=${PROPTEST_CASES:-512}
# Module (proptests/MODULE.rs, in the `proptests` test binary) and test name.
targets=(
  "fuzz_canon fuzz_canonicalisation"
  "fuzz_canon fuzz_encoded_items"
  "fuzz_loader fuzz_config_json"
  "fuzz_loader fuzz_safetensors_files"
  "fuzz_request_file fuzz_request_files"
  "fuzz_request_file fuzz_request_bytes"
)
per=$(awk "BEGIN { print $total / ${#targets[@]} }")
echo "fuzz: ${#targets[@]} targets, ${per} s each, first seed ${seed}, ${cases} cases per batch"

cargo test --release --test proptests --no-run
status=0
log=$(mktemp)
for t in "${targets[@]}"; do
  read -r module name <<<"$t"
  rc=0
  FUZZ_SECONDS=$per FUZZ_SEED=$seed PROPTEST_CASES=$cases \
    cargo test --release --test proptests -- --exact "$module::$name" --nocapture --test-threads=1 >"$log" 2>&1 || rc=$?
  # The harness prints "test NAME ... " and the target's summary on one line.
  grep -oE "fuzz [a-z-]+: [0-9]+ execs in [0-9.]+ s|panicked.*|minimal input.*|seed [0-9]+ fails.*" "$log" || true
  if [ "$rc" -ne 0 ]; then
    echo "fuzz: $name FAILED (exit $rc); full output:"
    cat "$log"
    status=1
  fi
done
rm -f "$log"
exit $status
