"""A GGUF file's tensors, found without parsing its metadata.

gguf.GGUFReader builds a numpy view for every metadata value, and a model's tokenizer is ~100,000 strings of
metadata: about 3 s of a worker's start, for the one string (the architecture) and the tensor table that the
quantized layers need. This reads the header with struct, skips the metadata by its lengths, and maps each tensor's
bytes as the reader would ([rows, bytes a row] uint8 for block formats). The gguf package still gives the type codes
and block sizes, and tests hold this index to GGUFReader's.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
STRING, ARRAY = 8, 9  # GGUF metadata value types whose length is in the data
# The other types, as struct formats (uint8, int8, uint16, int16, uint32, int32, float32, bool, uint64, int64, float64)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
DEFAULT_ALIGNMENT = 32


@dataclass
class Tensor:
    name: str
    type: str  # the GGML type's name: "Q4_1", "F32", ...
    shape: tuple[int, ...]  # GGUF order: the innermost dimension (K of a weight) first
    data: np.ndarray  # uint8 [rows, bytes a row]


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.at = buf, 0

    def take(self, fmt: str):
        values = struct.unpack_from("<" + fmt, self.buf, self.at)
        self.at += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        n = self.take("Q")
        self.at += n
        return bytes(self.buf[self.at - n:self.at]).decode("utf-8", "replace")

    def skip_array(self) -> None:
        kind, count = self.take("IQ")
        if kind == STRING:
            for _ in range(count):
                self.at += 8 + struct.unpack_from("<Q", self.buf, self.at)[0]
        elif kind == ARRAY:
            for _ in range(count):
                self.skip_array()
        else:
            self.at += count * struct.calcsize("<" + SCALARS[kind])

    def value(self, kind: int):
        """The value of a scalar or string; arrays are skipped (None)."""
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            self.skip_array()
            return None
        return self.take(SCALARS[kind])


def read(path: Path) -> tuple[dict[str, object], dict[str, Tensor]]:
    """(the file's scalar and string metadata, its tensors by name). Raises ValueError for a file that is not a
    little-endian GGUF of version 2 or 3."""
    import gguf

    raw = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(raw))
    if bytes(raw[:4]) != MAGIC:
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
    cur.at = 4
    version, tensor_count, kv_count = cur.take("IQQ")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not read here (2 and 3 are; a big-endian file reads as a "
                         "huge version)")
    meta = {}
    for _ in range(kv_count):
        key = cur.string()
        value = cur.value(cur.take("I"))
        if value is not None:
            meta[key] = value
    infos = []
    for _ in range(tensor_count):
        name = cur.string()
        dims = cur.take("I")
        shape = tuple(cur.take("Q") for _ in range(dims))
        kind, offset = cur.take("IQ")
        infos.append((name, shape, gguf.GGMLQuantizationType(kind), offset))
    align = int(meta.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-cur.at // align) * align
    tensors = {}
    for name, shape, kind, offset in infos:
        block, size = gguf.GGML_QUANT_SIZES[kind]
        row_bytes = shape[0] // block * size
        rows = int(np.prod(shape[1:], dtype=np.int64))
        data = raw[start + offset:start + offset + rows * row_bytes].reshape(rows, row_bytes)
        tensors[name] = Tensor(name, kind.name, shape, data)
    return meta, tensors
