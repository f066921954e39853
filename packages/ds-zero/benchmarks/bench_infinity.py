"""ZeRO-Infinity: train a GPT whose model states do not fit in this machine's memory.

The yardstick's GPT-style pre-LN decoder (``_yardstick.py``) at other sizes (default: d_model 2560,
24 layers, 20 heads, vocab 8192, sequence 64, untied LM head: 1.93B parameters). Float32 Adam's model
states are 16 bytes per parameter (weights, gradients, two moments): 31 GB against this machine's 24 GiB of RAM. The model is built under
``ds_zero.Init`` with ``offload_param.device: nvme`` (each slice written to disk as its module is
built, so no rank ever holds the model), then trained by ``ZeroOptimizer`` at stage 3 with the
parameters and Adam's states on NVMe (12 bytes per parameter on disk) and the gradient partition in
RAM (4 bytes per parameter / N): 2 ranks x 1 thread on gloo, one micro-batch of 1 x 64 tokens per
rank, the same batch every step (the loss must fall), AdamW.

Prints per step: seconds, the optimizer step's seconds, the loss, the bytes read and written (the
optimizer's, and the parameter fetches of forward and backward); the optimizer's NVMe bandwidth
(both ranks' bytes over the slower rank's step time) against the disk's, measured by ``ds-nvme-tune``
in the same run, before and after training (this VM's disk drifts by 30 % within the hour): its best
read and write GB/s, averaged over the two runs, combined for the step's mix of reads and writes;
peak RSS per rank. The handle runs with the first tuning's recommended ``aio`` block (``--aio FILE``
gives one instead). ``--json PATH`` writes the same figures.

``--checkpoint``: then a checkpoint of states larger than RAM: ``save_zero_checkpoint`` (timed, with
the rise of peak RSS while it runs), one more step, ``load_zero_checkpoint`` of the saved one (the same),
and that step again: its loss must be the first time's, bit for bit, and so must the next step's, which
uses the loaded Adam states (another 12 bytes per parameter on disk).

    python benchmarks/bench_infinity.py [--nvme-path DIR] [--steps 3] [--checkpoint] [--json out.json]

It needs about 24 GB free under ``--nvme-path`` (checked before anything is written) and takes
minutes per step: a benchmark, not a test (the tests run a scaled-down version:
tests/test_stage3.py::test_infinity_scaled_down_model_states_beyond_a_ram_budget).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _yardstick import GPT, Shape

from ds_comm.testing import spawn
from ds_zero import Init, ZeroOptimizer, load_zero_checkpoint, save_zero_checkpoint


def shape(args) -> Shape:
    """The yardstick GPT (``_yardstick.py``) at ``args``' sizes, one sample of ``--seq`` tokens per rank."""
    return Shape(args.vocab, args.d_model, args.layers, args.heads, args.seq, micro_batch=1)


def ds_config(args, path: str) -> dict:
    aio = json.loads(Path(args.aio).read_text()).get("aio", {}) if args.aio else args.tuned_aio
    return {"train_micro_batch_size_per_gpu": 1, "aio": aio, "zero_optimization": {
        "stage": 3, "sub_group_size": int(args.sub_group_size),
        "stage3_max_live_parameters": int(args.max_live), "stage3_prefetch_bucket_size": int(args.max_live // 2),
        "stage3_max_reuse_distance": 0, "stage3_param_persistence_threshold": 10 * args.d_model,
        "offload_param": {"device": "nvme", "nvme_path": path},
        "offload_optimizer": {"device": "nvme", "nvme_path": path, "pipeline_read": True, "pipeline_write": True}}}


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) * 1024


def _timed_with_peak(work) -> tuple[float, int]:
    """Seconds ``work()`` took and how far peak RSS rose above RSS meanwhile (VmHWM, reset first)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before, start = _status_bytes("VmRSS"), time.perf_counter()
    work()
    return time.perf_counter() - start, _status_bytes("VmHWM") - before


def checkpoint_round_trip(zero, model, tokens, directory: str) -> dict:
    """A save, a step, a load, the step again and one more (see the module docstring)."""
    def step() -> float:
        loss = model(tokens)
        zero.backward(loss)
        zero.step()
        zero.zero_grad()
        return loss.item()

    save_s, save_rise = _timed_with_peak(lambda: save_zero_checkpoint(zero, directory))
    first = [step(), step()]
    load_s, load_rise = _timed_with_peak(lambda: load_zero_checkpoint(zero, directory))
    again = [step(), step()]
    on_disk = sum(f.stat().st_size for f in Path(directory).rglob("*") if f.is_file())
    return {"save_s": save_s, "save_rss_rise": save_rise, "load_s": load_s, "load_rss_rise": load_rise,
            "losses": first, "losses_after_load": again, "checkpoint_bytes": on_disk}


def run(rank: int, world_size: int, args, path: str) -> dict:
    torch.set_num_threads(1)
    config = ds_config(args, path)
    began = time.perf_counter()
    torch.manual_seed(0)
    with Init(config_dict_or_path=config):
        model = GPT(shape(args))
    built = time.perf_counter()
    rss_built = _rss()
    zero = ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs={"lr": args.lr, "weight_decay": 0.0},
                         config=config)
    ready = time.perf_counter()
    nvme = zero._nvme
    tokens = torch.randint(0, args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(rank))
    steps = []
    for _ in range(args.steps):
        before = (nvme.bytes_read, nvme.bytes_written, nvme.fetch_bytes_read)
        start = time.perf_counter()
        loss = model(tokens)
        zero.backward(loss)
        stepping = time.perf_counter()
        zero.step()
        end = time.perf_counter()
        zero.zero_grad()
        steps.append({"s": end - start, "optimizer_s": end - stepping, "loss": loss.item(),
                      "optimizer_read": nvme.bytes_read - before[0], "optimizer_written": nvme.bytes_written - before[1],
                      "fetch_read": nvme.fetch_bytes_read - before[2]})
    memory = zero.memory_bytes()
    checkpoint = checkpoint_round_trip(zero, model, tokens, f"{path}/checkpoint") if args.checkpoint else None
    # no zero.close(): at stage 3 it makes every parameter whole again, which is what does not fit here
    return {"init_s": built - began, "setup_s": ready - built, "steps": steps, "memory": memory,
            "rss_after_init": rss_built, "peak_rss": _rss(), "checkpoint": checkpoint}


# a short sweep (4 configurations, 1 GiB each: about 30 s) around what the default sweep found best here
SWEEP = {"block_size": ["1M", "8M"], "queue_depth": [32], "intra_op_parallelism": [1, 2], "overlap_events": [True]}


def tune_disk(directory: str) -> tuple[float, float, dict]:
    """``ds-nvme-tune`` on ``directory``: its best read and write GB/s and its recommended ``aio`` block."""
    work = Path(tempfile.mkdtemp(prefix="tune_", dir=directory))
    try:
        (work / "sweep.json").write_text(json.dumps(SWEEP))
        command = shutil.which("ds-nvme-tune") or str(Path(sys.executable).with_name("ds-nvme-tune"))
        subprocess.run([command, "--nvme_dir", str(work), "--log_dir", str(work), "--io_size", "1G",
                        "--sweep_config", str(work / "sweep.json"), "--output", str(work / "aio.json")],
                       check=True, stdout=subprocess.DEVNULL)
        rows = json.loads((work / "ds_nvme_tune.json").read_text())["results"]
        read = max(v for r in rows for v in (r["read_gbps"], r["buffered_read_gbps"]) if v is not None)
        write = max(r["write_gbps"] for r in rows if r["write_gbps"] is not None)
        return read, write, json.loads((work / "aio.json").read_text())["aio"]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=2560)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--heads", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--sub-group-size", type=float, default=1e7, help="elements per optimizer chunk")
    parser.add_argument("--max-live", type=float, default=1e8, help="stage3_max_live_parameters")
    parser.add_argument("--nvme-path", default=tempfile.gettempdir(), help="a fresh directory is made under it")
    parser.add_argument("--aio", help="a JSON file with an \"aio\" block (default: what ds-nvme-tune recommends)")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--checkpoint", action="store_true", help="then save and load a checkpoint (see above)")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()

    numel = shape(args).params()
    states, ram = 16 * numel, _ram_bytes()
    print(f"GPT {numel / 1e9:.2f}B parameters (d_model {args.d_model}, {args.layers} layers, vocab {args.vocab}), "
          f"fp32 Adam model states {states / 1e9:.1f} GB vs {ram / 2**30:.1f} GiB of RAM; 2 ranks, 1 x {args.seq} "
          "tokens per rank, parameters and optimizer on NVMe", flush=True)
    before = tune_disk(args.nvme_path)
    args.tuned_aio = before[2]
    print(f"ds-nvme-tune before: read {before[0]:.2f} GB/s, write {before[1]:.2f} GB/s", flush=True)
    path = tempfile.mkdtemp(prefix="ds_infinity_", dir=args.nvme_path)
    try:
        results = spawn(run, world_size=2, args=(args, path), timeout=args.timeout)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    after = tune_disk(args.nvme_path)
    print(f"ds-nvme-tune after: read {after[0]:.2f} GB/s, write {after[1]:.2f} GB/s", flush=True)
    bandwidth = ((before[0] + after[0]) / 2, (before[1] + after[1]) / 2)
    report = {"parameters": numel, "model_state_bytes": states, "ram_bytes": ram, "ranks": results,
              "aio": args.tuned_aio if not args.aio else args.aio, "tune_before": before[:2], "tune_after": after[:2]}
    print(f"init (build under Init, slices to NVMe): {max(r['init_s'] for r in results):.1f} s; ZeroOptimizer "
          f"(layout, states to NVMe): {max(r['setup_s'] for r in results):.1f} s")
    print("| step | s | optimizer s | loss | optimizer read GB | written GB | fetch read GB | optimizer GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for i in range(args.steps):
        rows = [r["steps"][i] for r in results]
        moved = sum(r["optimizer_read"] + r["optimizer_written"] for r in rows)
        seconds = max(r["optimizer_s"] for r in rows)
        print(f"| {i + 1} | {max(r['s'] for r in rows):.1f} | {seconds:.1f} | {rows[0]['loss']:.4f} | "
              f"{sum(r['optimizer_read'] for r in rows) / 1e9:.2f} | {sum(r['optimizer_written'] for r in rows) / 1e9:.2f} "
              f"| {sum(r['fetch_read'] for r in rows) / 1e9:.2f} | {moved / seconds / 1e9:.2f} |")
    last = [r["steps"][-1] for r in results]
    read = sum(r["optimizer_read"] for r in last)
    written = sum(r["optimizer_written"] for r in last)
    achieved = (read + written) / statistics.median(max(r["steps"][i]["optimizer_s"] for r in results)
                                                   for i in range(args.steps)) / 1e9
    report["optimizer_gbs"] = achieved
    best_read, best_write = bandwidth
    disk = (read + written) / 1e9 / (read / 1e9 / best_read + written / 1e9 / best_write)
    report.update(disk_read_gbs=best_read, disk_write_gbs=best_write, disk_mixed_gbs=disk)
    print(f"optimizer NVMe traffic {achieved:.2f} GB/s (median step) vs the disk's {disk:.2f} GB/s for this mix "
          f"(ds-nvme-tune, mean of before and after: read {best_read:.2f}, write {best_write:.2f} GB/s): "
          f"{achieved / disk:.0%}")
    for rank, r in enumerate(results):
        print(f"rank {rank}: peak RSS {r['peak_rss'] / 2**30:.2f} GiB (after Init {r['rss_after_init'] / 2**30:.2f}); "
              f"ds-zero holds {sum(v for k, v in r['memory'].items() if k != 'nvme') / 2**30:.2f} GiB in RAM "
              f"({', '.join(f'{k} {v / 2**30:.2f}' for k, v in r['memory'].items())} GiB)")
    if args.checkpoint:
        ck = [r["checkpoint"] for r in results]
        rises = {kind: ", ".join(f"{c[kind + '_rss_rise'] / 2**20:.0f}" for c in ck) for kind in ("save", "load")}
        print(f"checkpoint of {ck[0]['checkpoint_bytes'] / 1e9:.1f} GB: save {max(c['save_s'] for c in ck):.1f} s, "
              f"load {max(c['load_s'] for c in ck):.1f} s; peak RSS rose {rises['save']} MiB (save) and "
              f"{rises['load']} MiB (load) per rank")
        first, again = ck[0]["losses"], ck[0]["losses_after_load"]
        print(f"the two steps after the save: losses {first[0]:.6f}, {first[1]:.6f}; after the load: {again[0]:.6f}, "
              f"{again[1]:.6f} ({'equal' if first == again else 'DIFFERENT'})")
    losses = [r["loss"] for r in results[0]["steps"]]
    print(f"loss {' -> '.join(f'{x:.4f}' for x in losses)}: {'fell' if losses[-1] < losses[0] else 'DID NOT FALL'}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


def _ram_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


if __name__ == "__main__":
    main()
