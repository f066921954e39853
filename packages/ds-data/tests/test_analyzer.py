"""DataAnalyzer and the indexed format against references computed here: the metric values sorted by hand,
the .idx parsed by hand from Megatron's layout, several workers' map-reduce against one worker's."""

from __future__ import annotations

import itertools
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from ds_data import DataAnalyzer
from ds_data._analyzer import load_metric_index
from ds_data._indexed import (
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    find_fit_int_dtype,
    write_indexed,
)

N = 57
FILES = ("sample_to_metric", "index_to_sample", "index_to_metric", "index_to_sample_percentile_merged")


class Tokens(torch.utils.data.Dataset):
    """Sample i: 8 token ids in [0, 5) from a fixed generator."""

    def __init__(self, n: int = N) -> None:
        self.data = torch.randint(0, 5, (n, 8), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


def n_zeros(batch: torch.Tensor) -> torch.Tensor:  # a single value per sample, with many ties
    return (batch == 0).sum(dim=1).to(torch.int64)


def histogram(batch: torch.Tensor) -> np.ndarray:  # accumulated over samples
    return np.bincount(batch.reshape(-1).numpy(), minlength=5).astype(np.int64)


def analyzer(dataset, save, workers=1, worker=0, batch_size=4, functions=(n_zeros, histogram),
             types=("single_value_per_sample", "accumulate_value_over_samples"), dtypes=(torch.int64, np.int64)):
    return DataAnalyzer(dataset, metric_names=["zeros", "vocab"][:len(functions)], metric_functions=list(functions),
                        metric_types=list(types), metric_dtypes=list(dtypes), save_path=save,
                        num_workers=workers, worker_id=worker, batch_size=batch_size)


def parse_idx(path: Path) -> dict:
    """Megatron's .idx layout read with struct, independently of the reader under test."""
    raw = path.read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack("<Q", raw[9:17])
    (code,) = struct.unpack("<B", raw[17:18])
    count, docs = struct.unpack("<QQ", raw[18:34])
    sizes = list(struct.unpack(f"<{count}i", raw[34:34 + 4 * count]))
    pointers = list(struct.unpack(f"<{count}q", raw[34 + 4 * count:34 + 12 * count]))
    doc_idx = list(struct.unpack(f"<{docs}q", raw[34 + 12 * count:34 + 12 * count + 8 * docs]))
    assert len(raw) == 34 + 12 * count + 8 * docs
    return {"version": version, "code": code, "sizes": sizes, "pointers": pointers, "doc_idx": doc_idx}


def test_single_value_metric_matches_a_sort_by_hand(tmp_path):
    data = Tokens()
    analyzer(data, tmp_path).run_map_reduce()
    values = [int((data[i] == 0).sum()) for i in range(N)]
    distinct = sorted(set(values))
    index = load_metric_index(tmp_path, "zeros")
    assert index["sample_to_metric"].tolist() == values
    assert index["index_to_metric"].tolist() == distinct
    assert [row.tolist() for row in index["index_to_sample"]] == [
        [i for i in range(N) if values[i] == v] for v in distinct]
    merged = MMapIndexedDataset(tmp_path / "zeros" / "zeros_index_to_sample_percentile_merged")
    step = max(1, len(distinct) // 100)
    assert len(merged) == -(-len(distinct) // step)
    assert np.concatenate(list(merged)).tolist() == sorted(range(N), key=lambda i: (values[i], i))


def test_accumulated_metric_is_the_sum_over_samples(tmp_path):
    data = Tokens()
    analyzer(data, tmp_path).run_map_reduce()
    total = MMapIndexedDataset(tmp_path / "vocab" / "vocab_metric_value")
    assert len(total) == 1
    assert total[0].tolist() == [int((data.data == t).sum()) for t in range(5)]
    assert total.dtype == find_fit_int_dtype(0, int(max(total[0])))


def test_files_follow_megatrons_layout(tmp_path):
    data = Tokens()
    analyzer(data, tmp_path).run_map_reduce()
    prefix = tmp_path / "zeros" / "zeros_index_to_sample"
    idx = parse_idx(Path(f"{prefix}.idx"))
    assert idx["version"] == 1
    assert idx["code"] == 1  # uint8 holds sample indices 0..56 (DeepSpeed's table: 1 is uint8)
    groups = load_metric_index(tmp_path, "zeros")["index_to_sample"]
    assert idx["sizes"] == [len(g) for g in groups]
    assert idx["pointers"] == [sum(len(g) for g in groups[:k]) for k in range(len(groups))]  # bytes: itemsize 1
    assert idx["doc_idx"] == [0, len(groups)]
    raw = Path(f"{prefix}.bin").read_bytes()
    assert list(raw) == np.concatenate(groups).tolist()


@pytest.mark.parametrize("workers", [2, 3])
def test_workers_map_then_one_reduce_equals_one_worker(tmp_path, workers):
    data = Tokens()
    analyzer(data, tmp_path / "one").run_map_reduce()
    parts = [analyzer(data, tmp_path / "many", workers=workers, worker=w, batch_size=5) for w in range(workers)]
    ranges = [p.worker_range() for p in parts]
    assert ranges[0][0] == 0 and ranges[-1][1] == N
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    for part in parts:
        part.run_map()
    parts[0].run_reduce()
    for metric, names in (("zeros", FILES), ("vocab", ("metric_value",))):
        for name in names:
            for ext in ("bin", "idx"):
                one = (tmp_path / "one" / metric / f"{metric}_{name}.{ext}").read_bytes()
                many = (tmp_path / "many" / metric / f"{metric}_{name}.{ext}").read_bytes()
                assert one == many, (metric, name, ext)
    assert not list(tmp_path.rglob("*.tmp"))  # every temporary file renamed into place


def test_reduce_refuses_a_missing_worker(tmp_path):
    data = Tokens()
    parts = [analyzer(data, tmp_path, workers=2, worker=w) for w in range(2)]
    parts[0].run_map()
    with pytest.raises(RuntimeError, match="worker 1's map result"):
        parts[0].run_reduce()
    with pytest.raises(RuntimeError, match="num_workers=2"):
        parts[0].run_map_reduce()


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.int64, np.uint16, np.uint32,
                                   np.uint64, torch.int32])
def test_builder_and_reader_round_trip(tmp_path, dtype):
    rng = np.random.default_rng(3)
    info = np.iinfo(np.dtype(torch.empty(0, dtype=dtype).numpy().dtype) if isinstance(dtype, torch.dtype)
                    else dtype)
    arrays = [rng.integers(max(info.min, -100), min(info.max, 100), size=n) for n in (3, 0, 7, 1)]
    builder = MMapIndexedDatasetBuilder(tmp_path / "x.bin", dtype)
    builder.add_item(torch.tensor(arrays[0]))
    builder.add_items(arrays[1:3])
    builder.end_document()
    builder.add_item(arrays[3])
    builder.end_document()
    assert not (tmp_path / "x.bin").exists()  # nothing in place before finalize
    builder.finalize(tmp_path / "x.idx")
    read = MMapIndexedDataset(tmp_path / "x")
    assert len(read) == 4
    assert [a.tolist() for a in read] == [a.tolist() for a in arrays]
    assert [a.tolist() for a in read[1:3]] == [a.tolist() for a in arrays[1:3]]
    assert read.doc_idx.tolist() == [0, 3, 4]
    idx = parse_idx(tmp_path / "x.idx")
    assert idx["sizes"] == [3, 0, 7, 1]
    itemsize = read.dtype.itemsize
    assert idx["pointers"] == [0, 3 * itemsize, 3 * itemsize, 10 * itemsize]


def test_empty_and_bad_index_files(tmp_path):
    write_indexed(tmp_path / "empty", [], np.int64)
    assert len(MMapIndexedDataset(tmp_path / "empty")) == 0
    write_indexed(tmp_path / "x", [np.arange(4)], np.int32)
    (tmp_path / "bad.idx").write_bytes(b"NOTANIDX" + bytes(40))
    (tmp_path / "bad.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not an MMapIndexedDataset index"):
        MMapIndexedDataset(tmp_path / "bad")
    (tmp_path / "x.bin").write_bytes(bytes(3))
    with pytest.raises(ValueError, match="3 bytes, its index describes 16"):
        MMapIndexedDataset(tmp_path / "x")
    builder = MMapIndexedDatasetBuilder(tmp_path / "y.bin", np.uint8)
    with pytest.raises(ValueError, match=r"\[0, 300\] do not fit .* uint8"):
        builder.add_item(np.array([0, 300]))
    with pytest.raises(ValueError, match="holds integers"):
        builder.add_item(np.array([0.5]))
    builder.abort()
    assert not list(tmp_path.glob(".y.bin.*"))
    with pytest.raises(ValueError, match=r"float32.*not in the indexed format's table"):
        MMapIndexedDatasetBuilder(tmp_path / "z.bin", torch.float32)


def test_find_fit_int_dtype():
    assert find_fit_int_dtype(0, 255) == np.uint8
    assert find_fit_int_dtype(0, 256) == np.uint16
    assert find_fit_int_dtype(-1, 127) == np.int8
    assert find_fit_int_dtype(-129, 0) == np.int16
    assert find_fit_int_dtype(0, 2**32) == np.uint64


def test_bad_input_is_named(tmp_path):
    data = Tokens()
    with pytest.raises(ValueError, match="metric_type 'per_sample'; allowed: single_value_per_sample"):
        analyzer(data, tmp_path, functions=(n_zeros,), types=("per_sample",), dtypes=(np.int64,))
    with pytest.raises(ValueError, match="1 metric_names but"):
        DataAnalyzer(data, ["a"], [n_zeros, n_zeros], ["single_value_per_sample"], [np.int64], tmp_path)
    with pytest.raises(ValueError, match=r"worker_id must be in \[0, 2\), got 2"):
        analyzer(data, tmp_path, workers=2, worker=2)
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        analyzer(data, tmp_path, batch_size=0)
    with pytest.raises(ValueError, match="float32"):
        analyzer(data, tmp_path, functions=(n_zeros,), types=("single_value_per_sample",), dtypes=(np.float32,))
    wrong_shape = analyzer(data, tmp_path, functions=(lambda b: torch.zeros(len(b), 2, dtype=torch.int64),),
                           types=("single_value_per_sample",), dtypes=(np.int64,))
    with pytest.raises(ValueError, match=r"returned shape \(4, 2\) for a batch of 4"):
        wrong_shape.run_map()
    wrong_dtype = analyzer(data, tmp_path, functions=(lambda b: (b == 0).sum(dim=1).to(torch.int32),),
                           types=("single_value_per_sample",), dtypes=(np.int64,))
    with pytest.raises(ValueError, match="returned dtype int32, metric_dtype is int64"):
        wrong_dtype.run_map()
    floats = analyzer(data, tmp_path, functions=(lambda b: b.float().sum(dim=1),),
                      types=("single_value_per_sample",), dtypes=(np.int64,))
    with pytest.raises(ValueError, match=r"torch\.float32 tensor"):
        floats.run_map()
    not_array = analyzer(data, tmp_path, functions=(lambda b: [1] * len(b),),
                         types=("single_value_per_sample",), dtypes=(np.int64,))
    with pytest.raises(ValueError, match="tensor or a numpy array, got list"):
        not_array.run_map()
