"""Expert parallelism over nodes, on paper: bytes per GPU over each link and predicted dispatch/combine times.

``python -m jax_moe_a2a plan`` prints, for N nodes of G GPUs, three ways to move one layer's tokens:

- ``flat all_to_all``: one XLA ``all_to_all`` over all N*G GPUs at static lossless capacity (what an expert axis
  that spans hosts falls back to today): every GPU sends T rows to every other GPU.
- ``flat ideal``: each token sent once to each GPU that holds one of its experts, over NVLink inside the node and
  the NIC across (a ragged, per-GPU deduplicated exchange, as DeepEP's internode mode does; not built here): the
  lower bound on bytes for a one-level design.
- ``two-level``: a token crosses to each destination node at most once (static lossless ``all_to_all`` over the
  node axis, to the GPU with the same local index), then fans out one-sided over NVLink inside the node; combine
  sums inside the node first (float32 partial sums) and crosses back once.
- ``two-level ragged``: the same with a node leg that carries only the tokens a node has experts for, and bf16
  partial sums: what a ragged or capacity-bounded node exchange would reach.

The model, per GPU, T tokens, top-k distinct experts drawn uniformly from E experts laid out contiguously (each GPU
holds E/(N*G), each node E/N); rows of `layout.dispatch_layout(hidden, wire_format, top_k)` bytes on dispatch,
bf16 rows (2H) on combine's NVLink legs and float32 partial sums (4H) on two-level combine's node leg:

- A token reaches ``destinations(E, k, groups) = groups * (1 - C(E - E/groups, k) / C(E, k))`` distinct groups
  (GPUs, or nodes) in expectation (`destinations`; tests/test_plan.py checks it against sampled routing).
- A leg that moves B bytes per GPU over a link takes ``latency + B / bandwidth``. NVLink: the one-sided kernels'
  latency and per-GPU payload bandwidth fitted (least squares over 32..4096 tokens per rank) to the measured 2xH200
  runs in `NVLINK_RUNS` (dispatch and combine separately); assumed to hold for G > 2 GPUs per node, which is not
  measured. NIC: ``nic_gbps * nic_efficiency / 8`` GB/s per GPU and direction, and a fixed latency per exchange
  (assumptions, options of the command; the defaults are a 400 Gb/s NIC per GPU at 80 % and 20 us).
- One-level exchanges use both links at once (time = the slower leg); two-level runs its legs one after the other
  (dispatch: node leg, then NVLink; combine: NVLink, then node leg), with no overlap between them.

The command also prints the dispatch of every wire format (`wire_format_table`): a format changes the dispatch's
row (`layout.dispatch_layout`), not combine's (bf16 rows whatever the wire). NVFP4's global scale adds one scalar
``pmax`` over the expert axis before each dispatch (`wire.exchange_global_scale`): a collective's latency, about
one NIC latency across nodes, that the model leaves out.

Nothing here imports jax: the numbers are arithmetic on the layout's byte counts.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Optional, Sequence

from jax_moe_a2a import layout

# The measured runs the NVLink legs are calibrated on (2xH200, one process for both GPUs, fp8_blockwise wire, hidden
# 7168, top-8 of 256 experts, the tree of commit 1d418da): the one-sided rows of this result file of the repository,
# copied here so that an installed package has them (tests/test_plan.py checks the copy against the file).
NVLINK_CALIBRATION = "bench/results/a2a_2ranks_20261201-092948.json"
NVLINK_RUNS = (  # (op, tokens per rank, NVLink payload bytes per GPU, steady-state GPU us per call)
    ("dispatch", 1, 7456, 8.344777777777777),
    ("combine", 1, 14336, 7.2283333333333335),
    ("dispatch", 8, 59648, 9.333222222222222),
    ("combine", 8, 114688, 9.126888888888889),
    ("dispatch", 32, 238592, 10.727),
    ("combine", 32, 458752, 9.880666666666666),
    ("dispatch", 64, 473456, 12.526),
    ("combine", 64, 910336, 11.032777777777778),
    ("dispatch", 128, 943184, 13.425555555555555),
    ("combine", 128, 1813504, 14.051444444444446),
    ("dispatch", 512, 3798832, 23.391666666666666),
    ("combine", 512, 7304192, 35.98877777777778),
    ("dispatch", 4096, 30405568, 105.87255555555555),
    ("combine", 4096, 58462208, 181.913),
)
# Least-squares fit of steady_gpu_us = latency_us + nvlink_bytes_per_gpu / (bandwidth_gbps * 1e3) over the one-sided
# runs of 32..4096 tokens per rank (`fit_nvlink` recomputes it; tests/test_plan.py checks the two agree).
NVLINK_FIT = {"dispatch": (10.73, 319.3), "combine": (9.88, 338.8)}  # (latency_us, bandwidth GB/s)


def nvlink_runs(path: str) -> tuple[tuple[str, int, int, float], ...]:
  """The one-sided rows of a 2-GPU `bench a2a` result file, as `NVLINK_RUNS` holds them."""
  with open(path, encoding="utf-8") as f:
    return tuple((r["op"], r["tokens_per_rank"], int(r["nvlink_bytes_per_gpu"]), r["steady_gpu_us"])
                 for r in json.load(f)["rows"] if r["impl"] == "ffi")


@dataclasses.dataclass(frozen=True)
class Leg:
  """Bytes one GPU sends over one link in one exchange, and the time the model gives it."""

  link: str  # "nvlink" or "nic"
  bytes_per_gpu: float
  us: float


@dataclasses.dataclass(frozen=True)
class Plan:
  """One way to move a layer's tokens: its legs for dispatch and for combine, and their predicted times."""

  name: str
  dispatch: tuple[Leg, ...]
  combine: tuple[Leg, ...]
  dispatch_us: float
  combine_us: float

  def bytes(self, op: str, link: str) -> float:
    return sum(leg.bytes_per_gpu for leg in getattr(self, op) if leg.link == link)


_EXACT_TOP_K = 1024


def destinations(num_experts: int, top_k: int, groups: int) -> float:
  """Expected number of the `groups` equal, contiguous groups of experts that hold at least one of a token's top_k
  distinct experts drawn uniformly from num_experts."""
  if num_experts % groups:
    raise ValueError(f"destinations: num_experts must be divisible by groups ({groups}), got {num_experts}")
  if not 0 < top_k <= num_experts:
    raise ValueError(f"destinations: top_k must be in [1, num_experts={num_experts}], got {top_k}")
  outside = num_experts - num_experts // groups
  # The chance that a given group holds none of the token's experts, C(outside, k) / C(E, k): exactly up to
  # _EXACT_TOP_K, from log-gamma beyond (the exact binomials grow to k log2(E) bits and take minutes).
  if top_k > outside:
    miss = 0.0
  elif top_k <= _EXACT_TOP_K:
    miss = math.comb(outside, top_k) / math.comb(num_experts, top_k)
  else:
    miss = math.exp(math.lgamma(outside + 1) - math.lgamma(outside - top_k + 1) - math.lgamma(num_experts + 1)
                    + math.lgamma(num_experts - top_k + 1))
  return groups * (1.0 - miss)


def fit_nvlink(op: str, runs: Sequence[tuple[str, int, int, float]] = NVLINK_RUNS,
               min_tokens: int = 32) -> tuple[float, float]:
  """(latency_us, bandwidth GB/s) of `op`'s runs (as in `NVLINK_RUNS`), by least squares over those of at least
  `min_tokens` tokens per rank."""
  rows = [(b, us) for o, tokens, b, us in runs if o == op and tokens >= min_tokens]
  if len(rows) < 2:
    raise ValueError(f"fit_nvlink: runs must hold at least two {op} runs of >= {min_tokens} tokens, got {len(rows)}")
  xs = [b for b, _ in rows]
  ys = [us for _, us in rows]
  mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
  slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
  return my - slope * mx, 1.0 / (slope * 1e3)


def _leg(link: str, num_bytes: float, *, op: str, nic_gbps: float, nic_efficiency: float,
         nic_latency_us: float) -> Leg:
  if link == "nvlink":
    latency, gbps = NVLINK_FIT[op]
  else:
    latency, gbps = nic_latency_us, nic_gbps * nic_efficiency / 8.0
  return Leg(link, num_bytes, latency + num_bytes / (gbps * 1e3) if num_bytes > 0 else 0.0)


def plans(*, nodes: int, gpus_per_node: int, hidden: int = 7168, top_k: int = 8, num_experts: int = 256,
          tokens: int = 4096, wire_format: str = layout.FP8_BLOCKWISE, nic_gbps: float = 400.0,
          nic_efficiency: float = 0.8, nic_latency_us: float = 20.0,
          mx_alignment: Optional[int] = None) -> list[Plan]:
  """The three plans of the module docstring for one cluster and layer shape (per GPU, T = `tokens`)."""
  op = "plans"
  for name, v in (("nodes", nodes), ("gpus_per_node", gpus_per_node), ("hidden", hidden), ("top_k", top_k),
                  ("num_experts", num_experts), ("tokens", tokens)):
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
      raise ValueError(f"{op}: {name} must be a positive int, got {v!r}")
  ranks = nodes * gpus_per_node
  if num_experts % ranks:
    raise ValueError(f"{op}: num_experts must be divisible by nodes * gpus_per_node ({ranks}), got {num_experts}")
  for name, v, lo in (("nic_gbps", nic_gbps, 0.0), ("nic_efficiency", nic_efficiency, 0.0),
                      ("nic_latency_us", nic_latency_us, -1.0)):
    if not (isinstance(v, (int, float)) and math.isfinite(v) and v > lo) or (name == "nic_efficiency" and v > 1):
      raise ValueError(f"{op}: {name} must be {'in (0, 1]' if name == 'nic_efficiency' else '> ' + str(lo)}, "
                       f"got {v!r}")
  if top_k > num_experts:
    raise ValueError(f"{op}: top_k must be <= num_experts ({num_experts}), got {top_k}")
  if wire_format not in layout.FORMATS:
    raise ValueError(f"{op}: wire_format must be one of {', '.join(layout.FORMATS)}, got {wire_format!r}")
  if mx_alignment is not None and (wire_format != layout.MXFP8 or isinstance(mx_alignment, bool)
                                   or not isinstance(mx_alignment, int) or mx_alignment <= 0 or mx_alignment % 32):
    raise ValueError(f"{op}: mx_alignment must be None, or a positive multiple of 32 with wire_format "
                     f"{layout.MXFP8!r}, got {mx_alignment!r} with {wire_format!r}")
  try:
    row = layout.dispatch_layout(hidden, wire_format, top_k=top_k, mx_alignment=mx_alignment).bytes_per_token
  except ValueError as e:
    raise ValueError(f"{op}: hidden must fit wire_format {wire_format!r}, got {hidden} ({e})") from None
  out_row, partial_row = 2 * hidden, 4 * hidden  # bf16 expert rows; float32 partial sums per node
  t, n, g = float(tokens), nodes, gpus_per_node
  leg = lambda link, b, which: _leg(link, b, op=which, nic_gbps=nic_gbps, nic_efficiency=nic_efficiency,
                                    nic_latency_us=nic_latency_us)

  def one_level(name, nvl_rows, nic_rows):
    d = (leg("nvlink", t * nvl_rows * row, "dispatch"), leg("nic", t * nic_rows * row, "dispatch"))
    c = (leg("nvlink", t * nvl_rows * out_row, "combine"), leg("nic", t * nic_rows * out_row, "combine"))
    return Plan(name, d, c, max(x.us for x in d), max(x.us for x in c))

  # Flat, static lossless all_to_all: T rows to each of the other GPUs.
  flat_a2a = one_level("flat all_to_all", g - 1, (n - 1) * g)
  # Flat ideal: each token to each distinct GPU holding one of its experts; by symmetry a share (G - 1) / (N G) of
  # them are the node's other GPUs and (N - 1) G / (N G) are on other nodes.
  d_gpu = destinations(num_experts, top_k, ranks)
  flat_ideal = one_level("flat ideal", d_gpu * (g - 1) / ranks, d_gpu * (n - 1) * g / ranks)
  # Two-level. Node leg: T rows to the same-index GPU of each other node (static lossless capacity). NVLink leg:
  # each GPU receives T * destinations(nodes) tokens for its node (its own included) and forwards each to the
  # node's GPUs holding its experts, d_gpu / d_node of them in expectation, all but its own share (1/G): in all
  # T * d_gpu * (G - 1) / G rows.
  fan_out = t * d_gpu * (g - 1) / g
  two_d = (leg("nic", t * (n - 1) * row, "dispatch"), leg("nvlink", fan_out * row, "dispatch"))
  two_c = (leg("nvlink", fan_out * out_row, "combine"), leg("nic", t * (n - 1) * partial_row, "combine"))
  two = Plan("two-level", two_d, two_c, sum(x.us for x in two_d), sum(x.us for x in two_c))
  # Two-level with a ragged node leg (only the nodes a token has experts on) and bf16 partial sums.
  remote_nodes = destinations(num_experts, top_k, n) * (n - 1) / n
  rag_d = (leg("nic", t * remote_nodes * row, "dispatch"), leg("nvlink", fan_out * row, "dispatch"))
  rag_c = (leg("nvlink", fan_out * out_row, "combine"), leg("nic", t * remote_nodes * out_row, "combine"))
  ragged = Plan("two-level ragged", rag_d, rag_c, sum(x.us for x in rag_d), sum(x.us for x in rag_c))
  return [flat_a2a, flat_ideal, two, ragged]


def format_table(rows: Sequence[tuple[int, int, list[Plan]]]) -> str:
  """A markdown table: per cluster and plan, MB per GPU over NVLink and the NIC, and the predicted times."""
  lines = ["| nodes × GPUs | plan | dispatch NVLink / NIC MB per GPU | dispatch µs | combine NVLink / NIC MB per GPU "
           "| combine µs |", "|---|---|---|---|---|---|"]
  for nodes, gpus, ps in rows:
    for p in ps:
      lines.append(f"| {nodes} × {gpus} | {p.name} | {p.bytes('dispatch', 'nvlink') / 1e6:.1f} / "
                   f"{p.bytes('dispatch', 'nic') / 1e6:.1f} | {p.dispatch_us:.0f} | "
                   f"{p.bytes('combine', 'nvlink') / 1e6:.1f} / {p.bytes('combine', 'nic') / 1e6:.1f} | "
                   f"{p.combine_us:.0f} |")
  return "\n".join(lines)


def wire_format_table(node_counts: Sequence[int], gpus_per_node: int, **kw) -> str:
  """A markdown table over the wire formats of `layout.FORMATS` that fit `hidden`: per node count and format, the
  dispatch row's bytes per token, and per plan the dispatch's bytes per token over the NIC (a GPU's NIC bytes over
  its tokens) and predicted time. `kw` as for `plans` (but wire_format and mx_alignment)."""
  hidden, top_k = kw.get("hidden", 7168), kw.get("top_k", 8)
  fmts = []
  for fmt in layout.FORMATS:
    try:
      fmts.append((fmt, layout.dispatch_layout(hidden, fmt, top_k=top_k).bytes_per_token))
    except ValueError:
      continue  # a hidden the format cannot carry: no row
  names = [p.name for p in plans(nodes=1, gpus_per_node=gpus_per_node, wire_format=fmts[0][0], **kw)] if fmts else []
  lines = ["| nodes × GPUs | wire | B per token | " + " | ".join(f"{n}: NIC B per token, µs" for n in names) + " |",
           "|---|---|---|" + "---|" * len(names)]
  tokens = kw.get("tokens", 4096)
  for nodes in node_counts:
    for fmt, row in fmts:
      ps = plans(nodes=nodes, gpus_per_node=gpus_per_node, wire_format=fmt, **kw)
      lines.append(f"| {nodes} × {gpus_per_node} | {fmt} | {row} | " + " | ".join(
          f"{p.bytes('dispatch', 'nic') / tokens:.0f}, {p.dispatch_us:.0f}" for p in ps) + " |")
  return "\n".join(lines)


def calibration_check(runs: Sequence[tuple[str, int, int, float]] = NVLINK_RUNS
                      ) -> list[tuple[str, int, float, float]]:
  """(op, tokens per rank, measured us, predicted us) for measured runs (as in `NVLINK_RUNS`): the model's NVLink
  leg against what it was fitted on."""
  out = []
  for op, tokens, num_bytes, measured in runs:
    latency, gbps = NVLINK_FIT[op]
    out.append((op, tokens, measured, latency + num_bytes / (gbps * 1e3)))
  return out


def run(args) -> int:
  """The `plan` command: the table for each node count, then the NVLink legs against the measured 2-GPU runs."""
  table = [(n, args.gpus_per_node, plans(nodes=n, gpus_per_node=args.gpus_per_node, hidden=args.hidden,
                                         top_k=args.top_k, num_experts=args.experts, tokens=args.tokens,
                                         wire_format=args.wire, nic_gbps=args.nic_gbps,
                                         nic_efficiency=args.nic_efficiency, nic_latency_us=args.nic_latency_us))
           for n in args.nodes]
  print(f"hidden {args.hidden}, top-{args.top_k} of {args.experts} experts, {args.tokens} tokens per GPU, "
        f"{args.wire} wire; NIC {args.nic_gbps:g} Gb/s per GPU at {args.nic_efficiency:g}, "
        f"{args.nic_latency_us:g} us per exchange; NVLink legs fitted to {NVLINK_CALIBRATION}\n")
  print(format_table(table))
  print("\nDispatch on every wire format (combine's rows are bf16 whatever the wire, its times as above; nvfp4 also "
        "takes a scalar pmax of its global scale before each dispatch, not in these times):\n")
  print(wire_format_table(args.nodes, args.gpus_per_node, hidden=args.hidden, top_k=args.top_k,
                          num_experts=args.experts, tokens=args.tokens, nic_gbps=args.nic_gbps,
                          nic_efficiency=args.nic_efficiency, nic_latency_us=args.nic_latency_us))
  print(f"\nNVLink legs against the measured 2xH200 runs ({NVLINK_CALIBRATION}):")
  for op, tokens, measured, predicted in calibration_check():
    print(f"  {op:<8} {tokens:>5} tokens per rank: measured {measured:7.1f} us, model {predicted:7.1f} us "
          f"({(predicted - measured) / measured:+.0%})")
  return 0
