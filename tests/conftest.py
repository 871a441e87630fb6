"""Test set-up: eight simulated CPU devices, unless a GPU run asks for real devices."""

import os

if os.environ.get("JAX_MOE_A2A_TEST_GPU", "0") != "1":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402  (after the flags above)
import pytest  # noqa: E402

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
