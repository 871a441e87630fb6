"""The memory of the one-sided calls: `Workspace`, the Python face of ``ffi/src/workspace.cc``.

A `Workspace` holds, for every device of an expert axis, one block laid out by `layout.workspace_layout` (receive
regions, the combine region, flags and epochs, twice), maps the peers' blocks (peer access within a process, CUDA
IPC handles across processes), and says which calls fit it (`fits_dispatch_rows`, `fits_combine_rows`,
`check_combine`). `a2a.dispatch` and `a2a.combine` take it to run as one-sided custom calls.
"""

from __future__ import annotations

import functools
import os
import socket
from typing import Any, Hashable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe_a2a import _ffi, layout


# The host a process runs on, for which devices can map each other's memory: this variable when set (e.g. to tell
# apart containers that share a host name), else the host name.
HOST_ENV = "JAX_MOE_A2A_HOST"
# The dtypes the combine custom call reads (combine_dtype) and writes (out_dtype).
COMBINE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


@functools.cache
def process_hosts() -> tuple[str, ...]:
  """The host of every process, by process index: ``$JAX_MOE_A2A_HOST`` or the host name of each, exchanged once
  through JAX's distributed key-value store (every process must call this, in the same order as its other
  exchanges: `Workspace` creation and the layer's tracing do)."""
  mine = os.environ.get(HOST_ENV) or socket.gethostname()
  if jax.process_count() == 1:
    return (mine,)
  from jax._src import distributed  # pylint: disable=import-outside-toplevel
  client = distributed.global_state.client
  if client is None:
    raise RuntimeError("jax_moe_a2a: devices of several processes need jax.distributed.initialize() first")
  client.key_value_set(f"jax_moe_a2a/host/{jax.process_index()}", mine)
  return tuple(client.blocking_key_value_get(f"jax_moe_a2a/host/{p}", 60_000) for p in range(jax.process_count()))


def _memory_domain(d: Any) -> tuple:
  """Devices of one domain can map each other's memory: GPUs of one host (peer access, CUDA IPC), CPU devices of
  one process (the process-wide meeting point)."""
  if d.platform == "gpu":
    return ("host", process_hosts()[d.process_index])
  return ("process", d.process_index)


def groups_span_domains(mesh: jax.sharding.Mesh, expert_axis: Hashable) -> bool:
  """Whether some expert group of ``mesh`` over ``expert_axis`` holds devices that cannot map each other's memory
  (GPUs of several hosts, CPU devices of several processes): such a group needs a two-level expert axis."""
  axes = expert_axis if isinstance(expert_axis, tuple) else (expert_axis,)
  groups = _expert_groups(mesh, axes)
  if len({d.process_index for d in groups.flat}) == 1:
    return False
  return any(len({_memory_domain(d) for d in g}) > 1 for g in groups)


def cpu_compiles_one_sided_backward() -> bool:
  """Whether this JAX compiles a backward pass through the one-sided calls for its CPU devices: XLA:CPU of jax
  0.11 crashes the process (a segmentation fault while compiling) on such programs over simulated devices; jax
  0.12 compiles them, and GPUs compile them with either."""
  return jax.__version_info__ >= (0, 12)


def check_one_sided_backward(op: str) -> None:
  """Refuses, at trace time, a backward pass through the one-sided calls that this JAX's XLA:CPU would crash on."""
  if jax.default_backend() == "cpu" and not cpu_compiles_one_sided_backward():
    raise RuntimeError(f"{op}: the backward pass through the one-sided calls does not compile on XLA:CPU of jax "
                       f"{jax.__version__} (it crashes the process); use jax >= 0.12, or on CPU no workspace (the "
                       f"reference exchange: the same results)")


def describe_array(a: Any) -> str:
  """An argument's shape and dtype (or type and value) for error messages."""
  if hasattr(a, "shape") and hasattr(a, "dtype"):
    return f"shape {tuple(a.shape)} dtype {a.dtype}"
  return f"{type(a).__name__} {a!r}"


class Workspace:
  """The one-sided communication memory of every device on an expert axis of a mesh.

  Create it once, outside `jit`, for the largest call it will serve; pass it to `dispatch` (and, through the
  handle, to `combine`). On GPUs each device gets one block of device memory laid out by
  `layout.workspace_layout`: receive regions of ``[num_ranks, capacity, ...]`` for every payload, the combine
  region, flags and epochs, twice (calls alternate buffers), with peer access enabled between the GPUs of an
  expert group when one process drives them; with one process per GPU (`jax.distributed`) each process allocates
  its own blocks and maps its peers' through CUDA IPC handles exchanged in JAX's distributed key-value store
  (every process must then create its workspaces in the same order). A process sets up only the groups holding
  one of its devices (with a two-level axis, its node's). Each GPU runs its calls in program order,
  so the calls of a group pair up in that order. On CPU the simulated devices of a group meet at a process-wide
  meeting point, once per call: every call carries a trace-time call-site id, so calls pair up by site (and by
  occurrence, in loops) whatever order XLA:CPU runs a device's independent ops in, and each rank reads what it
  receives straight from its peers' inputs there. Nothing is allocated, and no peer access enabled, inside a
  handler.

  Order other collectives by data. The one-sided calls of the devices of a group wait for each other; on CPU,
  XLA runs the independent ops of one device program concurrently and in any order, so a collective with no data
  path to or from a dispatch/combine (e.g. a psum of routing statistics) can end up waited for by one device
  while another waits in the dispatch: each waits for the other until XLA aborts. Give every such collective a
  data path to or from every one-sided call with `after` (``dispatch(x, ids, after(w, stats), ...)``,
  ``psum(after(g, y))``), as `moe.moe_apply` and the VJPs here do. `jax.lax.optimization_barrier` does not order
  them: XLA:CPU drops it before scheduling.

  Use as a context manager or call `close()`; closing twice is harmless, using a closed workspace raises.
  A call that times out waiting for a peer marks the workspace failed (its buffers may hold a half-finished
  exchange); `check()` and every later call on it raise, naming the rank(s) that did not arrive.

  Args:
    mesh: the mesh the MoE layer runs on (kept as ``mesh``). A call under another mesh must find there the same
      expert groups, in the same rank order (`check_mesh`, when the call is lowered): the same devices in another
      order are refused. A layer traced under the abstract mesh of ``jax.set_mesh`` (inside `jax.jit`) must have
      this mesh's axis names and sizes (`check_mesh_shape`), and takes devices from this one.
    expert_axis: the mesh axis (or tuple of axes) of `dispatch`'s `axis_name`.
    capacity: the largest per-shard token count T of a call.
    hidden: activation width.
    top_k: experts per token.
    fmt: wire format (`layout.FORMATS`), sizing the activation and scale regions.
    combine_dtype: dtype of combine's expert_out rows (bfloat16 or float32).
    timeout_s: how long a rank waits for its peers before failing, in [MIN_TIMEOUT_S, MAX_TIMEOUT_S] seconds.
    mx_alignment: see `layout.dispatch_layout`.
    training: also give each received activation row room for the rows that combine's VJP dispatches
      (``hidden`` values of combine_dtype), so that VJP takes the one-sided call whatever the wire format; with
      an FP8 wire and bf16 rows this doubles the activation receive regions. Without it gradients still work:
      combine's VJP takes the reference exchange where its rows do not fit the wire's (`fits_dispatch_rows`).

  Raises:
    TypeError: mesh is not a `jax.sharding.Mesh`.
    ValueError: any other argument of the wrong type or out of range, before anything reaches the extension; the
      message names the argument, what it accepts and the value. An expert group whose devices cannot map each
      other's memory (GPUs of several hosts, CPU devices of several processes): the message names each device's
      host or process and says to use a two-level expert axis (`a2a.dispatch_two_level`).
    RuntimeError: the extension could not create the workspace (e.g. device memory).
  """

  # Accepted ranges, from what the handlers take: the timeout travels as int64 nanoseconds, which the CPU
  # meeting adds to the steady clock and the process-group set-up turns into milliseconds (hence the bounds); slots
  # and received-row counts are int32 (send_slot, recv_counts), so capacity fits an int32; offsets and the block
  # size are int64 bytes.
  MIN_TIMEOUT_S = 1e-3
  MAX_TIMEOUT_S = 1e6
  MAX_CAPACITY = 2**31 - 1
  MAX_BYTES = 2**63 - 1

  def __init__(self, mesh: jax.sharding.Mesh, *, expert_axis: Hashable, capacity: int, hidden: int, top_k: int,
               fmt: str = layout.BF16, combine_dtype: Any = jnp.bfloat16, timeout_s: float = 10.0,
               mx_alignment: Optional[int] = None, training: bool = False):
    # Type and range checks (the extension gets only values it can hold)
    op = "Workspace"
    if not isinstance(mesh, jax.sharding.Mesh):
      raise TypeError(f"{op}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    axes = expert_axis if isinstance(expert_axis, tuple) else (expert_axis,)
    for a in axes:
      if a not in mesh.axis_names:
        raise ValueError(f"{op}: expert_axis must name axes of the mesh {tuple(mesh.axis_names)}, got {a!r}")
    if not axes or len(set(axes)) != len(axes):
      raise ValueError(f"{op}: expert_axis must be an axis name or a non-empty tuple of distinct ones, "
                       f"got {expert_axis!r}")
    capacity = Workspace._int_arg(op, "capacity", capacity, 1, Workspace.MAX_CAPACITY)
    hidden = Workspace._int_arg(op, "hidden", hidden, 1)
    top_k = Workspace._int_arg(op, "top_k", top_k, 1)
    if mx_alignment is not None:
      mx_alignment = Workspace._int_arg(op, "mx_alignment", mx_alignment, 1)
    if not isinstance(fmt, str) or fmt not in layout.FORMATS:
      raise ValueError(f"{op}: fmt must be one of {', '.join(layout.FORMATS)}, got {fmt!r}")
    if isinstance(timeout_s, (bool, np.bool_)) or not isinstance(timeout_s, (int, float, np.integer, np.floating)) \
        or not Workspace.MIN_TIMEOUT_S <= timeout_s <= Workspace.MAX_TIMEOUT_S:  # False for nan
      raise ValueError(f"{op}: timeout_s must be a number of seconds in [{Workspace.MIN_TIMEOUT_S:g}, "
                       f"{Workspace.MAX_TIMEOUT_S:g}], got {timeout_s!r}")
    try:
      combine_dtype = jnp.dtype(combine_dtype)
    except TypeError:
      combine_dtype = None
    if combine_dtype not in COMBINE_DTYPES:
      raise ValueError(f"{op}: combine_dtype must be bfloat16 or float32, got {combine_dtype!r}")
    if not isinstance(training, (bool, np.bool_)):
      raise ValueError(f"{op}: training must be a bool, got {training!r}")
    num_ranks = int(np.prod([mesh.shape[a] for a in axes]))
    try:
      self.layout = layout.workspace_layout(num_ranks=num_ranks, capacity=capacity, hidden=hidden, top_k=top_k,
                                            fmt=fmt, combine_dtype_bytes=combine_dtype.itemsize,
                                            mx_alignment=mx_alignment, training=bool(training))
    except ValueError as e:
      raise ValueError(f"{op}: {e}") from None
    if self.layout.total_bytes > Workspace.MAX_BYTES:
      raise ValueError(f"{op}: the block of one device must be at most 2**63 - 1 bytes, got "
                       f"{self.layout.total_bytes} for capacity={capacity}, hidden={hidden}, top_k={top_k}, "
                       f"{num_ranks} ranks and fmt={fmt!r}")
    self.mesh = mesh
    self.expert_axis = expert_axis
    self.training = bool(training)
    self.num_ranks = num_ranks
    self.combine_dtype = combine_dtype
    self.timeout_s = float(timeout_s)
    groups = _expert_groups(mesh, axes)
    # The device ids of each group in rank order: what a call's mesh is checked against (check_mesh).
    self.groups: tuple[tuple[int, ...], ...] = tuple(tuple(int(d.id) for d in g) for g in groups)
    platforms = {d.platform for d in groups.flat}
    if len(platforms) != 1:
      raise ValueError(f"Workspace: the mesh must hold devices of one platform, got {sorted(platforms)}")
    self.platform = platforms.pop()
    for g in groups:
      domains = [_memory_domain(d) for d in g]
      if len(set(domains)) > 1:
        where = ", ".join(f"device {d.id} on {kind} {name}" for d, (kind, name) in zip(g, domains))
        raise ValueError(
            f"Workspace: the devices of an expert group must be able to map each other's memory (GPUs of one host, "
            f"CPU devices of one process), got the group over {expert_axis!r}: {where}. Give the expert axis as two "
            f"mesh axes, (node, local) with local inside one host, and create the workspace over the local axis: "
            f"MoEConfig(expert_axis=(node, local), two_level=True) with make_workspace, or a2a.dispatch_two_level")
    me = jax.process_index()
    self._local_devices = frozenset(d for d in groups.flat if d.process_index == me)
    local = lambda d: d.process_index == me
    # The groups this process takes part in (a group of other processes only, e.g. another node's, is theirs), as
    # the device ordinals the handlers see (a GPU's local ordinal, a CPU device's id), or -1 for a device of
    # another process (its block is mapped through CUDA IPC).
    groups = groups[[any(local(d) for d in g) for g in groups]]
    ordinal = lambda d: int(d.id if self.platform == "cpu" or d.local_hardware_id is None else d.local_hardware_id)
    ordinals = [[ordinal(d) if local(d) else -1 for d in g] for g in groups]
    self._id: Optional[int] = int(_ffi.extension().workspace_create(
        self.platform, ordinals, self.layout.total_bytes, int(self.timeout_s * 1e9)))
    if not all(local(d) for d in groups.flat):
      try:
        self._open_peers_of_other_processes(groups, ordinals)
      except BaseException:
        self.close()
        raise
    _ffi.register()

  @staticmethod
  def _int_arg(op: str, name: str, v: Any, low: int, high: Optional[int] = None) -> int:
    """``v`` as a Python int (NumPy integers too, bools not) in ``[low, high]``, else ValueError."""
    if isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) and low <= v \
        and (high is None or v <= high):
      return int(v)
    expected = f">= {low}" if high is None else f"in [{low}, {high}]"
    raise ValueError(f"{op}: {name} must be an int {expected}, got {v!r}")

  # Every process creates its workspaces in the same order; the sequence number names their exchanged handles.
  _sequence = 0

  def _open_peers_of_other_processes(self, groups: np.ndarray, ordinals: list[list[int]]) -> None:
    """One process per GPU: publish this process's blocks' CUDA IPC handles in JAX's distributed key-value store,
    then map the other processes' blocks of our groups."""
    from jax._src import distributed  # pylint: disable=import-outside-toplevel
    client = distributed.global_state.client
    if client is None:
      raise RuntimeError("Workspace: devices of other processes need jax.distributed.initialize() first")
    Workspace._sequence += 1
    key = lambda d: f"jax_moe_a2a/workspace{Workspace._sequence}/device{d.id}"
    handles = _ffi.extension().workspace_ipc_handles(self._id)
    for g, group in enumerate(groups):
      for r, d in enumerate(group):
        if ordinals[g][r] >= 0:
          client.key_value_set(key(d), handles[ordinals[g][r]].hex())
    peers = {}
    for g, group in enumerate(groups):
      for r, d in enumerate(group):
        if ordinals[g][r] < 0:
          peers[(g, r)] = bytes.fromhex(client.blocking_key_value_get(key(d), int(self.timeout_s * 1000)))
    _ffi.extension().workspace_open_peers(self._id, peers)

  # Life cycle

  @property
  def id(self) -> int:
    if self._id is None:
      raise RuntimeError("Workspace: used after close(); create a new one")
    return self._id

  @property
  def closed(self) -> bool:
    return self._id is None

  def close(self) -> None:
    """Frees the memory once every computation already dispatched is done; a second call does nothing."""
    if self._id is not None:
      self._wait_for_dispatched()
      _ffi.extension().workspace_destroy(self._id)
      self._id = None

  def _wait_for_dispatched(self) -> None:
    """Blocks until the computations already dispatched to this workspace's devices are done.

    The custom calls are not effectful (see `_ffi_dispatch_forward`), so there is no effects barrier to wait on;
    instead every live array on these devices is waited for, which covers every pending computation whose
    results are still referenced. A computation whose results were all dropped may still run after this and
    then fail cleanly (its workspace is gone): nothing reads what it would have produced.
    """
    for a in jax.live_arrays():
      try:
        if not self._local_devices.isdisjoint(a.devices()):
          a.block_until_ready()
      except Exception:  # pylint: disable=broad-except  (a failed computation already raised to its caller)
        pass

  def __enter__(self) -> "Workspace":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __del__(self):
    if getattr(self, "_id", None) is not None:
      try:
        _ffi.extension().workspace_destroy(self._id)  # no barrier here: it may run inside the runtime
      except Exception:  # pylint: disable=broad-except  (interpreter shutdown)
        pass

  def check(self) -> None:
    """Waits for the dispatched computations, then raises RuntimeError if a call on this workspace failed (a peer
    did not arrive in time, or called with other arguments)."""
    ws_id = self.id
    self._wait_for_dispatched()
    failure = _ffi.extension().workspace_failure(ws_id)
    if failure:
      raise RuntimeError(f"Workspace {self.id}: {failure}")

  def __repr__(self) -> str:
    state = "closed" if self._id is None else f"id={self._id}"
    return (f"Workspace({state}, platform={self.platform}, expert_axis={self.expert_axis!r}, "
            f"num_ranks={self.num_ranks}, capacity={self.layout.capacity}, fmt={self.layout.dispatch.fmt}, "
            f"training={self.training}, {self.layout.total_bytes / 2**20:.1f} MiB per device)")

  # Trace-time checks of a call against the layout

  def check_mesh(self, op: str, mesh: Any, axis_name: Hashable) -> None:
    """Raises ValueError unless every expert group of ``mesh`` over ``axis_name`` (the devices that one `dispatch`
    exchanges between, in rank order: their index along the axis) is one of this workspace's groups, ranks included.

    The handlers take a device's rank and peers from the workspace, so a call under a mesh that orders the devices
    otherwise (reversed, transposed) would exchange with the wrong peers; where the groups agree, the order of the
    other axes does not matter.
    """
    axes = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if not isinstance(mesh, jax.sharding.Mesh):
      raise ValueError(f"{op}: the calling shard_map's mesh must be a jax.sharding.Mesh (its device order is checked "
                       f"against the workspace's), got {type(mesh).__name__}; pass mesh= to shard_map or use "
                       "jax.set_mesh")
    if any(a not in mesh.axis_names for a in axes):
      raise ValueError(f"{op}: axis_name must name axes of the mesh {tuple(mesh.axis_names)}, got {axis_name!r}")
    calling = tuple(tuple(int(d.id) for d in g) for g in _expert_groups(mesh, axes))
    if not set(calling) <= set(self.groups):
      raise ValueError(f"{op}: the mesh's expert groups over {axis_name!r} (device ids in rank order) must be groups of "
                       f"the workspace's mesh, {_groups_text(self.groups)}, got {_groups_text(calling)}")

  def check_mesh_shape(self, op: str, mesh: Any) -> None:
    """Raises ValueError unless ``mesh`` (a `jax.sharding.Mesh` or `AbstractMesh`) has the axis names and sizes of
    this workspace's mesh, in its order.

    While tracing, the mesh of ``jax.set_mesh`` is abstract: its names and sizes are all there is to match at trace
    time; the devices are matched when the calls are lowered (`check_mesh`).
    """
    shape = dict(getattr(mesh, "shape", {}))
    if tuple(shape.items()) != tuple(self.mesh.shape.items()):
      raise ValueError(f"{op}: the mesh must have the axis names and sizes of the workspace's mesh, "
                       f"{dict(self.mesh.shape)}, got {shape}")

  def _dispatch_row_problems(self, x: Any) -> list[str]:
    """What keeps ``x`` ([T, ...], an array or its shape and dtype) out of the dispatch regions: T over the
    capacity, a row over the room of a received row (layout.x_row_bytes)."""
    x_row = row_bytes(x)
    problems = []
    if x.shape[0] > self.layout.capacity:
      problems.append(f"num_tokens {x.shape[0]} > capacity {self.layout.capacity}")
    if x_row > self.layout.x_row_bytes:
      problems.append(f"x row of {x_row} bytes > {self.layout.x_row_bytes} (workspace format "
                      f"{self.layout.dispatch.fmt}, training={self.training})")
    return problems

  def check_dispatch(self, x: jax.Array, x_sf: Optional[jax.Array], top_k: int, num_ranks: int) -> None:
    d = self.layout.dispatch
    sf_row = 0 if x_sf is None else row_bytes(x_sf)
    problems = []
    if num_ranks != self.num_ranks:
      problems.append(f"num_ranks {num_ranks} (workspace: {self.num_ranks})")
    if top_k != d.top_k:
      problems.append(f"top_k {top_k} (workspace: {d.top_k})")
    problems += self._dispatch_row_problems(x)
    if sf_row > d.x_sf_bytes_per_token:
      problems.append(f"x_sf row of {sf_row} bytes > {d.x_sf_bytes_per_token} (workspace format {d.fmt})")
    if problems:
      raise ValueError(f"dispatch: the call must fit the workspace, got {'; '.join(problems)}")
    self.id  # pylint: disable=pointless-statement  (raises after close)

  def check_combine(self, expert_out: jax.Array, out_dtype: Any, num_ranks: int) -> None:
    hidden = expert_out.shape[-1]
    if jnp.dtype(expert_out.dtype) != self.combine_dtype or hidden != self.layout.dispatch.hidden:
      raise ValueError(f"combine: expert_out must be [num_ranks, num_tokens, {self.layout.dispatch.hidden}] "
                       f"{self.combine_dtype} to fit the workspace, got {describe_array(expert_out)}")
    if jnp.dtype(out_dtype) not in COMBINE_DTYPES:
      raise ValueError(f"combine: out_dtype must be bfloat16 or float32 on the custom-call path, got {out_dtype}")
    self.id  # pylint: disable=pointless-statement

  # Whether a VJP can take the one-sided calls (else it takes the reference)

  def fits_combine_rows(self, rows: Optional[jax.Array]) -> bool:
    """Whether ``rows`` ([num_ranks, T, hidden], floating) can travel as this workspace's combine rows: T within
    the capacity, its hidden (a multiple of 8), and a dtype that casts into combine_dtype exactly."""
    return (rows is not None and rows.ndim == 3 and rows.shape[0] == self.num_ranks
            and rows.shape[1] <= self.layout.capacity and rows.shape[2] == self.layout.dispatch.hidden
            and rows.shape[2] % 8 == 0 and _casts_exactly(rows.dtype, self.combine_dtype))

  def fits_dispatch_rows(self, rows: Any) -> bool:
    """Whether ``rows`` ([T, ...], an array or its shape and dtype) fit this workspace's dispatch rows
    (layout.x_row_bytes: the wire's x_bytes_per_token, or combine's rows with ``training``) and capacity."""
    return len(rows.shape) >= 1 and not self._dispatch_row_problems(rows)

  def attrs(self, op: str, *, x_row_bytes: Optional[int] = None,
            x_sf_row_bytes: Optional[int] = None) -> dict[str, np.int64]:
    """Custom-call attributes: buffer 0's region offsets, the buffer stride, flags, sync and scan words, the id.
    For a dispatch, also whether its rows (x and scale bytes per token; default: the wire format's) take the LL form
    at small sizes: ll_tokens is 0 where they cannot or where their LL rows would not fit the layout's."""
    off = self.layout.offsets()
    common = {"buffer_stride": off["buf1.recv_x"] - off["buf0.recv_x"], "capacity": self.layout.capacity,
              "num_ranks": self.num_ranks, "off_flags": off["flags"], "off_sync": off["sync"],
              "workspace": self.id}
    if op == "dispatch":
      d = self.layout.dispatch
      ll = layout.ll_row_bytes(d.x_bytes_per_token if x_row_bytes is None else x_row_bytes,
                               d.x_sf_bytes_per_token if x_sf_row_bytes is None else x_sf_row_bytes, d.top_k)
      common.update(off_x=off["buf0.recv_x"], off_x_sf=off["buf0.recv_x_sf"], off_ids=off["buf0.recv_topk_ids"],
                    off_weights=off["buf0.recv_topk_weights"], off_counts=off["buf0.recv_counts"],
                    off_ready=off["buf0.recv_ready"], off_ll=off["buf0.recv_ll"], off_scan=off["scan"],
                    ll_tokens=self.layout.ll_tokens if 0 < ll <= self.layout.ll_row_bytes else 0,
                    ll_row_bytes=self.layout.ll_row_bytes)
    else:
      common.update(off_combine=off["buf0.combine"], off_ready=off["buf0.combine_ready"])
    return {k: np.int64(v) for k, v in common.items()}


def _expert_groups(mesh: jax.sharding.Mesh, axes: tuple) -> np.ndarray:
  """``[num_groups, num_ranks]`` devices: one group per instance of the expert axes, a device's rank its index along
  them (major to minor, in the order of ``axes``), groups in the row-major order of the other axes."""
  names = list(mesh.axis_names)
  order = [names.index(a) for a in names if a not in axes] + [names.index(a) for a in axes]
  num_ranks = int(np.prod([mesh.shape[a] for a in axes]))
  return np.transpose(mesh.devices, order).reshape(-1, num_ranks)


def _groups_text(groups: tuple[tuple[int, ...], ...]) -> str:
  return "[" + ", ".join("[" + ", ".join(map(str, g)) + "]" for g in groups) + "]"


def row_bytes(a: Any) -> int:
  """Bytes of one row of ``a`` ([T, ...], an array or its shape and dtype)."""
  return int(np.prod(a.shape[1:])) * jnp.dtype(a.dtype).itemsize


def _casts_exactly(src: Any, dst: Any) -> bool:
  """Whether every value of floating dtype ``src`` is one of ``dst`` (bfloat16 in float32, float8 in bfloat16)."""
  src, dst = jnp.dtype(src), jnp.dtype(dst)
  if src == dst:
    return True
  if not (jnp.issubdtype(src, jnp.floating) and jnp.issubdtype(dst, jnp.floating)):
    return False
  s, d = jnp.finfo(src), jnp.finfo(dst)
  return s.nmant <= d.nmant and s.maxexp <= d.maxexp and s.minexp - s.nmant >= d.minexp - d.nmant
