"""Without the compiled extension the package still imports and runs on its pure-JAX references; asking for a custom
call then says how to build it."""

import jax
import jax.numpy as jnp
import pytest

import jax_moe_a2a
from jax_moe_a2a import _ffi, quant


@pytest.fixture
def missing_extension(monkeypatch):
  monkeypatch.setattr(_ffi, "_module", None)
  monkeypatch.setattr(_ffi, "_import_error", ImportError("simulated: no _jax_moe_a2a here"))
  monkeypatch.setattr(_ffi, "_registered", None)


def test_package_imports_and_references_run_without_the_extension(missing_extension):
  assert jax_moe_a2a.dispatch_layout(7168, "fp8_blockwise").x_sf_bytes_per_token == 224
  assert not _ffi.available()
  assert _ffi.resolve_impl("op", "auto") == "reference"
  x_q, x_sf = quant.quantize_fp8_blockwise(jnp.ones((2, 128), jnp.bfloat16))  # auto -> reference
  assert x_q.shape == (2, 128) and x_sf.shape == (2, 1)


def test_asking_for_the_custom_call_says_how_to_build_it(missing_extension):
  with pytest.raises(RuntimeError, match=r"could not be imported \(simulated.*pip install \.*"):
    quant.quantize_fp8_blockwise(jnp.ones((2, 128), jnp.bfloat16), impl="ffi")


def test_impl_is_validated(monkeypatch):
  with pytest.raises(ValueError, match=r"quantize_fp8_blockwise: impl must be one of auto, ffi, reference, got 'cuda'"):
    quant.quantize_fp8_blockwise(jnp.ones((2, 128), jnp.bfloat16), impl="cuda")
  monkeypatch.setenv(_ffi.ENV_IMPL, "fast")
  with pytest.raises(ValueError, match=r"\$JAX_MOE_A2A_IMPL must be one of auto, ffi, reference, got 'fast'"):
    quant.quantize_fp8_blockwise(jnp.ones((2, 128), jnp.bfloat16))


def test_an_empty_impl_variable_is_as_if_unset(monkeypatch):
  monkeypatch.setenv(_ffi.ENV_IMPL, "")
  assert _ffi.resolve_impl("op", "auto") == ("ffi" if _ffi.available() and jax.default_backend() in _ffi.register()
                                             else "reference")
