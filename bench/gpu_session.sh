#!/usr/bin/env bash
# One GPU session in one command: install the prebuilt extension from .whl/, check it, run the GPU tests and the
# benchmarks. Usage (on a GPU machine, from the repository root): bash bench/gpu_session.sh [bench names...]
# Results go to bench/results/ and, when $OUT is set, are copied there too.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
marker=$(mktemp)
whl=$(ls .whl/jax_moe_a2a-*.whl 2>/dev/null | head -n 1)
if [ -z "$whl" ]; then echo "no wheel in .whl/ (build one with: JAX_MOE_A2A_CUDA=ON pip wheel --no-deps -w .whl .)"; exit 2; fi
# The compiled module goes next to the sources, so the checkout's package is complete.
"$PY" - "$whl" <<'PYEOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
  for n in z.namelist():
    if n.startswith("jax_moe_a2a/_jax_moe_a2a") and n.endswith(".so"):
      z.extract(n, ".")
      print("extension:", n)
PYEOF
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
"$PY" -m jax_moe_a2a report --tokens 4096 || echo "REPORT FAILED"
JAX_MOE_A2A_TEST_GPU=1 timeout 300 "$PY" -m pytest -q -x -p no:cacheprovider tests/test_*_ffi.py tests/test_a2a_multiprocess.py 2>&1 | tail -n 30
for name in "$@"; do
  "$PY" -m jax_moe_a2a bench "$name" || echo "BENCH $name FAILED"
done
if [ -n "${OUT:-}" ]; then find bench/results -name "*.json" -newer "$marker" -exec cp {} "$OUT"/ \; ; fi
exit 0
