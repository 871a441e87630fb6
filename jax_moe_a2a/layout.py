"""Byte layouts: wire formats, per-token payloads and the one-sided workspace.

This module is the single source of truth for how many bytes anything occupies. Workspace allocation, the
kernels (which receive offsets and sizes as attributes and only check them), the benchmarks and the reports
all ask this module; nothing else computes a payload or region size. It imports nothing else of ours.

Wire formats (activations as they travel from a token's rank to its experts' ranks):

=================  ==========================================  =====================  =========================
format             values                                      x bytes / token        scale bytes / token
=================  ==========================================  =====================  =========================
``bf16``           bfloat16                                    2 * hidden             0
``fp8_blockwise``  E4M3, one FP32 scale per 1x128 group        hidden                 (hidden / 128) * 4
``mxfp8``          E4M3, one E8M0 scale per 32, K padded       hidden                 pad(hidden, align) / 32
``nvfp4``          E2M1 two per byte, one E4M3 scale per 16    hidden / 2             hidden / 16
=================  ==========================================  =====================  =========================

NVFP4 also carries one FP32 global scale per tensor; it is not per token and travels as a scalar.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

INVALID_EXPERT = -1
"""The expert id meaning "no expert" (a padding slot or a dropped choice); it travels in the top-k id payload.
Every module takes it from here."""

# ----------------------------------------------------------------------------------------------------------------
# Wire formats
# ----------------------------------------------------------------------------------------------------------------

BF16 = "bf16"
FP8_BLOCKWISE = "fp8_blockwise"
MXFP8 = "mxfp8"
NVFP4 = "nvfp4"


@dataclasses.dataclass(frozen=True)
class FormatSpec:
  """What one wire format is made of.

  Attributes:
    name: the format's name, one of `FORMATS`.
    block: elements that share one scale along hidden (0: no scale).
    scale_bytes: bytes of one scale (0: no scale).
    value_bytes_num / value_bytes_den: bytes per value as the fraction num/den (bf16 2/1, E4M3 1/1, E2M1 1/2).
    description: one line for reports and error messages.
  """

  name: str
  block: int
  scale_bytes: int
  value_bytes_num: int
  value_bytes_den: int
  description: str


FORMAT_SPECS: dict[str, FormatSpec] = {
    BF16: FormatSpec(BF16, 0, 0, 2, 1, "bfloat16, no scale"),
    FP8_BLOCKWISE: FormatSpec(FP8_BLOCKWISE, 128, 4, 1, 1, "E4M3 + FP32 scale per 1x128 group"),
    MXFP8: FormatSpec(MXFP8, 32, 1, 1, 1, "E4M3 + E8M0 scale per 32 (hidden padded to mx_alignment)"),
    NVFP4: FormatSpec(NVFP4, 16, 1, 1, 2, "E2M1 two per byte + E4M3 scale per 16 + FP32 global scale"),
}
FORMATS: tuple[str, ...] = tuple(FORMAT_SPECS)

# Top-k expert ids (int32) and weights (float32) travel beside the activation.
TOPK_ID_BYTES = 4
TOPK_WEIGHT_BYTES = 4


def format_spec(fmt: str) -> FormatSpec:
  """Returns the `FormatSpec` of `fmt`, or raises ValueError listing the supported formats."""
  spec = FORMAT_SPECS.get(fmt) if isinstance(fmt, str) else None
  if spec is None:
    raise ValueError(f"layout: fmt must be one of {', '.join(FORMATS)}, got {fmt!r}")
  return spec


def _check_positive(op: str, **values: int) -> None:
  for name, v in values.items():
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
      raise ValueError(f"{op}: {name} must be a positive int, got {v!r}")


def round_up(x: int, multiple: int) -> int:
  """Smallest multiple of `multiple` that is >= x."""
  return -(-x // multiple) * multiple


# ----------------------------------------------------------------------------------------------------------------
# Per-token payload
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DispatchLayout:
  """Bytes one token occupies on the wire.

  Attributes:
    fmt: the wire format.
    hidden: the activation width.
    top_k: experts per token.
    mx_alignment: for mxfp8, hidden is padded up to this multiple before scaling (None: no padding).
    scale_cols: scales per token (padded hidden / block; 0 for bf16).
    x_bytes_per_token: bytes of the activation.
    x_sf_bytes_per_token: bytes of its scales.
    topk_ids_bytes_per_token: bytes of the int32 top-k expert ids.
    topk_weights_bytes_per_token: bytes of the float32 top-k weights.
    bytes_per_token: the sum of the four.
  """

  fmt: str
  hidden: int
  top_k: int
  mx_alignment: Optional[int]
  scale_cols: int
  x_bytes_per_token: int
  x_sf_bytes_per_token: int
  topk_ids_bytes_per_token: int
  topk_weights_bytes_per_token: int
  bytes_per_token: int


def dispatch_layout(hidden: int, fmt: str, *, top_k: int = 1,
                    mx_alignment: Optional[int] = None) -> DispatchLayout:
  """Bytes per token of activation, scales, top-k ids and top-k weights for wire format `fmt`.

  Args:
    hidden: activation width H, > 0.
    fmt: one of `FORMATS`.
    top_k: experts per token (ids and weights are 4 bytes each per expert). The default, 1, gives the bytes
      per routed expert.
    mx_alignment: mxfp8 only: pad H up to this multiple of 32 before counting scales. Without it H must be a
      multiple of 32.

  Raises:
    ValueError: unknown format, non-positive sizes, fp8_blockwise with H % 128 != 0, nvfp4 with H % 16 != 0,
      mxfp8 with H % 32 != 0 and no alignment, or an alignment that is not a positive multiple of 32.
  """
  spec = format_spec(fmt)
  _check_positive("dispatch_layout", hidden=hidden, top_k=top_k)
  if mx_alignment is not None and fmt != MXFP8:
    raise ValueError(f"dispatch_layout: mx_alignment applies to {MXFP8} only, got mx_alignment={mx_alignment} "
                     f"with fmt={fmt!r}")
  padded = hidden
  if fmt == FP8_BLOCKWISE and hidden % 128:
    raise ValueError(f"dispatch_layout: {fmt} needs hidden % 128 == 0, got hidden={hidden}")
  if fmt == NVFP4 and hidden % 16:
    raise ValueError(f"dispatch_layout: {fmt} needs hidden % 16 == 0, got hidden={hidden}")
  if fmt == MXFP8:
    if mx_alignment is None:
      if hidden % 32:
        raise ValueError(f"dispatch_layout: {fmt} needs hidden % 32 == 0 or an mx_alignment, got hidden={hidden}")
    else:
      if isinstance(mx_alignment, bool) or not isinstance(mx_alignment, int) or mx_alignment <= 0 \
          or mx_alignment % 32:
        raise ValueError(f"dispatch_layout: {fmt} mx_alignment must be a positive multiple of 32, "
                         f"got {mx_alignment!r}")
      padded = round_up(hidden, mx_alignment)
  x_bytes = hidden * spec.value_bytes_num // spec.value_bytes_den
  scale_cols = padded // spec.block if spec.block else 0
  x_sf_bytes = scale_cols * spec.scale_bytes
  ids = TOPK_ID_BYTES * top_k
  weights = TOPK_WEIGHT_BYTES * top_k
  return DispatchLayout(fmt=fmt, hidden=hidden, top_k=top_k, mx_alignment=mx_alignment, scale_cols=scale_cols,
                        x_bytes_per_token=x_bytes, x_sf_bytes_per_token=x_sf_bytes,
                        topk_ids_bytes_per_token=ids, topk_weights_bytes_per_token=weights,
                        bytes_per_token=x_bytes + x_sf_bytes + ids + weights)


# ----------------------------------------------------------------------------------------------------------------
# One-sided workspace
# ----------------------------------------------------------------------------------------------------------------

# Every region starts on this boundary (bytes): 16-byte vector stores and TMA both need less; 128 keeps each
# region on its own cache lines.
REGION_ALIGNMENT = 128
# Flags, epochs and arrival counters are 8-byte words; each op has SYNC_WORDS of them in the sync region.
FLAG_BYTES = 8
SYNC_WORDS = 4
# A dispatch count word per source: the count and the epoch of the call that wrote it (see `WorkspaceLayout`).
COUNT_BYTES = 8
# Rows cross NVLink in pieces of PIECE_BYTES; each piece of a receive slot has a READY_BYTES ready word (the GPU
# kernels' kPieceBytes and Pieces() state the same; tests/test_layout.py checks the two against each other).
PIECE_BYTES = 2048
READY_BYTES = 4
# A dispatch call has at most SCAN_BLOCKS sender blocks on a GPU; large calls number their slots with a scan over the
# blocks' counts, a COUNT_BYTES word per (block, rank) in the scan region (the GPU kernels' kScanBlocks states the
# same; tests/test_layout.py checks the two against each other).
SCAN_BLOCKS = 256


# Dispatch calls of at most LL_MAX_TOKENS tokens per rank send a peer its rows in LL form: every 4 bytes of the row
# (x, then scales, ids and weights) in an 8-byte unit with the call's epoch, so that one 64-bit store makes a unit
# whole and the receiver needs neither a fence before it nor a ready word after it, at twice the bytes on the wire.
# It takes rows whose x part is whole 16-byte vectors and whose scale part is whole 4-byte words. Past about 64
# tokens the doubled bytes cost more than the fences save (docs/PERFORMANCE.md).
LL_MAX_TOKENS = 64
LL_UNIT_BYTES = 8


def ll_row_bytes(x_bytes: int, x_sf_bytes: int, top_k: int) -> int:
  """Bytes of a row of `x_bytes` activation and `x_sf_bytes` scale bytes in LL form (an even number of units), or 0
  where such a row does not take the LL form."""
  if x_bytes % 16 or x_sf_bytes % 4:
    return 0
  words = (x_bytes + x_sf_bytes) // 4 + 2 * top_k
  return LL_UNIT_BYTES * (words + words % 2)


def pieces(row_bytes: int) -> int:
  """Pieces of a row of `row_bytes` bytes (at least one)."""
  return max(1, -(-row_bytes // PIECE_BYTES))


@dataclasses.dataclass(frozen=True)
class Region:
  """A named byte range [offset, offset + size) of a workspace."""

  name: str
  offset: int
  size: int

  @property
  def end(self) -> int:
    return self.offset + self.size


@dataclasses.dataclass(frozen=True)
class WorkspaceLayout:
  """The per-rank workspace of the one-sided dispatch/combine, as named aligned regions.

  Regions of one buffer (``buf<b>.`` prefix, b < num_buffers; consecutive calls alternate buffers so a peer
  never overwrites what a slower rank may still be reading):

  - ``recv_x``        [num_ranks, capacity, x_row_bytes]: activations received from each source rank;
  - ``recv_x_sf``     [num_ranks, capacity, x_sf_bytes_per_token]: their scales (size 0 for bf16);
  - ``recv_topk_ids`` [num_ranks, capacity, top_k] int32;
  - ``recv_topk_weights`` [num_ranks, capacity, top_k] float32;
  - ``recv_counts``   [num_ranks] uint64: per source, the tokens received from it in the low 32 bits, under the
    epoch of the dispatch that wrote them (GPU kernels; one 64-bit store keeps the two together);
  - ``combine``       [num_ranks, capacity, hidden] combine dtype: expert outputs sent back by each rank;
  - ``recv_ready``    [num_ranks, capacity, pieces(x_row_bytes)] uint32: per piece of a received row, the
    epoch of the dispatch that filled it (written by the source after the piece);
  - ``combine_ready`` [num_ranks, capacity, pieces(combine bytes per token)] uint32: the same for combine rows.
  - ``recv_ll``       [num_ranks, ll_tokens, ll_row_bytes] uint64 units: rows received in LL form (see
    LL_MAX_TOKENS); empty where the rows do not take the LL form.

  Shared by all buffers:

  - ``flags`` [2, num_ranks] uint64: per-source epoch flags of dispatch and combine, written by the peers;
  - ``sync``  [2, 4] uint64: per op this rank's completed epoch (advanced by the kernel), the arrival counter of
    its kernel's blocks and two spare words (the dispatch's last holds the device's sticky error code);
  - ``scan``  [SCAN_BLOCKS, num_ranks] uint64: per sender block of a large dispatch, the tokens of its range bound
    for each rank, under the epoch of the call (written and read by this rank's kernel only).

  Attributes:
    num_ranks, capacity: the sizes the layout was computed for.
    dispatch: the per-token payload layout (format, hidden, top_k).
    x_row_bytes: room for one received activation row: the wire's x_bytes_per_token, or more (see
      `workspace_layout`); a call's rows may be narrower.
    combine_bytes_per_token: bytes of one combine row (hidden * bytes of the combine dtype).
    num_buffers: how many alternating copies of the per-call regions exist.
    ll_tokens: the most tokens per rank of a dispatch call that sends its rows in LL form (0: none).
    ll_row_bytes: bytes of a row in LL form, for the widest row the workspace holds (0: none).
    regions: all regions in offset order.
    total_bytes: bytes of the whole workspace (a multiple of REGION_ALIGNMENT).
  """

  num_ranks: int
  capacity: int
  dispatch: DispatchLayout
  x_row_bytes: int
  combine_bytes_per_token: int
  num_buffers: int
  ll_tokens: int
  ll_row_bytes: int
  regions: tuple[Region, ...]
  total_bytes: int

  def region(self, name: str) -> Region:
    """The region called `name` (e.g. ``"buf0.recv_x"`` or ``"flags"``)."""
    for r in self.regions:
      if r.name == name:
        return r
    raise KeyError(f"workspace_layout: no region {name!r}; regions are {[r.name for r in self.regions]}")

  def offsets(self) -> dict[str, int]:
    """Region name -> byte offset, e.g. to pass as custom-call attributes."""
    return {r.name: r.offset for r in self.regions}


def workspace_layout(*, num_ranks: int, capacity: int, hidden: int, top_k: int, fmt: str,
                     combine_dtype_bytes: int = 2, num_buffers: int = 2,
                     mx_alignment: Optional[int] = None, x_row_bytes: Optional[int] = None,
                     training: bool = False) -> WorkspaceLayout:
  """Offsets and sizes of every region of one rank's one-sided workspace, computed in one pass.

  Receive regions hold [num_ranks, capacity, ...]: a source sends each of its `capacity` tokens to a rank at
  most once, so no region can overflow (docs/DESIGN.md §3).

  Args:
    num_ranks: ranks on the expert axis.
    capacity: tokens per (source, destination) pair, i.e. the local token count of a source.
    hidden: activation width.
    top_k: experts per token.
    fmt: wire format of the dispatched activations (one of `FORMATS`).
    combine_dtype_bytes: bytes of one element of the combine payload (2 for bf16, 4 for float32).
    num_buffers: alternating copies of the per-call regions (2: double buffering).
    mx_alignment: see `dispatch_layout`.
    x_row_bytes: room for one received activation row, at least the wire format's x_bytes_per_token (the
      default). More lets the workspace carry wider rows too, e.g. the bf16 cotangent rows that combine's VJP
      dispatches next to an FP8 wire.
    training: room for the rows that combine's VJP dispatches, `hidden` combine elements, beside the wire's row:
      x_row_bytes becomes max(wire row, hidden * combine_dtype_bytes). Not with x_row_bytes.

  Raises:
    ValueError: a non-positive size, a bad format (see `dispatch_layout`), x_row_bytes below the wire's row, or
      both x_row_bytes and training.
  """
  _check_positive("workspace_layout", num_ranks=num_ranks, capacity=capacity, hidden=hidden, top_k=top_k,
                  combine_dtype_bytes=combine_dtype_bytes, num_buffers=num_buffers)
  d = dispatch_layout(hidden, fmt, top_k=top_k, mx_alignment=mx_alignment)
  if training and x_row_bytes is not None:
    raise ValueError(f"workspace_layout: give x_row_bytes or training, not both (got x_row_bytes={x_row_bytes})")
  if x_row_bytes is None:
    x_row_bytes = max(d.x_bytes_per_token, hidden * combine_dtype_bytes) if training else d.x_bytes_per_token
  _check_positive("workspace_layout", x_row_bytes=x_row_bytes)
  if x_row_bytes < d.x_bytes_per_token:
    raise ValueError(f"workspace_layout: x_row_bytes must be >= the {fmt} row of {d.x_bytes_per_token} bytes, "
                     f"got {x_row_bytes}")
  slots = num_ranks * capacity
  # LL rows sized for the widest row that takes the LL form: the room, else the wire's row.
  ll_row = ll_row_bytes(x_row_bytes, d.x_sf_bytes_per_token, top_k) or \
      ll_row_bytes(d.x_bytes_per_token, d.x_sf_bytes_per_token, top_k)
  ll_tokens = min(capacity, LL_MAX_TOKENS) if ll_row else 0
  per_buffer = (
      ("recv_x", slots * x_row_bytes),
      ("recv_x_sf", slots * d.x_sf_bytes_per_token),
      ("recv_topk_ids", slots * d.topk_ids_bytes_per_token),
      ("recv_topk_weights", slots * d.topk_weights_bytes_per_token),
      ("recv_counts", num_ranks * COUNT_BYTES),
      ("combine", slots * hidden * combine_dtype_bytes),
      ("recv_ready", slots * pieces(x_row_bytes) * READY_BYTES),
      ("combine_ready", slots * pieces(hidden * combine_dtype_bytes) * READY_BYTES),
      ("recv_ll", num_ranks * ll_tokens * ll_row),
  )
  shared = (
      ("flags", 2 * num_ranks * FLAG_BYTES),
      ("sync", 2 * SYNC_WORDS * FLAG_BYTES),
      ("scan", SCAN_BLOCKS * num_ranks * COUNT_BYTES),
  )
  named = [(f"buf{b}.{name}", size) for b in range(num_buffers) for name, size in per_buffer] + list(shared)
  regions = []
  offset = 0
  for name, size in named:  # the one pass: each offset is the previous end, aligned
    regions.append(Region(name, offset, size))
    offset = round_up(offset + size, REGION_ALIGNMENT)
  return WorkspaceLayout(num_ranks=num_ranks, capacity=capacity, dispatch=d, x_row_bytes=x_row_bytes,
                         combine_bytes_per_token=hidden * combine_dtype_bytes, num_buffers=num_buffers,
                         ll_tokens=ll_tokens, ll_row_bytes=ll_row, regions=tuple(regions), total_bytes=offset)
