#!/usr/bin/env bash
# A kernel change measured against its baseline on one warm GPU machine: the extensions of two wheels take turns
# (baseline first), each round running one benchmark with each, so that drifts of clock and temperature fall on both.
# From the repository root (the checkout's Python sources are used with each wheel's compiled module):
#   bash bench/gpu_ab.sh BASELINE.whl CHANGED.whl ROUNDS "<bench name> [bench args...]"
# e.g. bash bench/gpu_ab.sh .whlK/jax_moe_a2a-*.whl .whl/jax_moe_a2a-*.whl 3 "quant --m 16384 --ops nvfp4_gs"
# Logs and results go to $OUT/ab/<baseline|changed><round>/ (a temporary folder without $OUT); the extension of
# CHANGED is left in place at the end. BENCH_TIMEOUT (default 120) bounds each benchmark in seconds.
set -uo pipefail
if [ $# -ne 4 ]; then
  echo "usage: bash bench/gpu_ab.sh BASELINE.whl CHANGED.whl ROUNDS \"<bench name> [args...]\"" >&2
  exit 2
fi
baseline=$1 changed=$2 rounds=$3 spec=$4
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-$(mktemp -d)}
PY=${PYTHON:-python3}
status=0
for r in $(seq "$rounds"); do
  for side in baseline changed; do
    whl=$([ "$side" = baseline ] && echo "$baseline" || echo "$changed")
    "$PY" "$(dirname "$0")/extension_from_wheel.py" "$whl" > /dev/null || exit 2
    dir="$OUT/ab/$side$r"
    mkdir -p "$dir"
    # shellcheck disable=SC2086  (the bench arguments are word-split on purpose)
    timeout "${BENCH_TIMEOUT:-120}" "$PY" -m jax_moe_a2a bench $spec --out "$dir" > "$dir/bench.log" 2>&1 \
      || { echo "BENCH $side round $r FAILED"; status=1; }
    echo "== $side, round $r"
    # Every row of the run's table: its files may not come back from a GPU machine (a limit on returned files).
    grep -vE "^wrote|Warning|warn" "$dir/bench.log"
  done
done
exit $status
