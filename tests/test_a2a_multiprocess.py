"""One process per GPU (jax.distributed): the one-sided dispatch/combine maps its peers' memory through CUDA IPC
handles exchanged in JAX's key-value store, and still equals the reference bit for bit
(tests/multiprocess_worker.py)."""

import jax
import pytest

from conftest import run_workers
from jax_moe_a2a import _ffi


@pytest.mark.gpu
def test_one_process_per_gpu_equals_the_reference():
  if not _ffi.with_cuda():
    pytest.skip("extension built without CUDA")
  num_processes = len(jax.devices())
  if num_processes < 2:
    pytest.skip(f"needs at least two GPUs, this machine has {num_processes}")
  # The test process already holds the GPUs' default memory pool: the workers allocate on demand.
  run_workers("multiprocess_worker.py", num_processes,
              {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "NCCL_NVLS_ENABLE": "0", "XLA_FLAGS": ""}, timeout_s=240)
