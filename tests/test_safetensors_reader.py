"""jax_moe_a2a.safetensors_reader against files the safetensors package writes: every dtype bit for bit, slices read
from the map, and files that are not safetensors refused with the file named."""

import struct

import ml_dtypes
import numpy as np
import pytest

from jax_moe_a2a import safetensors_reader

save_file = pytest.importorskip("safetensors.numpy").save_file

DTYPES = [np.bool_, np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32, np.uint64, np.int64, np.float16,
          ml_dtypes.bfloat16, np.float32, np.float64, np.complex64, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2]


def test_every_dtype_reads_back_bit_for_bit(tmp_path):
  rng = np.random.default_rng(0)
  tensors = {}
  for i, dtype in enumerate(DTYPES):
    itemsize = np.dtype(dtype).itemsize
    raw = rng.integers(0, 256, size=(3, 5, itemsize), dtype=np.uint8)  # every bit pattern, NaNs included
    tensors[f"t{i}"] = raw.view(dtype).reshape(3, 5) if dtype is not np.bool_ else raw[..., 0] % 2 == 1
  tensors["empty"] = np.zeros((0, 4), np.float32)
  tensors["scalar"] = np.array(2.5, np.float32)
  path = str(tmp_path / "a.safetensors")
  save_file(tensors, path)
  read = safetensors_reader.open_file(path)
  assert sorted(read) == sorted(tensors)
  for name, want in tensors.items():
    got = read[name]
    assert (got.shape, got.dtype) == (want.shape, want.dtype), name
    np.testing.assert_array_equal(np.asarray(got).reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8),
                                  err_msg=name)
  np.testing.assert_array_equal(read["t12"][1:, 2], tensors["t12"][1:, 2])


def test_files_that_are_not_safetensors_are_refused(tmp_path):
  short = tmp_path / "short.safetensors"
  short.write_bytes(b"\x01\x02")
  with pytest.raises(ValueError, match=r"short.safetensors is not a safetensors file: 2 bytes"):
    safetensors_reader.open_file(str(short))
  huge = tmp_path / "huge.safetensors"
  huge.write_bytes(struct.pack("<Q", 10**6) + b"{}")
  with pytest.raises(ValueError, match=r"header length 1000000 for a file of 10 bytes"):
    safetensors_reader.open_file(str(huge))
  bad = tmp_path / "bad.safetensors"
  header = b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}'
  bad.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
  with pytest.raises(ValueError, match=r"tensor 'w' of shape \(4,\) and dtype F32 needs 16 bytes, its data_offsets "
                                       r"hold 8"):
    safetensors_reader.open_file(str(bad))
  past = tmp_path / "past.safetensors"
  header = b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}'
  past.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
  with pytest.raises(ValueError, match=r"outside the file's 8 data bytes"):
    safetensors_reader.open_file(str(past))


def test_a_dtype_numpy_cannot_hold_is_listed_and_refused_when_read(tmp_path):
  path = tmp_path / "f4.safetensors"
  header = b'{"w": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]}}'
  path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0")
  w = safetensors_reader.open_file(str(path))["w"]
  assert w.shape == (4,) and w.dtype.name == "F4"
  with pytest.raises(ValueError, match=r"tensor 'w' of .* is stored as F4, which NumPy cannot hold"):
    np.asarray(w)
