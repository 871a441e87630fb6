"""Tests of the multi-node cost model (jax_moe_a2a.plan): its expectation against sampled routing, its NVLink legs
against the measured runs they were fitted on, the relations between its plans, and the command line."""

import os
import subprocess
import sys

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


def test_destinations_refuse_bad_arguments():
  with pytest.raises(ValueError, match=r"destinations: num_experts must be divisible by groups \(3\), got 256"):
    plan.destinations(256, 8, 3)
  with pytest.raises(ValueError, match=r"destinations: top_k must be in \[1, num_experts=16\], got 17"):
    plan.destinations(16, 17, 2)


def test_nvlink_fit_is_the_fit_of_the_cited_runs():
  path = os.path.join(ROOT, plan.NVLINK_CALIBRATION)
  for op, (latency, gbps) in plan.NVLINK_FIT.items():
    got_latency, got_gbps = plan.fit_nvlink(path, op)
    assert abs(got_latency - latency) < 0.01 and abs(got_gbps - gbps) < 0.1, (op, got_latency, got_gbps)


def test_nvlink_legs_predict_the_measured_runs_within_20_percent_from_32_tokens():
  checks = plan.calibration_check(os.path.join(ROOT, plan.NVLINK_CALIBRATION))
  assert {op for op, *_ in checks} == {"dispatch", "combine"}
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
])
def test_plans_refuse_bad_arguments(kw, match):
  with pytest.raises(ValueError, match=match):
    plan.plans(**{"nodes": 2, "gpus_per_node": 8, **kw})


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "jax_moe_a2a", "plan", *args], capture_output=True, text=True,
                        check=False, cwd=ROOT)


def test_command_prints_the_table_and_the_calibration():
  r = _cli("--nodes", "2", "8")
  assert r.returncode == 0, r.stderr
  assert "| 8 × 8 | two-level ragged |" in r.stdout and "| 2 × 8 | flat all_to_all |" in r.stdout
  assert "dispatch  4096 tokens per rank: measured   105.9 us" in r.stdout


@pytest.mark.parametrize("args,message", [
    (("--experts", "100"), "--experts (100) must be divisible by every nodes * gpus-per-node, got [16, 32, 64, 128]"),
    (("--nic-efficiency", "2"), "must be a finite float in [0.01, 1.0], got '2'"),
    (("--nodes", "0"), "--nodes"),
])
def test_command_refuses_bad_options(args, message):
  r = _cli(*args)
  assert r.returncode == 2 and message in r.stderr, r.stderr
