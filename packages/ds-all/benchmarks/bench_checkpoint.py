"""The engine's checkpoints against torch.save/torch.load of the same states and against DCP used directly,
on the workload of ARCHITECTURE.md, 'The yardstick workload'.

The yardstick GPT (``packages/ds-zero/benchmarks/_yardstick.py``, ~34M parameters), 2 ranks x
1 thread on gloo, ZeRO-2 in float32 with AdamW, two training steps first (so Adam's states exist). Then,
rounds of, in turn (interleaved, so that the machine's drift falls on all alike):

* ``engine``: ``engine.save_checkpoint(dir)`` / ``engine.load_checkpoint(dir)`` (DCP shards of whole
  parameters, every file fsynced, renamed into place, ``latest`` last);
* ``torch``: what DeepSpeed writes, with torch.save: rank 0 the module's ``state_dict()``, every rank its
  own ZeRO partition (``zero.state_dict()``: Adam's states of its shard); loading: ``torch.load``
  (``weights_only=True``) on every rank, ``load_state_dict`` of both. ``torch+fsync`` is the same with each
  file fsynced, as ours are (a save that survives a power cut);
* ``dcp``: ``torch.distributed.checkpoint.save``/``load`` of the same shards ds-zero describes, with DCP's
  own ``FileSystemWriter`` (``torch.save`` per entry, fsynced) and no tag directory, metadata, rename or
  ``latest``; the engine writes the entries raw through ds-io (O_DIRECT) instead.

A time is the slowest rank's, from a barrier to a barrier; the table gives the median over rounds and
the bytes on disk. ``--async`` also times ``save_checkpoint(..., async_save=True)``: how long training is
blocked (the call's return) and how long the write takes to finish in the background.

    python benchmarks/bench_checkpoint.py [--rounds 5] [--async] [--cold] [--dir /tmp/...] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# the workload's one definition (ARCHITECTURE.md, "The yardstick workload"), from ds-zero's benchmarks folder by
# path: benchmarks are not installed, and this package gains no dependency on ds-zero
sys.path.append(str(Path(__file__).resolve().parents[2] / "ds-zero" / "benchmarks"))
import _yardstick as yardstick

import ds_comm
from ds_comm.testing import spawn

KINDS = ["engine", "torch", "torch+fsync", "dcp"]



def _disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _timed(fn) -> float:
    """The slowest rank's seconds for ``fn``, barrier to barrier."""
    ds_comm.barrier()
    start = time.perf_counter()
    fn()
    ds_comm.barrier()
    seconds = torch.tensor([time.perf_counter() - start])
    ds_comm.all_reduce(seconds, op=ds_comm.ReduceOp.MAX)
    return float(seconds)


def _torch_save(engine, path: Path, fsync: bool) -> None:
    rank = ds_comm.get_rank()

    def write(obj, target: Path) -> None:
        with open(target, "wb") as f:
            torch.save(obj, f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())

    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    ds_comm.barrier()
    if rank == 0:
        write(engine.module.state_dict(), path / "model_states.pt")
    write(engine.zero.state_dict(), path / f"optim_states_rank{rank}.pt")


def _torch_load(engine, path: Path) -> None:
    rank = ds_comm.get_rank()
    engine.module.load_state_dict(torch.load(path / "model_states.pt", weights_only=True))
    engine.zero.load_state_dict(torch.load(path / f"optim_states_rank{rank}.pt", weights_only=True))


def _save(kind: str, engine, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from ds_zero._checkpoint import zero_state

    if kind == "engine":
        engine.save_checkpoint(path, tag="t")
    elif kind == "dcp":
        dcp.save(zero_state(engine.zero), storage_writer=dcp.FileSystemWriter(path))
    else:
        _torch_save(engine, path, fsync=kind.endswith("fsync"))


def _load(kind: str, engine, path: Path, meta: dict) -> None:
    from ds_zero._checkpoint import load_zero_state

    if kind == "engine":
        engine.load_checkpoint(path, tag="t")
    elif kind == "dcp":
        load_zero_state(engine.zero, path, meta)
    else:
        _torch_load(engine, path)


def _drop_page_cache() -> None:
    """Loads from the disk, not from the page cache the save just filled (root only)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1")


def run(rank: int, world_size: int, root: str, rounds: int, with_async: bool, cold: bool) -> dict:
    torch.set_num_threads(1)
    import ds_all
    from ds_zero import read_zero_metadata

    torch.manual_seed(0)
    model = yardstick.GPT()
    config = {"train_micro_batch_size_per_gpu": yardstick.Shape().micro_batch, "steps_per_print": 10**6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01, "torch_adam": True}},
              "zero_optimization": {"stage": 2}}
    engine, *_ = ds_all.initialize(model=model, config=config)
    for step in range(2):
        engine.backward(engine(yardstick.tokens(step, 0, rank)))
        engine.step()
    base = Path(root)
    times: dict[str, dict[str, list[float]]] = {k: {"save": [], "load": []} for k in KINDS}
    sizes: dict[str, int] = {}
    meta: dict = {}
    for r in range(rounds):
        order = KINDS[r % len(KINDS):] + KINDS[:r % len(KINDS)]
        for kind in order:
            path = base / f"{kind}-{r}"
            times[kind]["save"].append(_timed(functools.partial(_save, kind, engine, path)))
            if kind == "engine" and not meta:
                meta = read_zero_metadata(path / "t")
            if kind == "dcp" and rank == 0:  # what load_zero_state reads besides DCP's files
                (path / "zero_meta.json").write_text(json.dumps(meta))
            if cold and rank == 0:
                _drop_page_cache()
            ds_comm.barrier()
            times[kind]["load"].append(_timed(functools.partial(_load, kind, engine, path, meta)))
            if rank == 0:
                sizes[kind] = _disk_bytes(path)
            ds_comm.barrier()
            if rank == 0:
                shutil.rmtree(path)
    out = {"times": times, "sizes": sizes}
    if with_async:
        blocked, finished = [], []
        for r in range(rounds):
            path = base / f"async-{r}"
            ds_comm.barrier()
            start = time.perf_counter()
            engine.save_checkpoint(path, tag="t", async_save=True)
            blocked.append(time.perf_counter() - start)
            engine.wait_checkpoint()
            finished.append(time.perf_counter() - start)
            ds_comm.barrier()
            if rank == 0:
                shutil.rmtree(path)
        out["async"] = {"blocked": blocked, "finished": finished}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--async", dest="with_async", action="store_true", help="also time async_save=True")
    parser.add_argument("--cold", action="store_true",
                        help="drop the page cache before each load (needs root): reads from the disk")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_checkpoint_"))
    try:
        results = spawn(run, world_size=2, args=(str(root), args.rounds, args.with_async, args.cold), timeout=3600)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    first = results[0]
    medians = {k: {op: statistics.median(v) for op, v in ops.items()} for k, ops in first["times"].items()}
    print(f"ZeRO-2 fp32, GPT ~34M parameters, 2 ranks, medians of {args.rounds} interleaved rounds (slowest rank), "
          f"loads {'from the disk (page cache dropped)' if args.cold else 'right after the save (page cache warm)'}")
    print(f"{'':<12} {'save s':>8} {'load s':>8} {'MiB on disk':>12} {'save vs ours':>13} {'load vs ours':>13}")
    ours = medians["engine"]
    for kind in KINDS:
        m = medians[kind]
        print(f"{kind:<12} {m['save']:>8.3f} {m['load']:>8.3f} {first['sizes'][kind] / 2**20:>12.1f} "
              f"{m['save'] / ours['save']:>12.2f}x {m['load'] / ours['load']:>12.2f}x")
    if "async" in first:
        blocked = max(statistics.median(r["async"]["blocked"]) for r in results)
        finished = max(statistics.median(r["async"]["finished"]) for r in results)
        print(f"async save: training blocked {blocked:.3f} s ({blocked / ours['save']:.1%} of the synchronous save), "
              f"written in {finished:.3f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"medians": medians, "raw": results}, indent=2))


if __name__ == "__main__":
    main()
