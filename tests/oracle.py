"""An independent float64 NumPy oracle of the whole MoE layer, written from the definitions.

This module imports nothing of jax_moe_a2a and shares no code with it: it restates, in plain NumPy, what the
layer is documented to compute, so that a bug in a function the library's own dense reference reuses (the
router, the expert MLP, the shared experts, the load-balance loss) cannot hide by appearing on both sides of a
comparison. Everything is float64; parameters are read in the library's documented layout
(`moe.param_shapes`):

- ``router`` [hidden, num_experts]: logits are ``x @ router``;
- ``router_bias`` [num_experts] (deepseek_v3 only): the score-correction bias (``e_score_correction_bias``);
- ``w_gate_up`` [num_experts, 2 * ffn, hidden] with rows ``[0, ffn)`` the gate projection and rows
  ``[ffn, 2 * ffn)`` the up projection; ``w_down`` [num_experts, hidden, ffn] ("NT" layout: y = x @ W^T);
- ``shared_w_gate_up`` [num_shared, 2 * shared_ffn, hidden], ``shared_w_down`` [num_shared, hidden, shared_ffn],
  same layout; ``shared_gate`` [hidden] (with shared_expert_gate).

Conventions chosen where a definition leaves room (each follows the library's documentation, and DeepSeek-V3 /
Switch / GShard where the documentation is silent):

- Top-k ties go to the lower expert (and group) id.
- DeepSeek-V3 renormalization divides by the plain sum of the chosen scores; the reference implementation's
  ``+ 1e-20`` is immaterial in float64 for sigmoid scores (each > 0) and is left out.
- The routed scaling factor multiplies the routed weights only, after renormalization; shared experts are added
  with weight 1 (DeepSeek-V3's ``y = shared(x) + sum_k w_k expert_k(x)``), or with Qwen2-MoE's per-token gate
  ``sigmoid(x . shared_gate)`` on their sum when shared_expert_gate is set.
- The load-balance loss is computed over all tokens of the layer (batch-wise, as `moe_apply` documents), not per
  sequence as DeepSeek-V3's complementary sequence-wise loss is. Its selection indicator counts the experts
  actually chosen (after bias and group limiting), not a plain top-k of the unbiased scores.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

import numpy as np

SOFTMAX = "softmax"
DEEPSEEK_V3 = "deepseek_v3"


@dataclasses.dataclass(frozen=True)
class OracleConfig:
  """The settings of the layer that change its mathematics (mesh, wire, dtype and impl do not).

  Attributes:
    num_experts: routed experts N.
    top_k: experts per token K.
    router_kind: ``"softmax"`` or ``"deepseek_v3"``.
    n_group: deepseek_v3: expert groups (contiguous, equal size).
    topk_group: deepseek_v3: groups kept per token.
    renormalize: make each token's routed weights sum to 1 (before scaling).
    routed_scaling_factor: deepseek_v3: factor applied to the routed weights last.
    num_shared_experts: shared experts every token goes through with weight 1.
    shared_expert_gate: scale the shared experts' sum per token by ``sigmoid(x . shared_gate)`` (Qwen2-MoE).
  """

  num_experts: int
  top_k: int
  router_kind: str = SOFTMAX
  n_group: int = 1
  topk_group: int = 1
  renormalize: bool = True
  routed_scaling_factor: float = 1.0
  num_shared_experts: int = 0
  shared_expert_gate: bool = False


def _f64(a) -> np.ndarray:
  return np.asarray(a, dtype=np.float64)


# ----------------------------------------------------------------------------------------------------------------
# Elementwise functions
# ----------------------------------------------------------------------------------------------------------------


def sigmoid(z) -> np.ndarray:
  """``sigma(z) = 1 / (1 + exp(-z))``, evaluated without overflow for either sign of z."""
  z = _f64(z)
  e = np.exp(-np.abs(z))
  return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def softmax(z) -> np.ndarray:
  """``softmax(z)_e = exp(z_e - max z) / sum_j exp(z_j - max z)`` over the last axis."""
  z = _f64(z)
  e = np.exp(z - np.max(z, axis=-1, keepdims=True))
  return e / np.sum(e, axis=-1, keepdims=True)


def silu(z) -> np.ndarray:
  """``silu(z) = z * sigma(z)`` (the Swish-1 of the SwiGLU gate)."""
  z = _f64(z)
  return z * sigmoid(z)


def top_k_indices(values, k: int) -> np.ndarray:
  """Per row, the indices of the k largest values in descending order, ties toward the lower index."""
  values = _f64(values)
  # A stable sort of the negated values keeps equal values in index order; -inf sorts last.
  return np.argsort(-values, axis=-1, kind="stable")[..., :k]


# ----------------------------------------------------------------------------------------------------------------
# Routers
# ----------------------------------------------------------------------------------------------------------------


def route_softmax(logits, top_k: int, *, renormalize: bool):
  """Softmax top-k router (Switch / GShard / Mixtral).

  ``p = softmax(logits)``; the K experts with the largest p are chosen; their weights are ``p_e`` or, with
  `renormalize`, ``p_e / sum_{j in topk} p_j``.

  Returns:
    (weights [T, K] float64, ids [T, K] int64, probs [T, N] float64: the probabilities of the loss).
  """
  probs = softmax(logits)
  ids = top_k_indices(probs, top_k)
  w = np.take_along_axis(probs, ids, axis=-1)
  if renormalize:
    w = w / np.sum(w, axis=-1, keepdims=True)
  return w, ids, probs


def _kept_experts(c: np.ndarray, n_group: int, topk_group: int):
  """Group limiting: (experts of the kept groups [T, N] bool, sorted group scores [T, n_group] descending).

  A group's score is the sum of its two largest selection scores (its one score for one-expert groups); the
  `topk_group` best groups are kept, ties toward the lower group id."""
  num_tokens, num_experts = c.shape
  size = num_experts // n_group
  top = np.sort(c.reshape(num_tokens, n_group, size), axis=-1)[..., ::-1][..., :min(2, size)]
  group_score = np.sum(top, axis=-1)  # [T, n_group]
  group_ok = np.zeros((num_tokens, n_group), dtype=bool)
  np.put_along_axis(group_ok, top_k_indices(group_score, topk_group), True, axis=-1)
  return np.repeat(group_ok, size, axis=-1), np.sort(group_score, axis=-1)[:, ::-1]


def route_deepseek_v3(logits, top_k: int, *, bias=None, n_group: int = 1, topk_group: int = 1,
                      renormalize: bool = True, routed_scaling_factor: float = 1.0):
  """DeepSeek-V3 router (``MoEGate`` with ``topk_method="noaux_tc"``).

  1. Affinities ``s = sigmoid(logits)``; selection scores ``c = s + b`` (b the correction bias, 0 if None).
  2. Experts form ``n_group`` contiguous groups; a group's score is the sum of its two largest c (its single c for
     one-expert groups). The ``topk_group`` best groups are kept; experts of the other groups cannot be chosen.
  3. The K experts with the largest c among the kept groups are chosen.
  4. Gates are the chosen *unbiased* affinities ``s_e``; with `renormalize`, ``g_e = s_e / sum_{j in topk} s_j``;
     then ``g_e *= routed_scaling_factor``. The bias steers selection only.

  The probabilities of the load-balance loss are DeepSeek-V3's normalized affinities
  ``s'_{t,e} = s_{t,e} / sum_j s_{t,j}`` (over all N experts, no bias).

  Returns:
    (weights [T, K] float64, ids [T, K] int64, probs [T, N] float64).
  """
  s = sigmoid(logits)
  c = s if bias is None else s + _f64(bias)[None, :]
  if topk_group < n_group:
    allowed, _ = _kept_experts(c, n_group, topk_group)
    c = np.where(allowed, c, -np.inf)
  ids = top_k_indices(c, top_k)
  w = np.take_along_axis(s, ids, axis=-1)
  if renormalize:
    w = w / np.sum(w, axis=-1, keepdims=True)
  w = w * float(routed_scaling_factor)
  probs = s / np.sum(s, axis=-1, keepdims=True)
  return w, ids, probs


def route(logits, config: OracleConfig, bias=None):
  """The router `config` names; returns (weights, ids, probs) as `route_softmax` / `route_deepseek_v3`."""
  if config.router_kind == SOFTMAX:
    return route_softmax(logits, config.top_k, renormalize=config.renormalize)
  if config.router_kind == DEEPSEEK_V3:
    return route_deepseek_v3(logits, config.top_k, bias=bias, n_group=config.n_group,
                             topk_group=config.topk_group, renormalize=config.renormalize,
                             routed_scaling_factor=config.routed_scaling_factor)
  raise ValueError(f"oracle.route: router_kind must be 'softmax' or 'deepseek_v3', got {config.router_kind!r}")


def selection_margin(logits, config: OracleConfig, bias=None) -> float:
  """The smallest gap, over tokens, between the last chosen and the first rejected candidate (experts, and groups
  when group limiting is on), in the quantity that decides the choice. A float32 implementation can disagree
  with this float64 one on the chosen set only where this margin is at float32 rounding level (~1e-7): tests
  check their inputs keep it well above that."""
  logits = _f64(logits)
  if config.router_kind == SOFTMAX:
    c = softmax(logits)
  else:
    c = sigmoid(logits) + (0.0 if bias is None else _f64(bias)[None, :])
  margins = [np.inf]
  if config.router_kind == DEEPSEEK_V3 and config.topk_group < config.n_group:
    allowed, g = _kept_experts(c, config.n_group, config.topk_group)
    margins.append(np.min(g[:, config.topk_group - 1] - g[:, config.topk_group]))
    c = np.where(allowed, c, -np.inf)
  if config.top_k < c.shape[1]:
    srt = np.sort(c, axis=-1)[:, ::-1]
    margins.append(np.min(srt[:, config.top_k - 1] - srt[:, config.top_k]))
  return float(min(margins))


# ----------------------------------------------------------------------------------------------------------------
# Experts
# ----------------------------------------------------------------------------------------------------------------


def swiglu_expert(x, w_gate_up, w_down) -> np.ndarray:
  """One SwiGLU expert (Shazeer 2020): ``down(silu(gate(x)) * up(x))``.

  With the library's NT layout, ``gate(x) = x @ w_gate_up[:F].T``, ``up(x) = x @ w_gate_up[F:].T`` (gate rows
  first) and ``down(a) = a @ w_down.T``.

  Args:
    x: [T, H]; w_gate_up: [2F, H]; w_down: [H, F].

  Returns:
    [T, H] float64.
  """
  x, w_gate_up, w_down = _f64(x), _f64(w_gate_up), _f64(w_down)
  ffn = w_gate_up.shape[0] // 2
  gate = x @ w_gate_up[:ffn].T
  up = x @ w_gate_up[ffn:].T
  return (silu(gate) * up) @ w_down.T


def shared_experts(x, w_gate_up, w_down) -> np.ndarray:
  """``sum_s swiglu_expert_s(x)`` over the shared experts (each with weight 1); w_gate_up [S, 2Fs, H],
  w_down [S, H, Fs]. Returns [T, H] float64."""
  x = _f64(x)
  y = np.zeros_like(x)
  for s in range(np.shape(w_gate_up)[0]):
    y += swiglu_expert(x, w_gate_up[s], w_down[s])
  return y


def combine(x, weights, ids, w_gate_up, w_down) -> np.ndarray:
  """Routed output ``y_t = sum_k weights[t, k] * expert_{ids[t, k]}(x_t)``, each expert evaluated on its tokens.

  Args:
    x: [T, H]; weights, ids: [T, K]; w_gate_up: [N, 2F, H]; w_down: [N, H, F].

  Returns:
    [T, H] float64.
  """
  x, weights = _f64(x), _f64(weights)
  y = np.zeros_like(x)
  for e in range(np.shape(w_gate_up)[0]):
    tokens, slots = np.nonzero(ids == e)
    if tokens.size:
      y[tokens] += weights[tokens, slots][:, None] * swiglu_expert(x[tokens], w_gate_up[e], w_down[e])
  return y


# ----------------------------------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------------------------------


def expert_load(ids, num_experts: int) -> np.ndarray:
  """Number of (token, k) assignments to each expert; ids outside [0, N) are not counted. [N] int64."""
  ids = np.asarray(ids).reshape(-1)
  ids = ids[(ids >= 0) & (ids < num_experts)]
  return np.bincount(ids, minlength=num_experts).astype(np.int64)


def load_balance_loss(probs, ids, num_experts: int) -> float:
  """Switch / GShard auxiliary loss, ``N * sum_e f_e * P_e`` (1.0 for perfectly uniform routing).

  ``f_e`` = (assignments to e) / (all valid assignments, T * K when none is dropped) and ``P_e`` = mean over the T
  tokens of ``probs[:, e]``. With DeepSeek-V3's normalized affinities as `probs` this is exactly DeepSeek-V3's
  ``sum_e f'_e P_e`` with ``f'_e = N / (K T) * count_e``, whose coefficient alpha is left to the caller.
  """
  probs = _f64(probs)
  counts = expert_load(ids, num_experts).astype(np.float64)
  total = np.sum(counts)
  if total == 0:
    return 0.0
  f = counts / total
  p = np.mean(probs, axis=0)
  return float(num_experts * np.sum(f * p))


# ----------------------------------------------------------------------------------------------------------------
# The layer
# ----------------------------------------------------------------------------------------------------------------


def moe_layer(params: Mapping[str, np.ndarray], x, config: OracleConfig) -> dict:
  """The whole MoE layer on all tokens at once, float64.

  ``logits = x @ router``; weights and ids from `route`;
  ``y = combine(x, weights, ids) + g(x) * shared_experts(x)`` with ``g(x) = sigmoid(x . shared_gate)`` under
  shared_expert_gate, else 1; the statistics `load_balance_loss` and `expert_load` over all tokens.

  Args:
    params: the parameters in the layout of the module docstring (any array type NumPy can read; FP8 weights
      must be dequantized by the caller).
    x: [T, H] or [B, S, H].
    config: the layer's mathematical settings.

  Returns:
    A dict: ``y`` (x's shape), ``load_balance_loss`` (float), ``expert_load`` [N] int64, and the intermediates
    ``logits`` [T, N], ``probs`` [T, N], ``topk_weights`` [T, K], ``topk_ids`` [T, K].
  """
  x = _f64(x)
  shape = x.shape
  xs = x.reshape(-1, shape[-1])
  logits = xs @ _f64(params["router"])
  bias: Optional[np.ndarray] = params.get("router_bias") if config.router_kind == DEEPSEEK_V3 else None
  weights, ids, probs = route(logits, config, bias)
  y = combine(xs, weights, ids, _f64(params["w_gate_up"]), _f64(params["w_down"]))
  if config.num_shared_experts:
    shared = shared_experts(xs, _f64(params["shared_w_gate_up"]), _f64(params["shared_w_down"]))
    if config.shared_expert_gate:
      shared = shared * sigmoid(xs @ _f64(params["shared_gate"]))[:, None]
    y = y + shared
  return {
      "y": y.reshape(shape),
      "load_balance_loss": load_balance_loss(probs, ids, config.num_experts),
      "expert_load": expert_load(ids, config.num_experts),
      "logits": logits,
      "probs": probs,
      "topk_weights": weights,
      "topk_ids": ids,
  }
