"""Tests for jax_moe_a2a.layout: per-token wire payloads and the one-sided workspace regions.

Every expected number below is computed by hand (docs/DESIGN.md §1.1 table, §3), never by re-running the module's
formula.
"""

import re

import pytest

from jax_moe_a2a import layout
from jax_moe_a2a.layout import REGION_ALIGNMENT, dispatch_layout, pieces, workspace_layout

SUPPORTED = ("bf16", "fp8_blockwise", "mxfp8", "nvfp4")
PER_BUFFER = ("recv_x", "recv_x_sf", "recv_topk_ids", "recv_topk_weights", "recv_counts", "combine", "recv_ready",
              "combine_ready", "recv_ll")

# ----------------------------------------------------------------------------------------------------------------
# Constants and helpers
# ----------------------------------------------------------------------------------------------------------------


def test_constants():
  assert REGION_ALIGNMENT == 128
  assert layout.FORMATS == SUPPORTED
  assert (layout.BF16, layout.FP8_BLOCKWISE, layout.MXFP8, layout.NVFP4) == SUPPORTED
  assert layout.TOPK_ID_BYTES == 4
  assert layout.TOPK_WEIGHT_BYTES == 4


@pytest.mark.parametrize("x, multiple, expected", [
    (0, 128, 0), (1, 128, 128), (127, 128, 128), (128, 128, 128), (129, 128, 256), (7000, 128, 7040),
    (7000, 32, 7008), (7000, 256, 7168), (1584, 128, 1664),
])
def test_round_up(x, multiple, expected):
  assert layout.round_up(x, multiple) == expected


def test_format_spec():
  assert layout.format_spec("fp8_blockwise").block == 128
  assert layout.format_spec("fp8_blockwise").scale_bytes == 4
  assert layout.format_spec("nvfp4").block == 16
  assert (layout.format_spec("nvfp4").value_bytes_num, layout.format_spec("nvfp4").value_bytes_den) == (1, 2)
  assert layout.format_spec("bf16").block == 0
  with pytest.raises(ValueError, match=re.escape("fmt must be one of bf16, fp8_blockwise, mxfp8, nvfp4, got 'x'")):
    layout.format_spec("x")


def test_region_end():
  assert layout.Region("a", 256, 10).end == 266
  assert layout.Region("b", 0, 0).end == 0


# ----------------------------------------------------------------------------------------------------------------
# dispatch_layout: hand-computed payloads
# ----------------------------------------------------------------------------------------------------------------

# (fmt, hidden, top_k, mx_alignment, scale_cols, x bytes, scale bytes, ids bytes, weights bytes, total)
DISPATCH_CASES = [
    # DeepSeek-V3, H = 7168, top-8.
    ("fp8_blockwise", 7168, 8, None, 56, 7168, 224, 32, 32, 7456),
    ("bf16", 7168, 8, None, 0, 14336, 0, 32, 32, 14400),
    ("nvfp4", 7168, 8, None, 448, 3584, 448, 32, 32, 4096),
    ("mxfp8", 7168, 8, None, 224, 7168, 224, 32, 32, 7456),
    # mxfp8 with padding: pad(7000, 128) = 7040, 7040 / 32 = 220 scales of 1 byte.
    ("mxfp8", 7000, 8, 128, 220, 7000, 220, 32, 32, 7284),
    # pad(7000, 32) = 7008 -> 219; pad(7000, 256) = 7168 -> 224.
    ("mxfp8", 7000, 1, 32, 219, 7000, 219, 4, 4, 7227),
    ("mxfp8", 7000, 1, 256, 224, 7000, 224, 4, 4, 7232),
    # An already aligned hidden is not padded further.
    ("mxfp8", 7168, 2, 128, 224, 7168, 224, 8, 8, 7408),
    # Small shapes.
    ("fp8_blockwise", 256, 2, None, 2, 256, 8, 8, 8, 280),
    ("fp8_blockwise", 128, 1, None, 1, 128, 4, 4, 4, 140),
    ("bf16", 256, 2, None, 0, 512, 0, 8, 8, 528),
    ("bf16", 7, 3, None, 0, 14, 0, 12, 12, 38),  # bf16 has no divisibility rule
    ("nvfp4", 256, 2, None, 16, 128, 16, 8, 8, 160),
    ("nvfp4", 16, 1, None, 1, 8, 1, 4, 4, 17),
    ("mxfp8", 256, 2, None, 8, 256, 8, 8, 8, 280),
    ("mxfp8", 32, 1, None, 1, 32, 1, 4, 4, 41),
]


@pytest.mark.parametrize("fmt, hidden, top_k, align, cols, x, sf, ids, w, total", DISPATCH_CASES)
def test_dispatch_layout_hand_computed(fmt, hidden, top_k, align, cols, x, sf, ids, w, total):
  d = dispatch_layout(hidden, fmt, top_k=top_k, mx_alignment=align)
  assert d.fmt == fmt
  assert d.hidden == hidden
  assert d.top_k == top_k
  assert d.mx_alignment == align
  assert d.scale_cols == cols
  assert d.x_bytes_per_token == x
  assert d.x_sf_bytes_per_token == sf
  assert d.topk_ids_bytes_per_token == ids
  assert d.topk_weights_bytes_per_token == w
  assert d.bytes_per_token == total


def test_deepseek_v3_fp8_blockwise():
  d = dispatch_layout(7168, "fp8_blockwise", top_k=8)
  assert d.x_bytes_per_token == 7168
  assert d.x_sf_bytes_per_token == 224  # 56 groups * 4 bytes
  assert d.scale_cols == 56


def test_dispatch_layout_default_top_k_is_one():
  d = dispatch_layout(7168, "fp8_blockwise")
  assert d.top_k == 1
  assert d.topk_ids_bytes_per_token == 4
  assert d.topk_weights_bytes_per_token == 4
  assert d.bytes_per_token == 7168 + 224 + 4 + 4


@pytest.mark.parametrize("top_k, ids_bytes", [(1, 4), (2, 8), (6, 24), (8, 32), (16, 64)])
def test_topk_bytes_are_four_per_expert(top_k, ids_bytes):
  d = dispatch_layout(512, "bf16", top_k=top_k)
  assert d.topk_ids_bytes_per_token == ids_bytes
  assert d.topk_weights_bytes_per_token == ids_bytes
  assert d.bytes_per_token == 1024 + 2 * ids_bytes


def test_dispatch_layout_is_frozen():
  d = dispatch_layout(128, "bf16")
  with pytest.raises(AttributeError):
    d.hidden = 256  # type: ignore[misc]


# ----------------------------------------------------------------------------------------------------------------
# dispatch_layout: errors
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hidden", [7000, 100, 64, 7176, 129])
def test_fp8_blockwise_rejects_hidden_not_multiple_of_128(hidden):
  msg = f"dispatch_layout: fp8_blockwise needs hidden % 128 == 0, got hidden={hidden}"
  with pytest.raises(ValueError, match=re.escape(msg)):
    dispatch_layout(hidden, "fp8_blockwise", top_k=8)


@pytest.mark.parametrize("hidden", [100, 8, 7000 + 4, 24])
def test_nvfp4_rejects_hidden_not_multiple_of_16(hidden):
  msg = f"dispatch_layout: nvfp4 needs hidden % 16 == 0, got hidden={hidden}"
  with pytest.raises(ValueError, match=re.escape(msg)):
    dispatch_layout(hidden, "nvfp4")


@pytest.mark.parametrize("hidden", [7000, 16, 48, 100])
def test_mxfp8_rejects_unaligned_hidden_without_alignment(hidden):
  msg = f"dispatch_layout: mxfp8 needs hidden % 32 == 0 or an mx_alignment, got hidden={hidden}"
  with pytest.raises(ValueError, match=re.escape(msg)):
    dispatch_layout(hidden, "mxfp8")


@pytest.mark.parametrize("align", [48, 16, 100, 0, -32, -128, True, 64.0, "128"])
def test_mxfp8_rejects_bad_alignment(align):
  msg = f"dispatch_layout: mxfp8 mx_alignment must be a positive multiple of 32, got {align!r}"
  with pytest.raises(ValueError, match=re.escape(msg)):
    dispatch_layout(7168, "mxfp8", mx_alignment=align)


@pytest.mark.parametrize("fmt", ["bf16", "fp8_blockwise", "nvfp4"])
def test_mx_alignment_only_for_mxfp8(fmt):
  msg = f"dispatch_layout: mx_alignment applies to mxfp8 only, got mx_alignment=128 with fmt='{fmt}'"
  with pytest.raises(ValueError, match=re.escape(msg)):
    dispatch_layout(7168, fmt, mx_alignment=128)


@pytest.mark.parametrize("fmt", ["fp8", "FP8_BLOCKWISE", "e4m3", "", "mxfp4", None, 8])
def test_unknown_format_lists_supported(fmt):
  with pytest.raises(ValueError, match=r"fmt must be one of bf16, fp8_blockwise, mxfp8, nvfp4, got") as e:
    dispatch_layout(7168, fmt)
  assert repr(fmt) in str(e.value)
  for name in SUPPORTED:
    assert name in str(e.value)


@pytest.mark.parametrize("hidden", [0, -128, 128.0, True, False, "128", None])
def test_bad_hidden(hidden):
  msg = f"dispatch_layout: hidden must be a positive int, got {hidden!r}"
  with pytest.raises(ValueError, match=re.escape(msg)):
    dispatch_layout(hidden, "bf16")


@pytest.mark.parametrize("top_k", [0, -1, 2.0, True, False, "8", None])
def test_bad_top_k(top_k):
  msg = f"dispatch_layout: top_k must be a positive int, got {top_k!r}"
  with pytest.raises(ValueError, match=re.escape(msg)):
    dispatch_layout(7168, "fp8_blockwise", top_k=top_k)


# ----------------------------------------------------------------------------------------------------------------
# workspace_layout: a hand-computed case
# ----------------------------------------------------------------------------------------------------------------

# num_ranks=2, capacity=3, hidden=256, top_k=2, fp8_blockwise, bf16 combine (6 slots):
#   recv_x 6*256 = 1536, recv_x_sf 6*8 = 48, recv_topk_ids 6*8 = 48, recv_topk_weights 48, recv_counts 2*8 = 16,
#   combine 6*256*2 = 3072, recv_ready 6*1*4 = 24 (256-byte rows: one piece), combine_ready 6*1*4 = 24;
#   recv_ll: 3 tokens (< LL_MAX_TOKENS) of (256 + 8) / 4 + 2 * 2 = 70 words, 8 bytes each: 2*3*560 = 3360;
#   flags 2*2*8 = 32; sync 2*4*8 = 64.
# Offsets: each next offset is round_up(previous end, 128):
#   0 +1536 -> 1536 +48 -> 1584 => 1664 +48 -> 1712 => 1792 +48 -> 1840 => 1920 +16 -> 1936 => 2048
#   +3072 -> 5120 +24 -> 5144 => 5248 +24 -> 5272 => 5376 +3360 -> 8736 => 8832 (buffer stride 8832) ...
#   buf1.recv_ll 14208 +3360 -> 17568 => 17664; flags 17664 +32 => 17792; sync 17792 +64 -> 17856 => 17920 = total.
FP8_CASE = dict(num_ranks=2, capacity=3, hidden=256, top_k=2, fmt="fp8_blockwise")
FP8_CASE_REGIONS = [
    ("buf0.recv_x", 0, 1536),
    ("buf0.recv_x_sf", 1536, 48),
    ("buf0.recv_topk_ids", 1664, 48),
    ("buf0.recv_topk_weights", 1792, 48),
    ("buf0.recv_counts", 1920, 16),
    ("buf0.combine", 2048, 3072),
    ("buf0.recv_ready", 5120, 24),
    ("buf0.combine_ready", 5248, 24),
    ("buf0.recv_ll", 5376, 3360),
    ("buf1.recv_x", 8832, 1536),
    ("buf1.recv_x_sf", 10368, 48),
    ("buf1.recv_topk_ids", 10496, 48),
    ("buf1.recv_topk_weights", 10624, 48),
    ("buf1.recv_counts", 10752, 16),
    ("buf1.combine", 10880, 3072),
    ("buf1.recv_ready", 13952, 24),
    ("buf1.combine_ready", 14080, 24),
    ("buf1.recv_ll", 14208, 3360),
    ("flags", 17664, 32),
    ("sync", 17792, 64),
    ("scan", 17920, 4096),
]


def test_workspace_hand_computed_fp8():
  ws = workspace_layout(**FP8_CASE)
  assert [(r.name, r.offset, r.size) for r in ws.regions] == FP8_CASE_REGIONS
  assert ws.total_bytes == 22016
  assert ws.ll_tokens == 3 and ws.ll_row_bytes == 560
  assert ws.num_ranks == 2
  assert ws.capacity == 3
  assert ws.num_buffers == 2
  assert ws.combine_bytes_per_token == 512
  assert ws.dispatch.fmt == "fp8_blockwise"
  assert ws.dispatch.x_bytes_per_token == 256
  assert ws.dispatch.x_sf_bytes_per_token == 8
  assert ws.dispatch.top_k == 2


def test_workspace_offsets_dict():
  ws = workspace_layout(**FP8_CASE)
  offsets = ws.offsets()
  assert offsets == {name: off for name, off, _ in FP8_CASE_REGIONS}
  assert list(offsets) == [name for name, _, _ in FP8_CASE_REGIONS]


def test_workspace_region_lookup():
  ws = workspace_layout(**FP8_CASE)
  r = ws.region("buf0.combine")
  assert (r.name, r.offset, r.size, r.end) == ("buf0.combine", 2048, 3072, 5120)
  r = ws.region("sync")
  assert (r.offset, r.size, r.end) == (17792, 64, 17856)
  assert ws.region("flags").offset == 17664
  assert ws.region("buf1.recv_counts").size == 16


@pytest.mark.parametrize("name", ["recv_x", "buf2.recv_x", "buf0.recv_y", "", "FLAGS"])
def test_workspace_region_unknown_raises_key_error(name):
  ws = workspace_layout(**FP8_CASE)
  with pytest.raises(KeyError, match=re.escape(f"workspace_layout: no region {name!r}; regions are [")) as e:
    ws.region(name)
  for known, _, _ in FP8_CASE_REGIONS:
    assert f"'{known}'" in str(e.value)


def test_workspace_buf1_mirrors_buf0_at_constant_stride():
  ws = workspace_layout(**FP8_CASE)
  for name in PER_BUFFER:
    r0, r1 = ws.region(f"buf0.{name}"), ws.region(f"buf1.{name}")
    assert r1.size == r0.size
    assert r1.offset - r0.offset == 8832


def test_workspace_three_buffers_constant_stride():
  ws = workspace_layout(**FP8_CASE, num_buffers=3)
  for name in PER_BUFFER:
    assert [ws.region(f"buf{b}.{name}").offset - ws.region(f"buf0.{name}").offset for b in range(3)] == [0, 8832, 17664]
  assert ws.region("flags").offset == 26496
  assert ws.region("sync").offset == 26624
  assert ws.region("scan").offset == 26752
  assert ws.total_bytes == 30848


def test_workspace_single_buffer():
  # buf0 as above; flags at 8832 (+32 -> 8864 => 8960); sync at 8960 (+64 -> 9024 => 9088); scan 9088 +4096.
  ws = workspace_layout(**FP8_CASE, num_buffers=1)
  assert [(r.name, r.offset, r.size) for r in ws.regions] == FP8_CASE_REGIONS[:9] + [
      ("flags", 8832, 32), ("sync", 8960, 64), ("scan", 9088, 4096)]
  assert ws.total_bytes == 13184
  assert ws.num_buffers == 1
  assert not any(r.name.startswith("buf1.") for r in ws.regions)
  with pytest.raises(KeyError, match="no region 'buf1.recv_x'"):
    ws.region("buf1.recv_x")


def test_workspace_combine_dtype_bytes_4_doubles_combine():
  ws2 = workspace_layout(**FP8_CASE, combine_dtype_bytes=2)
  ws4 = workspace_layout(**FP8_CASE, combine_dtype_bytes=4)
  assert ws2.region("buf0.combine").size == 3072
  assert ws4.region("buf0.combine").size == 6144
  assert ws4.region("buf1.combine").size == 6144
  assert ws4.combine_bytes_per_token == 1024
  # combine at 2048 now ends at 8192; the ready regions follow (1024-byte rows: still one piece), then recv_ll at
  # 8448 (+3360 -> 11808): buffer stride 11904; buf1.combine 13952; flags 23808; sync 23936 +64 => 24064; scan
  # 24064 +4096 => 28160.
  assert ws4.region("buf0.combine_ready").size == 24
  assert ws4.region("buf0.recv_ll").offset == 8448
  assert ws4.region("buf1.recv_x").offset == 11904
  assert ws4.region("buf1.combine").offset == 13952
  assert ws4.region("flags").offset == 23808
  assert ws4.region("sync").offset == 23936
  assert ws4.total_bytes == 28160
  # Nothing in front of combine moves.
  for name in PER_BUFFER[:PER_BUFFER.index("combine")]:
    assert ws4.region(f"buf0.{name}") == ws2.region(f"buf0.{name}")


def test_workspace_ready_regions_hold_a_word_per_piece():
  # 7168 FP8 bytes per row = 4 pieces of 2048; bf16 combine rows of 14336 bytes = 7 pieces; float32: 14.
  case = dict(num_ranks=2, capacity=5, hidden=7168, top_k=8, fmt="fp8_blockwise")
  assert workspace_layout(**case).region("buf0.recv_ready").size == 2 * 5 * 4 * 4
  assert workspace_layout(**case).region("buf1.combine_ready").size == 2 * 5 * 7 * 4
  assert workspace_layout(**case, combine_dtype_bytes=4).region("buf0.combine_ready").size == 2 * 5 * 14 * 4
  assert [pieces(n) for n in (0, 1, 2048, 2049, 7168)] == [1, 1, 1, 2, 4]


def test_piece_size_and_scan_blocks_are_the_ones_the_kernels_use():
  from jax_moe_a2a import _ffi  # pylint: disable=import-outside-toplevel
  if not _ffi.available():
    pytest.skip("compiled extension not built")
  assert _ffi.extension().piece_bytes == layout.PIECE_BYTES
  assert _ffi.extension().scan_blocks == layout.SCAN_BLOCKS


def test_workspace_hand_computed_bf16_zero_size_scale_region():
  # bf16: recv_x 6*512 = 3072 at 0; recv_x_sf is empty at 3072 and the next region starts there too;
  # ids 3072 +48 => 3200; weights 3200 +48 => 3328; counts 3328 +16 => 3456; combine 3456 +3072 -> 6528 (= 51*128);
  # ready regions 6528 +24 => 6656 +24 => 6784; recv_ll 2*3*(512 / 4 + 2 * 2 = 132 words * 8) = 6336 -> 13120 =>
  # 13184 (the buffer stride); flags 26368; sync 26496 +64 => 26624; scan 26624 + 256*2*8 => 30720.
  ws = workspace_layout(num_ranks=2, capacity=3, hidden=256, top_k=2, fmt="bf16")
  expected = [
      ("buf0.recv_x", 0, 3072),
      ("buf0.recv_x_sf", 3072, 0),
      ("buf0.recv_topk_ids", 3072, 48),
      ("buf0.recv_topk_weights", 3200, 48),
      ("buf0.recv_counts", 3328, 16),
      ("buf0.combine", 3456, 3072),
  ]
  assert [(r.name, r.offset, r.size) for r in ws.regions[:6]] == expected
  assert ws.region("buf0.recv_ll").offset == 6784 and ws.ll_row_bytes == 1056
  assert ws.region("buf1.recv_x").offset == 13184
  assert ws.region("flags").offset == 26368
  assert ws.region("sync").offset == 26496
  assert ws.total_bytes == 30720


def test_workspace_shared_regions_scale_with_ranks():
  # 8 ranks: flags 2*8*8 = 128; sync 2*4*8 = 64; scan 256*8*8 = 16384; recv_counts 8*8 = 64.
  ws = workspace_layout(num_ranks=8, capacity=16, hidden=7168, top_k=8, fmt="fp8_blockwise", num_buffers=1)
  assert ws.region("flags").size == 128
  assert ws.region("sync").size == 64
  assert ws.region("scan").size == 16384
  assert ws.region("buf0.recv_counts").size == 64
  # 128 slots: recv_x 128*7168 = 917504; scales 128*224 = 28672; ids/weights 128*32 = 4096; combine 128*14336.
  assert ws.region("buf0.recv_x").size == 917504
  assert ws.region("buf0.recv_x_sf").size == 28672
  assert ws.region("buf0.recv_topk_ids").size == 4096
  assert ws.region("buf0.recv_topk_weights").size == 4096
  assert ws.region("buf0.combine").size == 1835008


def test_workspace_mxfp8_alignment_passes_through():
  # 2 ranks * 4 tokens = 8 slots; pad(7000, 128) / 32 = 220 scale bytes per token.
  ws = workspace_layout(num_ranks=2, capacity=4, hidden=7000, top_k=1, fmt="mxfp8", mx_alignment=128)
  assert ws.dispatch.mx_alignment == 128
  assert ws.region("buf0.recv_x").size == 56000
  assert ws.region("buf0.recv_x_sf").size == 1760
  assert ws.region("buf0.recv_x_sf").offset == 56064  # round_up(56000, 128)


# ----------------------------------------------------------------------------------------------------------------
# workspace_layout: invariants over many shapes
# ----------------------------------------------------------------------------------------------------------------

INVARIANT_CASES = [
    dict(num_ranks=2, capacity=3, hidden=256, top_k=2, fmt="fp8_blockwise"),
    dict(num_ranks=2, capacity=3, hidden=256, top_k=2, fmt="bf16"),
    dict(num_ranks=1, capacity=1, hidden=16, top_k=1, fmt="nvfp4"),
    dict(num_ranks=3, capacity=5, hidden=7000, top_k=3, fmt="mxfp8", mx_alignment=128),
    dict(num_ranks=8, capacity=128, hidden=7168, top_k=8, fmt="nvfp4", combine_dtype_bytes=4),
    dict(num_ranks=7, capacity=9, hidden=96, top_k=5, fmt="mxfp8", num_buffers=3),
    dict(num_ranks=5, capacity=1, hidden=33, top_k=1, fmt="bf16", num_buffers=1),
]


@pytest.mark.parametrize("kw", INVARIANT_CASES)
def test_workspace_invariants(kw):
  ws = workspace_layout(**kw)
  nb = kw.get("num_buffers", 2)
  names = [r.name for r in ws.regions]
  assert names == [f"buf{b}.{n}" for b in range(nb) for n in PER_BUFFER] + ["flags", "sync", "scan"]
  assert len(set(names)) == len(names)
  offsets = [r.offset for r in ws.regions]
  assert offsets == sorted(offsets)
  assert offsets[0] == 0
  for r in ws.regions:
    assert r.offset % REGION_ALIGNMENT == 0, r
    assert r.size >= 0
  nonempty = [r for r in ws.regions if r.size > 0]
  for a, b in zip(nonempty, nonempty[1:]):
    assert a.end <= b.offset, (a, b)
  assert ws.total_bytes % REGION_ALIGNMENT == 0
  assert ws.total_bytes >= max(r.end for r in ws.regions)
  assert ws.total_bytes - ws.regions[-1].end < REGION_ALIGNMENT
  stride = ws.region("buf1.recv_x").offset if nb > 1 else None
  for b in range(1, nb):
    for n in PER_BUFFER:
      assert ws.region(f"buf{b}.{n}").offset == ws.region(f"buf0.{n}").offset + b * stride
      assert ws.region(f"buf{b}.{n}").size == ws.region(f"buf0.{n}").size


# ----------------------------------------------------------------------------------------------------------------
# workspace_layout: errors
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["num_ranks", "capacity", "hidden", "top_k", "combine_dtype_bytes", "num_buffers"])
@pytest.mark.parametrize("value", [0, -1, True, 2.0])
def test_workspace_rejects_bad_sizes(field, value):
  kw = dict(FP8_CASE)
  kw[field] = value
  msg = f"workspace_layout: {field} must be a positive int, got {value!r}"
  with pytest.raises(ValueError, match=re.escape(msg)):
    workspace_layout(**kw)


def test_workspace_propagates_format_errors():
  with pytest.raises(ValueError, match=re.escape("fp8_blockwise needs hidden % 128 == 0, got hidden=200")):
    workspace_layout(num_ranks=2, capacity=3, hidden=200, top_k=2, fmt="fp8_blockwise")
  with pytest.raises(ValueError, match="fmt must be one of bf16, fp8_blockwise, mxfp8, nvfp4"):
    workspace_layout(num_ranks=2, capacity=3, hidden=256, top_k=2, fmt="int8")
  with pytest.raises(ValueError, match="mx_alignment applies to mxfp8 only"):
    workspace_layout(num_ranks=2, capacity=3, hidden=256, top_k=2, fmt="bf16", mx_alignment=128)


def test_workspace_ll_region_holds_small_calls_in_8_byte_units():
  # DeepSeek-V3 rows: (7168 + 224) / 4 + 2 * 8 = 1864 words of x, scales, ids and weights, 8 bytes each.
  ws = workspace_layout(num_ranks=2, capacity=4096, hidden=7168, top_k=8, fmt="fp8_blockwise")
  assert ws.ll_tokens == layout.LL_MAX_TOKENS == 64
  assert ws.ll_row_bytes == 14912
  assert ws.region("buf0.recv_ll").size == ws.region("buf1.recv_ll").size == 2 * 64 * 14912
  # Fewer tokens than LL_MAX_TOKENS: all of them; an odd word count is rounded up to whole 16-byte unit pairs.
  ws = workspace_layout(num_ranks=4, capacity=5, hidden=256, top_k=3, fmt="bf16")
  assert (ws.ll_tokens, ws.ll_row_bytes) == (5, 8 * (128 + 6))
  assert ws.region("buf0.recv_ll").size == 4 * 5 * 8 * 134
  # 384 FP8 bytes (96 words), 3 scales, 1 id and 1 weight: 101 words, one more unit pads the row to 816 bytes.
  ws = workspace_layout(num_ranks=4, capacity=5, hidden=384, top_k=1, fmt="fp8_blockwise")
  assert ws.ll_row_bytes == 816
  # An x row that is not whole 16-byte vectors does not take the LL form: the region is empty.
  ws = workspace_layout(num_ranks=2, capacity=5, hidden=100, top_k=2, fmt="bf16")
  assert (ws.ll_tokens, ws.ll_row_bytes, ws.region("buf0.recv_ll").size) == (0, 0, 0)


def test_workspace_rows_with_room_for_wider_rows():
  """x_row_bytes widens the activation rows (and their ready words and LL rows), nothing else."""
  wire = workspace_layout(num_ranks=2, capacity=4096, hidden=7168, top_k=8, fmt="fp8_blockwise")
  assert wire.x_row_bytes == wire.dispatch.x_bytes_per_token == 7168
  # Room for bf16 rows (the cotangents combine's VJP dispatches): 14336 bytes, 7 pieces each; LL rows of
  # (14336 + 224) / 4 + 2 * 8 = 3656 words.
  wide = workspace_layout(num_ranks=2, capacity=4096, hidden=7168, top_k=8, fmt="fp8_blockwise", x_row_bytes=14336)
  assert wide.x_row_bytes == 14336 and wide.dispatch == wire.dispatch
  assert wide.region("buf0.recv_x").size == 2 * 4096 * 14336
  assert wide.region("buf0.recv_ready").size == 2 * 4096 * 7 * 4
  assert wide.ll_tokens == 64 and wide.ll_row_bytes == 8 * 3656
  for name in ("recv_x_sf", "recv_topk_ids", "recv_topk_weights", "recv_counts", "combine", "combine_ready"):
    assert wide.region(f"buf0.{name}").size == wire.region(f"buf0.{name}").size
  # A room that does not take the LL form leaves the wire's LL rows.
  odd = workspace_layout(num_ranks=2, capacity=3, hidden=256, top_k=2, fmt="fp8_blockwise", x_row_bytes=300)
  assert odd.ll_row_bytes == 560 and odd.region("buf0.recv_x").size == 6 * 300
  with pytest.raises(ValueError, match=re.escape("x_row_bytes must be >= the fp8_blockwise row of 256 bytes, got 255")):
    workspace_layout(num_ranks=2, capacity=3, hidden=256, top_k=2, fmt="fp8_blockwise", x_row_bytes=255)
  with pytest.raises(ValueError, match="x_row_bytes must be a positive int, got 0"):
    workspace_layout(num_ranks=2, capacity=3, hidden=256, top_k=2, fmt="fp8_blockwise", x_row_bytes=0)


def test_a_training_workspace_has_room_for_combine_s_rows():
  sizes = dict(num_ranks=2, capacity=16, hidden=256, top_k=2)
  for fmt, combine_bytes, row in (("fp8_blockwise", 2, 512), ("fp8_blockwise", 4, 1024), ("nvfp4", 2, 512),
                                  ("bf16", 2, 512), ("bf16", 4, 1024)):
    assert workspace_layout(**sizes, fmt=fmt, combine_dtype_bytes=combine_bytes, training=True).x_row_bytes == row
    assert workspace_layout(**sizes, fmt=fmt, combine_dtype_bytes=combine_bytes).x_row_bytes == \
        dispatch_layout(256, fmt, top_k=2).x_bytes_per_token
  with pytest.raises(ValueError, match=re.escape("give x_row_bytes or training, not both (got x_row_bytes=600)")):
    workspace_layout(**sizes, fmt="fp8_blockwise", x_row_bytes=600, training=True)
