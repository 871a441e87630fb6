"""The layer against an independent oracle: `moe.moe_apply` and `moe.moe_dense_reference` vs `tests/oracle.py`.

`moe_dense_reference` reuses the layer's own router, expert MLP, shared experts and load-balance loss, so a bug
in any of those is on both sides of `test_moe.py`'s comparisons. `oracle.py` is a float64 NumPy restatement of
the layer from its definitions (softmax top-k; DeepSeek-V3 sigmoid, correction bias, group-limited top-k,
renormalization, routed scaling factor; SwiGLU with gate rows first; shared experts, optionally under
Qwen2-MoE's sigmoid gate; Switch/GShard load-balance loss on DeepSeek-V3's normalized affinities) that shares no
code with jax_moe_a2a. Every returned value of the layer is compared with it: the output, ``load_balance_loss``
and ``expert_load``.

Shapes: 16 experts, top-4, hidden 64, ffn 32, 32 tokens on a 2x4 (data, expert) mesh (the bf16 case on 1x8);
every case runs `routing.route` and `moe_dense_reference`, all but DENSE_ONLY also `moe_apply` (each costs a
compilation of ~2 s: the file runs in 20 to 25 s on 2 cores).
x holds BF16-exact float32 values, so the layer's BF16 wire is lossless and float32 cases differ from the oracle
by float32 rounding only. Each case checks that its inputs keep every top-k decision (experts and groups) at a
margin >= 1e-4 from a tie (`oracle.selection_margin`), so float32 rounding cannot change which experts are chosen.

Tolerances, and why:

- float32 compute: ``max |y - y_ref| <= 2e-5 * max |y_ref|``. Logits, gates and the two matmuls of an expert each
  round to float32 (unit roundoff 6e-8), sums of up to 64 terms in another order: a few 1e-7 relative to
  the output's scale (observed 3e-7 to 5e-7).
- bfloat16 compute: the experts' operands (weights, the SwiGLU activation) and the combine payload round to 8
  mantissa bits (unit roundoff 2^-9 = 2e-3 per rounding, three or four in series): ``max |err| <= 3e-2 * max
  |ref|`` and relative RMS error ``||y - y_ref|| / ||y_ref|| <= 1e-2`` (observed 5e-3 and 5e-3).
- ``load_balance_loss``: the router runs in float32 whatever the compute dtype: relative error <= 1e-5 (a sum of
  16 products of float32 means; observed <= 1.1e-7). ``expert_load``: integers, exact.
- Routed weights from `routing.route` (a float32 softmax/sigmoid and a division): ``|w - w_ref| <= 1e-6 *
  max(1, routed_scaling_factor)`` (observed <= 2.5e-7); ids exact.
- Fixtures (the oracle against its own stored float64 results): relative 1e-12, i.e. only a change in the
  oracle's arithmetic, or in NumPy's summation order, could move them.

Fixtures: ``tests/fixtures/oracle_<name>.npz`` hold a tiny case (8 experts, top-2, hidden 8, ffn 4, 16 tokens):
its config (JSON), inputs, parameters and the oracle's float64 results. Regenerate them, only after a deliberate
change to the oracle, with::

    . .venv/bin/activate && python tests/test_oracle.py --regenerate
"""

import dataclasses
import functools
import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oracle  # noqa: E402  (tests/ is not a package)

FIXTURE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")

HIDDEN, FFN, EXPERTS, TOP_K, TOKENS = 64, 32, 16, 4, 32
F32_TOL = 2e-5  # max |err| / max |ref|, float32 compute
BF16_TOL, BF16_RMS = 3e-2, 1e-2  # max |err| / max |ref| and ||err|| / ||ref||, bfloat16 compute
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-6
FIXTURE_RTOL = 1e-12
MIN_MARGIN = 1e-4

# name -> (MoEConfig fields beyond the shapes, mesh shape over (data, expert), seed)
CASES = {
    "softmax": (dict(router_kind="softmax"), (2, 4), 1),
    # Qwen2-MoE's shape: softmax without renormalization, a shared expert under a sigmoid gate.
    "softmax_raw_shared": (dict(router_kind="softmax", renormalize=False, num_shared_experts=1, shared_ffn=16,
                                shared_expert_gate=True), (2, 4), 0),
    "deepseek": (dict(router_kind="deepseek_v3", n_group=4, topk_group=2, routed_scaling_factor=2.5), (2, 4), 2),
    "deepseek_raw_shared": (dict(router_kind="deepseek_v3", n_group=4, topk_group=2, renormalize=False,
                                 routed_scaling_factor=2.5, num_shared_experts=2, shared_ffn=16), (2, 4), 1),
    "deepseek_ungrouped": (dict(router_kind="deepseek_v3", routed_scaling_factor=1.5, num_shared_experts=1),
                           (2, 4), 4),
    "deepseek_bf16": (dict(router_kind="deepseek_v3", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                           num_shared_experts=1, dtype="bfloat16"), (1, 8), 6),
}

# Cases checked on the router and the dense reference only: each moe_apply case costs a ~2 s compilation.
DENSE_ONLY = ("deepseek_ungrouped",)

# name -> (oracle config fields, seed); shapes 8 experts, top-2, hidden 8, ffn 4 (shared ffn 4), 16 tokens
FIXTURES = {
    "softmax": (dict(num_experts=8, top_k=2, router_kind="softmax"), 10),
    "deepseek": (dict(num_experts=8, top_k=2, router_kind="deepseek_v3", n_group=4, topk_group=2,
                      routed_scaling_factor=2.5), 11),
    "deepseek_raw_shared": (dict(num_experts=8, top_k=2, router_kind="deepseek_v3", n_group=4, topk_group=2,
                                 renormalize=False, routed_scaling_factor=2.5, num_shared_experts=1), 12),
}
FIXTURE_SHAPE = dict(hidden=8, ffn=4, shared_ffn=4, tokens=16)

# ----------------------------------------------------------------------------------------------------------------
# Inputs (NumPy only, so that the fixtures regenerate without JAX)
# ----------------------------------------------------------------------------------------------------------------


def _bf16_exact(a: np.ndarray) -> np.ndarray:
  """float32 values with the low 16 bits cleared: exactly representable in bfloat16."""
  bits = np.ascontiguousarray(a, np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
  return bits.view(np.float32)


def _draw(seed: int, *, num_experts: int, hidden: int, ffn: int, tokens: int, router_kind: str,
          num_shared_experts: int = 0, shared_ffn: int = 0,
          shared_expert_gate: bool = False) -> tuple[dict, np.ndarray]:
  """float32 parameters in the layer's layout (weights ~ N(0, 1/fan_in)) and BF16-exact x ~ N(0, 1)."""
  rng = np.random.default_rng(seed)
  normal = lambda shape, fan_in: (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)
  params = {"router": normal((hidden, num_experts), hidden)}
  if router_kind == oracle.DEEPSEEK_V3:
    params["router_bias"] = (0.1 * rng.standard_normal(num_experts)).astype(np.float32)
  params["w_gate_up"] = normal((num_experts, 2 * ffn, hidden), hidden)
  params["w_down"] = normal((num_experts, hidden, ffn), ffn)
  if num_shared_experts:
    params["shared_w_gate_up"] = normal((num_shared_experts, 2 * shared_ffn, hidden), hidden)
    params["shared_w_down"] = normal((num_shared_experts, hidden, shared_ffn), shared_ffn)
  if shared_expert_gate:
    params["shared_gate"] = normal((hidden,), hidden)
  x = _bf16_exact(rng.standard_normal((tokens, hidden)).astype(np.float32))
  return params, x


def _fixture_case(name: str) -> tuple[oracle.OracleConfig, dict, np.ndarray]:
  fields, seed = FIXTURES[name]
  cfg = oracle.OracleConfig(**fields)
  params, x = _draw(seed, num_experts=cfg.num_experts, hidden=FIXTURE_SHAPE["hidden"], ffn=FIXTURE_SHAPE["ffn"],
                    tokens=FIXTURE_SHAPE["tokens"], router_kind=cfg.router_kind,
                    num_shared_experts=cfg.num_shared_experts, shared_ffn=FIXTURE_SHAPE["shared_ffn"])
  return cfg, params, x


_EXPECTED = ("y", "load_balance_loss", "expert_load", "topk_ids", "topk_weights")


def regenerate_fixtures(directory: str = FIXTURE_DIR) -> list[str]:
  """Writes ``oracle_<name>.npz`` for every entry of FIXTURES: config JSON, x, ``param/<name>`` and the oracle's
  results ``expected/<key>``; returns the paths."""
  os.makedirs(directory, exist_ok=True)
  paths = []
  for name in FIXTURES:
    cfg, params, x = _fixture_case(name)
    out = oracle.moe_layer(params, x, cfg)
    arrays = {"config": np.array(json.dumps(dataclasses.asdict(cfg), sort_keys=True)), "x": x}
    arrays.update({f"param/{k}": v for k, v in params.items()})
    arrays.update({f"expected/{k}": np.asarray(out[k]) for k in _EXPECTED})
    path = os.path.join(directory, f"oracle_{name}.npz")
    np.savez_compressed(path, **arrays)
    paths.append(path)
  return paths


def _load_fixture(name: str):
  with np.load(os.path.join(FIXTURE_DIR, f"oracle_{name}.npz"), allow_pickle=False) as z:
    cfg = oracle.OracleConfig(**json.loads(str(z["config"])))
    params = {k[len("param/"):]: z[k] for k in z.files if k.startswith("param/")}
    expected = {k[len("expected/"):]: z[k] for k in z.files if k.startswith("expected/")}
    return cfg, params, z["x"], expected


# ----------------------------------------------------------------------------------------------------------------
# Comparisons
# ----------------------------------------------------------------------------------------------------------------


def _max_rel(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def _rms_rel(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _check_layer(what: str, y, aux, ref: dict, *, bf16: bool) -> None:
  """y and every aux value against the oracle, with the module docstring's tolerances."""
  y = np.asarray(y, np.float64)
  assert y.shape == ref["y"].shape, f"{what}: y shape {y.shape}, oracle {ref['y'].shape}"
  assert sorted(aux) == ["expert_load", "load_balance_loss"], f"{what}: aux keys {sorted(aux)}"
  load = np.asarray(aux["expert_load"])
  np.testing.assert_array_equal(load, ref["expert_load"], err_msg=f"{what}: expert_load")
  loss, want_loss = float(aux["load_balance_loss"]), float(ref["load_balance_loss"])
  assert abs(loss - want_loss) <= LOSS_RTOL * abs(want_loss), \
      f"{what}: load_balance_loss {loss!r}, oracle {want_loss!r} (rel {abs(loss - want_loss) / want_loss:.2e})"
  err = _max_rel(y, ref["y"])
  if bf16:
    rms = _rms_rel(y, ref["y"])
    assert err <= BF16_TOL and rms <= BF16_RMS, \
        f"{what}: y max rel err {err:.2e} (tol {BF16_TOL}), rms rel err {rms:.2e} (tol {BF16_RMS})"
  else:
    assert err <= F32_TOL, f"{what}: y max rel err {err:.2e} (tol {F32_TOL})"


# ----------------------------------------------------------------------------------------------------------------
# The library's cases
# ----------------------------------------------------------------------------------------------------------------


def _moe_config(name: str):
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax_moe_a2a import moe  # pylint: disable=import-outside-toplevel
  fields, _, _ = CASES[name]
  fields = dict(fields)
  dtype = jnp.dtype(fields.pop("dtype", "float32"))
  return moe.MoEConfig(num_experts=EXPERTS, top_k=TOP_K, hidden=HIDDEN, ffn=FFN, dtype=dtype, **fields)


def _oracle_config(config) -> oracle.OracleConfig:
  return oracle.OracleConfig(**{f.name: getattr(config, f.name) for f in dataclasses.fields(oracle.OracleConfig)})


def _jax_arrays(params: dict) -> dict:
  # moe_dense_reference indexes the expert weights with traced group ids, which NumPy arrays do not accept.
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  return {k: jnp.asarray(v) for k, v in params.items()}


@functools.lru_cache(maxsize=None)
def _case(name: str):
  """(MoEConfig, params, x, oracle results) of a case; checks the selection margin of its inputs."""
  config = _moe_config(name)
  cfg = _oracle_config(config)
  params, x = _draw(CASES[name][2], num_experts=EXPERTS, hidden=HIDDEN, ffn=FFN, tokens=TOKENS,
                    router_kind=config.router_kind, num_shared_experts=config.num_shared_experts,
                    shared_ffn=config.shared_width, shared_expert_gate=config.shared_expert_gate)
  ref = oracle.moe_layer(params, x, cfg)
  margin = oracle.selection_margin(ref["logits"], cfg, params.get("router_bias"))
  assert margin >= MIN_MARGIN, f"case {name}: inputs too close to a top-k tie ({margin:.1e}); change its seed"
  return config, params, x, ref


@pytest.mark.parametrize("name", sorted(CASES))
def test_router_matches_oracle(name):
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax_moe_a2a import routing  # pylint: disable=import-outside-toplevel
  config, params, _, ref = _case(name)
  bias = params.get("router_bias")
  w, ids = routing.route(jnp.asarray(ref["logits"], jnp.float32), config.router_config,
                         None if bias is None else jnp.asarray(bias))
  np.testing.assert_array_equal(np.asarray(ids), ref["topk_ids"], err_msg="topk_ids")
  np.testing.assert_allclose(np.asarray(w), ref["topk_weights"], rtol=0,
                             atol=WEIGHT_ATOL * max(1.0, config.routed_scaling_factor), err_msg="topk_weights")


@pytest.mark.parametrize("name", sorted(n for n in CASES if n not in DENSE_ONLY))
def test_moe_apply_matches_oracle(name):
  import jax  # pylint: disable=import-outside-toplevel
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  from conftest import devices  # pylint: disable=import-outside-toplevel
  from jax_moe_a2a import moe  # pylint: disable=import-outside-toplevel
  config, params, x, ref = _case(name)
  shape = CASES[name][1]
  mesh = Mesh(np.asarray(devices(int(np.prod(shape)))).reshape(shape), (moe.DATA_AXIS, moe.EXPERT_AXIS))
  specs = moe.param_specs(config)
  dev_params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
  dev_x = jax.device_put(x.astype(config.dtype), NamedSharding(mesh, P(config.token_axes, None)))
  y, aux = moe.moe_apply(dev_params, dev_x, config, mesh)
  assert y.dtype == config.dtype
  _check_layer(f"moe_apply[{name}]", y, aux, ref, bf16=config.dtype.itemsize == 2)


@pytest.mark.parametrize("name", sorted(n for n in CASES if not n.endswith("_bf16")))
def test_dense_reference_matches_oracle(name):
  # moe_dense_reference computes in float32 whatever config.dtype says, so the bf16 case adds nothing here.
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax_moe_a2a import moe  # pylint: disable=import-outside-toplevel
  config, params, x, ref = _case(name)
  y, aux = moe.moe_dense_reference(_jax_arrays(params), jnp.asarray(x), config)
  _check_layer(f"moe_dense_reference[{name}]", y, aux, ref, bf16=False)


# ----------------------------------------------------------------------------------------------------------------
# Fixtures: the oracle cannot drift
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_oracle_reproduces_fixture(name):
  cfg, params, x, expected = _load_fixture(name)
  assert cfg == _fixture_case(name)[0], "fixture config differs from FIXTURES: regenerate the fixtures"
  out = oracle.moe_layer(params, x, cfg)
  np.testing.assert_array_equal(out["topk_ids"], expected["topk_ids"])
  np.testing.assert_array_equal(out["expert_load"], expected["expert_load"])
  for key in ("y", "topk_weights", "load_balance_loss"):
    np.testing.assert_allclose(out[key], expected[key], rtol=FIXTURE_RTOL, atol=0, err_msg=key)


@pytest.mark.parametrize("name", ["deepseek_raw_shared"])  # the fixture with every feature; one compilation
def test_dense_reference_matches_fixture(name):
  """The library's dense reference against the stored results, with no oracle code running."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax_moe_a2a import moe  # pylint: disable=import-outside-toplevel
  cfg, params, x, expected = _load_fixture(name)
  config = moe.MoEConfig(hidden=x.shape[1], ffn=params["w_down"].shape[-1], dtype=jnp.float32,
                         shared_ffn=params["shared_w_down"].shape[-1] if cfg.num_shared_experts else None,
                         **dataclasses.asdict(cfg))
  y, aux = moe.moe_dense_reference(_jax_arrays(params), jnp.asarray(x), config)
  _check_layer(f"moe_dense_reference[fixture {name}]", y, aux, expected, bf16=False)


if __name__ == "__main__":
  if sys.argv[1:] != ["--regenerate"]:
    sys.exit("usage: python tests/test_oracle.py --regenerate")
  for p in regenerate_fixtures():
    print(p, os.path.getsize(p), "bytes")
