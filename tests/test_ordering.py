"""Tests of `ordering.after`: x comes back bit for bit in every dtype JAX has (every bit pattern of the 8-bit and
narrower types, NaNs with their signs and payloads in the wider ones), the compiled program keeps the dependency
(also where x is a constant), and arguments that are not arrays are refused by name; and of the identities that
order a backward pass with it (`ordered`, `after_in_backward`, `joined`)."""

import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax_moe_a2a import ordering

# Every dtype jax.numpy names, found by name so that one added to JAX is tested too.
_NAMES = sorted(n for n in dir(jnp) if re.fullmatch(r"(u?int\d+|b?float\d+(_\w+)?|complex\d+|bool_)", n))
_X64 = {"float64", "int64", "uint64", "complex128"}
_SIX_BIT = {"float6_e2m3fn", "float6_e3m2fn"}  # XLA:CPU moves them but cannot convert, compare or hold a constant
# JAX names dtypes XLA does not hold: the 1-bit ints (a storage type only), and from jax 0.12.1 complex32 and
# float8_e5m3fnu (no device accepts them). `after` refuses those by name; the rest must come back bit for bit.
_COMPUTED = [n for n in _NAMES if n in ordering._HELD_NAMES]
_NOT_HELD = [n for n in _NAMES if n not in ordering._HELD_NAMES]
_DEP_TYPES = [n for n in _COMPUTED if n not in _SIX_BIT]


def test_the_dtypes_found_include_every_kind_the_layer_meets():
  want = {"bool_", "int8", "int16", "int32", "uint8", "uint16", "uint32", "bfloat16", "float16", "float32",
          "complex64", "float8_e5m2", "float8_e4m3", "float8_e3m4", "float8_e4m3fn", "float8_e4m3fnuz",
          "float8_e5m2fnuz", "float8_e4m3b11fnuz", "float8_e8m0fnu", "float4_e2m1fn", "int4", "uint4"} | _X64
  assert want <= set(_COMPUTED), sorted(want - set(_COMPUTED))
  assert {"int1", "uint1"} <= set(_NOT_HELD)


@pytest.mark.parametrize("name", _NOT_HELD)
def test_a_dtype_xla_does_not_hold_is_refused_by_name(name):
  a = np.zeros(2, _dtype(name))
  with pytest.raises(TypeError, match=re.escape("after: x must have a dtype XLA computes with (one of bool_, ")
                     + f".*got {name}"):
    ordering.after(a, jnp.ones(2))
  with pytest.raises(TypeError, match=re.escape("after: deps[0] must have a dtype whose bits XLA can read")
                     + f".*got {name}"):
    ordering.after(jnp.ones(2), a)


def _dtype(name: str) -> np.dtype:
  return np.dtype(getattr(jnp, name))


def _x64(name: str):
  return jax.enable_x64(name in _X64)


def _bits(a) -> np.ndarray:
  a = np.asarray(a)
  if a.dtype == np.bool_:
    return a.view(np.uint8)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64, 16: np.uint64}[a.dtype.itemsize])


def _width(dtype: np.dtype) -> int:
  if dtype == np.bool_:
    return 1
  if jnp.issubdtype(dtype, jnp.floating):
    return jnp.finfo(dtype).bits
  return jnp.iinfo(dtype).bits


def _float_patterns(bits: int, nmant: int, rng) -> np.ndarray:
  """Bit patterns of a float type of `bits` bits (IEEE layout, `nmant` mantissa bits): zeros, infinities,
  quiet and signalling NaNs of both signs with several payloads, extremes, and random patterns."""
  u = np.dtype(f"uint{bits}")
  sign = 1 << (bits - 1)
  exp = ((1 << (bits - 1 - nmant)) - 1) << nmant
  quiet = 1 << (nmant - 1)
  payloads = [1, quiet, quiet | 1, (1 << nmant) - 1, 0x5A5A5A5A5A5A5A5A & ((1 << nmant) - 1)]
  payloads += [int(p) for p in rng.integers(1, 1 << nmant, 8, dtype=np.uint64)]
  pats = [0, exp, 1, exp - 1, 1 << nmant]  # +0, +inf, the smallest subnormal, the largest finite, the smallest normal
  pats += [exp | p for p in payloads]  # NaNs
  pats += [p | sign for p in pats]
  pats += [int(p) for p in rng.integers(0, np.iinfo(u).max, 16, dtype=u, endpoint=True)]
  return np.array(pats, u)


def _patterns(name: str) -> np.ndarray:
  """x for the bit-exactness tests: every pattern of a type of at most 8 bits; NaN payloads and samples else."""
  dtype = _dtype(name)
  rng = np.random.default_rng(len(name))
  if dtype == np.bool_:
    return np.array([False, True])
  if dtype.itemsize == 1:
    return np.arange(1 << _width(dtype), dtype=np.uint8).view(dtype)
  if jnp.issubdtype(dtype, jnp.complexfloating):
    part = np.dtype(f"float{dtype.itemsize * 4}")
    real = _float_patterns(part.itemsize * 8, jnp.finfo(part).nmant, rng)
    return np.stack([real, rng.permutation(real)], axis=-1).reshape(-1).view(dtype)
  if jnp.issubdtype(dtype, jnp.floating):
    return _float_patterns(_width(dtype), jnp.finfo(dtype).nmant, rng).view(dtype)
  info = np.iinfo(dtype)
  return np.concatenate([np.array([0, -1 if info.min else 1, info.min, info.max], dtype),
                         rng.integers(info.min, info.max, 32, dtype=dtype, endpoint=True)])


@pytest.mark.parametrize("name", _COMPUTED)
def test_after_returns_every_bit_pattern_unchanged(name):
  x = _patterns(name)
  with _x64(name):
    dep = jnp.array([-0.0, 2.0], jnp.bfloat16)
    f = jax.jit(ordering.after)
    # Only the first element goes through the select: each pattern takes its turn there.
    for i in range(len(x)):
      xi = np.roll(x, -i)
      got = f(xi, dep)
      assert got.dtype == x.dtype and got.shape == x.shape
      np.testing.assert_array_equal(_bits(got), _bits(xi), err_msg=f"{name}: pattern {_bits(xi)[0]:#x} first")
    # Not jitted, and on a 2-D array, too.
    np.testing.assert_array_equal(_bits(ordering.after(x, dep)), _bits(x))
    x2 = x[: len(x) // 2 * 2].reshape(2, -1)
    np.testing.assert_array_equal(_bits(f(x2, dep)), _bits(x2))


@pytest.mark.parametrize("name", ["float8_e5m2", "float8_e4m3", "float8_e3m4", "float16", "float32"])
def test_after_under_vmap_returns_every_bit_pattern_unchanged(name):
  x = _patterns(name)
  rows = np.stack([np.roll(x, -i) for i in range(len(x))])  # each pattern first in one row
  got = jax.jit(jax.vmap(ordering.after))(rows, jnp.ones((len(x), 2), jnp.float32))
  np.testing.assert_array_equal(_bits(got), _bits(rows))


def _param_is_read(hlo_text: str, index: int) -> bool:
  entry = hlo_text[hlo_text.index("ENTRY"):]
  param = re.search(rf"%([\w.\-]+) = [^\n]*\bparameter\({index}\)", entry).group(1)
  return re.search(rf"[(,] ?%{re.escape(param)}\b", entry) is not None


@pytest.mark.parametrize("name", [n for n in _COMPUTED if n not in _SIX_BIT])
def test_after_keeps_its_dependency_when_x_is_a_constant_of_every_dtype(name):
  # A zero cotangent reaches `after` as a constant: the compiled program must still read the dependency, and a
  # constant NaN keeps its bits through the constant folding around the select.
  x = _patterns(name)
  x = np.concatenate([x[-8:], x[:8]])  # for the 8-bit types, NaNs and infinities of both signs among them
  with _x64(name):
    dep = jnp.array([-0.0, 2.0], jnp.bfloat16)
    f = jax.jit(lambda d: ordering.after(jnp.asarray(x), d))
    assert _param_is_read(f.lower(dep).compile().as_text(), 0), name
    np.testing.assert_array_equal(_bits(f(dep)), _bits(x))
    zeros = jax.jit(lambda d: ordering.after(jnp.zeros((3,), x.dtype), d))
    assert _param_is_read(zeros.lower(dep).compile().as_text(), 0), name


@pytest.mark.parametrize("name", _DEP_TYPES)
def test_a_dep_of_every_dtype_makes_a_dependency(name):
  dep = _patterns(name)[:2]
  x = np.array([np.nan, -0.0], np.float32)
  with _x64(name):
    f = jax.jit(lambda x, d: ordering.after(x, d) * 2)
    assert _param_is_read(f.lower(x, dep).compile().as_text(), 1), name
    np.testing.assert_array_equal(_bits(jax.jit(ordering.after)(x, dep)), _bits(x))


def test_after_keeps_every_bit_and_a_dependency_the_compiler_keeps():
  x = np.array([[np.nan, -0.0], [1.5, -np.inf]], np.float32)
  x.view(np.uint32)[0, 0] = 0x7FC0BEEF  # a NaN payload
  dep = jnp.array([-0.0, 2.0], jnp.bfloat16)  # its bits, not its value, make the dependency: -0.0 works too
  for a in (x, x.astype(jnp.bfloat16), x.astype(jnp.float8_e4m3fn), np.array([3, -1], np.int32), np.array(True)):
    got = jax.jit(ordering.after)(a, dep)
    assert got.dtype == a.dtype and got.shape == a.shape
    np.testing.assert_array_equal(_bits(got), _bits(a))
  g = jax.grad(lambda x, d: jnp.sum(ordering.after(x, d) * jnp.arange(4.0).reshape(2, 2)), argnums=(0, 1))(
      np.ones_like(x), dep)
  np.testing.assert_array_equal(g[0], np.arange(4.0).reshape(2, 2))
  np.testing.assert_array_equal(g[1], np.zeros(2))
  # In the compiled program the result still reads the dependency (parameter 1).
  hlo = jax.jit(lambda x, d: ordering.after(x, d) * 2).lower(x, dep).compile().as_text()
  entry = hlo[hlo.index("ENTRY"):]
  param = re.search(r"%([\w.\-]+) = bf16\[2\]\{0\} parameter\(1\)", entry).group(1)
  assert re.search(rf"[(,] ?%{re.escape(param)}\b", entry), entry


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.uint8, jnp.bool_, jnp.int4])
def test_after_keeps_its_dependency_when_x_is_a_constant(dtype):
  # A zero cotangent reaches `after` as a constant: the compiled program must still read the dependency.
  dep = jnp.array([-0.0, 2.0], jnp.bfloat16)
  f = jax.jit(lambda d: ordering.after(jnp.zeros((3,), dtype), d))
  entry = f.lower(dep).compile().as_text()
  entry = entry[entry.index("ENTRY"):]
  param = re.search(r"%([\w.\-]+) = bf16\[2\]\{0\} parameter\(0\)", entry).group(1)
  assert re.search(rf"[(,] ?%{re.escape(param)}\b", entry), entry
  np.testing.assert_array_equal(np.asarray(f(dep)), np.zeros((3,), dtype))


def test_empty_arrays_and_float0_order_nothing():
  x = np.arange(3.0, dtype=np.float32)
  assert ordering.after(x, np.zeros((0,), np.float32)) is x
  assert ordering.after(x) is x
  empty = np.zeros((0, 2), np.float32)
  assert ordering.after(empty, jnp.ones(2)) is empty
  assert ordering.after(x, np.zeros((2,), jax.dtypes.float0)) is x


@pytest.mark.parametrize("args,error", [
    ((3, jnp.ones(2)), "after: x must be an array, got int"),
    ((1.5, jnp.ones(2)), "after: x must be an array, got float"),
    (([1.0, 2.0], jnp.ones(2)), "after: x must be an array, got list"),
    ((None, jnp.ones(2)), "after: x must be an array, got NoneType"),
    ((jnp.ones(2), 3), "after: deps[0] must be an array, got int"),
    ((jnp.ones(2), jnp.ones(2), 2.0), "after: deps[1] must be an array, got float"),
    ((jnp.ones(2), {"a": [jnp.ones(2), 1]}), "after: deps[0]['a'][1] must be an array, got int"),
    ((jnp.ones(2), "s"), "after: deps[0] must be an array, got str"),
    ((np.zeros(2, jnp.int1), jnp.ones(2)), "after: x must have a dtype XLA computes with (one of bool_, int2, "),
    ((jnp.ones(2), np.zeros(2, jnp.float6_e2m3fn)), "after: deps[0] must have a dtype whose bits XLA can read (one "
                                                  "of bool_, "),
    ((jnp.ones(2), np.zeros(2, jnp.float6_e2m3fn)), "but the 6-bit floats), got float6_e2m3fn"),
    ((jnp.ones(2), np.zeros(2, jnp.uint1)), "after: deps[0] must have a dtype whose bits XLA can read"),
])
def test_arguments_that_are_not_arrays_are_refused_by_name(args, error):
  with pytest.raises(TypeError, match=re.escape(error)):
    ordering.after(*args)


def test_a_python_scalar_dep_is_refused_under_jit_too():
  with pytest.raises(TypeError, match=re.escape("after: deps[0] must be an array, got int")):
    jax.jit(lambda x: ordering.after(x, 3))(jnp.ones(2))


def test_none_in_deps_is_an_empty_pytree():
  x = jnp.ones(2)
  np.testing.assert_array_equal(ordering.after(x, None, {"a": None}), x)


def test_the_backward_orderings_are_identities_in_both_passes():
  """ordered, after_in_backward and joined return their inputs bit for bit, and their gradients are the
  cotangents unchanged (dep's is zero): the order they add costs no value."""
  a, b = jnp.asarray([1.5, -2.0, jnp.nan]), jnp.asarray([[3.0, 4.0]])
  ct_a, ct_b = jnp.asarray([0.25, -1.0, 7.0]), jnp.asarray([[2.0, -0.5]])
  for fn in (lambda a, b: ordering.ordered(a, b), lambda a, b: (ordering.after_in_backward(a, b), b),
             lambda a, b: ordering.joined((a, b))):
    out, vjp = jax.vjp(jax.jit(fn), a, b)
    np.testing.assert_array_equal(_bits(out[0]), _bits(a))
    np.testing.assert_array_equal(out[1], b)
    d_a, d_b = vjp((ct_a, ct_b))
    np.testing.assert_array_equal(d_a, ct_a)
    np.testing.assert_array_equal(d_b, ct_b)


@pytest.mark.parametrize("which", ["ordered", "after_in_backward", "joined"])
def test_the_backward_orderings_keep_their_dependency_in_the_compiled_backward(which):
  """The cotangent they order waits on its dep in the compiled backward: the select of `after` survives (the
  cotangents are squares' derivatives, values of the inputs, so nothing folds to a constant)."""
  x, dep = jnp.arange(4.0), jnp.arange(2.0)
  sq = lambda vs: sum(jnp.sum(v * v) for v in vs)
  fn = {"ordered": lambda x, d: sq(ordering.ordered(d, x)),
        "after_in_backward": lambda x, d: sq([ordering.after_in_backward(x, d)]),
        "joined": lambda x, d: sq(ordering.joined((x, d)))}[which]
  hlo = jax.jit(jax.grad(fn, argnums=(0, 1))).lower(x, dep).compile().as_text()
  assert "select" in hlo, hlo

