"""ds-autotune's tuner against the exhaustive grid over the same space, on the §9 GPT, 2 ranks, one run.

The workload is ARCHITECTURE.md's yardstick GPT (its one definition, ``packages/ds-zero/benchmarks/_yardstick.py``,
loaded from its file) scaled down so that the grid runs in a few minutes on a CPU: vocabulary 1024,
d_model 128, 2 layers, 4 heads, sequence 64 (``--shape`` changes it). The space: ZeRO stages 0-3 x
micro-batch sizes 1, 2, 4, 8, 16, 32 (24 experiments, 32 samples per rank per step: the accumulation is
32 / micro-batch), metric throughput, steps 3..12 timed. Both searches are full ``ds-autotune`` runs (model-info
run included), each experiment a fresh 2-rank ``ds-launch`` of this file:

- grid: ``tuner_type`` gridsearch, no early stopping (every experiment runs);
- tuner: ``tuner_type`` model_based, ``tuner_early_stopping`` 2.

Then the two bests head to head: each re-measured ``--rounds`` times, alternating (the machine's load drifts
over the minutes a grid takes, so values measured minutes apart are not comparable); the quality ratio
is the median of the tuner's best over the median of the grid's best (criterion: >= 0.95). Printed: both
wall times, experiments and bests as each search measured them, the head-to-head medians, the quality
ratio, the tuner's own best over the grid's best, and the wall-time ratio (criterion: <= 1/3).
``--json PATH`` writes the same figures.

    python benchmarks/bench_autotune.py [--rounds 3] [--json out.json] [--keep DIR]
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

# the workload's one definition (ARCHITECTURE.md, "The yardstick workload"): ds-zero's benchmarks folder, by path
# (benchmarks are not installed, and this package gains no dependency on ds-zero)
_YARDSTICK = Path(__file__).resolve().parents[2] / "ds-zero" / "benchmarks"
SHAPE = {"VOCAB": 1024, "D_MODEL": 128, "LAYERS": 2, "HEADS": 4, "SEQ": 64}
SIZES = [1, 2, 4, 8, 16, 32]


def _yardstick(shape: dict):
    """The yardstick's module and its ``Shape`` at ``shape`` (``--shape``: VOCAB, D_MODEL, LAYERS, HEADS, SEQ),
    imported in the worker only (the search's process needs no torch)."""
    if str(_YARDSTICK) not in sys.path:
        sys.path.append(str(_YARDSTICK))
    import _yardstick

    return _yardstick, _yardstick.Shape(**{key.lower(): value for key, value in shape.items()})


def worker(argv: list[str]) -> None:
    """One experiment's rank (ds-launch runs this file with --worker): train until the engine exits."""
    import torch

    import ds_all

    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--shape", default=json.dumps(SHAPE))
    p.add_argument("--local_rank", type=int, default=0)
    p.add_argument("--steps", type=int, default=1000)
    ds_all.add_config_arguments(p)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    yardstick, shape = _yardstick(json.loads(args.shape))
    torch.manual_seed(0)
    model = yardstick.GPT(shape)
    engine, _, _, _ = ds_all.initialize(args=args, model=model, model_parameters=model.parameters())
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    g = torch.Generator().manual_seed(engine.global_rank)
    for _ in range(args.steps):
        for _ in range(gas):
            tokens = torch.randint(0, shape.vocab, (micro, shape.seq), generator=g)
            engine.backward(engine(tokens))
            engine.step()
    engine.destroy()


def _search(directory: Path, tuner: str, early_stopping: int, shape: dict) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": SIZES, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
           "zero_optimization": {"stage": "all"}, "steps_per_print": 1000,
           "autotuning": {"enabled": True, "start_profile_step": 2, "end_profile_step": 11, "metric": "throughput",
                          "tuner_type": tuner, "tuner_early_stopping": early_stopping, "tuner_num_trials": 100,
                          "results_dir": str(directory / "results"), "exps_dir": str(directory / "exps"),
                          "overwrite": True}}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "cfg.json").write_text(json.dumps(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    cmd = [shutil.which("ds-autotune") or "ds-autotune", "--num_gpus", "2", "--seed", "0", str(Path(__file__).resolve()),
           "--worker", "--shape", json.dumps(shape), "--deepspeed_config", str(directory / "cfg.json")]
    start = time.perf_counter()
    with open(directory / "ds-autotune.log", "w") as log:
        rc = subprocess.run(cmd, env=env, cwd=directory, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - start
    if rc != 0:
        raise SystemExit(f"ds-autotune ({tuner}) failed with exit code {rc}; see {directory / 'ds-autotune.log'}")
    results = json.loads((directory / "results" / "results.json").read_text())
    ran = [r for r in results["experiments"] if r["status"] != "pruned"]
    return {"wall_s": wall, "best": results["best"]["name"], "best_metric": results["best"]["metric"],
            "experiments_run": len(ran), "best_config": results["best"]["ds_config"]}


def _measure(directory: Path, name: str, ds_config: dict, shape: dict, round_: int) -> float:
    """One more run of a config (2 ranks through ds-launch); its throughput."""
    run = directory / f"{name}_{round_}"
    run.mkdir(parents=True, exist_ok=True)
    cfg = {**ds_config, "autotuning": {**ds_config["autotuning"], "metric_path": str(run / "metrics.json")}}
    (run / "cfg.json").write_text(json.dumps(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "ds_launch", "--num_gpus", "2", str(Path(__file__).resolve()), "--worker",
           "--shape", json.dumps(shape), "--deepspeed_config", str(run / "cfg.json")]
    with open(run / "log.txt", "w") as log:
        rc = subprocess.run(cmd, env=env, cwd=run, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"re-measuring {name} failed with exit code {rc}; see {run / 'log.txt'}")
    return json.loads((run / "metrics.json").read_text())["throughput"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="write the figures to this file")
    p.add_argument("--keep", default=None, help="keep the experiments' directories here")
    p.add_argument("--shape", default=json.dumps(SHAPE), help="the GPT's shape (JSON)")
    p.add_argument("--rounds", type=int, default=3, help="head-to-head re-measurements of the two bests")
    args = p.parse_args()
    shape = json.loads(args.shape)
    root = Path(args.keep or tempfile.mkdtemp(prefix="bench_autotune_"))
    try:
        grid = _search(root / "grid", "gridsearch", 0, shape)
        tuned = _search(root / "tuner", "model_based", 2, shape)
        heads = {"grid": [], "tuner": []}
        for r in range(args.rounds):
            for who, found in (("grid", grid), ("tuner", tuned))[:: 1 if r % 2 == 0 else -1]:
                heads[who].append(_measure(root / "head_to_head", who, found["best_config"], shape, r))
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    grid_best = grid["best_metric"]
    grid_median, tuner_median = statistics.median(heads["grid"]), statistics.median(heads["tuner"])
    out = {
        "shape": shape, "space": f"stages 0-3 x micro-batch {SIZES}", "metric": "throughput (samples/s)",
        "grid": {k: grid[k] for k in ("wall_s", "best", "best_metric", "experiments_run")},
        "tuner": {k: tuned[k] for k in ("wall_s", "best", "best_metric", "experiments_run")},
        "head_to_head": {"grid_best": heads["grid"], "tuner_best": heads["tuner"], "grid_median": grid_median,
                         "tuner_median": tuner_median},
        "quality_ratio": tuner_median / grid_median,
        "tuner_own_metric_ratio": tuned["best_metric"] / grid_best,
        "time_ratio": tuned["wall_s"] / grid["wall_s"],
    }
    out["pass"] = bool(out["quality_ratio"] >= 0.95 and out["time_ratio"] <= 1 / 3)
    print(f"GPT {shape}, 2 ranks, space: {out['space']}, metric {out['metric']}")
    for name in ("grid", "tuner"):
        r = out[name]
        print(f"{name:6s}: {r['experiments_run']:2d} experiments in {r['wall_s']:7.1f} s, best {r['best']} "
              f"at {r['best_metric']:.1f}")
    print(f"head to head ({args.rounds} rounds, alternating): grid's best {grid['best']} median {grid_median:.1f} "
          f"{[round(v, 1) for v in heads['grid']]}, tuner's best {tuned['best']} median {tuner_median:.1f} "
          f"{[round(v, 1) for v in heads['tuner']]}")
    print(f"quality ratio (tuner's best / grid's best, head to head): {out['quality_ratio']:.3f} (>= 0.95); "
          f"as each search measured them: {out['tuner_own_metric_ratio']:.3f}")
    print(f"time ratio tuner / grid: {out['time_ratio']:.3f} (<= 0.333); pass: {out['pass']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    if "--worker" in sys.argv[1:]:
        worker(sys.argv[1:])
    else:
        main()
