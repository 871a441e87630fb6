"""One process per GPU (jax.distributed): the one-sided dispatch/combine maps its peers' memory through CUDA IPC
handles exchanged in JAX's key-value store, and still equals the twin bit for bit (tests/multiprocess_worker.py)."""

import os
import socket
import subprocess
import sys

import jax
import pytest

import jax_moe_a2a
from jax_moe_a2a import _ffi


@pytest.mark.gpu
def test_one_process_per_gpu_equals_the_twin():
  if not _ffi.with_cuda():
    pytest.skip("extension built without CUDA")
  num_processes = len(jax.devices())
  if num_processes < 2:
    pytest.skip(f"needs at least two GPUs, this machine has {num_processes}")
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiprocess_worker.py")
  # The test process already holds the GPUs' default memory pool: the workers allocate on demand.
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", NCCL_NVLS_ENABLE="0")
  env.pop("XLA_FLAGS", None)
  package_root = os.path.dirname(os.path.dirname(os.path.abspath(jax_moe_a2a.__file__)))
  env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in [env.get("PYTHONPATH")] if p])
  procs = [subprocess.Popen([sys.executable, worker, str(i), str(num_processes), str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(num_processes)]
  outputs = [p.communicate(timeout=240)[0] for p in procs]
  for i, (p, out) in enumerate(zip(procs, outputs)):
    assert p.returncode == 0 and f"OK {i}" in out, f"process {i} (exit {p.returncode}):\n{out[-3000:]}"
