"""Tests of the multi-node cost model (jax_moe_a2a.plan): its expectation against sampled routing, its NVLink legs
against the measured runs they were fitted on, the relations between its plans, and the command line."""

import math
import os
import subprocess
import sys
import time
from fractions import Fraction

import numpy as np
import pytest

from jax_moe_a2a import layout, plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("experts,top_k,groups", [(256, 8, 16), (256, 8, 4), (64, 6, 8), (32, 2, 32), (8, 8, 2)])
def test_destinations_match_sampled_routing(experts, top_k, groups):
  rng = np.random.default_rng(experts + top_k + groups)
  ids = np.argsort(rng.random((20000, experts)), axis=1)[:, :top_k]  # top_k distinct experts per token
  group = ids // (experts // groups)
  sampled = np.mean([len(set(row)) for row in group])
  assert abs(plan.destinations(experts, top_k, groups) - sampled) <= 0.01 * sampled + 0.01


@pytest.mark.parametrize("experts,top_k,groups", [(8192, 1500, 64), (4096, 3000, 2), (100000, 5000, 1000)])
def test_destinations_of_many_experts_per_token_match_the_exact_binomials(experts, top_k, groups):
  outside = experts - experts // groups
  exact = groups * (1 - float(Fraction(math.comb(outside, top_k), math.comb(experts, top_k))))
  assert top_k > plan._EXACT_TOP_K  # pylint: disable=protected-access  (the log-gamma path)
  assert plan.destinations(experts, top_k, groups) == pytest.approx(exact, rel=1e-9)


def test_destinations_of_the_largest_counts_are_quick():
  start = time.perf_counter()
  assert plan.destinations(2**30, 2**29, 8) == pytest.approx(8.0)
  assert plan.destinations(2**31 - 1, 2**31 - 1, 1) == 1.0
  assert plan.destinations(2**30, 2**20, 2**20) == pytest.approx(2**20 * (1 - math.exp(-1)), rel=1e-3)
  assert time.perf_counter() - start < 1.0


def test_destinations_refuse_bad_arguments():
  with pytest.raises(ValueError, match=r"destinations: num_experts must be divisible by groups \(3\), got 256"):
    plan.destinations(256, 8, 3)
  with pytest.raises(ValueError, match=r"destinations: top_k must be in \[1, num_experts=16\], got 17"):
    plan.destinations(16, 17, 2)


def test_the_packaged_runs_are_those_of_the_cited_file():
  assert plan.nvlink_runs(os.path.join(ROOT, plan.NVLINK_CALIBRATION)) == plan.NVLINK_RUNS


def test_nvlink_fit_is_the_fit_of_the_cited_runs():
  runs = plan.nvlink_runs(os.path.join(ROOT, plan.NVLINK_CALIBRATION))
  for op, (latency, gbps) in plan.NVLINK_FIT.items():
    for got_latency, got_gbps in (plan.fit_nvlink(op), plan.fit_nvlink(op, runs)):
      assert abs(got_latency - latency) < 0.01 and abs(got_gbps - gbps) < 0.1, (op, got_latency, got_gbps)


def test_nvlink_fit_refuses_fewer_than_two_runs():
  with pytest.raises(ValueError, match=r"fit_nvlink: runs must hold at least two combine runs of >= 32 tokens, got 1"):
    plan.fit_nvlink("combine", [("combine", 64, 1000, 10.0), ("combine", 8, 100, 9.0), ("dispatch", 64, 10, 1.0)])


def test_nvlink_legs_predict_the_measured_runs_within_20_percent_from_32_tokens():
  checks = plan.calibration_check()
  assert {op for op, *_ in checks} == {"dispatch", "combine"} and len(checks) == len(plan.NVLINK_RUNS)
  for op, tokens, measured, predicted in checks:
    if tokens >= 32:
      assert abs(predicted - measured) <= 0.2 * measured, (op, tokens, measured, predicted)


@pytest.mark.parametrize("nodes", [1, 2, 4, 8, 16])
def test_plans_relations(nodes):
  ps = {p.name: p for p in plan.plans(nodes=nodes, gpus_per_node=8)}
  row = layout.dispatch_layout(7168, "fp8_blockwise", top_k=8).bytes_per_token
  flat, ideal, two, ragged = ps["flat all_to_all"], ps["flat ideal"], ps["two-level"], ps["two-level ragged"]
  assert flat.bytes("dispatch", "nic") == pytest.approx(4096 * (nodes - 1) * 8 * row)
  assert two.bytes("dispatch", "nic") == pytest.approx(4096 * (nodes - 1) * row)
  for op in ("dispatch", "combine"):
    assert ideal.bytes(op, "nic") <= flat.bytes(op, "nic")
    assert ragged.bytes(op, "nic") <= two.bytes(op, "nic")
    assert ideal.bytes(op, "nvlink") <= flat.bytes(op, "nvlink")
  assert two.bytes("dispatch", "nic") <= flat.bytes("dispatch", "nic") / 8
  if nodes == 1:  # one node: nothing crosses a NIC, and the two-level fan-out is the ideal flat exchange
    for p in ps.values():
      assert p.bytes("dispatch", "nic") == 0 and p.bytes("combine", "nic") == 0
    assert two.bytes("dispatch", "nvlink") == pytest.approx(ideal.bytes("dispatch", "nvlink"))


@pytest.mark.parametrize("kw,match", [
    (dict(nodes=0), r"plans: nodes must be a positive int, got 0"),
    (dict(num_experts=100), r"plans: num_experts must be divisible by nodes \* gpus_per_node \(16\), got 100"),
    (dict(nic_efficiency=1.5), r"plans: nic_efficiency must be in \(0, 1\], got 1.5"),
    (dict(nic_gbps=float("nan")), r"plans: nic_gbps must be > 0.0, got nan"),
    (dict(top_k=300), r"plans: top_k must be <= num_experts \(256\), got 300"),
    (dict(hidden=100), r"plans: hidden must fit wire_format 'fp8_blockwise', got 100 \(dispatch_layout: fp8_blockwise "
                       r"needs hidden % 128 == 0, got hidden=100\)"),
    (dict(wire_format="fp4"), r"plans: wire_format must be one of bf16, fp8_blockwise, mxfp8, nvfp4, got 'fp4'"),
    (dict(mx_alignment=64), r"plans: mx_alignment must be None, or a positive multiple of 32 with wire_format "
                            r"'mxfp8', got 64 with 'fp8_blockwise'"),
    (dict(wire_format="mxfp8", mx_alignment=48), r"plans: mx_alignment must be None, or a positive multiple of 32"),
])
def test_plans_refuse_bad_arguments(kw, match):
  with pytest.raises(ValueError, match=match):
    plan.plans(**{"nodes": 2, "gpus_per_node": 8, **kw})


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "jax_moe_a2a", "plan", *args], capture_output=True, text=True,
                        check=False, cwd=ROOT, timeout=60)


def test_wire_format_table_has_every_format_that_fits_with_its_plans_bytes_and_times():
  table = plan.wire_format_table([2, 4], 8, hidden=7168, tokens=1024)
  rows = [line.split(" | ") for line in table.splitlines()[2:]]
  assert [(r[0], r[1]) for r in rows] == [(f"| {n} × 8", f) for n in (2, 4) for f in layout.FORMATS]
  for r in rows:
    nodes, fmt = int(r[0][2:].split(" ")[0]), r[1]
    row = layout.dispatch_layout(7168, fmt, top_k=8).bytes_per_token
    assert int(r[2]) == row
    ps = plan.plans(nodes=nodes, gpus_per_node=8, tokens=1024, wire_format=fmt)
    cells = [c.strip(" |").split(", ") for c in r[3:]]
    assert [(float(b), float(us)) for b, us in cells] == [
        (round(p.bytes("dispatch", "nic") / 1024), round(p.dispatch_us)) for p in ps]
    assert float(cells[2][0]) == (nodes - 1) * row  # two-level: a token crosses to each other node once
  # NVFP4 carries the fewest bytes, bf16 the most; a hidden that only some formats fit lists those.
  by_fmt = {r[1]: int(r[2]) for r in rows}
  assert by_fmt["nvfp4"] < by_fmt["mxfp8"] == by_fmt["fp8_blockwise"] < by_fmt["bf16"]
  assert [line.split(" | ")[1] for line in plan.wire_format_table([2], 8, hidden=48).splitlines()[2:]] == \
      ["bf16", "nvfp4"]


def test_command_prints_the_table_and_the_calibration():
  r = _cli("--nodes", "2", "8")
  assert r.returncode == 0, r.stderr
  assert "| 8 × 8 | two-level ragged |" in r.stdout and "| 2 × 8 | flat all_to_all |" in r.stdout
  for fmt in layout.FORMATS:
    assert f"| 8 × 8 | {fmt} | {layout.dispatch_layout(7168, fmt, top_k=8).bytes_per_token} |" in r.stdout
  assert "dispatch  4096 tokens per rank: measured   105.9 us" in r.stdout


@pytest.mark.parametrize("args,message", [
    (("--experts", "100"), "argument --experts: must be divisible by --gpus-per-node times every --nodes value "
                           "(16, 32, 64, 128 here), got 100"),
    (("--nodes", "2", "3", "--experts", "32"), "argument --experts: must be divisible by --gpus-per-node times every "
                                               "--nodes value (24 here), got 32"),
    (("--nic-efficiency", "2"), "argument --nic-efficiency: must be a finite float in [0.01, 1.0], got '2'"),
    (("--nodes", "0"), "argument --nodes: must be an int in [1, 9223372036854775807], got '0'"),
    (("--top-k", "300"), "argument --top-k: must be <= --experts (256), got 300"),
    (("--hidden", "100"), "argument --hidden: must be a multiple of 128 for --wire fp8_blockwise, got 100"),
    (("--nodes", "1", "--hidden", "100", "--wire", "bf16", "--experts", "8", "--top-k", "9"),
     "argument --top-k: must be <= --experts (8), got 9"),
    (("--hidden", str(10**400)), "argument --hidden: must be an int in [1, 9223372036854775807]"),
    (("--experts", str(2**31)), "argument --experts: must be an int in [1, 2147483647], got '2147483648'"),
    (("--top-k", "-1"), "argument --top-k: must be an int in [1, 2147483647], got '-1'"),
    (("--tokens", "0"), "argument --tokens: must be an int in [1, 9223372036854775807], got '0'"),
    (("--gpus-per-node", "x"), "argument --gpus-per-node: must be an int in [1, 9223372036854775807], got 'x'"),
    (("--nic-gbps", "inf"), "argument --nic-gbps: must be a finite float >= 0.001, got 'inf'"),
    (("--nic-latency-us", "-1"), "argument --nic-latency-us: must be a finite float >= 0.0, got '-1'"),
    (("--wire", "fp4"), "argument --wire: invalid choice: 'fp4'"),
    (("--hidden", "200", "--wire", "nvfp4"), "argument --hidden: must be a multiple of 16 for --wire nvfp4, got 200"),
])
def test_command_refuses_bad_options(args, message):
  r = _cli(*args)
  assert r.returncode == 2 and "python -m jax_moe_a2a plan: error: " + message in r.stderr, r.stderr
  assert "Traceback" not in r.stderr, r.stderr


def test_command_takes_the_largest_sizes_quickly():
  r = _cli("--nodes", "1", "--gpus-per-node", "1", "--experts", str(2**31 - 1), "--top-k", str(2**31 - 2),
           "--hidden", str(2**63 - 128), "--tokens", str(2**63 - 1))
  assert r.returncode == 0, r.stderr
  assert "| 1 × 1 | flat all_to_all |" in r.stdout
