"""Read a GGUF file's header: its key/value metadata and where each tensor's bytes lie, over a memory map.

gguf-py's ``GGUFReader`` builds numpy views for every field part, ~250,000 of them for a 49k-token vocabulary
(3-7 s on a busy 2-core machine); this reads the same header with ``struct`` in one pass (docs/performance.md,
"Load time and memory"). Values come back as ``GGUFReader``'s ``field.contents()`` gives them: ints, floats, bools, str, and
lists of those. Tensor bytes are views of a copy-on-write map of the file, as llama.cpp maps its weights.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# GGUF value types: struct format of the scalars, numpy dtype of their arrays
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # ggml's


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # as GGUF lists it, fastest dimension first
    ggml_type: int
    offset: int  # of its first byte in the file


class GGUFFile:
    """``metadata`` (key -> value) and ``tensors`` (name -> TensorInfo) of a GGUF file; ``data(info, n_bytes)`` is a
    uint8 view of a tensor's bytes in the mapped file. Raises ValueError on a malformed or truncated header."""

    def __init__(self, path: str | Path):
        self.map = np.memmap(path, dtype=np.uint8, mode="c")
        buffer = memoryview(self.map)
        self._buffer, self._at = buffer, 4
        if bytes(buffer[:4]) != b"GGUF":
            raise ValueError("bad magic")
        version, n_tensors, n_kv = self._unpack("<IQQ")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        # what llama.cpp's gguf reader refuses, refused here too: a key or tensor named twice, a tensor of no or more
        # than 4 dimensions, an alignment that is not a power of two, a tensor not at a multiple of it
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            if key in self.metadata:
                raise ValueError(f"key {key!r} appears twice")
            self.metadata[key] = self._value(self._unpack("<I")[0])
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if (not isinstance(alignment, int) or isinstance(alignment, bool) or alignment < 1
                or alignment & (alignment - 1)):
            raise ValueError(f"general.alignment {str(alignment)[:40]} is not a power of two")
        self.tensors: dict[str, TensorInfo] = {}
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._unpack("<I")[0]
            if not 1 <= n_dims <= MAX_DIMS:
                raise ValueError(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS})")
            shape = self._unpack(f"<{n_dims}Q")
            ggml_type, offset = self._unpack("<IQ")
            if offset % alignment:
                raise ValueError(f"tensor {name!r} lies at offset {offset}, not a multiple of the alignment "
                                 f"{alignment}")
            infos.append((name, shape, ggml_type, offset))
        start = -(-self._at // alignment) * alignment
        for name, shape, ggml_type, offset in infos:
            if name in self.tensors:
                raise ValueError(f"tensor {name!r} appears twice")
            self.tensors[name] = TensorInfo(name, tuple(shape), ggml_type, start + offset)
        del self._buffer

    def data(self, info: TensorInfo, n_bytes: int) -> np.ndarray:
        end = info.offset + n_bytes
        if end > self.map.size:
            raise ValueError(f"tensor {info.name} runs past the end of the file")
        return self.map[info.offset:end]

    def _unpack(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        if self._at + size > len(self._buffer):
            raise ValueError("the header runs past the end of the file")
        values = struct.unpack_from(fmt, self._buffer, self._at)
        self._at += size
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        end = self._at + length
        if end > len(self._buffer):
            raise ValueError("a string runs past the end of the file")
        text = str(self._buffer[self._at:end], "utf-8")
        self._at = end
        return text

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind in _SCALARS:
            return self._unpack("<" + _SCALARS[kind])[0]
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item, count = self._unpack("<IQ")
        if item == _ARRAY:  # llama.cpp's reader has no arrays of arrays either
            raise ValueError("an array of arrays")
        if item == _STRING:
            return self._strings(count)
        if item in _SCALARS:
            dtype = np.dtype("<" + _SCALARS[item])
            end = self._at + count * dtype.itemsize
            if end > len(self._buffer):
                raise ValueError("an array runs past the end of the file")
            values = np.frombuffer(self._buffer, dtype, count, self._at).tolist()
            self._at = end
            return values
        raise ValueError(f"unknown GGUF array type {item}")

    def _strings(self, count: int) -> list[str]:
        """``count`` length-prefixed strings in one loop of slices (a vocabulary's worth in tens of ms)."""
        buffer, at, out, size = self._buffer, self._at, [], len(self._buffer)
        unpack_length = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if at + 8 > size:
                raise ValueError("a string array runs past the end of the file")
            end = at + 8 + unpack_length(buffer, at)[0]
            if end > size:
                raise ValueError("a string runs past the end of the file")
            out.append(str(buffer[at + 8:end], "utf-8"))
            at = end
        self._at = at
        return out
