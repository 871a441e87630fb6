"""Reads ``.safetensors`` files as NumPy arrays mapped from the file, every dtype the format has included.

The format: an 8-byte little-endian header length N, N bytes of JSON (``name -> {"dtype", "shape",
"data_offsets": [begin, end]}``, plus an optional ``"__metadata__"``), then the tensors' bytes, C order, little
endian, offsets relative to the end of the header. The arrays returned here are views of one read-only memory map
per file: opening a file reads its header only, and a tensor's bytes are read when that tensor (or a slice of it) is
used, so a process reads only what it takes from a checkpoint.

The safetensors package's own NumPy and Flax readers cannot return float8 tensors (they look the dtype up on the
numpy module, which has none), and FP8 is the dtype DeepSeek-V3's expert weights come in; the format is small and
stable, so it is read here. Writing stays with the safetensors package (the tests write with it).
"""

from __future__ import annotations

import json
import os
import struct
from typing import Optional

import ml_dtypes
import numpy as np

# The format's dtype names. Those without a NumPy dtype (the sub-byte and packed ones) read as None: their tensors
# are listed with their shape and refused when used.
DTYPES: dict[str, Optional[np.dtype]] = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8), "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16), "U32": np.dtype(np.uint32), "I32": np.dtype(np.int32), "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32), "F64": np.dtype(np.float64), "C64": np.dtype(np.complex64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
# A header larger than this is not a safetensors header (the format caps it at 100 MB).
_MAX_HEADER = 100 << 20


class UnreadableDtype:
  """The dtype of a tensor stored in a dtype NumPy cannot hold (e.g. ``F4``); carries the format's name."""

  def __init__(self, name: str):
    self.name = name

  def __repr__(self):
    return f"safetensors dtype {self.name}"


class Tensor:
  """A tensor of a file: its shape and dtype from the header, its values read on `__array__` / indexing."""

  def __init__(self, path: str, name: str, dtype, shape: tuple[int, ...], mapped: Optional[np.ndarray]):
    self.path, self.name, self.dtype, self.shape = path, name, dtype, shape
    self._mapped = mapped

  @property
  def ndim(self) -> int:
    return len(self.shape)

  def _values(self) -> np.ndarray:
    if self._mapped is None:
      raise ValueError(f"safetensors: tensor {self.name!r} of {self.path} is stored as {self.dtype.name}, which "
                       f"NumPy cannot hold")
    return self._mapped

  def __getitem__(self, index) -> np.ndarray:
    return np.array(self._values()[index])

  def __array__(self, dtype=None, copy=None):
    a = np.array(self._values())
    return a if dtype is None else a.astype(dtype)


def read_header(path: str) -> tuple[dict, int]:
  """(the JSON header without ``__metadata__``, the offset of the data) of the file at `path`."""
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    head = f.read(8)
    if len(head) < 8:
      raise ValueError(f"safetensors: {path} is not a safetensors file: {size} bytes, shorter than the 8-byte header "
                       f"length")
    (n,) = struct.unpack("<Q", head)
    if n > min(_MAX_HEADER, size - 8):
      raise ValueError(f"safetensors: {path} is not a safetensors file: header length {n} for a file of {size} bytes")
    try:
      header = json.loads(f.read(n))
    except ValueError as e:
      raise ValueError(f"safetensors: {path} has a header that is not JSON: {e}") from None
  if not isinstance(header, dict):
    raise ValueError(f"safetensors: {path} has a header that is not a JSON object")
  header.pop("__metadata__", None)
  return header, 8 + n


def open_file(path: str) -> dict[str, Tensor]:
  """The tensors of the file at `path`, by name, each mapped from the file (nothing but the header is read)."""
  header, start = read_header(path)
  size = os.path.getsize(path)
  data = np.memmap(path, dtype=np.uint8, mode="r") if size > start else np.zeros(0, np.uint8)
  out = {}
  for name, entry in header.items():
    try:
      dtype_name, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
    except (KeyError, TypeError, ValueError):
      raise ValueError(f"safetensors: {path}: tensor {name!r} has a malformed header entry {entry!r}") from None
    if not isinstance(dtype_name, str):
      raise ValueError(f"safetensors: {path}: tensor {name!r} has dtype {dtype_name!r}, not a dtype name")
    if not all(isinstance(d, int) and d >= 0 for d in shape) or not (0 <= begin <= end <= size - start):
      raise ValueError(f"safetensors: {path}: tensor {name!r} has shape {shape} and data_offsets {[begin, end]}, "
                       f"outside the file's {size - start} data bytes")
    dtype = DTYPES.get(dtype_name)
    if dtype is None:
      out[name] = Tensor(path, name, UnreadableDtype(dtype_name), shape, None)
      continue
    if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
      raise ValueError(f"safetensors: {path}: tensor {name!r} of shape {shape} and dtype {dtype_name} needs "
                       f"{int(np.prod(shape)) * dtype.itemsize} bytes, its data_offsets hold {end - begin}")
    # The file is little endian, as every host JAX runs on.
    mapped = data[start + begin:start + end].view(dtype).reshape(shape)
    out[name] = Tensor(path, name, dtype, shape, mapped)
  return out
