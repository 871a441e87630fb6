#!/usr/bin/env bash
# One GPU session in one command: install the prebuilt extension from .whl/, check it, run the GPU tests and the
# benchmarks. Usage (on a GPU machine, from the repository root):
#   TESTS="tests/test_x.py ..." bash bench/gpu_session.sh ["<bench name> [bench args...]" ...]
# TESTS defaults to the FFI tests; TESTS=none runs none; the test log ends with every failure and every skip with
# its reason. Each further argument is one benchmark with its arguments. Results go to bench/results/ (or where a
# benchmark's --out says) and, when $OUT is set, are copied there too, with the full test log and the notebook's
# figure. Exits non-zero when a test or a benchmark fails.
# Optional: EXTRA_WHEELS=<dir> installs the wheels there first (offline, into a private folder on PYTHONPATH: what
# the GPU image lacks, e.g. the test extra's transformers or the notebook's nbclient and ipykernel);
# TEST_TIMEOUT (default 300) and BENCH_TIMEOUT (default 180) bound the tests and each benchmark in seconds;
# JAX_MOE_A2A_COMMIT names the commit in the results where the copy has no git metadata.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
LOG_DIR=${OUT:-$(mktemp -d)}
marker=$(mktemp)
whl=$(ls .whl/jax_moe_a2a-*.whl 2>/dev/null | head -n 1)
if [ -z "$whl" ]; then echo "no wheel in .whl/ (build one with: JAX_MOE_A2A_CUDA=ON pip wheel --no-deps -w .whl .)"; exit 2; fi
# The compiled module goes next to the sources, so the checkout's package is complete.
"$PY" "$(dirname "$0")/extension_from_wheel.py" "$whl" || exit 2
if [ -n "${EXTRA_WHEELS:-}" ]; then
  site=$(mktemp -d)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$EXTRA_WHEELS"/*.whl > /dev/null 2>&1 \
    || echo "some of $EXTRA_WHEELS did not install"
  export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
status=0
tests=${TESTS:-tests/test_*_ffi.py tests/test_a2a_multiprocess.py}
if [ "$tests" != "none" ]; then
  # shellcheck disable=SC2086  (the list is word-split on purpose)
  JAX_MOE_A2A_TEST_GPU=1 timeout "${TEST_TIMEOUT:-300}" "$PY" -m pytest -q -rfEs -p no:cacheprovider $tests \
    > "$LOG_DIR/pytest.log" 2>&1
  rc=$?
  tail -n 25 "$LOG_DIR/pytest.log"
  if [ "$rc" -ne 0 ]; then echo "TESTS FAILED (exit $rc)"; status=1; fi
fi
# Results reach $OUT after each benchmark, so that those finished survive a run stopped at its time limit.
copy_results() {
  if [ -n "${OUT:-}" ]; then
    find bench/results \( -name "*.json" -o -name "*.png" \) -newer "$marker" -exec cp {} "$OUT"/ \;
  fi
}
for spec in "$@"; do
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-180}" "$PY" -m jax_moe_a2a bench $spec || { echo "BENCH $spec FAILED"; status=1; }
  copy_results
done
exit $status
