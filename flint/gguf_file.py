"""A bounded GGUF reader: header, metadata, tensor infos and views of the tensor data, each checked
as it is read. Bad input raises ``LoadError`` naming the file and the field or tensor.

gguf.GGUFReader trusts the counts it reads (an array count of 2^62 loops with memory climbing),
silently skips a field it cannot decode (a non-UTF-8 token string drops the whole vocabulary) and
builds a numpy view per scalar (seconds for a 49k-token vocabulary). This reader keeps the gguf
package's constants (value types, quantization block sizes) and guarantees, by construction:

* no loop or allocation before its count is bounded by the bytes left in the file;
* strings are UTF-8, keys and tensor names unique, booleans 0 or 1, arrays not nested;
* tensor data lies inside the file, aligned to ``general.alignment``, and the tensors tile the
  data section in offset order: no overlap (a tensor reading its neighbour's bytes) and no gap or
  tail wider than the alignment padding (a tensor whose type or shape was changed to need fewer
  bytes than were written for it).

Tests: ``pytest tests/test_loader_fuzz.py tests/test_loading.py -k gguf``.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

import gguf
import numpy as np

from .params import LoadError

VT = gguf.GGUFValueType
QT = gguf.GGMLQuantizationType
MAX_DIMS = 4  # GGML_MAX_DIMS
_SCALAR = {VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h", VT.UINT32: "<I",
           VT.INT32: "<i", VT.FLOAT32: "<f", VT.BOOL: "<B", VT.UINT64: "<Q", VT.INT64: "<q",
           VT.FLOAT64: "<d"}
INT_TYPES = frozenset({VT.UINT8, VT.INT8, VT.UINT16, VT.INT16, VT.UINT32, VT.INT32, VT.UINT64, VT.INT64})
FLOAT_TYPES = frozenset({VT.FLOAT32, VT.FLOAT64})


@dataclass
class Field:
    value: object  # int, float, bool, str, or a list of those
    type: VT
    item_type: VT | None = None  # for arrays


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the contiguous dimension
    tensor_type: QT
    offset: int  # from the start of the data section
    nbytes: int
    data: np.ndarray | None = None  # uint8 view of the nbytes, once the layout is checked


@dataclass
class GGUFFile:
    path: str
    fields: dict[str, Field]
    tensors: list[TensorInfo]
    alignment: int
    buf: mmap.mmap | None = None  # the file, mapped read-only
    data_start: int = 0  # the tensor data's offset in the file

    def values(self) -> dict:
        return {k: f.value for k, f in self.fields.items()}

    def release(self, t: TensorInfo) -> None:
        """Drop the mapped pages of tensor ``t`` from this process's memory once it has been
        converted, so that loading holds one tensor's file bytes at a time beside the converted
        weights. A later read of ``t.data`` still works: the pages come back from the file."""
        if self.buf is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        page = mmap.PAGESIZE
        begin = (self.data_start + t.offset) // page * page
        end = min(len(self.buf), -(-(self.data_start + t.offset + t.nbytes) // page) * page)
        if end > begin:
            self.buf.madvise(mmap.MADV_DONTNEED, begin, end - begin)


class _Cursor:
    def __init__(self, buf, path: str):
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def fail(self, what: str) -> LoadError:
        return LoadError(f"{self.path}: truncated or corrupt GGUF: {what}")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(f"{what} needs {n} bytes at offset {self.pos}, the file has "
                            f"{self.size - self.pos} left")

    def scalar(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return v

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        self.need(n, what)
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not valid UTF-8 ({e.reason} at byte {e.start})") from None

    def vtype(self, what: str) -> VT:
        v = self.scalar("<I", what)
        try:
            return VT(v)
        except ValueError:
            raise self.fail(f"{what}: unknown value type {v}") from None

    def value(self, vt: VT, what: str):
        if vt == VT.STRING:
            return self.string(what)
        v = self.scalar(_SCALAR[vt], what)
        if vt == VT.BOOL:
            if v > 1:
                raise self.fail(f"{what}: boolean byte {v} is neither 0 nor 1")
            return bool(v)
        return v

    def array(self, what: str) -> tuple[list, VT]:
        it = self.vtype(f"{what} (array item type)")
        if it == VT.ARRAY:
            raise self.fail(f"{what}: nested arrays are not supported")
        count = self.scalar("<Q", f"{what} (array count)")
        item = 8 if it == VT.STRING else struct.calcsize(_SCALAR[it])
        if count * item > self.size - self.pos:  # before any loop or allocation
            raise self.fail(f"{what}: an array of {count} {it.name} items needs at least "
                            f"{count * item} bytes, the file has {self.size - self.pos} left")
        if it == VT.STRING:
            return [self.string(f"{what}[{i}]") for i in range(count)], it
        arr = np.frombuffer(self.buf, dtype=np.dtype(_SCALAR[it]), count=count, offset=self.pos)
        self.pos += count * item
        if it == VT.BOOL:
            if count and int(arr.max()) > 1:
                raise self.fail(f"{what}: a boolean item is neither 0 nor 1")
            return arr.astype(bool).tolist(), it
        return arr.tolist(), it


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def read(path: str | os.PathLike) -> GGUFFile:
    """Parse and check a GGUF file (v2 or v3, little-endian); tensor data stays memory-mapped."""
    path = str(path)
    if not os.path.exists(path):
        raise LoadError(f"{path}: file not found")
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size < 24:
            raise LoadError(f"{path}: truncated or corrupt GGUF: {size} bytes, the header alone is 24")
        buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    c = _Cursor(buf, path)
    if buf[:4] != b"GGUF":
        raise LoadError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF')")
    c.pos = 4
    version = c.scalar("<I", "the version")
    if version not in (2, 3):
        raise c.fail(f"version {version} is not supported (2 or 3, little-endian)")
    n_tensors = c.scalar("<Q", "the tensor count")
    n_kv = c.scalar("<Q", "the metadata count")
    # each metadata entry takes at least 13 bytes (key length, type, one byte), each tensor info 24
    if n_kv * 13 + n_tensors * 24 > size - c.pos:
        raise c.fail(f"{n_kv} metadata entries and {n_tensors} tensor infos cannot fit in "
                     f"{size - c.pos} bytes")
    fields: dict[str, Field] = {}
    for i in range(n_kv):
        key = c.string(f"metadata key #{i}")
        if key in fields:
            raise c.fail(f"field {key!r} appears twice")
        vt = c.vtype(f"field {key!r}")
        what = f"field {key!r}"
        if vt == VT.ARRAY:
            value, it = c.array(what)
            fields[key] = Field(value, vt, it)
        else:
            fields[key] = Field(c.value(vt, what), vt)
    alignment = gguf.GGUF_DEFAULT_ALIGNMENT
    if "general.alignment" in fields:
        f = fields["general.alignment"]
        if f.type != VT.UINT32 or f.value <= 0 or f.value & (f.value - 1):
            raise c.fail(f"field 'general.alignment'={f.value!r} must be a power of two (uint32)")
        alignment = f.value
    tensors, names = [], set()
    for i in range(n_tensors):
        name = c.string(f"tensor info #{i} name")
        what = f"tensor {name!r}"
        if name in names:
            raise c.fail(f"{what} appears twice")
        names.add(name)
        n_dims = c.scalar("<I", f"{what} dimension count")
        if not 1 <= n_dims <= MAX_DIMS:
            raise c.fail(f"{what} has {n_dims} dimensions (1 to {MAX_DIMS})")
        shape = tuple(c.scalar("<Q", f"{what} shape") for _ in range(n_dims))
        code = c.scalar("<I", f"{what} type")
        try:
            kind = QT(code)
            block, type_size = gguf.GGML_QUANT_SIZES[kind]
        except (ValueError, KeyError):
            raise c.fail(f"{what} has unknown tensor type {code}") from None
        offset = c.scalar("<Q", f"{what} data offset")
        if 0 in shape:
            raise c.fail(f"{what} has an empty dimension in shape {list(shape)}")
        if shape[0] % block:
            raise c.fail(f"{what}: row length {shape[0]} is not a multiple of the {kind.name} block "
                         f"of {block}")
        if offset % alignment:
            raise c.fail(f"{what}: data offset {offset} is not aligned to {alignment} bytes")
        nbytes = int(np.prod(shape, dtype=object)) // block * type_size
        tensors.append(TensorInfo(name, shape, kind, offset, nbytes))
    start = _align(c.pos, alignment)
    data_size = size - start
    prev = None
    for t in sorted(tensors, key=lambda t: t.offset):
        end = t.offset + t.nbytes
        if end > data_size:
            raise c.fail(f"tensor {t.name!r} ({t.tensor_type.name}, shape {list(t.shape)}): data "
                         f"[{t.offset}, {end}) runs past the {max(data_size, 0)} bytes of tensor data")
        expect = 0 if prev is None else _align(prev.offset + prev.nbytes, alignment)
        if t.offset < expect:
            raise c.fail(f"tensor {t.name!r} at {t.offset} overlaps tensor {prev.name!r}, "
                         f"which ends at {prev.offset + prev.nbytes}")
        if t.offset > expect:
            after = f"after tensor {prev.name!r}" if prev else "at the start of the tensor data"
            raise c.fail(f"tensor {t.name!r} starts at {t.offset}: {t.offset - expect} bytes {after} "
                         "belong to no tensor (a wrong type, shape or offset in the tensor infos)")
        prev = t
    used = _align(prev.offset + prev.nbytes, alignment) if prev else 0
    if data_size > used:
        last = f"the last tensor {prev.name!r}" if prev else "the tensor infos"
        raise c.fail(f"{data_size - used} bytes after {last} belong to no tensor "
                     "(a wrong type, shape or offset in the tensor infos)")
    for t in tensors:
        t.data = np.frombuffer(buf, dtype=np.uint8, count=t.nbytes, offset=start + t.offset)
    return GGUFFile(path, fields, tensors, alignment, buf, start)
