"""ds-io's aio handle against what a user would pick instead, one tensor (1 GiB by default):

* the device's practical limit: ``fio`` (sequential, direct=1, ioengine=libaio, 1 MiB blocks,
  iodepth 32), or ``dd`` with oflag/iflag=direct when fio is not installed;
* plain Python: ``file.write(memoryview)`` + fsync, ``file.readinto``;
* ``torch.save`` (+ fsync, so that the bytes reach the disk like ours) / ``torch.load``.

Cases: write to a fresh file, write over an existing file, cold read (the page cache dropped
before every read, ours included: ``echo 1 > /proc/sys/vm/drop_caches`` as root, else the file's
own pages with ``posix_fadvise(DONTNEED)``), warm read (buffered readers, file just read). Ours
read with O_DIRECT, and also buffered with kernel readahead (``buffered_reads=True``). Every case
is measured ``--repeats`` times, the contenders interleaved; medians. Prints every figure,
ours / fio and ours / torch ratios, and with ``--json PATH`` writes them as JSON.

    python benchmarks/bench_aio.py [--size 1G] [--dir /nvme] [--tuned aio.json] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ds_io import AioConfig, AsyncIOHandle
from ds_io.tune import evict_from_page_cache, parse_size

TUNED_DEFAULT = {"block_size": 1048576, "queue_depth": 32, "intra_op_parallelism": 2, "single_submit": False,
                 "overlap_events": True}


def drop_caches(path: Path | None = None) -> str:
    """Empty the page cache (root) or at least ``path``'s pages; says which was done."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "drop_caches"
    except OSError:
        if path is not None and path.exists():
            evict_from_page_cache(path)
        return "fadvise"


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ---- baselines ------------------------------------------------------------------------------------
def fio(path: Path, size: int, rw: str) -> float | None:
    """GB/s of fio; None when fio is missing."""
    if not shutil.which("fio"):
        return None
    out = subprocess.run(["fio", "--name=bench", f"--filename={path}", f"--rw={rw}", "--bs=1M", "--direct=1",
                          "--ioengine=libaio", "--iodepth=32", f"--size={size}", "--output-format=json"],
                         capture_output=True, text=True, check=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    return job["read" if rw == "read" else "write"]["bw_bytes"] / 1e9


def dd(path: Path, size: int, write: bool) -> float:
    count = size // (1 << 20)
    args = (["if=/dev/zero", f"of={path}", "oflag=direct", "conv=notrunc"] if write
            else [f"if={path}", "of=/dev/null", "iflag=direct"])
    seconds = timed(lambda: subprocess.run(["dd", "bs=1M", f"count={count}", *args], capture_output=True, check=True))
    return count * (1 << 20) / seconds / 1e9


def python_write(t: torch.Tensor, path: Path, fresh: bool) -> float:
    view = memoryview(t.numpy())
    if fresh:
        path.unlink(missing_ok=True)

    def run():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        with os.fdopen(fd, "wb", buffering=0) as f:
            f.write(view)
            os.fsync(f.fileno())
    return t.numel() / timed(run) / 1e9


def python_read(t: torch.Tensor, path: Path) -> float:
    view = memoryview(t.numpy())

    def run():
        with open(path, "rb", buffering=0) as f:
            f.readinto(view)
    return t.numel() / timed(run) / 1e9


def torch_save(t: torch.Tensor, path: Path) -> float:
    path.unlink(missing_ok=True)

    def run():
        with open(path, "wb") as f:
            torch.save(t, f)
            f.flush()
            os.fsync(f.fileno())
    return t.numel() / timed(run) / 1e9


def torch_load(path: Path, nbytes: int) -> float:
    return nbytes / timed(lambda: torch.load(path, weights_only=True)) / 1e9


# ---- ours ----------------------------------------------------------------------------------------------
def ours(handle: AsyncIOHandle, t: torch.Tensor, path: Path, write: bool, fresh: bool, async_op: bool) -> float:
    if write and fresh:
        path.unlink(missing_ok=True)
    if not write:
        drop_caches(path)

    def run():
        (handle.pwrite if write else handle.pread)(t, path, async_op=async_op)
        if async_op:
            handle.wait()
    return t.numel() / timed(run) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1G", help="tensor size in bytes (default 1G)")
    parser.add_argument("--dir", default=None, help="directory on the disk to test (default: a temp dir in /var/tmp)")
    parser.add_argument("--tuned", default=None, help="an {\"aio\": ...} JSON (ds-nvme-tune --output) for the tuned rows")
    parser.add_argument("--repeats", type=int, default=3, help="measurements of each case (medians; default 3)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the figures as JSON")
    args = parser.parse_args(argv)
    size = parse_size(args.size, "--size") // (1 << 20) * (1 << 20)
    section = dict(json.loads(Path(args.tuned).read_text())["aio"] if args.tuned else TUNED_DEFAULT)
    tuned_buffered = bool(section.get("buffered_reads", False))
    if "buffered_reads" not in AioConfig.model_fields:
        section.pop("buffered_reads", None)
    tuned = AioConfig(**section)
    work = Path(tempfile.mkdtemp(prefix="bench_aio.", dir=args.dir or "/var/tmp"))
    how = drop_caches()
    cases = ["write fresh", "write overwrite", "read cold", "read warm"]
    samples: dict[str, dict[str, list[float]]] = {}

    def record(name: str, case: str, value: float | None) -> None:
        samples.setdefault(name, {c: [] for c in cases})
        if value is not None:
            samples[name][case].append(value)
    try:
        tuned_kwargs = {**tuned.handle_kwargs(), "buffered_reads": tuned_buffered}
        with AsyncIOHandle() as default, AsyncIOHandle(intra_op_parallelism=2) as two, \
                AsyncIOHandle(**tuned_kwargs) as tuned_handle, \
                AsyncIOHandle(intra_op_parallelism=2, queue_depth=8, buffered_reads=True) as buffered:
            t = default.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
            t.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
            f = work / "t.bin"
            contenders = {
                "ours default sync (1 thread)": (default, False),
                "ours default async (1 thread)": (default, True),
                "ours 2 threads async": (two, True),
                f"ours tuned async ({tuned.intra_op_parallelism} thr, bs {tuned.block_size >> 10}K, "
                f"qd {tuned.queue_depth}{', buffered reads' if tuned_buffered else ''})": (tuned_handle, True),
                "ours buffered reads (2 thr, bs 1024K, qd 8)": (buffered, True),
            }
            p, s = work / "py.bin", work / "torch.pt"
            for repeat in range(args.repeats):
                for name, (h, async_op) in contenders.items():  # interleaved with the baselines below
                    record(name, "write fresh", ours(h, t, f, True, True, async_op))
                    record(name, "write overwrite", ours(h, t, f, True, False, async_op))
                    record(name, "read cold", ours(h, t, f, False, False, async_op))
                default.pread(t, f)
                expected = t[:1 << 20].clone()
                name = "python write+fsync / readinto"
                record(name, "write fresh", python_write(t, p, True))
                record(name, "write overwrite", python_write(t, p, False))
                drop_caches(p)
                record(name, "read cold", python_read(t, p))
                record(name, "read warm", python_read(t, p))
                name = "torch.save+fsync / torch.load"
                record(name, "write fresh", torch_save(t, s))
                drop_caches(s)
                record(name, "read cold", torch_load(s, size))
                record(name, "read warm", torch_load(s, size))
                assert torch.equal(t[:1 << 20], expected)
                print(f"  repeat {repeat + 1}/{args.repeats} done", file=sys.stderr, flush=True)

            g = work / "fio.bin"
            if shutil.which("fio"):
                name = "fio (libaio, direct, 1M, qd32)"
                record(name, "write fresh", fio(g, size, "write"))
                record(name, "write overwrite", fio(g, size, "write"))
                record(name, "write fresh", _fio_fresh(g, size))
                record(name, "read cold", fio(g, size, "read"))
            else:
                g.unlink(missing_ok=True)
                name = "dd (direct, 1M)"
                record(name, "write fresh", dd(g, size, True))
                record(name, "write overwrite", dd(g, size, True))
                record(name, "read cold", dd(g, size, False))
            print("  device limit: done", file=sys.stderr, flush=True)
            default.free_cpu_locked_tensor(t)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    rows = {name: {c: (max(v) if name.startswith("fio") and c == "write fresh" else statistics.median(v)) if v else None
                   for c, v in per_case.items()} for name, per_case in samples.items()}
    print(f"\nbench_aio: {size / 2**30:.2f} GiB tensor in {work.parent}, median of {args.repeats} "
          f"(cold reads: {'page cache dropped (drop_caches)' if how == 'drop_caches' else 'the file evicted with posix_fadvise(DONTNEED)'}"
          " before each; ours O_DIRECT unless it says buffered; fio's and dd's O_DIRECT)")
    print(f"{'GB/s':<62}" + "".join(f"{c:>17}" for c in cases))
    for name, row in rows.items():
        print(f"{name:<62}" + "".join(f"{'-' if row[c] is None else f'{row[c]:.2f}':>17}" for c in cases))
    limit_name = next(n for n in rows if n.startswith(("fio", "dd")))
    ours_rows = {n: r for n, r in rows.items() if n.startswith("ours")}
    best = {c: max((r[c] for r in ours_rows.values() if r[c] is not None), default=None) for c in cases}
    best_cold = max(ours_rows, key=lambda n: ours_rows[n]["read cold"])
    ratios = {}
    torch_row = rows["torch.save+fsync / torch.load"]
    for c in ("write fresh", "write overwrite", "read cold"):
        limit = rows[limit_name][c]
        ratios[f"ours/{limit_name.split()[0]} {c}"] = best[c] / limit if limit else None
    ratios["ours/torch.save write fresh"] = best["write fresh"] / torch_row["write fresh"]
    ratios["ours/torch.load read cold"] = best["read cold"] / torch_row["read cold"]
    ratios["ours/python readinto read cold"] = best["read cold"] / rows["python write+fsync / readinto"]["read cold"]
    print("\nbest of ours vs the baselines (ratio):")
    for name, value in ratios.items():
        print(f"  {name:<40} {'-' if value is None else f'{value:.2f}x'}")
    print(f"  (best cold read of ours: {best_cold})")
    if args.json:
        Path(args.json).write_text(json.dumps({"size": size, "repeats": args.repeats, "cold_read_cache": how,
                                               "samples": samples, "rows": rows, "best_ours": best,
                                               "best_cold_read": best_cold, "ratios": ratios}, indent=1))
    return 0


def _fio_fresh(path: Path, size: int) -> float:
    path.unlink(missing_ok=True)
    return fio(path, size, "write")


if __name__ == "__main__":
    sys.exit(main())
