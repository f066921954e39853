"""The examples run under ds-launch on 2 ranks: the main job (train_gpt.py, here with --tiny; `nox -s
demo` runs it whole) trains from its DeepSpeed JSON with every part the JSON turns on, and the plain
ds-zero loop keeps its ranks identical; each loss goes down and the comms logger counts the
collectives."""

from __future__ import annotations

import csv
import re
import socket
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(script: str, *args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ds_launch", "--num_procs", "2", "--master_port", str(_free_port()),
                           str(EXAMPLES / script), *args], capture_output=True, text=True, timeout=180, cwd=cwd)


def test_the_main_job_trains_from_its_json_with_every_part_it_enables(tmp_path):
    result = _launch("train_gpt.py", "--tiny", "--steps", "40", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert re.search(r"^GPT 0\.\d+M parameters, 2 ranks, ZeRO stage 3, (bf16|float32), 40 steps$", out, re.M), out
    # the engine's progress every steps_per_print (10) steps, with the schedule's cosine decay to 0.1 x lr
    steps = [(int(m[1]), float(m[2]), float(m[3])) for m in
             re.finditer(r"^\[ds_all\] step=(\d+), skipped=0, lr=\[([0-9.e-]+)\], loss=([0-9.]+)", out, re.M)]
    assert [s for s, _, _ in steps] == [10, 20, 30, 40]
    assert abs(steps[-1][1] - 1e-4) < 1e-9
    assert "Flops Profiler" in out and "fwd flops per GPU" in out  # the profile at step 2
    ops = {m[1] for m in re.finditer(r"^(\w+) +[0-9.]+ [KMG]?B +\d+ ", out, re.M)}
    assert {"reduce_scatter_bucket", "all_gather_bucket"} <= ops  # the comms logger's summary (ZeRO-3)
    fell = re.search(r"^loss fell: ([0-9.]+) -> ([0-9.]+) in 40 steps", out, re.M)
    assert fell and float(fell[2]) < 0.5 * float(fell[1])
    assert "logs (tensorboard): runs/gpt" in out and "logs (csv_monitor): runs/gpt" in out
    with open(tmp_path / "runs" / "gpt" / "Train_Samples_train_loss.csv") as f:
        rows = list(csv.reader(f))[1:]
    # one row per step, stepped by samples seen (2 ranks x micro-batch 4), the last loss as printed
    assert [int(step) for step, _ in rows] == [8 * k for k in range(1, 41)]
    assert abs(float(rows[-1][1]) - steps[-1][2]) < 1e-5
    assert list((tmp_path / "runs" / "gpt").glob("events.out.tfevents.*"))


def test_the_plain_ds_zero_loop_trains_and_keeps_the_ranks_identical():
    result = _launch("train_zero_plain.py", "--steps", "15")
    assert result.returncode == 0, result.stdout + result.stderr
    losses = [float(x) for x in re.findall(r"^step +\d+ +loss ([0-9.]+)$", result.stdout, re.M)]
    assert len(losses) == 15
    assert losses[-1] < 0.5 * losses[0]
    assert "parameters identical on every rank: True" in result.stdout
    assert re.search(r"^loss went down: ", result.stdout, re.M)
    counts = {m[1]: int(m[2]) for m in re.finditer(r"^(\w+) +\d+ B +(\d+) ", result.stdout, re.M)}
    assert counts["reduce_scatter_bucket"] == 15 and counts["all_gather_bucket"] == 15, result.stdout


def test_the_readme_engine_example_runs_on_two_ranks_and_prints_what_it_says(tmp_path):
    readme = (EXAMPLES.parent / "README.md").read_text()
    block = re.findall(r"```python\n(.*?)```", readme.split("## The engine", 1)[1], re.S)[0]
    promised = re.search(r"# (.+)$", block.strip().splitlines()[-1]).group(1)
    script = tmp_path / "engine_example.py"
    script.write_text(block)
    # one log per rank: two ranks printing to one pipe interleave their writes under python -u
    result = subprocess.run([sys.executable, "-m", "ds_launch", "--num_procs", "2", "--master_port", str(_free_port()),
                             "--enable_each_rank_log", str(tmp_path / "logs"), str(script)],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    logs = [(tmp_path / "logs" / f"rank{r}.log").read_text() for r in range(2)]
    assert [log.splitlines().count(promised) for log in logs] == [1, 1], logs  # each rank
    assert len(re.findall(r"^\[ds_all\] step=[48], ", logs[0], re.M)) == 2, logs[0]  # steps_per_print 4, rank 0


def test_the_pipeline_example_trains_two_stages_through_the_engine(tmp_path):
    logs = tmp_path / "logs"
    result = subprocess.run([sys.executable, "-m", "ds_launch", "--num_procs", "2", "--master_port", str(_free_port()),
                             "--enable_each_rank_log", str(logs), str(EXAMPLES / "train_pipeline.py"), "--steps", "30"],
                            capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    first, last = ((logs / f"rank{r}.log").read_text() for r in range(2))
    assert "stage boundaries [0, 3, 6]" in first and "stage 0 | F0 F1 .  B0 F2 B1 F3 B2 .  B3" in first, first
    # both stages report the same loss (the last stage's, shared by the engine) every 10 steps
    per_stage = [re.findall(r"^stage \d step (\d+) loss ([0-9.]+)$", log, re.M) for log in (first, last)]
    assert per_stage[0] == per_stage[1] and [s for s, _ in per_stage[0]] == ["10", "20", "30"], per_stage
    assert re.search(r"^stage 0: loss fell: ", first, re.M) and re.search(r"^stage 1: loss fell: ", last, re.M)


class _Clock:
    """A ``time`` whose ``perf_counter`` ticks grow ``growth`` times per call: 1, every interval timed is equal
    (bf16 as fast as float32); 10, each later interval far longer (bf16 emulated)."""

    def __init__(self, growth: float):
        self.now, self.tick, self.growth = 0.0, 1.0, growth

    def perf_counter(self) -> float:
        self.now += self.tick
        self.tick *= self.growth
        return self.now


def main_job_with_clocks(rank, world_size, directory):
    import importlib.util
    import os

    import ds_all

    spec = importlib.util.spec_from_file_location("train_gpt_example", EXAMPLES / "train_gpt.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.time = _Clock(1.0 if rank == 0 else 10.0)  # the ranks' timings disagree (a busy machine)
    chosen, initialize = [], ds_all.initialize

    def recording(*args, config, **kwargs):  # what each rank chose
        chosen.append(config["bf16"]["enabled"])
        return initialize(*args, config=config, **kwargs)

    ds_all.initialize = recording  # in this rank's process only
    os.chdir(directory)
    sys.argv = ["train_gpt.py", "--tiny", "--steps", "4"]
    example.main()
    return chosen


def test_the_main_job_picks_one_precision_for_all_ranks_when_their_timings_differ(tmp_path):
    """``--precision auto`` times a bf16 matmul: rank 0 decides for all (a rank in bf16 and another in float32
    exchange tensors of different sizes: gloo aborts, as it did in CI on a busy machine)."""
    from ds_comm.testing import spawn

    assert spawn(main_job_with_clocks, world_size=2, args=(str(tmp_path),), timeout=240) == [[True], [True]]
