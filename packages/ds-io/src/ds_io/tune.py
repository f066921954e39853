"""``ds-nvme-tune`` (and ``ds_io.tune``): find the ``aio`` settings that move data fastest here.

    ds-nvme-tune --nvme_dir /local_nvme [--sweep_config sweep.json] [--io_size 256M] [--output aio.json]

Sweeps block_size x queue_depth x intra_op_parallelism x single_submit x overlap_events, writing
``io_size`` bytes from page-locked memory into a fresh file in each directory (O_DIRECT) and reading
them back cold two ways: O_DIRECT, and buffered with kernel readahead (the handle's
``buffered_reads``; the files' pages are evicted from the page cache first with
``posix_fadvise(DONTNEED)``). It shows each configuration's speed as it goes, then prints the best
read and write GB/s, which read path was faster, and the recommended ``"aio"`` block as JSON. A
sweep config is a JSON object of lists, e.g. ``{"block_size": ["256K", "1M"], "queue_depth": [8, 32]}``;
the keys it leaves out keep the default lists. Progress goes to stderr: one line rewritten with
``\r`` on a terminal, one line per configuration otherwise (log files). Ctrl-C stops it with exit
code 130 and removes its files.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from ds_config import ConfigError, Section, write_atomic
from pydantic import Field, model_validator

from .config import AioConfig
from .handle import AsyncIOHandle

DEFAULT_SWEEP: dict[str, list] = {
    "block_size": [128 * 1024, 256 * 1024, 1024 * 1024],
    "queue_depth": [8, 32, 128],
    "intra_op_parallelism": [1, 2],
    "single_submit": [False],
    "overlap_events": [True, False],
}
SWEEP_ALIASES = {"thread_count": "intra_op_parallelism", "io_parallel": "intra_op_parallelism"}
DEFAULT_IO_SIZE = 256 * 1024 * 1024
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}


def parse_size(value: Any, what: str = "size") -> int:
    """Bytes from 1048576, 1e6, "1M", "256K", "1G" (binary units)."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a number of bytes (e.g. 1048576 or \"1M\"), got {value!r}")
    if isinstance(value, int | float) and float(value).is_integer() and value > 0:
        return int(value)
    if isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)i?B?\s*", value.upper())
        if match and int(match.group(1)) > 0:
            return int(match.group(1)) * _UNITS[match.group(2)]
    raise ValueError(f"{what} must be a positive number of bytes (e.g. 1048576 or \"1M\"), got {value!r}")


class _Sweep(Section):
    """The value lists ds-nvme-tune sweeps; a key may also hold one value. Each value is then
    checked by ``AioConfig`` (bounds, types)."""

    block_size: list[int | str] = Field(default_factory=lambda: list(DEFAULT_SWEEP["block_size"]),
                                        description="Piece sizes in bytes (1048576, 1e6, \"1M\").")
    queue_depth: list[int] = Field(default_factory=lambda: list(DEFAULT_SWEEP["queue_depth"]),
                                   description="Pieces in flight per worker.")
    intra_op_parallelism: list[int] = Field(default_factory=lambda: list(DEFAULT_SWEEP["intra_op_parallelism"]),
                                            alias="thread_count", description="Worker threads per request.")
    single_submit: list[bool] = Field(default_factory=lambda: list(DEFAULT_SWEEP["single_submit"]),
                                      description="Submit pieces one at a time.")
    overlap_events: list[bool] = Field(default_factory=lambda: list(DEFAULT_SWEEP["overlap_events"]),
                                       description="Submit as earlier pieces complete.")

    @model_validator(mode="before")
    @classmethod
    def _lists(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = {SWEEP_ALIASES.get(k, k) if k == "io_parallel" else k: v for k, v in data.items()}
        if "thread_count" in data and "intra_op_parallelism" in data:
            raise ValueError("give one of thread_count, io_parallel, intra_op_parallelism (the same setting)")
        data = {k: v if isinstance(v, list) else [v] for k, v in data.items()}
        for key, values in data.items():
            if not values:
                raise ValueError(f"{key!r} needs at least one value")
        return data


def load_sweep(source: dict | str | os.PathLike | None) -> dict[str, list]:
    """The sweep's value lists: the defaults, overridden by a dict or a JSON file's keys."""
    if source is None:
        return {k: list(v) for k, v in DEFAULT_SWEEP.items()}
    if not isinstance(source, dict):
        try:
            source = json.loads(Path(source).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read the sweep config {os.fspath(source)!r}: {e}") from None
        if not isinstance(source, dict):
            raise ValueError(f"the sweep config must be a JSON object of lists, got {type(source).__name__}")
    try:
        lists = _Sweep.model_validate(source).model_dump()
    except ConfigError as e:
        raise ValueError("\n".join(f"sweep config: {line}" for line in str(e).splitlines())) from None
    lists["block_size"] = [parse_size(v, "sweep config: block_size") for v in lists["block_size"]]
    # each value as AioConfig checks it (bounds, types)
    return {name: [AioConfig(**{name: v}).model_dump()[name] for v in values] for name, values in lists.items()}


@dataclass
class Result:
    block_size: int
    queue_depth: int
    intra_op_parallelism: int
    single_submit: bool
    overlap_events: bool
    read_gbps: float | None = None           # O_DIRECT
    write_gbps: float | None = None
    buffered_read_gbps: float | None = None  # page cache + kernel readahead, cold

    @property
    def best_read_gbps(self) -> float | None:
        speeds = [v for v in (self.read_gbps, self.buffered_read_gbps) if v is not None]
        return max(speeds) if speeds else None

    @property
    def score(self) -> float:
        """What the recommendation maximises: the faster read path's GB/s plus the write GB/s."""
        return (self.best_read_gbps or 0.0) + (self.write_gbps or 0.0)

    @property
    def buffered_reads(self) -> bool:
        """Whether buffered reads were measured faster than O_DIRECT ones for this configuration."""
        return (self.buffered_read_gbps or 0.0) > (self.read_gbps or 0.0)

    def config(self) -> AioConfig:
        return AioConfig(block_size=self.block_size, queue_depth=self.queue_depth,
                         intra_op_parallelism=self.intra_op_parallelism, single_submit=self.single_submit,
                         overlap_events=self.overlap_events)


@dataclass
class TuneReport:
    results: list[Result]
    best_read_gbps: float | None
    best_write_gbps: float | None
    recommended: AioConfig
    seconds: float
    buffered_reads: bool = False  # the recommended config reads faster buffered than with O_DIRECT

    def aio_json(self) -> dict[str, Any]:
        """The recommended ``{"aio": ...}`` block, ``buffered_reads`` included."""
        section = self.recommended.to_ds_config()
        section["aio"].pop("use_gds")
        section["aio"]["buffered_reads"] = self.buffered_reads
        return section


def _print_progress(index: int, total: int, result: Result) -> None:
    parts = [f"[{index:>3}/{total}] block_size={result.block_size:>8} queue_depth={result.queue_depth:>3} "
             f"intra_op_parallelism={result.intra_op_parallelism} single_submit={result.single_submit!s:<5} "
             f"overlap_events={result.overlap_events!s:<5}"]
    if result.write_gbps is not None:
        parts.append(f"write {result.write_gbps:6.2f} GB/s")
    if result.read_gbps is not None:
        parts.append(f"read {result.read_gbps:6.2f} GB/s")
    if result.buffered_read_gbps is not None:
        parts.append(f"buffered read {result.buffered_read_gbps:6.2f} GB/s")
    print("  ".join(parts), file=sys.stderr, flush=True)


def _count_progress(stream) -> Callable[[int, int, Result], None]:
    """A progress counter: one line rewritten with \r on a terminal, a line per step otherwise."""
    tty = stream.isatty()

    def show(index: int, total: int, result: Result) -> None:
        text = f"ds-nvme-tune: {index}/{total} configurations"
        if tty:
            print(f"\r{text}", end="" if index < total else "\n", file=stream, flush=True)
        else:
            print(text, file=stream, flush=True)
    return show


def tune(nvme_dirs: Sequence[str | os.PathLike], sweep_config: dict | str | os.PathLike | None = None, *,
         read: bool = True, write: bool = True, buffered_read: bool = True, io_size: int | str = DEFAULT_IO_SIZE,
         loops: int = 1, log_dir: str | os.PathLike | None = None,
         progress: Callable[[int, int, Result], None] | None = _print_progress) -> TuneReport:
    """Run the sweep; returns every result, the best read/write GB/s and the recommended config
    (the best write config when reads are off, the best read config when writes are off, else
    the config with the best sum of both; a configuration's read speed is the faster of its
    O_DIRECT and, with ``buffered_read``, its cold buffered reads)."""
    if not read and not write:
        raise ValueError("nothing to measure: reads and writes are both disabled")
    dirs = [Path(d) for d in nvme_dirs]
    if not dirs:
        raise ValueError("give at least one directory to test (--nvme_dir)")
    for d in dirs:
        if not d.is_dir():
            raise FileNotFoundError(f"--nvme_dir {os.fspath(d)!r} is not a directory")
        if not os.access(d, os.W_OK):
            raise PermissionError(f"--nvme_dir {os.fspath(d)!r} is not writable")
    if isinstance(loops, bool) or not isinstance(loops, int) or loops < 1:
        raise ValueError(f"loops must be an integer >= 1, got {loops!r}")
    io_size = parse_size(io_size, "io_size")
    sweep = load_sweep(sweep_config)
    per_dir = -(-io_size // len(dirs) // 4096) * 4096
    combos = list(itertools.product(*(sweep[k] for k in DEFAULT_SWEEP)))
    start = time.perf_counter()
    results: list[Result] = []
    with AsyncIOHandle() as allocator:
        buffers = [allocator.new_cpu_locked_tensor(per_dir, torch.empty(0, dtype=torch.uint8)) for _ in dirs]
        for k, b in enumerate(buffers):
            b.copy_(torch.randint(0, 256, (per_dir,), dtype=torch.uint8, generator=torch.Generator().manual_seed(k)))
        expected = [b[:4096].clone() for b in buffers]
        files = [d / f".ds_nvme_tune.{os.getpid()}.{k}.bin" for k, d in enumerate(dirs)]
        try:
            for index, combo in enumerate(combos, start=1):
                result = Result(*combo)
                with AsyncIOHandle(**result.config().handle_kwargs()) as handle:
                    if write or not all(f.exists() for f in files):
                        seconds = _best_of(loops, lambda h=handle: _run(h, buffers, files, True, fresh=True))
                        if write:
                            result.write_gbps = per_dir * len(dirs) / seconds / 1e9
                    if read:
                        seconds = _best_of(loops, lambda h=handle: _run(h, buffers, files, False, fresh=False))
                        result.read_gbps = per_dir * len(dirs) / seconds / 1e9
                        _check_data(buffers, expected, files)
                if read and buffered_read:
                    with AsyncIOHandle(**{**result.config().handle_kwargs(), "buffered_reads": True}) as handle:
                        seconds = _best_of(loops, lambda h=handle: _run(h, buffers, files, False, fresh=False,
                                                                        evict=True))
                        result.buffered_read_gbps = per_dir * len(dirs) / seconds / 1e9
                        _check_data(buffers, expected, files)
                results.append(result)
                if progress:
                    progress(index, len(combos), result)
        finally:
            for f in files:
                f.unlink(missing_ok=True)
            for b in buffers:
                allocator.free_cpu_locked_tensor(b)
    report = _summarize(results, read, write, time.perf_counter() - start)
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        write_atomic(Path(log_dir) / "ds_nvme_tune.json", json.dumps(
            {"dirs": [os.fspath(d) for d in dirs], "io_size": io_size, "loops": loops,
             "results": [asdict(r) for r in results], "buffered_reads_faster": report.buffered_reads,
             "recommended": report.aio_json()}, indent=1))
    return report


def _best_of(loops: int, fn: Callable[[], float]) -> float:
    return min(fn() for _ in range(loops))


def _check_data(buffers, expected, files) -> None:
    for b, e, f in zip(buffers, expected, files, strict=True):
        if not torch.equal(b[:4096], e):
            raise OSError(f"ds-nvme-tune: data read back from '{f}' differs from what was written")


def evict_from_page_cache(path: str | os.PathLike) -> None:
    """Drop ``path``'s pages from the page cache (written back first), so that the next buffered
    read comes from the device; needs no privileges, unlike /proc/sys/vm/drop_caches."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _run(handle: AsyncIOHandle, buffers, files, write: bool, fresh: bool, evict: bool = False) -> float:
    if write and fresh:
        for f in files:
            f.unlink(missing_ok=True)
    if not write:
        for b in buffers:
            b[:4096].zero_()  # the read must bring these bytes back for the check to mean anything
    if evict:
        for f in files:
            evict_from_page_cache(f)
    start = time.perf_counter()
    for b, f in zip(buffers, files, strict=True):
        (handle.async_pwrite if write else handle.async_pread)(b, f)
    handle.wait()
    return time.perf_counter() - start


def _summarize(results: list[Result], read: bool, write: bool, seconds: float) -> TuneReport:
    best_read = max((r.best_read_gbps for r in results), default=None) if read else None
    best_write = max((r.write_gbps for r in results), default=None) if write else None
    best = max(results, key=lambda r: r.score)
    return TuneReport(results, best_read, best_write, best.config(), seconds, buffered_reads=best.buffered_reads)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ds-nvme-tune", description=__doc__.splitlines()[0])
    parser.add_argument("--nvme_dir", nargs="+", required=True, help="Directory (or directories) in which to "
                        "perform I/O tests: writable, on the NVMe device.")
    parser.add_argument("--sweep_config", help="Sweep configuration JSON file (lists of values per key).")
    parser.add_argument("--no_read", action="store_true", help="Disable read performance measurements.")
    parser.add_argument("--no_write", action="store_true", help="Disable write performance measurements.")
    parser.add_argument("--no_buffered_read", action="store_true", help="Measure O_DIRECT reads only (not also "
                        "buffered reads with kernel readahead).")
    parser.add_argument("--io_size", default=str(DEFAULT_IO_SIZE), help="Bytes to read/write per measurement "
                        "(e.g. 400M; default 256M).")
    parser.add_argument("--loops", type=int, default=1, help="Repetitions of each measurement (the best counts).")
    parser.add_argument("--log_dir", help="Write every configuration's results to LOG_DIR/ds_nvme_tune.json.")
    parser.add_argument("--output", help="Write the recommended {\"aio\": ...} block to this JSON file.")
    parser.add_argument("--verbose", action="store_true", help="Print every configuration's result (default: "
                        "a progress line per configuration).")
    args = parser.parse_args(argv)
    try:
        return _main(args)
    except KeyboardInterrupt:
        print("\nds-nvme-tune: interrupted", file=sys.stderr, flush=True)
        return 130


def _main(args: argparse.Namespace) -> int:
    print(f"Running DeepNVMe performance tuning on {args.nvme_dir}", file=sys.stderr, flush=True)
    try:
        report = tune(args.nvme_dir, args.sweep_config, read=not args.no_read, write=not args.no_write,
                      buffered_read=not args.no_buffered_read, io_size=args.io_size, loops=args.loops,
                      log_dir=args.log_dir, progress=_print_progress if args.verbose else _count_progress(sys.stderr))
    except (ValueError, OSError) as e:
        print(f"ds-nvme-tune: error: {e}", file=sys.stderr)
        return 2
    fmt = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
    print(f"Best performance (GB/sec): read = {fmt(report.best_read_gbps)}, write = {fmt(report.best_write_gbps)}"
          f"  ({len(report.results)} configurations in {report.seconds:.0f} s)")
    best = max(report.results, key=lambda r: r.score)
    if best.buffered_read_gbps is not None and best.read_gbps is not None:
        faster = "buffered (page cache + readahead)" if best.buffered_reads else "O_DIRECT"
        print(f"Reads with the recommended settings: O_DIRECT {best.read_gbps:.2f} GB/s, buffered "
              f"{best.buffered_read_gbps:.2f} GB/s: {faster} is faster")
    text = json.dumps(report.aio_json(), indent=2)
    print(text)
    if args.output:
        write_atomic(Path(args.output), text + "\n")
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
