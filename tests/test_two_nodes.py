"""Two processes as two nodes (jax.distributed on CPU, collectives on gloo), each with its own workspace over its
4 devices: the layer picks two levels by itself and matches the dense oracle and the reference
exchange (tests/two_node_worker.py)."""

import jax
import pytest

from conftest import run_workers
from jax_moe_a2a import workspace


@pytest.mark.skipif(not workspace.cpu_compiles_one_sided_backward(),
                    reason=f"the one-sided calls' backward does not compile on XLA:CPU of jax {jax.__version__}")
def test_two_processes_as_two_nodes():
  run_workers("two_node_worker.py", 2, {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
                                        "JAX_MOE_A2A_HOST": ""}, timeout_s=400)
