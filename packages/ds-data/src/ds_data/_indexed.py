"""DeepSpeed's (Megatron's) ``MMapIndexedDataset`` format: a list of 1-D integer arrays in two files.

``<prefix>.bin``: the arrays' elements back to back, in the dataset's dtype, C order, nothing else.

``<prefix>.idx``, little-endian:

* the magic ``b"MMIDIDX\\x00\\x00"`` (9 bytes), the version ``1`` (``<Q``), the dtype code (``<B``:
  1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 uint16, 7 uint32, 8 uint64, DeepSpeed's table);
* the number of arrays ``n`` (``<Q``) and the length ``m`` of the document index (``<Q``);
* ``sizes``: ``n`` int32, each array's element count; ``pointers``: ``n`` int64, each array's byte offset
  in ``.bin`` (the exclusive prefix sum of size × itemsize); ``doc_idx``: ``m`` int64, the array index at
  which each document starts, from ``[0]``, one more entry per `MMapIndexedDatasetBuilder.end_document`.

Files DeepSpeed's ``data_analyzer`` writes read here and the other way round. Every file is written
atomically: the ``.bin`` goes to a temporary file renamed over the target at `finalize`, the ``.idx``
(written last, so a complete ``.idx`` means a complete pair) through `ds_config.write_atomic`.
"""

from __future__ import annotations

import os
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from ds_config import write_atomic

_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
DTYPE_CODES: dict[int, type[np.integer]] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                                            6: np.uint16, 7: np.uint32, 8: np.uint64}
_TORCH = {torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32,
          torch.int64: np.int64}


def numpy_dtype(dtype: Any) -> np.dtype:
    """The numpy integer dtype of ``dtype`` (a numpy or torch integer dtype in DeepSpeed's table), or a
    ``ValueError`` naming it and the allowed ones."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH:
            raise ValueError(f"dtype {dtype} is not in the indexed format's table; allowed: {_allowed()}")
        return np.dtype(_TORCH[dtype])
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"dtype {dtype!r} is not in the indexed format's table; allowed: {_allowed()}") from None
    if resolved.type not in DTYPE_CODES.values():
        raise ValueError(f"dtype {dtype!r} is not in the indexed format's table; allowed: {_allowed()}")
    return resolved


def _allowed() -> str:
    return ", ".join(np.dtype(t).name for t in DTYPE_CODES.values()) + " (numpy or torch)"


def dtype_code(dtype: Any) -> int:
    resolved = numpy_dtype(dtype)
    return next(code for code, kind in DTYPE_CODES.items() if np.dtype(kind) == resolved)


def find_fit_int_dtype(min_value: int, max_value: int) -> np.dtype:
    """The smallest integer dtype holding ``[min_value, max_value]``: unsigned when ``min_value >= 0``
    (DeepSpeed's ``find_fit_int_dtype``)."""
    kinds = (np.uint8, np.uint16, np.uint32, np.uint64) if min_value >= 0 else (np.int8, np.int16, np.int32, np.int64)
    for kind in kinds:
        info = np.iinfo(kind)
        if info.min <= min_value and max_value <= info.max:
            return np.dtype(kind)
    raise ValueError(f"no 64-bit integer dtype holds the range [{min_value}, {max_value}]")


def split_index(start: int, end: int, parts: int) -> list[tuple[int, int]]:
    """``[start, end)`` cut into ``parts`` contiguous ranges (DeepSpeed's ``split_index``: ``linspace``
    boundaries, truncated)."""
    bounds = np.linspace(start, end, num=parts + 1, dtype=int)
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(parts)]


class MMapIndexedDatasetBuilder:
    """Writes ``<prefix>.bin`` as arrays are added and ``<prefix>.idx`` at `finalize` (DeepSpeed's builder,
    given the ``.bin`` path). Nothing is visible at the target paths before `finalize`."""

    def __init__(self, out_file: str | os.PathLike, dtype: Any = np.int64) -> None:
        self._dtype = numpy_dtype(dtype)
        self._path = Path(out_file)
        fd, tmp = tempfile.mkstemp(dir=self._path.parent, prefix=f".{self._path.name}.", suffix=".tmp")
        self._tmp = Path(tmp)
        self._file = os.fdopen(fd, "wb")
        self._sizes: list[int] = []
        self._doc_idx: list[int] = [0]

    def add_item(self, item: Any) -> None:
        """Append one array (a tensor, an array or a sequence of integers), flattened to 1-D and cast to
        the builder's dtype; a value the dtype cannot hold is a ``ValueError``."""
        if isinstance(item, torch.Tensor):
            item = item.detach().cpu().numpy()
        values = np.asarray(item).reshape(-1)
        if values.dtype.kind not in "iub":
            raise ValueError(f"the indexed format holds integers; got an array of dtype {values.dtype}")
        if values.size:
            info = np.iinfo(self._dtype)
            low, high = int(values.min()), int(values.max())
            if low < info.min or high > info.max:
                raise ValueError(f"values in [{low}, {high}] do not fit the builder's dtype {self._dtype.name}")
        self._file.write(values.astype(self._dtype, copy=False).tobytes(order="C"))
        self._sizes.append(int(values.size))

    add_item_numpy = add_item

    def add_items(self, items: Any) -> None:
        """Append each of ``items``; a 2-D array adds its rows, in one write."""
        if isinstance(items, np.ndarray) and items.ndim == 2:
            rows, cols = items.shape
            self.add_item(items)
            self._sizes[-1:] = [cols] * rows
            return
        for item in items:
            self.add_item(item)

    def end_document(self) -> None:
        self._doc_idx.append(len(self._sizes))

    def finalize(self, index_file: str | os.PathLike) -> None:
        """Rename the ``.bin`` into place and write ``index_file`` (the ``.idx``), each atomically."""
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._tmp, self._path)
        except BaseException:
            self.abort()
            raise
        sizes = np.asarray(self._sizes, dtype=np.int64)
        if sizes.size and sizes.max() > np.iinfo(np.int32).max:
            raise ValueError(f"an array of {int(sizes.max())} elements is over the format's int32 size field")
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            np.cumsum(sizes[:-1] * self._dtype.itemsize, out=pointers[1:])
        header = _MAGIC + struct.pack("<Q", _VERSION) + struct.pack("<B", dtype_code(self._dtype))
        header += struct.pack("<Q", len(sizes)) + struct.pack("<Q", len(self._doc_idx))
        write_atomic(index_file, header + sizes.astype(np.int32).tobytes() + pointers.tobytes()
                     + np.asarray(self._doc_idx, dtype=np.int64).tobytes())

    def abort(self) -> None:
        """Drop what was written (the temporary ``.bin``)."""
        if not self._file.closed:
            self._file.close()
        self._tmp.unlink(missing_ok=True)


def write_indexed(prefix: str | os.PathLike, items: Any, dtype: Any) -> None:
    """``<prefix>.bin``/``.idx`` holding ``items`` (one document), written atomically."""
    builder = MMapIndexedDatasetBuilder(f"{os.fspath(prefix)}.bin", dtype)
    try:
        builder.add_items(items)
        builder.end_document()
    except BaseException:
        builder.abort()
        raise
    builder.finalize(f"{os.fspath(prefix)}.idx")


class MMapIndexedDataset:
    """Reads ``<prefix>.bin``/``.idx`` (memory-mapped, read-only): ``ds[i]`` is array ``i``, ``ds[a:b]`` a
    list of arrays. A file that is not this format is a ``ValueError`` naming it and what was found."""

    def __init__(self, path: str | os.PathLike, skip_warmup: bool = True) -> None:
        self._path = os.fspath(path)
        index = Path(f"{self._path}.idx")
        raw = index.read_bytes()
        fixed = len(_MAGIC) + 8 + 1 + 8 + 8
        if len(raw) < fixed or raw[:len(_MAGIC)] != _MAGIC:
            raise ValueError(f"{index} is not an MMapIndexedDataset index (no {_MAGIC!r} header)")
        offset = len(_MAGIC)
        (version,) = struct.unpack_from("<Q", raw, offset)
        if version != _VERSION:
            raise ValueError(f"{index}: index version {version}, only version {_VERSION} is read")
        (code,) = struct.unpack_from("<B", raw, offset + 8)
        if code not in DTYPE_CODES:
            raise ValueError(f"{index}: dtype code {code} is not one of {sorted(DTYPE_CODES)}")
        self._dtype = np.dtype(DTYPE_CODES[code])
        count, doc_count = struct.unpack_from("<QQ", raw, offset + 9)
        if len(raw) != fixed + count * (4 + 8) + doc_count * 8:
            raise ValueError(f"{index}: {len(raw)} bytes do not hold {count} sizes/pointers and {doc_count} "
                             "document starts")
        self._sizes = np.frombuffer(raw, dtype=np.int32, count=count, offset=fixed)
        self._pointers = np.frombuffer(raw, dtype=np.int64, count=count, offset=fixed + 4 * count)
        self._doc_idx = np.frombuffer(raw, dtype=np.int64, count=doc_count, offset=fixed + 12 * count)
        data = Path(f"{self._path}.bin")
        need = int(self._pointers[-1]) + int(self._sizes[-1]) * self._dtype.itemsize if count else 0
        have = data.stat().st_size
        if have != need:
            raise ValueError(f"{data}: {have} bytes, its index describes {need}")
        self._bin = np.memmap(data, dtype=np.uint8, mode="r") if have else np.zeros(0, dtype=np.uint8)

    def __len__(self) -> int:
        return len(self._sizes)

    def __getitem__(self, idx: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(f"slices of an MMapIndexedDataset are contiguous; got step {step}")
            return [self[i] for i in range(start, stop)]
        i = int(idx)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"array {idx} of an MMapIndexedDataset of {len(self)}")
        pointer, size = int(self._pointers[i]), int(self._sizes[i])
        return np.frombuffer(self._bin, dtype=self._dtype, count=size, offset=pointer)

    def flat(self) -> np.ndarray:
        """Every array's elements back to back (the whole ``.bin``)."""
        return np.frombuffer(self._bin, dtype=self._dtype)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def sizes(self) -> np.ndarray:
        return self._sizes

    @property
    def doc_idx(self) -> np.ndarray:
        return self._doc_idx

    @staticmethod
    def exists(path: str | os.PathLike) -> bool:
        return os.path.exists(f"{os.fspath(path)}.idx") and os.path.exists(f"{os.fspath(path)}.bin")
