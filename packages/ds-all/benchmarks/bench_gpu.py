"""The GPU check's benchmark: ds against the plain-PyTorch baseline on one GPU, the figures of issue 28.

Five parts, each in a fresh Python process (a crash, a CUDA error or an out-of-memory kill costs one
part, not the run), each writing its figures as it goes, so a part stopped at its time limit still
reports what it measured:

* ``gpt``: the GPT of the yardstick workload (ARCHITECTURE.md; ``packages/ds-zero/benchmarks/_yardstick.py``,
  its sizes as a ``Shape``) scaled to ~356M parameters (d_model 1024, 20 layers, 16 heads, sequence 1024,
  vocab 50304, micro-batch 8) in bf16 through ``ds_all.initialize`` at ZeRO stages 0-3 against plain
  PyTorch (float32 weights under ``torch.autocast`` bf16, ``torch.optim.AdamW(fused=True)``), steps
  interleaved from the same weights on the same batches: step time medians, the median of adjacent
  steps' ratios (goal <= 1.05) and the losses (the last within 2 % of plain's: bf16 tolerance).
* ``adam``: ``ds_ops.FusedAdam`` against ``torch.optim.AdamW(fused=True)`` on 100M float32 parameters:
  the speed ratio (goal >= 0.95) and the bandwidth Adam's 28 bytes/element need as a fraction of a
  device-to-device copy's (goal >= 80 %).
* ``copies``: 1 GiB device -> pinned host and back through ds-zero's offload copy path
  (``ds_zero._transfer``) against plain ``tensor.copy_(non_blocking=True)`` between torch-pinned
  buffers (goal >= 80 % of the probe).
* ``zero3_offload``: ZeRO-3 with ``offload_param: cpu`` against ZeRO-3 without, the ``gpt`` model,
  interleaved (goal <= 1.3x).
* ``offload``: ZeRO-Offload (stage 2, bf16, ``offload_optimizer: cpu``) on the largest GPT that the GPU
  and the host's memory hold (goal >= 5B parameters): one process per size, 5.2B first (the goal),
  then 6.0B if that ran and time is left, else smaller ones; TFLOPS (6 x parameters x tokens / step)
  and where the step's time goes (forward, backward with the gradients' device->host copies, the CPU
  Adam, the rest of the step: waiting for copies, host->device parameters).

    python benchmarks/bench_gpu.py --json bench_gpu.json [--budget 200] [--parts gpt adam ...]
    python benchmarks/bench_gpu.py --smoke     # every part on the CPU (gloo), tiny sizes, under a minute

Run by ``scripts/gpu_check.sh`` on the lent H100; not part of CI (nox's ``bench`` session runs it too,
as a smoke run where there is no GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _bench_gpu_parts import HOST_BYTES_PER_PARAM, OFFLOAD_SIZES, SMOKE_OFFLOAD, run_part

PARTS = ("gpt", "adam", "copies", "zero3_offload", "offload")
CAPS = {"gpt": 45, "adam": 15, "copies": 15, "zero3_offload": 30, "offload": 110}  # seconds per part (GPU)
SMOKE_CAP = 40


# ---------------------------------------------------------------- the orchestrator


class Runner:
    def __init__(self, smoke: bool, budget: float, workdir: str):
        self.smoke, self.deadline, self.workdir, self.runs = smoke, time.time() + budget, Path(workdir), 0

    def left(self) -> float:
        return self.deadline - time.time()

    def part(self, part: str, cap: float, *extra: str) -> dict:
        """Runs one part in a fresh process for at most ``cap`` seconds; its figures, exit and log's end."""
        self.runs += 1
        out, log = self.workdir / f"{part}-{self.runs}.json", self.workdir / f"{part}-{self.runs}.log"
        timeout = max(1.0, min(cap, self.left()))
        cmd = [sys.executable, os.path.abspath(__file__), "--part", part, "--out", str(out), "--deadline",
               str(time.time() + timeout - 3), *extra] + (["--smoke"] if self.smoke else [])
        env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
        if self.smoke:
            env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
        begin = time.perf_counter()
        with open(log, "w") as fh:
            try:
                exit_code = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                exit_code = f"killed at its time limit ({timeout:.0f} s)"
        text = log.read_text(errors="replace")
        sys.stdout.write(text)
        sys.stdout.flush()
        try:
            data = json.loads(out.read_text())
        except (OSError, ValueError):
            data = {}
        data["exit"], data["wall_s"] = exit_code, round(time.perf_counter() - begin, 1)
        if exit_code != 0:
            data["log_tail"] = text[-3000:]
        return data


def orchestrate(args: argparse.Namespace) -> dict:
    import platform

    smoke = args.smoke
    caps = {k: SMOKE_CAP for k in CAPS} if smoke else dict(CAPS)
    report = {"smoke": smoke, "budget_s": args.budget, "python": platform.python_version(), "parts": {}}
    with tempfile.TemporaryDirectory(prefix="bench_gpu_") as workdir:
        runner = Runner(smoke, args.budget, workdir)
        for part in args.parts:
            begin = time.time()
            cap = min(caps[part], runner.left())
            if runner.left() < 5:
                report["parts"][part] = {"skipped": "out of the benchmark's time budget"}
            elif part == "gpt":
                report["parts"][part] = _gpt(runner, cap)
            elif part == "offload":
                report["parts"][part] = _offload(runner, runner.left(), smoke)  # all that is left
            else:
                report["parts"][part] = runner.part(part, cap)
            print(f"== {part}: {time.time() - begin:.0f} s", flush=True)
            _write(args.json, report)
    report["summary"] = _summary(report["parts"])
    _write(args.json, report)
    return report


def _gpt(runner: Runner, cap: float) -> dict:
    """Stages 0-3 in one process; if it dies, the stage it died in is marked and the rest rerun."""
    end, stages, merged, tries = time.time() + cap, ["0", "1", "2", "3"], {}, 0
    while stages and end - time.time() > 5 and tries < 3:
        tries += 1
        data = runner.part("gpt", end - time.time(), "--stages", *stages)
        merged.update({k: v for k, v in data.items() if k not in ("exit", "wall_s", "log_tail")})
        merged[f"run{tries}"] = {k: data.get(k) for k in ("exit", "wall_s", "log_tail") if k in data}
        missing = [s for s in stages if f"stage{s}" not in data]
        if missing and data["exit"] != 0:
            merged[f"stage{missing[0]}"] = {"error": f"the process ended ({data['exit']}) in this stage"}
            missing = missing[1:]
        stages = missing if data["exit"] != 0 else []
    return merged


def _offload(runner: Runner, budget: float, smoke: bool) -> dict:
    """The goal size first; after it ran, the next size up if time is left, else the sizes below it."""
    sizes = ["s2", "s1"] if smoke else ["5.2B", "6.0B", "3.6B", "2.0B"]
    table = SMOKE_OFFLOAD if smoke else OFFLOAD_SIZES
    available = _mem_available()
    out, largest, end = {"host_mem_available_gib": round(available / 2**30, 1), "tries": {}}, None, time.time() + budget
    for size in sizes:
        if largest is not None and table[size].params() < table[largest].params():
            break
        if largest is None and size == "6.0B":  # the goal size failed: no bigger one
            continue
        need = HOST_BYTES_PER_PARAM * table[size].params() + 6 * 2**30
        left = end - time.time()
        if need > 0.92 * available:
            out["tries"][size] = {"skipped": f"needs ~{need / 2**30:.0f} GiB of host memory, "
                                             f"{available / 2**30:.0f} GiB available"}
            continue
        bigger = largest is not None  # the goal size ran: this one is a bonus, worth a try only with time for it
        if left < (15 if smoke else (80 if bigger else 45)):
            out["tries"][size] = {"skipped": f"{left:.0f} s left of the benchmark's budget"}
            continue
        data = runner.part("offload", left, "--size", size)
        out["tries"][size] = data
        ran = data.get("result", {}).get("steps_done", 0) >= 2
        if ran and (largest is None or table[size].params() > table[largest].params()):
            largest = size
    out["largest"] = largest
    if largest is not None:
        out["result"] = out["tries"][largest]["result"]
    return out


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _summary(parts: dict) -> dict:
    """The figures against issue 28's goals, one line each."""
    out = {}
    for stage in range(4):
        row = parts.get("gpt", {}).get(f"stage{stage}", {})
        if "ratio" in row:
            out[f"gpt_stage{stage}"] = (f"{row['ratio']:.3f}x plain (goal <= 1.05: {'met' if row['ratio_ok'] else 'missed'})"
                                        f", last loss {row['last_loss_rel_diff']:.2%} off "
                                        f"({'within' if row['loss_ok'] else 'outside'} bf16 tolerance)")
    adam = parts.get("adam", {})
    if "fused_adam" in adam:
        fa = adam["fused_adam"]
        out["fused_adam"] = f"{fa['speed_vs_torch']:.3f}x torch's speed (goal >= 0.95), {fa['adam_gbps']:.0f} GB/s"
    if "fraction_ok" in adam.get("copy_probe", {}):
        out["fused_adam_bandwidth"] = f"{adam['copy_probe']['adam_fraction_of_copy']:.1%} of a d2d copy (goal >= 80 %)"
    for direction, row in parts.get("copies", {}).get("copies", {}).items():
        out[f"copies_{direction}"] = (f"{row['ds_gbps']:.1f} GB/s, {row['fraction']:.1%} of the probe's "
                                      f"{row['probe_gbps']:.1f} GB/s (goal >= 80 %)")
    z3 = parts.get("zero3_offload", {}).get("zero3", {})
    if "ratio" in z3:
        out["zero3_offload_param"] = (f"{z3['ratio']:.3f}x ZeRO-3 with the optimizer alone offloaded (goal <= 1.3); "
                                      f"{z3['vs_no_offload']['ratio']:.3f}x ZeRO-3 with nothing offloaded")
    offload = parts.get("offload", {})
    if offload.get("result"):
        r = offload["result"]
        out["zero_offload"] = (f"largest {offload['largest']} ({r['params'] / 1e9:.2f}B parameters, goal >= 5B: "
                               f"{'met' if r['params_ok'] else 'missed'}), {r['step_s']:.2f} s/step, "
                               f"{r['tflops']:.1f} TFLOPS")
    return out


def _write(path: str | None, report: dict) -> None:
    if path:
        with open(f"{path}.tmp", "w") as f:
            json.dump(report, f, indent=1, default=str)
        os.replace(f"{path}.tmp", path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="every part on the CPU with tiny sizes (gloo)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--budget", type=float, default=None, help="seconds for all parts (default 210; smoke 150)")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)  # inside a part's own process
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.part:
        args.deadline = args.deadline or time.time() + 600
        run_part(args)
        return
    if not args.smoke:
        import torch

        if not torch.cuda.is_available():
            print("bench_gpu: no CUDA device: running the --smoke sizes on the CPU instead", flush=True)
            args.smoke = True
    if args.budget is None:
        args.budget = 150.0 if args.smoke else 210.0
    report = orchestrate(args)
    print("\n".join(["", "bench_gpu summary:"] + [f"  {k}: {v}" for k, v in report["summary"].items()]
                    + [f"  {k}: {v.get('skipped') or v.get('error') or 'no figures (see its log)'}"
                       for k, v in report["parts"].items() if not _has_figures(k, v)]), flush=True)


def _has_figures(part: str, data: dict) -> bool:
    keys = {"gpt": "stage0", "adam": "fused_adam", "copies": "copies", "zero3_offload": "zero3", "offload": "result"}
    return keys[part] in data and "error" not in data[keys[part]]


if __name__ == "__main__":
    main()
