"""Routing: which experts each token goes to, with what weight, and on which rank those experts live.

Everything here is pure JAX and runs under `jit`, `vmap` and `shard_map`. Sizes (`num_experts`, `top_k`,
`n_group`, `topk_group`, `num_ranks`) are Python ints checked at trace time; only arrays are traced.

Conventions shared by every function:

- Top-k ids are `[num_tokens, top_k] int32`, top-k weights `[num_tokens, top_k] float32`, in the order
  (weights, ids) when returned together.
- `INVALID_EXPERT` (-1) means "no expert": a padding slot or a dropped choice. Any id outside
  `[0, num_experts)` (negative or too large) is treated exactly like `INVALID_EXPERT`: it is never placed on a
  rank, never counted as load, and `mask_invalid` rewrites it to `INVALID_EXPERT` with weight 0. An out-of-range
  id is therefore dropped, never silently routed to some expert by wrap-around or clamping.
- Top-k selection breaks ties toward the lower expert id (and, for groups, the lower group id), on every
  backend: it uses `jax.lax.top_k(..., is_stable=True)`, which keeps equal elements in input order.
- Expert placement is contiguous: with `num_local_experts = num_experts // num_ranks`, expert `e` lives on
  rank `e // num_local_experts` as local expert `e % num_local_experts`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp

from jax_moe_a2a.layout import INVALID_EXPERT  # noqa: F401  (re-exported: routing's results use it)

SOFTMAX = "softmax"
DEEPSEEK_V3 = "deepseek_v3"
ROUTER_KINDS: tuple[str, ...] = (SOFTMAX, DEEPSEEK_V3)

AxisName = Union[str, Sequence[str]]

# ----------------------------------------------------------------------------------------------------------------
# Trace-time checks
# ----------------------------------------------------------------------------------------------------------------


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _check_positive_int(op: str, name: str, v) -> None:
  if not _is_int(v) or v <= 0:
    raise ValueError(f"{op}: {name} must be a positive int, got {v!r}")


def _check_bool(op: str, name: str, v) -> None:
  if not isinstance(v, bool):
    raise TypeError(f"{op}: {name} must be a bool, got {v!r}")


def _check_scaling_factor(op: str, v) -> None:
  if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
    raise ValueError(f"{op}: routed_scaling_factor must be a finite float > 0, got {v!r}")


def _check_logits(op: str, logits) -> jax.Array:
  """Checks `logits` is a 2-D floating [num_tokens, num_experts] array and returns it as a JAX array."""
  logits = jnp.asarray(logits)
  if logits.ndim != 2:
    raise ValueError(f"{op}: logits must be a 2-D [num_tokens, num_experts] array, got shape {logits.shape}")
  if not jnp.issubdtype(logits.dtype, jnp.floating):
    raise TypeError(f"{op}: logits must have a floating dtype, got {logits.dtype}")
  return logits


def _check_top_k(op: str, top_k, num_experts: int) -> None:
  if not _is_int(top_k) or not 1 <= top_k <= num_experts:
    raise ValueError(f"{op}: top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}")


def _check_ids(op: str, topk_ids) -> jax.Array:
  topk_ids = jnp.asarray(topk_ids)
  if not jnp.issubdtype(topk_ids.dtype, jnp.integer):
    raise TypeError(f"{op}: topk_ids must have an integer dtype, got {topk_ids.dtype}")
  return topk_ids


def _check_grouping(op: str, num_experts: int, top_k: int, n_group, topk_group) -> None:
  _check_positive_int(op, "n_group", n_group)
  if num_experts % n_group:
    raise ValueError(f"{op}: n_group must divide num_experts={num_experts}, got {n_group}")
  if not _is_int(topk_group) or not 1 <= topk_group <= n_group:
    raise ValueError(f"{op}: topk_group must be an int in [1, n_group={n_group}], got {topk_group!r}")
  reachable = topk_group * (num_experts // n_group)
  if top_k > reachable:
    raise ValueError(f"{op}: top_k must be <= topk_group * (num_experts // n_group) = {topk_group} * "
                     f"{num_experts // n_group} = {reachable}, got {top_k}")


def num_local_experts(num_experts: int, num_ranks: int, *, op: str = "num_local_experts") -> int:
  """Experts per rank under contiguous placement, `num_experts // num_ranks`.

  Raises:
    ValueError: a size is not a positive int, or `num_ranks` does not divide `num_experts`.
  """
  _check_positive_int(op, "num_experts", num_experts)
  _check_positive_int(op, "num_ranks", num_ranks)
  if num_experts % num_ranks:
    raise ValueError(f"{op}: num_ranks must divide num_experts={num_experts}, got {num_ranks}")
  return num_experts // num_ranks


# ----------------------------------------------------------------------------------------------------------------
# Softmax top-k
# ----------------------------------------------------------------------------------------------------------------


def topk_softmax(logits: jax.Array, top_k: int, *, renormalize: bool = True) -> tuple[jax.Array, jax.Array]:
  """Softmax router: the `top_k` most probable experts of each token and their probabilities.

  The softmax is computed in float32 whatever the dtype of `logits`. Experts are chosen by their float32
  logit, which orders them exactly as their probability does but cannot tie two experts whose probabilities
  merely underflow to the same value. Ties are broken toward the lower expert id.

  Args:
    logits: `[num_tokens, num_experts]` floating (any float dtype), router logits.
    top_k: experts per token, `1 <= top_k <= num_experts`.
    renormalize: divide the chosen probabilities by their sum so each token's weights sum to 1 (vLLM's
      `renormalize=True`); otherwise they are the raw softmax probabilities.

  Returns:
    topk_weights: `[num_tokens, top_k] float32`, the (renormalized) probabilities of the chosen experts.
    topk_ids: `[num_tokens, top_k] int32`, the chosen experts, in descending order of probability.

  Raises:
    ValueError: `logits` is not 2-D, or `top_k` is out of range.
    TypeError: `logits` is not floating, or `renormalize` is not a bool.
  """
  op = "topk_softmax"
  logits = _check_logits(op, logits)
  num_experts = logits.shape[1]
  _check_top_k(op, top_k, num_experts)
  _check_bool(op, "renormalize", renormalize)
  with jax.named_scope(op):
    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    _, topk_ids = jax.lax.top_k(logits, top_k, is_stable=True)
    topk_weights = jnp.take_along_axis(probs, topk_ids, axis=-1)
    if renormalize:
      # The sum is at least the top-1 probability, >= 1 / num_experts: never zero.
      topk_weights = topk_weights / jnp.sum(topk_weights, axis=-1, keepdims=True)
    return topk_weights, topk_ids.astype(jnp.int32)


# ----------------------------------------------------------------------------------------------------------------
# DeepSeek-V3 grouped sigmoid top-k
# ----------------------------------------------------------------------------------------------------------------


def topk_grouped_sigmoid(logits: jax.Array, top_k: int, *, bias: Optional[jax.Array] = None, n_group: int = 1,
                         topk_group: int = 1, renormalize: bool = True,
                         routed_scaling_factor: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """DeepSeek-V3 router: sigmoid scores, bias-corrected group-limited top-k (`MoEGate`, `noaux_tc`).

  Steps, all in float32:

  1. `scores = sigmoid(logits)`; `choice = scores + bias` (bias `None` is a zero bias).
  2. The experts are split into `n_group` contiguous groups of `num_experts // n_group`. A group's score is the
     sum of its two largest `choice` values (its one value when groups have a single expert).
  3. The `topk_group` best groups are kept (ties toward the lower group id); the other groups' experts are
     excluded (their `choice` is set to -inf, so a negative `choice` in a kept group still beats them).
  4. The `top_k` experts with the largest `choice` among the kept groups are chosen (ties toward the lower id).
  5. Weights are the chosen experts' original `scores`, without the bias; when `renormalize` they are divided
     by their sum (plus 1e-20, as the reference does), then multiplied by `routed_scaling_factor`.

  The bias steers selection only (auxiliary-loss-free load balancing); it never enters the weights. Unlike
  DeepSeek-V2's `group_limited_greedy` (and vLLM's `grouped_topk` without a bias), which score a group by its
  maximum, a group is always scored by its top-2 sum here, with or without a bias, as `noaux_tc` does.
  `renormalize` applies for every `top_k`, including 1 (as in vLLM's `grouped_topk`).

  Args:
    logits: `[num_tokens, num_experts]` floating (any float dtype), router logits.
    top_k: experts per token, `1 <= top_k <= topk_group * (num_experts // n_group)`.
    bias: `[num_experts]` floating, the score correction bias (`e_score_correction_bias`), or None.
    n_group: number of expert groups; must divide `num_experts`. 1 disables grouping.
    topk_group: groups kept per token, `1 <= topk_group <= n_group`.
    renormalize: make each token's weights sum to 1 before scaling (DeepSeek-V3's `norm_topk_prob`).
    routed_scaling_factor: factor applied to the weights last (2.5 in DeepSeek-V3).

  Returns:
    topk_weights: `[num_tokens, top_k] float32`, the chosen experts' sigmoid scores, renormalized and scaled.
    topk_ids: `[num_tokens, top_k] int32`, the chosen experts, in descending order of `scores + bias`.

  Raises:
    ValueError: `logits` is not 2-D; `top_k`, `n_group` or `topk_group` out of range; `bias` of the wrong shape;
      `routed_scaling_factor` not a finite positive number.
    TypeError: `logits` or `bias` not floating, or `renormalize` not a bool.
  """
  op = "topk_grouped_sigmoid"
  logits = _check_logits(op, logits)
  num_tokens, num_experts = logits.shape
  _check_top_k(op, top_k, num_experts)
  _check_grouping(op, num_experts, top_k, n_group, topk_group)
  _check_bool(op, "renormalize", renormalize)
  _check_scaling_factor(op, routed_scaling_factor)
  if bias is not None:
    bias = jnp.asarray(bias)
    if bias.shape != (num_experts,):
      raise ValueError(f"{op}: bias must have shape [num_experts] = ({num_experts},), got {bias.shape}")
    if not jnp.issubdtype(bias.dtype, jnp.floating):
      raise TypeError(f"{op}: bias must have a floating dtype, got {bias.dtype}")
  group_size = num_experts // n_group

  with jax.named_scope(op):
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores if bias is None else scores + bias.astype(jnp.float32)[None, :]

    if topk_group < n_group:
      grouped = choice.reshape(num_tokens, n_group, group_size)
      top2, _ = jax.lax.top_k(grouped, min(2, group_size), is_stable=True)
      group_scores = jnp.sum(top2, axis=-1)  # [num_tokens, n_group]
      _, kept = jax.lax.top_k(group_scores, topk_group, is_stable=True)  # [num_tokens, topk_group]
      group_mask = jnp.any(kept[:, :, None] == jnp.arange(n_group, dtype=kept.dtype), axis=1)
      expert_mask = jnp.repeat(group_mask, group_size, axis=1)  # [num_tokens, num_experts]
      choice = jnp.where(expert_mask, choice, -jnp.inf)
    # With topk_group == n_group every group is kept: grouping cannot change the choice.

    _, topk_ids = jax.lax.top_k(choice, top_k, is_stable=True)
    topk_weights = jnp.take_along_axis(scores, topk_ids, axis=-1)
    if renormalize:
      topk_weights = topk_weights / (jnp.sum(topk_weights, axis=-1, keepdims=True) + 1e-20)
    if routed_scaling_factor != 1.0:
      topk_weights = topk_weights * jnp.float32(routed_scaling_factor)
    return topk_weights, topk_ids.astype(jnp.int32)


# ----------------------------------------------------------------------------------------------------------------
# Router config
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RouterConfig:
  """How a MoE layer routes; frozen and hashable, so it can be a static argument.

  Attributes:
    kind: `"softmax"` (`topk_softmax`) or `"deepseek_v3"` (`topk_grouped_sigmoid`).
    num_experts: experts in the layer.
    top_k: experts per token.
    n_group: deepseek_v3 only: expert groups (must divide num_experts); 1 for softmax.
    topk_group: deepseek_v3 only: groups kept per token; 1 for softmax.
    renormalize: make each token's weights sum to 1 (before scaling).
    routed_scaling_factor: deepseek_v3 only: factor applied to the weights last; 1.0 for softmax.
  """

  kind: str
  num_experts: int
  top_k: int
  n_group: int = 1
  topk_group: int = 1
  renormalize: bool = True
  routed_scaling_factor: float = 1.0

  def __post_init__(self):
    op = "RouterConfig"
    if self.kind not in ROUTER_KINDS:
      raise ValueError(f"{op}: kind must be one of {', '.join(repr(k) for k in ROUTER_KINDS)}, got {self.kind!r}")
    _check_positive_int(op, "num_experts", self.num_experts)
    _check_top_k(op, self.top_k, self.num_experts)
    _check_bool(op, "renormalize", self.renormalize)
    _check_scaling_factor(op, self.routed_scaling_factor)
    if self.kind == SOFTMAX:
      if (self.n_group, self.topk_group, self.routed_scaling_factor) != (1, 1, 1.0):
        raise ValueError(f"{op}: n_group, topk_group and routed_scaling_factor must be 1, 1 and 1.0 for kind "
                         f"'softmax', got {self.n_group}, {self.topk_group} and {self.routed_scaling_factor}")
    else:
      _check_grouping(op, self.num_experts, self.top_k, self.n_group, self.topk_group)


def route(logits: jax.Array, config: RouterConfig, bias: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array]:
  """Routes tokens as `config` says.

  Args:
    logits: `[num_tokens, num_experts]` floating, router logits; `num_experts` must equal `config.num_experts`.
    config: the router.
    bias: `[num_experts]` floating correction bias, deepseek_v3 only (None for softmax).

  Returns:
    topk_weights: `[num_tokens, top_k] float32`.
    topk_ids: `[num_tokens, top_k] int32`.

  Raises:
    TypeError: `config` is not a `RouterConfig`.
    ValueError: `logits` does not have `config.num_experts` columns, or a bias is given to a softmax router;
      and whatever the router itself raises.
  """
  op = "route"
  if not isinstance(config, RouterConfig):
    raise TypeError(f"{op}: config must be a RouterConfig, got {type(config).__name__}")
  logits = _check_logits(op, logits)
  if logits.shape[1] != config.num_experts:
    raise ValueError(f"{op}: logits must have config.num_experts={config.num_experts} columns, "
                     f"got shape {logits.shape}")
  if config.kind == SOFTMAX:
    if bias is not None:
      raise ValueError(f"{op}: bias must be None for kind 'softmax', got an array of shape {jnp.shape(bias)}")
    return topk_softmax(logits, config.top_k, renormalize=config.renormalize)
  return topk_grouped_sigmoid(logits, config.top_k, bias=bias, n_group=config.n_group,
                              topk_group=config.topk_group, renormalize=config.renormalize,
                              routed_scaling_factor=config.routed_scaling_factor)


# ----------------------------------------------------------------------------------------------------------------
# Invalid ids and expert placement
# ----------------------------------------------------------------------------------------------------------------


def valid_mask(topk_ids: jax.Array, num_experts: int) -> jax.Array:
  """Which ids name a real expert.

  Args:
    topk_ids: `[num_tokens, top_k]` integer (any shape works), expert ids.
    num_experts: experts in the layer.

  Returns:
    `[num_tokens, top_k] bool`, True where `0 <= id < num_experts`.
  """
  op = "valid_mask"
  topk_ids = _check_ids(op, topk_ids)
  _check_positive_int(op, "num_experts", num_experts)
  return (topk_ids >= 0) & (topk_ids < num_experts)


def mask_invalid(topk_ids: jax.Array, topk_weights: Optional[jax.Array],
                 num_experts: int) -> tuple[jax.Array, Optional[jax.Array]]:
  """Rewrites every id outside `[0, num_experts)` to `INVALID_EXPERT` and zeroes its weight.

  Args:
    topk_ids: `[num_tokens, top_k]` integer, expert ids.
    topk_weights: `[num_tokens, top_k]` floating, their weights, or None.
    num_experts: experts in the layer.

  Returns:
    topk_ids: `[num_tokens, top_k] int32`, with `INVALID_EXPERT` wherever the id was out of range.
    topk_weights: `[num_tokens, top_k]` (dtype kept), 0 wherever the id was out of range; None if given None.

  Raises:
    TypeError: `topk_ids` is not integer.
    ValueError: `topk_weights` does not have the shape of `topk_ids`.
  """
  op = "mask_invalid"
  topk_ids = _check_ids(op, topk_ids)
  valid = valid_mask(topk_ids, num_experts)
  ids = jnp.where(valid, topk_ids, INVALID_EXPERT).astype(jnp.int32)
  if topk_weights is None:
    return ids, None
  topk_weights = jnp.asarray(topk_weights)
  if topk_weights.shape != topk_ids.shape:
    raise ValueError(f"{op}: topk_weights must have the shape of topk_ids {topk_ids.shape}, "
                     f"got {topk_weights.shape}")
  return ids, jnp.where(valid, topk_weights, jnp.zeros_like(topk_weights))


def expert_to_rank(topk_ids: jax.Array, num_experts: int, num_ranks: int) -> jax.Array:
  """The rank that holds each expert, under contiguous placement.

  Expert `e` lives on rank `e // num_local_experts`, `num_local_experts = num_experts // num_ranks`.

  Args:
    topk_ids: `[num_tokens, top_k]` integer (any shape works), expert ids.
    num_experts: experts in the layer.
    num_ranks: ranks the experts are spread over; must divide `num_experts`.

  Returns:
    `[num_tokens, top_k] int32` ranks in `[0, num_ranks)`, or `INVALID_EXPERT` where the id is outside
    `[0, num_experts)`.

  Raises:
    TypeError: `topk_ids` is not integer.
    ValueError: `num_ranks` does not divide `num_experts`.
  """
  op = "expert_to_rank"
  topk_ids = _check_ids(op, topk_ids)
  local = num_local_experts(num_experts, num_ranks, op=op)
  ids = topk_ids.astype(jnp.int32)
  return jnp.where(valid_mask(ids, num_experts), ids // local, INVALID_EXPERT).astype(jnp.int32)


def local_expert_ids(topk_ids: jax.Array, rank: Union[int, jax.Array], num_experts: int,
                     num_ranks: int) -> jax.Array:
  """Each id's index among the experts of `rank`, or `INVALID_EXPERT` when it lives elsewhere.

  Args:
    topk_ids: `[num_tokens, top_k]` integer (any shape works), global expert ids.
    rank: this rank, a Python int in `[0, num_ranks)` or a traced integer scalar (e.g.
      `jax.lax.axis_index(axis)` inside `shard_map`).
    num_experts: experts in the layer.
    num_ranks: ranks the experts are spread over; must divide `num_experts`.

  Returns:
    `[num_tokens, top_k] int32` local expert ids in `[0, num_local_experts)` for experts held by `rank`;
    `INVALID_EXPERT` for experts on other ranks and for ids outside `[0, num_experts)`.

  Raises:
    TypeError: `topk_ids` is not integer, or a traced `rank` is not an integer scalar.
    ValueError: `num_ranks` does not divide `num_experts`, or a static `rank` is out of range.
  """
  op = "local_expert_ids"
  topk_ids = _check_ids(op, topk_ids)
  local = num_local_experts(num_experts, num_ranks, op=op)
  if isinstance(rank, bool):
    raise TypeError(f"{op}: rank must be an int or an integer scalar array, got {rank!r}")
  if _is_int(rank):
    if not 0 <= rank < num_ranks:
      raise ValueError(f"{op}: rank must be in [0, num_ranks={num_ranks}), got {rank}")
  else:
    rank = jnp.asarray(rank)
    if rank.shape != () or not jnp.issubdtype(rank.dtype, jnp.integer):
      raise TypeError(f"{op}: rank must be an int or an integer scalar array, got {rank.dtype}{list(rank.shape)}")
    rank = rank.astype(jnp.int32)
  ids = topk_ids.astype(jnp.int32)
  mine = valid_mask(ids, num_experts) & (ids // local == rank)
  return jnp.where(mine, ids - rank * local, INVALID_EXPERT).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------------------------
# Load statistics and the auxiliary load-balance loss
# ----------------------------------------------------------------------------------------------------------------


def _local_counts(topk_ids: jax.Array, num_experts: int) -> jax.Array:
  ids = topk_ids.reshape(-1).astype(jnp.int32)
  # Out-of-range ids go to an extra bin that is cut off; -1 must not wrap around to the last expert.
  ids = jnp.where((ids >= 0) & (ids < num_experts), ids, num_experts)
  return jnp.zeros((num_experts + 1,), jnp.int32).at[ids].add(1)[:num_experts]


def expert_load(topk_ids: jax.Array, num_experts: int, *, axis_name: Optional[AxisName] = None) -> jax.Array:
  """Number of (token, k) assignments to each expert.

  Inside `shard_map`, with tokens sharded, the counts are those of this shard's tokens; the global load is
  their `psum` over the token axes, which passing `axis_name` does for you.

  Args:
    topk_ids: `[num_tokens, top_k]` integer (any shape works), expert ids; ids outside `[0, num_experts)`
      (e.g. `INVALID_EXPERT`) are not counted.
    num_experts: experts in the layer.
    axis_name: mesh axis name(s) the tokens are sharded over, to psum the counts over; None for no psum.

  Returns:
    `[num_experts] int32`, assignments per expert.

  Raises:
    TypeError: `topk_ids` is not integer.
    ValueError: `num_experts` is not a positive int.
  """
  op = "expert_load"
  topk_ids = _check_ids(op, topk_ids)
  _check_positive_int(op, "num_experts", num_experts)
  counts = _local_counts(topk_ids, num_experts)
  if axis_name is not None:
    counts = jax.lax.psum(counts, axis_name)
  return counts


def load_balance_loss(router_probs: jax.Array, topk_ids: jax.Array, num_experts: int, *,
                      axis_name: Optional[AxisName] = None) -> jax.Array:
  """Switch/GShard auxiliary load-balance loss, `num_experts * sum_e f_e * P_e`.

  `f_e` is the fraction of the valid (token, k) assignments that go to expert `e` (ids outside
  `[0, num_experts)` are not assignments: they count in neither numerator nor denominator); `P_e` is the mean
  of `router_probs[:, e]` over all tokens. Perfectly uniform routing gives 1.0. The loss is differentiable in
  `router_probs` (the gradient flows through `P` only; `f` comes from integer ids).

  The loss is bilinear in two token means, so the global loss is not the mean of per-shard losses. Inside
  `shard_map` with tokens sharded, pass `axis_name`: the per-expert counts, the valid-assignment count, the
  probability sums and the token count are each psummed over those axes before they are combined, and every
  shard gets the global value. Without `axis_name` the value is that of the local tokens only.

  Args:
    router_probs: `[num_tokens, num_experts]` floating, the router's probabilities (softmax output, or the
      normalized sigmoid scores); computed in float32. Rows of padding tokens count toward `P`: leave them out.
    topk_ids: `[num_tokens, top_k]` integer, the chosen experts.
    num_experts: experts in the layer; the width of `router_probs`.
    axis_name: mesh axis name(s) the tokens are sharded over; None for no collective.

  Returns:
    `[] float32`, the loss (0 when there is no valid assignment).

  Raises:
    ValueError: `router_probs` is not 2-D with `num_experts` columns, or `topk_ids` is not 2-D with the same
      number of tokens.
    TypeError: `router_probs` is not floating or `topk_ids` is not integer.
  """
  op = "load_balance_loss"
  _check_positive_int(op, "num_experts", num_experts)
  router_probs = jnp.asarray(router_probs)
  if router_probs.ndim != 2 or router_probs.shape[1] != num_experts:
    raise ValueError(f"{op}: router_probs must be a 2-D [num_tokens, num_experts={num_experts}] array, "
                     f"got shape {router_probs.shape}")
  if not jnp.issubdtype(router_probs.dtype, jnp.floating):
    raise TypeError(f"{op}: router_probs must have a floating dtype, got {router_probs.dtype}")
  topk_ids = _check_ids(op, topk_ids)
  num_tokens = router_probs.shape[0]
  if topk_ids.ndim != 2 or topk_ids.shape[0] != num_tokens:
    raise ValueError(f"{op}: topk_ids must be a 2-D [num_tokens={num_tokens}, top_k] array, "
                     f"got shape {topk_ids.shape}")

  with jax.named_scope(op):
    counts = _local_counts(topk_ids, num_experts)
    num_assigned = jnp.sum(counts)
    prob_sums = jnp.sum(router_probs.astype(jnp.float32), axis=0)
    token_count = jnp.float32(num_tokens)
    if axis_name is not None:
      counts, num_assigned, prob_sums, token_count = jax.lax.psum(
          (counts, num_assigned, prob_sums, token_count), axis_name)
    f = counts.astype(jnp.float32) / jnp.maximum(num_assigned, 1).astype(jnp.float32)
    p = prob_sums / jnp.maximum(token_count, 1.0)
    return jnp.float32(num_experts) * jnp.sum(f * p)
