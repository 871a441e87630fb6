"""Two processes as two nodes (jax.distributed on CPU, collectives on gloo), each with its own workspace over its
4 devices: the layer picks two levels by itself and matches the dense oracle and the twin
(tests/two_node_worker.py)."""

from conftest import run_workers


def test_two_processes_as_two_nodes():
  run_workers("two_node_worker.py", 2, {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
                                        "JAX_MOE_A2A_HOST": ""}, timeout_s=400)
