"""Test set-up: eight simulated CPU devices, unless a GPU run asks for real devices."""

import os
import socket
import subprocess
import sys

if os.environ.get("JAX_MOE_A2A_TEST_GPU", "0") != "1":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402  (after the flags above)
import pytest  # noqa: E402

import jax_moe_a2a  # noqa: E402

jax.config.update("jax_enable_x64", False)


def pytest_sessionstart(session):
  """With JAX_MOE_A2A_REQUIRE_EXTENSION=1 (CI sets it) a missing extension fails the run instead of skipping."""
  from jax_moe_a2a import _ffi  # pylint: disable=import-outside-toplevel
  if os.environ.get("JAX_MOE_A2A_REQUIRE_EXTENSION") == "1" and not _ffi.available():
    _ffi.extension()  # raises, saying why and how to build it


def pytest_collection_modifyitems(config, items):
  has_gpu = any(d.platform == "gpu" for d in jax.devices())
  skip = pytest.mark.skip(reason="needs a CUDA GPU (set JAX_MOE_A2A_TEST_GPU=1 on a GPU machine)")
  for item in items:
    if "gpu" in item.keywords and not has_gpu:
      item.add_marker(skip)


def devices(n: int) -> list:
  """The first `n` devices; skips the test where fewer are visible (a GPU run on one or two GPUs)."""
  have = jax.devices()
  if len(have) < n:
    pytest.skip(f"needs {n} devices, {len(have)} visible")
  return have[:n]


def skip_without_one_sided_backward() -> None:
  """Skips a test that differentiates through the one-sided calls on CPU devices where the package refuses that
  (`workspace.check_one_sided_backward`: XLA:CPU of jax 0.11 crashes the process compiling such programs)."""
  from jax_moe_a2a import workspace  # pylint: disable=import-outside-toplevel
  if jax.default_backend() == "cpu" and not workspace.cpu_compiles_one_sided_backward():
    pytest.skip(f"the one-sided calls' backward is refused on XLA:CPU of jax {jax.__version__} (it crashes compiling)")


def run_workers(script: str, num_processes: int, env: dict, timeout_s: float) -> None:
  """Runs ``tests/<script> PROCESS_ID NUM_PROCESSES PORT`` once per process (a jax.distributed job on a free local
  port, this checkout's package first on the path, `env` over this environment) and asserts that each exits 0
  printing "OK <process id>"; a worker past `timeout_s` is killed with the others."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), script)
  package_root = os.path.dirname(os.path.dirname(os.path.abspath(jax_moe_a2a.__file__)))
  env = dict(os.environ, **env)
  env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in [env.get("PYTHONPATH")] if p])
  procs = [subprocess.Popen([sys.executable, worker, str(i), str(num_processes), str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(num_processes)]
  outputs = []
  for p in procs:
    try:
      outputs.append(p.communicate(timeout=timeout_s)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      outputs.append(p.communicate()[0] + f"\n(killed after {timeout_s} s)")
  for i, (p, out) in enumerate(zip(procs, outputs)):
    assert p.returncode == 0 and f"OK {i}" in out, f"process {i} (exit {p.returncode}):\n{out[-4000:]}"
