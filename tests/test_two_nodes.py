"""Two processes as two nodes (jax.distributed on CPU, collectives on gloo), each with its own workspace over its
4 devices: the layer picks two levels by itself and matches the dense oracle and the twin
(tests/two_node_worker.py)."""

import os
import socket
import subprocess
import sys

import jax_moe_a2a


def test_two_processes_as_two_nodes():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "two_node_worker.py")
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
  env.pop("JAX_MOE_A2A_HOST", None)
  package_root = os.path.dirname(os.path.dirname(os.path.abspath(jax_moe_a2a.__file__)))
  env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in [env.get("PYTHONPATH")] if p])
  procs = [subprocess.Popen([sys.executable, worker, str(i), "2", str(port)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  outputs = []
  for p in procs:
    try:
      outputs.append(p.communicate(timeout=400)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      outputs.append(p.communicate()[0] + "\n(killed after 400 s)")
  for i, (p, out) in enumerate(zip(procs, outputs)):
    assert p.returncode == 0 and f"OK {i}" in out, f"process {i} (exit {p.returncode}):\n{out[-4000:]}"
