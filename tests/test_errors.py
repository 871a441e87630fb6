"""Bad inputs get an error that names the argument, what it accepts and the value (issue 22, "Clear errors").

Workspace arguments are refused in Python before the extension sees them; NumPy integers in a MoEConfig become
Python ints (bools are not ints); the command line's numeric options are usage errors (exit status 2); and
`moe_apply` and `quantize_experts` reshard an x and params that are not in the layer's sharding, Explicit mesh axes
included, where the dense oracle gathers them.
"""

import importlib
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from conftest import devices
from jax_moe_a2a import __main__ as cli
from jax_moe_a2a import _ffi, a2a, demo, moe

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def _raises(exc, message):
  """pytest.raises matching `message` literally."""
  return pytest.raises(exc, match=re.escape(message))


# ----------------------------------------------------------------------------------------------------------------
# a2a.Workspace
# ----------------------------------------------------------------------------------------------------------------


def _workspace(**kw):
  args = dict(mesh=Mesh(np.asarray(devices(8)), ("ep",)), expert_axis="ep", capacity=16, hidden=128, top_k=2)
  args.update(kw)
  return a2a.Workspace(args.pop("mesh"), **args)


@pytest.mark.parametrize("timeout_s", [math.inf, 1e10, "1", math.nan, True, 0, -1.0, 1e-6])
def test_workspace_timeout_outside_its_range(timeout_s):
  with _raises(ValueError, f"Workspace: timeout_s must be a number of seconds in [0.001, 1e+06], got {timeout_s!r}"):
    _workspace(timeout_s=timeout_s)


@pytest.mark.parametrize("capacity", [2**60, 2**31, 0, 16.0, True])
def test_workspace_capacity_outside_its_range(capacity):
  with _raises(ValueError, f"Workspace: capacity must be an int in [1, 2147483647], got {capacity!r}"):
    _workspace(capacity=capacity)


def test_workspace_block_larger_than_int64_bytes():
  with _raises(ValueError, "Workspace: the block of one device must be at most 2**63 - 1 bytes, got "):
    _workspace(capacity=2**31 - 1, hidden=2**30)


def test_workspace_mesh_none():
  with _raises(TypeError, "Workspace: mesh must be a jax.sharding.Mesh, got NoneType"):
    _workspace(mesh=None)


@pytest.mark.parametrize("kw,message", [
    (dict(hidden=0), "Workspace: hidden must be an int >= 1, got 0"),
    (dict(hidden=128.0), "Workspace: hidden must be an int >= 1, got 128.0"),
    (dict(top_k=True), "Workspace: top_k must be an int >= 1, got True"),
    (dict(fmt=None), "Workspace: fmt must be one of bf16, fp8_blockwise, mxfp8, nvfp4, got None"),
    (dict(combine_dtype="not_a_dtype"), "Workspace: combine_dtype must be bfloat16 or float32, got None"),
    (dict(training="yes"), "Workspace: training must be a bool, got 'yes'"),
    (dict(mx_alignment="32", fmt="mxfp8"), "Workspace: mx_alignment must be an int >= 1, got '32'"),
    (dict(mx_alignment=48, fmt="mxfp8"), "Workspace: dispatch_layout: mxfp8 mx_alignment must be a positive multiple "
                                          "of 32, got 48"),
    (dict(expert_axis=()), "Workspace: expert_axis must be an axis name or a non-empty tuple of distinct ones, got ()"),
    (dict(expert_axis=("ep", "ep")), "Workspace: expert_axis must be an axis name or a non-empty tuple of distinct "
                                     "ones, got ('ep', 'ep')"),
])
def test_workspace_other_arguments(kw, message):
  with _raises(ValueError, message):
    _workspace(**kw)


@pytest.mark.skipif(not _ffi.available(), reason="compiled extension not built")
def test_workspace_takes_numpy_scalars():
  with _workspace(capacity=np.int64(16), hidden=np.int32(128), top_k=np.int64(2), timeout_s=np.float32(5.0),
                  training=np.True_) as ws:
    assert ws.layout.capacity == 16 and type(ws.layout.capacity) is int  # pylint: disable=unidiomatic-typecheck
    assert ws.timeout_s == 5.0 and ws.training is True


# ----------------------------------------------------------------------------------------------------------------
# moe.MoEConfig
# ----------------------------------------------------------------------------------------------------------------

_BASE = dict(num_experts=16, top_k=2, hidden=128, ffn=64)
_DEEPSEEK = dict(router_kind="deepseek_v3", n_group=4, topk_group=2, routed_scaling_factor=2.5)


@pytest.mark.parametrize("field,value,extra", [
    ("num_experts", np.int64(16), {}),
    ("top_k", np.int32(2), {}),
    ("hidden", np.int64(128), {}),
    ("ffn", np.int64(64), {}),
    ("n_group", np.int64(4), _DEEPSEEK),
    ("topk_group", np.int64(2), _DEEPSEEK),
    ("num_shared_experts", np.int64(1), {}),
    ("shared_ffn", np.uint16(32), {}),
    ("routed_scaling_factor", np.float32(2.5), _DEEPSEEK),
    ("renormalize", np.False_, {}),
    ("fp8_weights", np.True_, {}),
])
def test_config_takes_numpy_scalars_as_python_ones(field, value, extra):
  config = moe.MoEConfig(**{**_BASE, **extra, field: value})
  plain = moe.MoEConfig(**{**_BASE, **extra, field: value.item()})
  assert type(getattr(config, field)) is type(value.item())  # pylint: disable=unidiomatic-typecheck
  assert config == plain and hash(config) == hash(plain)


@pytest.mark.parametrize("field,message", [
    ("num_experts", "num_experts must be a positive int, got True"),
    ("top_k", "top_k must be a positive int, got True"),
    ("hidden", "hidden must be a positive int, got True"),
    ("ffn", "ffn must be a positive int, got True"),
    ("n_group", "n_group must be a positive int, got True"),
    ("topk_group", "topk_group must be a positive int, got True"),
    ("num_shared_experts", "num_shared_experts must be an int >= 0, got True"),
    ("shared_ffn", "shared_ffn must be None or a positive int, got True"),
])
def test_config_refuses_bools_for_ints(field, message):
  with _raises(ValueError, f"MoEConfig: {message}"):
    moe.MoEConfig(**{**_BASE, field: True})


# ----------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv,message", [
    (["demo", "--tokens", "0"], "python -m jax_moe_a2a demo: error: argument --tokens: must be an int >= 1, got '0'"),
    (["demo", "--tokens", "-4"], "demo: error: argument --tokens: must be an int >= 1, got '-4'"),
    (["report", "--hidden", "0"], "report: error: argument --hidden: must be an int >= 1, got '0'"),
    (["report", "--hidden", "-128"], "report: error: argument --hidden: must be an int >= 1, got '-128'"),
    (["report", "--tokens", "-1"], "report: error: argument --tokens: must be an int >= 1, got '-1'"),
    (["report", "--tokens", "0"], "report: error: argument --tokens: must be an int >= 1, got '0'"),
])
def test_command_line_usage_error(argv, message):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run([sys.executable, "-m", "jax_moe_a2a", *argv], capture_output=True, text=True, env=env,
                        timeout=120)
  assert proc.returncode == 2, proc.stdout + proc.stderr
  assert proc.stderr.startswith("usage: python -m jax_moe_a2a "), proc.stderr
  assert message in proc.stderr


def _usage_error(main, argv, capsys) -> str:
  with pytest.raises(SystemExit) as exit_info:
    main(argv)
  assert exit_info.value.code == 2
  return capsys.readouterr().err


@pytest.mark.parametrize("option,value,expected", [
    (option, value, "an int >= 1") for option in ("--experts", "--top-k", "--hidden", "--ffn", "--tokens", "--data",
                                                  "--tp", "--n-group", "--topk-group", "--steps") for value in ("0",)
] + [
    ("--experts", "2.5", "an int >= 1"),
    ("--shared-experts", "-1", "an int >= 0"),
    ("--seed", "x", "an int in [-9223372036854775808, 9223372036854775807]"),
    ("--seed", str(2**63), "an int in [-9223372036854775808, 9223372036854775807]"),
    ("--max-calc-diff", "nan", "a finite float >= 0.0"),
    ("--max-calc-diff", "-0.5", "a finite float >= 0.0"),
])
def test_demo_numeric_options(option, value, expected, capsys):
  err = _usage_error(lambda argv: cli.main(["demo", *argv]), [option, value], capsys)
  assert f"argument {option}: must be {expected}, got {value!r}" in err


@pytest.mark.parametrize("option,value,expected", [
    ("--top-k", "0", "an int >= 1"),
    ("--ranks", "-8", "an int >= 1"),
    ("--capacity", "0", "an int >= 1"),
    ("--mx-alignment", "33", "an int >= 32, a multiple of 32"),
    ("--mx-alignment", "0", "an int >= 32, a multiple of 32"),
])
def test_report_numeric_options(option, value, expected, capsys):
  err = _usage_error(cli.main, ["report", option, value], capsys)
  assert f"argument {option}: must be {expected}, got {value!r}" in err


def _bench(name):
  sys.path.insert(0, BENCH)
  try:
    return importlib.import_module(name)
  finally:
    sys.path.remove(BENCH)


# Each argv would run (and fail or mislead) without its check; tiny sizes and --out keep such a run short.
@pytest.mark.parametrize("script,argv,message", [
    ("bench_a2a", ["--chain", "0", "--tokens", "1", "--hidden", "128", "--experts", "8", "--formats", "bf16",
                   "--impls", "reference", "--runs", "1"], "argument --chain: must be an int >= 1, got '0'"),
    ("bench_gemm", ["--shapes", "256x", "--groups", "1", "--rows", "8", "--methods", "bf16_einsum"],
     "argument --shapes: must be NxK with positive ints N and K (e.g. 4096x7168), got '256x'"),
    ("bench_quant", ["--k", "100", "--m", "8", "--calls", "1", "--runs", "1"],
     "argument --k: must be an int >= 128, a multiple of 128, got '100'"),
    ("bench_quant", ["--repeats", "0", "--m", "8", "--k", "128"], "argument --repeats: must be an int >= 1, got '0'"),
    ("bench_layer", ["--input-sets", "0", "--tokens", "8", "--local-experts", "1", "--hidden", "128", "--ffn", "128",
                     "--top-k", "1", "--variants", "einsum", "--modes", "fwd", "--no-stages"],
     "argument --input-sets: must be an int >= 1, got '0'"),
])
def test_bench_numeric_options(script, argv, message, capsys, tmp_path):
  err = _usage_error(_bench(script).main, [*argv, "--out", str(tmp_path)], capsys)
  assert message in err


def test_argument_types():
  assert demo.int_in(1)("3") == 3 and demo.float_in(0.0)("1e-3") == 1e-3
  for parse, text in [(demo.int_in(1), "0"), (demo.int_in(0, 7), "8"), (demo.int_in(32, multiple_of=32), "40"),
                      (demo.int_in(1), "1.0"), (demo.float_in(0.0), "inf"), (demo.float_in(0.0, 1.0), "2")]:
    with pytest.raises(Exception, match=f"must be {re.escape(parse.__name__)}, got '{text}'"):
      parse(text)


# ----------------------------------------------------------------------------------------------------------------
# moe_apply: x in another sharding
# ----------------------------------------------------------------------------------------------------------------


def _explicit_layer(axis_types):
  devices(8)
  mesh = jax.make_mesh((2, 4), (moe.DATA_AXIS, moe.EXPERT_AXIS), axis_types=axis_types)
  config = moe.MoEConfig(num_experts=8, top_k=2, hidden=128, ffn=64, dtype=jnp.float32, impl="reference")
  params = moe.init_params(jax.random.key(0), config, mesh)
  x = jax.random.normal(jax.random.key(1), (32, 128), jnp.float32)
  apply = lambda p, x: moe.moe_apply(p, x, config, mesh)
  apply.config = config
  return mesh, params, x, apply


def test_moe_apply_reshards_x_on_explicit_axes():
  mesh, params, x, apply = _explicit_layer((AxisType.Explicit,) * 2)
  want = np.asarray(apply(params, jax.device_put(x, NamedSharding(mesh, P((moe.DATA_AXIS, moe.EXPERT_AXIS)))))[0])
  replicated = jax.device_put(x, NamedSharding(mesh, P()))
  for name, fn, x_in in [("replicated", apply, replicated), ("replicated, traced", jax.jit(apply), replicated),
                         ("sharded otherwise", apply, jax.device_put(x, NamedSharding(mesh, P(moe.EXPERT_AXIS)))),
                         ("uncommitted, traced", jax.jit(apply), x)]:
    np.testing.assert_array_equal(np.asarray(fn(params, x_in)[0]), want, err_msg=name)
  grad = jax.jit(jax.grad(lambda x: jnp.sum(apply(params, x)[0] ** 2)))(replicated)
  assert grad.shape == x.shape and bool(jnp.all(jnp.isfinite(grad)))


def test_moe_apply_reshards_x_on_a_mesh_of_auto_and_explicit_axes():
  mesh, params, x, apply = _explicit_layer((AxisType.Auto, AxisType.Explicit))
  want = np.asarray(apply(params, jax.device_put(x, NamedSharding(mesh, P((moe.DATA_AXIS, moe.EXPERT_AXIS)))))[0])
  y = jax.jit(apply)(params, x)[0]  # not committed to the mesh
  np.testing.assert_array_equal(np.asarray(y), want)


@pytest.mark.parametrize("num_tokens,message", [
    (0, "make_workspace: num_tokens must be a positive int (the layer's global token count), got 0"),
    (-8, "make_workspace: num_tokens must be a positive int (the layer's global token count), got -8"),
    (32.0, "make_workspace: num_tokens must be a positive int (the layer's global token count), got 32.0"),
    (True, "make_workspace: num_tokens must be a positive int (the layer's global token count), got True"),
    (30, "make_workspace: num_tokens must be divisible by the 8 shards the layer splits tokens into (token axes "
         "('data', 'expert')), got 30"),
])
def test_make_workspace_num_tokens(num_tokens, message):
  mesh = jax.make_mesh((2, 4), (moe.DATA_AXIS, moe.EXPERT_AXIS), axis_types=(AxisType.Auto,) * 2, devices=devices(8))
  config = moe.MoEConfig(num_experts=8, top_k=2, hidden=128, ffn=128)
  with _raises(ValueError, message):
    moe.make_workspace(config, mesh, num_tokens)


def test_make_workspace_counts_the_tp_shards_of_sequence_parallelism():
  mesh = jax.make_mesh((2, 4), ("data", "tp"), axis_types=(AxisType.Auto,) * 2, devices=devices(8))
  config = moe.MoEConfig(num_experts=8, top_k=2, hidden=128, ffn=128, token_axes=("data",), expert_axis=("data", "tp"),
                         tp_axis="tp", sequence_parallel=True)
  with _raises(ValueError, "make_workspace: num_tokens must be divisible by the 8 shards the layer splits tokens into "
                           "(token axes ('data',) and tp), got 4"):
    moe.make_workspace(config, mesh, 4)


def test_make_workspace_refuses_a_dtype_the_one_sided_calls_do_not_combine():
  mesh = jax.make_mesh((2, 4), (moe.DATA_AXIS, moe.EXPERT_AXIS), axis_types=(AxisType.Auto,) * 2, devices=devices(8))
  config = moe.MoEConfig(num_experts=8, top_k=2, hidden=128, ffn=128, dtype=jnp.float16)
  with _raises(ValueError, "make_workspace: the one-sided exchange combines bfloat16 or float32 rows, got "
                           "config.dtype float16; run the layer without a workspace (XLA's all_to_all) or with dtype "
                           "bfloat16 or float32"):
    moe.make_workspace(config, mesh, 32)


@pytest.mark.parametrize("key,got", [(lambda: 0, lambda k: "int"), (lambda: np.uint32(7), lambda k: "uint32[]"),
                                     (lambda: jnp.zeros((4,), jnp.uint32), lambda k: "uint32[4]"),
                                     (lambda: jax.random.split(jax.random.key(0), 2), lambda k: f"{k.dtype}[2]")])
def test_init_params_refuses_what_is_not_one_prng_key(key, got):
  key = key()
  got = got(key)
  mesh = jax.make_mesh((2, 4), (moe.DATA_AXIS, moe.EXPERT_AXIS), axis_types=(AxisType.Auto,) * 2, devices=devices(8))
  config = moe.MoEConfig(num_experts=8, top_k=2, hidden=128, ffn=128)
  with _raises(TypeError, "init_params: key must be one PRNG key (jax.random.key(seed), or uint32[2] from "
                          f"jax.random.PRNGKey), got {got}"):
    moe.init_params(key, config, mesh)
  assert moe.init_params(jax.random.PRNGKey(0), config, mesh)["router"].shape == (128, 8)  # a raw key is one


def test_moe_apply_and_quantize_experts_reshard_params_on_explicit_axes():
  """Params as a checkpoint or the host gives them (NumPy, or replicated on the mesh) are laid out as the layer
  takes them over Explicit axes, as over Auto ones; so are the FP8 forms of quantize_experts."""
  mesh, params, x, apply = _explicit_layer((AxisType.Explicit,) * 2)
  want = np.asarray(apply(params, x)[0])
  host = {name: np.asarray(v) for name, v in params.items()}
  replicated = {name: jax.device_put(v, NamedSharding(mesh, P())) for name, v in params.items()}
  for name, p in [("host", host), ("replicated", replicated)]:
    np.testing.assert_array_equal(np.asarray(apply(p, x)[0]), want, err_msg=name)
    np.testing.assert_array_equal(np.asarray(jax.jit(apply)(p, x)[0]), want, err_msg=name + ", traced")
  config = moe.MoEConfig(num_experts=8, top_k=2, hidden=128, ffn=128, dtype=jnp.float32, impl="reference",
                         expert_precision="fp8")
  fp8_params = moe.init_params(jax.random.key(0), config, mesh)
  fp8_host = {name: np.asarray(v) for name, v in fp8_params.items()}
  q = moe.quantize_experts(fp8_host, config, mesh)
  want = np.asarray(moe.moe_apply(fp8_params, x, config, mesh)[0])
  q_host = jax.tree.map(np.asarray, q)
  np.testing.assert_array_equal(np.asarray(moe.moe_apply(fp8_host, x, config, mesh, quantized_experts=q_host)[0]),
                                want)


@pytest.mark.parametrize("axis_types", [(AxisType.Explicit,) * 2, (AxisType.Auto, AxisType.Explicit)])
def test_the_dense_oracle_takes_params_and_x_sharded_over_explicit_axes(axis_types):
  mesh, params, x, apply = _explicit_layer(axis_types)
  host = {name: jnp.asarray(np.asarray(v)) for name, v in params.items()}
  want = np.asarray(moe.moe_dense_reference(host, x, apply.config)[0])
  x_sharded = jax.device_put(x, NamedSharding(mesh, P((moe.DATA_AXIS, moe.EXPERT_AXIS))))
  oracle = lambda p, x: moe.moe_dense_reference(p, x, apply.config)[0]
  for name, fn in [("eager", oracle), ("traced", jax.jit(oracle))]:
    np.testing.assert_allclose(np.asarray(fn(params, x_sharded)), want, rtol=1e-6, atol=1e-6, err_msg=name)
  grads = jax.jit(jax.grad(lambda p: jnp.sum(oracle(p, x_sharded) ** 2)))(params)
  want_grads = jax.grad(lambda p: jnp.sum(oracle(p, x) ** 2))(host)
  for name in params:
    np.testing.assert_allclose(np.asarray(grads[name]), np.asarray(want_grads[name]), rtol=1e-4, atol=1e-4,
                               err_msg=name)


def test_a_one_sided_backward_that_xla_cpu_would_crash_on_is_refused(monkeypatch):
  """XLA:CPU of jax 0.11 crashes the process compiling the one-sided calls' backward: on such a JAX the backward is
  refused at trace time, naming the version and what works (here the JAX is made to look like one)."""
  from conftest import devices  # pylint: disable=import-outside-toplevel
  from jax_moe_a2a import _ffi, moe, workspace  # pylint: disable=import-outside-toplevel
  if not _ffi.available():
    pytest.skip("compiled extension not built")
  mesh = jax.make_mesh((1, 4), ("data", "expert"), devices=devices(4))
  config = moe.MoEConfig(num_experts=8, top_k=2, hidden=128, ffn=128)
  params = moe.init_params(jax.random.key(0), config, mesh)
  x = jax.random.normal(jax.random.key(1), (32, 128), jnp.bfloat16)
  monkeypatch.setattr(workspace, "cpu_compiles_one_sided_backward", lambda: False)
  with moe.make_workspace(config, mesh, 32, training=True) as ws:
    loss = lambda p: jnp.sum(moe.moe_apply(p, x, config, mesh, workspace=ws)[0].astype(jnp.float32))
    jax.jit(loss)(params)  # the forward compiles
    with pytest.raises(RuntimeError, match=r"the backward pass through the one-sided calls does not compile on "
                                           r"XLA:CPU of jax .* use jax >= 0.12, or on CPU no workspace"):
      jax.jit(jax.grad(loss))(params)
