"""Shared by the benchmark scripts: timing as METHOD.md asks, and result files with their provenance."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

import jax

# The command line's argparse types (a bad value is a usage error naming the option), for the scripts' parsers.
from jax_moe_a2a.demo import int_in, nonnegative_int, positive_int  # noqa: F401  pylint: disable=W0611

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def time_per_call(fn: Callable[..., Any], input_sets: Sequence[tuple], *, calls_per_run: int, warmup: int = 3,
                  runs: int = 20) -> dict[str, float]:
  """Median and spread of wall time per call of `fn`, a jitted function that makes `calls_per_run` calls.

  Each run takes the next input set in turn (fresh data, and more bytes than the L2 cache holds between two uses
  of one set), blocks until the device is done, and divides by `calls_per_run`.
  """
  for i in range(warmup):
    jax.block_until_ready(fn(*input_sets[i % len(input_sets)]))
  samples = []
  for i in range(runs):
    args = input_sets[i % len(input_sets)]
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    samples.append((time.perf_counter() - t0) / calls_per_run)
  samples.sort()
  return {"median_s": statistics.median(samples), "min_s": samples[0], "p90_s": samples[int(0.9 * (len(samples) - 1))],
          "runs": runs, "calls_per_run": calls_per_run}


def time_pipelined(fn: Callable[..., Any], input_sets: Sequence[tuple], *, calls: int = 10, warmup: int = 2,
                   runs: int = 10) -> dict[str, float]:
  """Median and spread of the time per call of `fn` in steady state: each run issues `calls` calls back to back
  (the next input set each, no wait in between, as a training or serving loop does) and blocks on the last one's
  outputs. The host's dispatch and the wait for one call's completion overlap the device work of the calls before,
  so this is the device's time per call plus the gaps the host leaves; `time_per_call` with one call per run adds
  one call's host dispatch and synchronization to each.
  """
  for i in range(warmup):
    jax.block_until_ready(fn(*input_sets[i % len(input_sets)]))
  samples = []
  for _ in range(runs):
    t0 = time.perf_counter()
    out = None
    for i in range(calls):
      out = fn(*input_sets[i % len(input_sets)])
    jax.block_until_ready(out)  # calls run in order on each device: the last one's end is the chain's end
    samples.append((time.perf_counter() - t0) / calls)
  samples.sort()
  return {"median_s": statistics.median(samples), "min_s": samples[0], "p90_s": samples[int(0.9 * (len(samples) - 1))],
          "runs": runs, "calls_per_run": calls}


class GpuClocks:
  """Samples every GPU's SM clock, power draw and clock-limit reasons with `nvidia-smi` while the block runs.

  An H200 running the layer's GEMMs reaches its power cap within about a second and lowers its SM clock (1980 MHz
  idle to 1200-1770 MHz were seen): step times are read at the clocks recorded beside them. `summary()` is empty
  where there is no `nvidia-smi` or no GPU backend.
  """

  QUERY = "clocks.sm,power.draw,clocks_throttle_reasons.active"
  POWER_CAP = 0x4  # the "SW power cap" bit of the clock-limit reasons

  def __init__(self, interval_ms: int = 50):
    self.interval_ms = interval_ms
    self.proc = None
    self.lines: list[str] = []

  def __enter__(self) -> "GpuClocks":
    if jax.default_backend() == "gpu":
      try:
        self.proc = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits", f"-lms={self.interval_ms}"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
      except OSError:
        self.proc = None
    return self

  def __exit__(self, *exc) -> None:
    if self.proc is not None:
      self.proc.terminate()
      out, _ = self.proc.communicate(timeout=10)
      self.lines = out.splitlines()

  def summary(self) -> dict[str, float]:
    """Median and lowest SM clock (MHz), median and highest power (W), and the fraction of samples at the cap."""
    clocks, power, capped = [], [], []
    for line in self.lines:
      parts = [p.strip() for p in line.split(",")]
      try:
        clocks.append(float(parts[0]))
        power.append(float(parts[1]))
        capped.append(bool(int(parts[2], 16) & self.POWER_CAP))
      except (IndexError, ValueError):
        continue
    if not clocks:
      return {}
    return {"sm_mhz_median": statistics.median(clocks), "sm_mhz_min": min(clocks),
            "power_w_median": round(statistics.median(power), 1), "power_w_max": round(max(power), 1),
            "power_capped_fraction": round(sum(capped) / len(capped), 2), "clock_samples": len(clocks)}


def git_commit() -> str:
  """HEAD of the checkout (+dirty), or $JAX_MOE_A2A_COMMIT where the copy has no git metadata."""
  if os.environ.get("JAX_MOE_A2A_COMMIT"):
    return os.environ["JAX_MOE_A2A_COMMIT"]
  try:
    out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.abspath(__file__)))
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    return out.stdout.strip() + ("+dirty" if dirty else "")
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def device_description() -> str:
  devices = jax.devices()
  return f"{len(devices)}x {devices[0].device_kind} ({jax.default_backend()}, jax {jax.__version__})"


def write_result(name: str, payload: dict[str, Any], out_dir: str | None = None) -> str:
  """Writes bench/results/<name>_<date>.json (or into out_dir) with command, commit, device and date."""
  out_dir = out_dir or RESULTS_DIR
  os.makedirs(out_dir, exist_ok=True)
  now = datetime.datetime.now(datetime.timezone.utc)
  record = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "commit": git_commit(),
            "device": device_description(), "date": now.isoformat(timespec="seconds"), **payload}
  if record["commit"].endswith("+dirty"):  # tests/test_results.py asks such a file to be labelled and listed
    record.setdefault("uncommitted", "the checkout had uncommitted changes to tracked files")
  if os.environ.get("XLA_FLAGS"):  # they change what XLA compiles (e.g. autotuning), so they are part of the command
    record["xla_flags"] = os.environ["XLA_FLAGS"]
  kernel = os.environ.get("JAX_MOE_A2A_FP8_GEMM_KERNEL")
  if kernel:  # chooses the FP8 GEMM kernels a whole process runs (grouped_gemm_kernels.cuh)
    record["fp8_gemm_kernel"] = kernel
  path = os.path.join(out_dir, f"{name}_{now.strftime('%Y%m%d-%H%M%S')}.json")
  with open(path, "w") as f:
    json.dump(record, f, indent=1)
  return path


def save_plot(result_path: str, draw: Callable[[Any, dict[str, Any]], Any]) -> str:
  """Draws a result file with `draw(plt, record)` (which returns the figure), headless, into <result>.png."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  with open(result_path) as f:
    record = json.load(f)
  fig = draw(plt, record)
  fig.tight_layout()
  out = os.path.splitext(result_path)[0] + ".png"
  fig.savefig(out, dpi=120)
  plt.close(fig)
  return out


def plot_if_possible(result_path: str, plot: Callable[[str], str]) -> None:
  """Plots a freshly written result where matplotlib is installed; otherwise says how to plot it later."""
  try:
    print("wrote", plot(result_path))
  except ImportError:
    print("no matplotlib here: plot later with --plot", result_path)


Kernels = dict[str, list[tuple[str, int, int]]]  # device -> [(kernel name, start ns, duration ns)]


def device_kernels(fn: Callable[..., Any], args: tuple, *, runs: int = 2) -> Kernels:
  """GPU kernels of the last of `runs` traced calls of `fn(*args)`, per device: [(kernel name, start ns, duration ns)].

  Read from a `jax.profiler` trace (CUPTI device timestamps), so launch and host costs are not in the durations;
  the gaps between kernels show them. Only the last call is kept, after warm-up; every call launches the same
  kernels, so the last call's are the last 1/runs of each device's events. Its first kernel that synchronizes
  devices can still wait for a peer that the host started later (tens of us were seen on two H200s): `steady_us`
  leaves the first call of a chain out. Empty where the backend records no device activity (CPU).
  """
  import glob  # pylint: disable=import-outside-toplevel
  import tempfile  # pylint: disable=import-outside-toplevel

  jax.block_until_ready(fn(*args))
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      for _ in range(runs):
        jax.block_until_ready(fn(*args))
    paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    data = jax.profiler.ProfileData.from_file(paths[0]) if paths else None
  out: Kernels = {}
  for plane in (data.planes if data else []):
    if not plane.name.startswith("/device:GPU"):
      continue
    events = []
    for line in plane.lines:
      if line.name.startswith("Stream"):
        events += [(e.name, int(e.start_ns), int(e.duration_ns)) for e in line.events]
    events.sort(key=lambda e: e[1])
    out[plane.name] = events[len(events) - len(events) // runs:]
  return out


def device_time_per_call(fn: Callable[..., Any], args: tuple, calls: int) -> tuple[float | None, float | None]:
  """Microseconds per call in one traced run of `fn(*args)` that makes `calls` calls: the GPU kernels' own
  durations (the slowest device's sum), and the span from the first kernel's start to the last one's end (the
  durations plus the gaps between kernels). Neither holds the host's dispatch of the run or the wait at its end,
  which a wall time per call (`time_per_call`) carries. (None, None) where the backend records no device activity
  (CPU)."""
  kernels = device_kernels(fn, args)
  busy = kernel_busy_us(kernels, "", calls)  # every kernel's name holds ""
  if busy is None:
    return None, None
  return busy, max(span_us(events) for events in kernels.values() if events) / calls


def span_us(events: list[tuple[str, int, int]]) -> float:
  """Microseconds from the first kernel's start to the last kernel's end (events sorted by start)."""
  return (max(s + d for _, s, d in events) - events[0][1]) / 1e3


def kernel_busy_us(kernels: Kernels, name_part: str, calls: int) -> float | None:
  """Per call: the slowest device's total duration of the kernels whose name contains `name_part` (None: none)."""
  busy = [sum(d for n, _, d in events if name_part in n) for events in kernels.values()]
  busy = [b for b in busy if b > 0]
  return max(busy) / 1e3 / calls if busy else None


def steady_us(kernels: Kernels, name_part: str, calls: int) -> tuple[float | None, float | None]:
  """Per call over calls 2..`calls` of a chain whose every call runs one kernel named like `name_part`: the slowest
  device's span from the end of the first such kernel to the end of its last kernel, and its time in those
  kernels after the first. The first call is left out because it alone can wait for a peer device that the host
  started later; (None, None) where the trace has fewer than two such kernels."""
  spans, busy = [], []
  for events in kernels.values():
    own = [(s, d) for n, s, d in events if name_part in n]
    if calls < 2 or len(own) < 2:
      continue
    spans.append((max(s + d for _, s, d in events) - (own[0][0] + own[0][1])) / 1e3 / (calls - 1))
    busy.append(sum(d for _, d in own[1:]) / 1e3 / (calls - 1))
  return (max(spans), max(busy)) if spans else (None, None)


def print_kernel_table(kernels: Kernels, calls: int) -> None:
  """Per device: span from first kernel start to last kernel end, busy time, and each kernel's mean per call."""
  for device, events in kernels.items():
    if not events:
      continue
    span = span_us(events)
    busy = sum(d for _, _, d in events) / 1e3
    print(f"  {device}: span {span / calls:.1f} us/call, kernels busy {busy / calls:.1f} us/call")
    by_name: dict[str, list[int]] = {}
    for name, _, dur in events:
      by_name.setdefault(name, []).append(dur)
    for name, durs in sorted(by_name.items(), key=lambda kv: -sum(kv[1])):
      short = name if len(name) <= 70 else name[:67] + "..."
      print(f"    {len(durs):>4} x {statistics.mean(durs) / 1e3:>8.1f} us  {short}")
