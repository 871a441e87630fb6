#!/usr/bin/env bash
# What a commit needs shown on one GPU, in parts that each fit a 10-minute command (from the repository root, with
# the package's wheel in .whl/ and, for the test extra and the notebook, .whl/extra from bench/gpu_wheels.sh):
#   bash bench/gpu_verify.sh tests   the custom calls' GPU test files, and beside them (CPU, 8 simulated devices)
#                                    the layer's test files on this machine's jax
#   bash bench/gpu_verify.sh layer_tests   the layer's test files on the GPU (training, wire formats, Flax, ...)
#   bash bench/gpu_verify.sh bench   bench quant (the quantizers beside their references and XLA's memory
#                                    ceilings, wall and device time, at 16384 x 7168), the notebook on the
#                                    GPU, the layer at 128 tokens beside its Flax forms, the four wire formats at 4096
#   bash bench/gpu_verify.sh fp8     the FP8 recipe at 4096 tokens beside the einsum baseline (--check, 2
#                                    micro-batches)
#   bash bench/gpu_verify.sh gemm    bench gemm
# Logs and results go to $OUT (a temporary folder without it). JAX_MOE_A2A_COMMIT names the commit in the results
# where the copy has no git metadata.
set -uo pipefail
part=${1:-}
export OUT=${OUT:-$(mktemp -d)} NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
[ -d .whl/extra ] && export EXTRA_WHEELS=.whl/extra
here=$(dirname "$0")
case "$part" in
  tests)
    gpu_tests="$(ls tests/test_*_ffi.py | tr '\n' ' ')tests/test_a2a_multiprocess.py"
    TESTS="$gpu_tests" TEST_TIMEOUT=${TEST_TIMEOUT:-420} bash "$here/gpu_session.sh" &
    gpu=$!
    # The extension is extracted by gpu_session.sh; wait for it before the CPU run imports the package.
    for _ in $(seq 60); do ls jax_moe_a2a/_jax_moe_a2a*.so > /dev/null 2>&1 && break; sleep 1; done
    workers=$(python3 -c "import xdist" 2> /dev/null && echo "-n 6")
    # shellcheck disable=SC2086
    JAX_MOE_A2A_REQUIRE_EXTENSION=1 timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider $workers \
      tests/test_demo.py tests/test_two_nodes.py tests/test_two_level.py tests/test_wire.py tests/test_training.py \
      tests/test_set_mesh.py tests/test_moe.py > "$OUT/pytest_cpu_devices.log" 2>&1
    cpu=$?
    tail -n 5 "$OUT/pytest_cpu_devices.log"
    wait $gpu
    gpu=$?
    [ "$cpu" -eq 0 ] && [ "$gpu" -eq 0 ]
    ;;
  layer_tests)
    TESTS="tests/test_training.py tests/test_wire.py tests/test_quant_mx.py tests/test_checkpoints.py tests/test_flax.py
      tests/test_moe.py tests/test_expert_mlp.py" TEST_TIMEOUT=${TEST_TIMEOUT:-420} bash "$here/gpu_session.sh"
    ;;
  bench)
    TESTS=none BENCH_TIMEOUT=${BENCH_TIMEOUT:-150} bash "$here/gpu_session.sh" \
      "quant --m 16384 --ops kmajor kmajor_fp8 weight weight_t mxfp8 mxfp8_dequant nvfp4_gs nvfp4 nvfp4_dequant \
xla_copy xla_read xla_e4m3" \
      "notebook" \
      "layer --tokens 128 --variants bf16 bf16_ws fp8_stored_ws nnx_call_ws nnx_jit_ws nnx_jit_apply_ws linen_jit_ws --modes fwd --no-stages" \
      "layer --tokens 4096 --variants fp8_ws --wire-formats bf16 fp8_blockwise mxfp8 nvfp4 --modes fwd --check --no-stages"
    ;;
  fp8)
    # On an H200 the four variants with --check and micro-batches take more than 270 s (compiles included).
    TESTS=none BENCH_TIMEOUT=${BENCH_TIMEOUT:-480} bash "$here/gpu_session.sh" \
      "layer --tokens 4096 --variants einsum fp8_ws fp8_dgrad_ws fp8_fp8bwd_ws --check --micro-batches 2"
    ;;
  gemm)
    TESTS=none BENCH_TIMEOUT=${BENCH_TIMEOUT:-400} bash "$here/gpu_session.sh" "gemm"
    ;;
  *)
    echo "usage: bash bench/gpu_verify.sh tests|layer_tests|bench|fp8|gemm" >&2
    exit 2
    ;;
esac
