"""Mixture of Experts: the MoE GPT step against the dense GPT of the same active FLOPs, ep=2 against ep=1, the
all-to-all share, per-rank expert memory, ds-all against DeepSpeed 0.19.8, aux-loss-free balancing (issue 29).

The workload is ARCHITECTURE.md's yardstick GPT (vocab 8192, d_model 512, 8 layers, 8 heads, seq 256, micro-batch 4
per rank, 2 ranks x 1 thread on gloo, AdamW, fp32) with every block's MLP replaced by a ds-moe `MoE` of 8 experts,
top-2, each expert the usual MLP (512 -> 2048 -> 512, GELU), DeepSpeed's defaults otherwise (capacity factor 1.0,
token dropping, RTS, second-expert sampling), the aux loss added with coefficient 0.01. Everything trains through
``ds_all.initialize`` with ZeRO stage 1 (``--stage``); the model is defined once in ``_bench_moe_parts.py``.

* **Same active FLOPs.** With top-2 at capacity factor 1.0 each rank's expert buffers hold
  ``E * C = 8 * ceil(2 * S / 8) = 2 S`` rows (S = 1024 tokens per rank; empty and dropped slots are computed as zero
  rows), each through a 512 -> 2048 -> 512 MLP: the FLOPs of S rows through a 512 -> 4096 -> 512 MLP. So the dense
  baseline is the same GPT with MLP hidden ``2 x 2048 = 4096``; attention, embeddings and head are identical. The MoE
  adds only the gate (512 x 8 per token), dispatch, combine and the all-to-alls: the overhead the goal (<= 1.35x) is on.
* **Speed**, in one process pair: dense, MoE ep=1, MoE ep=2 and MoE ep=2 with its local experts forced onto the batched
  path (ds-moe's ``Experts.batched = True``: one batched GEMM through ``torch.vmap``; the default picks it on an
  accelerator and computes the experts one after another on a CPU, where that measured faster) are built
  from seed 0 and step in turn (which goes first rotates), each step timed after a barrier (the slower rank's time);
  medians over steps after ``--warmup``, and the median of the per-step ratios (adjacent steps, so the machine's
  drift cancels). Rank 0's forward / backward / optimizer-step split is printed too.
* **All-to-all share**: ``--a2a-steps`` more MoE ep=2 steps with the comms logger recording ``all_to_all_single``
  (forward and backward, including the wait for the peer) and the layers' ``wall_clock_breakdown`` timers
  (``time_falltoall + time_salltoall``: the forward's only, as DeepSpeed's).
* **Memory**: bytes of the parameters marked as expert parameters (``allreduce = False``) on each rank, ep=1 and 2.
* **DeepSpeed 0.19.8** (``--dsref``, its venv): ``_bench_moe_parts.py`` run under ``torchrun`` with
  ``--backend deepspeed`` (``deepspeed.moe.layer.MoE``, ``deepspeed.initialize``) and ``--backend ds_all``
  (``ds_moe.MoE``, ``ds_all.initialize``), same config dict, same seed, same data, MoE ep=2. The two jobs run at
  once and step in turn (a turn file passes the machine after every step; ``--repeats`` rounds, which job goes first
  alternates), so adjacent steps are compared as in one process; the two backends' losses are compared too.
* **Balancing** (beyond DeepSpeed): a smaller GPT (``--balance-*``, ep=2, lr 1e-3) on a skewed token stream (Zipf,
  exponent ``--skew``), arms from one seed stepping in turn: no balancing, the aux loss (coefficient 0.01),
  aux-loss-free bias balancing (one arm per ``--bias-update-speed``, default 1e-3 and 1e-2). After
  ``--balance-steps`` steps: each layer's max/mean expert load (``exp_counts`` summed over ranks) over the last
  ``--balance-window`` steps, the share of routes dropped by capacity, and the cross entropy (without the aux term).

    python benchmarks/bench_moe.py [--json out.json]                        # the issue's figures, ~17 min here
    python benchmarks/bench_moe.py --d-model 128 --layers 2 --seq 64 --vocab 1024 --steps 5   # a quick run
    python benchmarks/bench_moe.py --parts speed a2a                          # some parts only
    python benchmarks/bench_moe.py --parts profile          # where one step's time goes (dense and MoE ep=2)
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
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_moe_parts import Moe, Shape, build_gpt, config, expert_param_bytes, tokens

import ds_comm
from ds_comm.testing import spawn

RUNNER = Path(__file__).resolve().parent / "_bench_moe_parts.py"
PARTS = ("speed", "a2a", "deepspeed", "balance", "profile")
VARIANTS = {"dense": Moe(num_experts=0), "moe_ep1": Moe(ep_size=1), "moe_ep2": Moe(ep_size=2),
            "moe_ep2_batched": Moe(ep_size=2)}  # the last: ds-moe's Experts with ``batched = True`` (vmap)


def _trainer(model, shape: Shape, stage: int, lr: float | None = None):
    """One training step of ``model`` through ``ds_all.initialize``: ``step(batch, aux_coeff) -> ce``."""
    import ds_all

    engine, *_ = ds_all.initialize(model=model, model_parameters=list(model.parameters()),
                                   config=config(shape, stage, lr))

    def step(batch: torch.Tensor, aux_coeff: float, phases: list | None = None) -> float:
        """``phases``: appended with (forward, backward, optimizer step) seconds."""
        t0 = time.perf_counter()
        ce, aux = engine(batch)
        t1 = time.perf_counter()
        engine.backward(ce + aux_coeff * aux)
        t2 = time.perf_counter()
        engine.step()
        if phases is not None:
            phases.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
        return float(ce.detach())

    return step


def _moe_layers(model):
    return [m.deepspeed_moe for m in model.modules() if hasattr(m, "deepspeed_moe")]


def _a2a_seconds() -> float:
    return sum(r.total_s for r in ds_comm.comms_logger.records() if r.op == "all_to_all_single")


def run_speed(rank: int, world_size: int, shape: Shape, stage: int, steps: int, a2a_steps: int) -> dict:
    torch.set_num_threads(1)
    models = {name: build_gpt(shape, moe, _moe_cls()) for name, moe in VARIANTS.items()}
    for module in models["moe_ep2_batched"].modules():
        if hasattr(module, "deepspeed_experts"):
            module.batched = True  # ds-moe's Experts: vmap's batched GEMMs (the CPU default is one GEMM per expert)
    steps_fn = {name: _trainer(model, shape, stage) for name, model in models.items()}
    names = list(models)
    times: dict[str, list[float]] = {name: [] for name in names}
    phases: dict[str, list] = {name: [] for name in names}
    for step in range(steps):
        batch = tokens(shape, step, rank)
        shift = step % len(names)
        for name in names[shift:] + names[:shift]:
            ds_comm.barrier()
            start = time.perf_counter()
            steps_fn[name](batch, VARIANTS[name].aux_coeff, phases[name])
            times[name].append(time.perf_counter() - start)
    memory = {name: dict(zip(("expert_bytes", "dense_bytes"), expert_param_bytes(models[name]), strict=True))
              for name in names}
    result = {"times": times, "phases": phases, "memory": memory}
    if a2a_steps:
        # the all-to-all share of the MoE ep=2 step: comms logger (forward + backward) and the layers' timers
        ds_comm.configure(enabled=True, prof_all=False, prof_ops=["all_to_all_single"])
        layers = _moe_layers(models["moe_ep2"])
        for layer in layers:
            layer.wall_clock_breakdown = True
        rows = []
        for step in range(steps, steps + a2a_steps):
            batch = tokens(shape, step, rank)
            ds_comm.comms_logger.reset()
            ds_comm.barrier()
            start = time.perf_counter()
            steps_fn["moe_ep2"](batch, VARIANTS["moe_ep2"].aux_coeff)
            total = time.perf_counter() - start
            rows.append({"step_s": total, "a2a_s": _a2a_seconds(),
                         "fwd_a2a_s": sum(layer.time_falltoall + layer.time_salltoall for layer in layers) / 1e3,
                         "fwd_moe_s": sum(layer.time_moe for layer in layers) / 1e3})
        ds_comm.configure(enabled=False)
        for layer in layers:
            layer.wall_clock_breakdown = False
        result["a2a"] = rows
    return result


def _moe_cls():
    from ds_moe import MoE

    return MoE


def _per_step_max(results: list[dict], name: str) -> list[float]:
    return [max(r["times"][name][i] for r in results) for i in range(len(results[0]["times"][name]))]


def speed(args: argparse.Namespace, shape: Shape, report: dict) -> None:
    a2a_steps = args.a2a_steps if "a2a" in args.parts else 0
    print(f"speed: dense, MoE ep=1, MoE ep=2, MoE ep=2 batched experts stepping in turn in one process pair, "
          f"{args.steps} steps each, "
          f"medians of steps {args.warmup + 1}..{args.steps}", flush=True)
    results = spawn(run_speed, world_size=2, args=(shape, args.stage, args.steps, a2a_steps), timeout=7200)
    w = args.warmup
    per = {name: _per_step_max(results, name) for name in VARIANTS}
    med = {name: statistics.median(per[name][w:]) for name in VARIANTS}

    def ratio(a, b):
        return statistics.median(x / y for x, y in zip(per[a][w:], per[b][w:], strict=True))

    rows = {"s_per_step": med, "moe_ep2_vs_dense": ratio("moe_ep2", "dense"),
            "moe_ep1_vs_dense": ratio("moe_ep1", "dense"), "ep2_vs_ep1": ratio("moe_ep2", "moe_ep1"),
            "memory": [r["memory"] for r in results]}
    # forward / backward / optimizer step: rank 0's, medians over the timed steps
    split = {name: [statistics.median(p[i] for p in results[0]["phases"][name][w:]) for i in range(3)]
             for name in VARIANTS}
    rows["phases_rank0"] = split
    for name in VARIANTS:
        f, b, o = split[name]
        print(f"  {name:<12} {med[name]:.3f} s/step  (rank 0: forward {f:.3f}, backward {b:.3f}, optimizer step "
              f"{o:.3f} s; steps: {' '.join(f'{t:.2f}' for t in per[name])})")
    goal = rows["moe_ep2_vs_dense"]
    print(f"  MoE ep=2 / dense (same active FLOPs): {goal:.3f}x  "
          f"(goal <= 1.35x: {'met' if goal <= 1.35 else 'missed'})")
    print(f"  MoE ep=1 / dense: {rows['moe_ep1_vs_dense']:.3f}x;  MoE ep=2 / ep=1: {rows['ep2_vs_ep1']:.3f}x")
    batched = ratio("moe_ep2_batched", "dense")
    rows["moe_ep2_batched_vs_dense"] = batched
    print(f"  MoE ep=2 with the local experts batched (Experts.batched = True) / dense: {batched:.3f}x; "
          f"/ MoE ep=2 default ({'batched' if torch.accelerator.is_available() else 'one expert at a time'}): "
          f"{ratio('moe_ep2_batched', 'moe_ep2'):.3f}x")
    fb = (split["moe_ep2"][0] + split["moe_ep2"][1]) / (split["dense"][0] + split["dense"][1])
    rows["moe_ep2_vs_dense_fwd_bwd_rank0"] = fb
    print(f"  forward + backward only (rank 0, medians): MoE ep=2 / dense {fb:.3f}x")
    for rank, memory in enumerate(rows["memory"]):
        e1, e2 = memory["moe_ep1"]["expert_bytes"], memory["moe_ep2"]["expert_bytes"]
        print(f"  rank {rank}: expert parameters {e2 / 2**20:.1f} MiB at ep=2, {e1 / 2**20:.1f} MiB at ep=1 "
              f"(ep=2 holds {e2 / e1:.3f} of the total; goal 1/2)")
    report["speed"] = rows
    if a2a_steps:
        a2a = [{k: max(r["a2a"][i][k] for r in results) for k in results[0]["a2a"][i]} for i in range(a2a_steps)]
        # per rank, the share of its own step; the figure is the median over steps of the mean over ranks
        shares = [statistics.mean(r["a2a"][i]["a2a_s"] / r["a2a"][i]["step_s"] for r in results)
                  for i in range(a2a_steps)]
        fwd_shares = [statistics.mean(r["a2a"][i]["fwd_a2a_s"] / r["a2a"][i]["step_s"] for r in results)
                      for i in range(a2a_steps)]
        report["a2a"] = {"steps": a2a, "share": statistics.median(shares), "fwd_share": statistics.median(fwd_shares)}
        print(f"  all-to-all share of the MoE ep=2 step: {report['a2a']['share']:.1%} (comms logger, forward + "
              f"backward, {2 * 2 * shape.layers} all-to-alls per step); forward only (the layers' timers "
              f"time_falltoall + time_salltoall): {report['a2a']['fwd_share']:.1%}", flush=True)


def run_profile(rank: int, world_size: int, shape: Shape, stage: int, names: list[str]) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    tables = {}
    for name in names:
        model = build_gpt(shape, VARIANTS[name], _moe_cls())
        step_fn = _trainer(model, shape, stage)
        step_fn(tokens(shape, 0, rank), VARIANTS[name].aux_coeff)  # warm
        ds_comm.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step_fn(tokens(shape, 1, rank), VARIANTS[name].aux_coeff)
        tables[name] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=60)
        del model, step_fn
    return tables


def profile_step(args: argparse.Namespace, shape: Shape, report: dict) -> None:
    names = ["dense", "moe_ep2"]
    print("profile: one step of each (after one warm step), torch.profiler, rank 0, ops by self CPU time", flush=True)
    tables = spawn(run_profile, world_size=2, args=(shape, args.stage, names), timeout=7200)[0]
    for name in names:
        print(f"--- {name}\n{tables[name]}", flush=True)
    report["profile"] = tables


# ---- DeepSpeed 0.19.8 against ds-all, alternating runs -----------------------------------------------------

def _launch(backend: str, args: argparse.Namespace, shape: Shape, out: str, turn: str) -> subprocess.Popen:
    peer = "deepspeed" if backend == "ds_all" else "ds_all"
    flags = ["--backend", backend, "--out", out, "--steps", str(args.steps), "--stage", str(args.stage),
             "--ep", "2", "--turn", turn, "--peer", peer]
    flags += [x for k, v in asdict(shape).items() for x in (f"--{k.replace('_', '-')}", str(v))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    if backend == "deepspeed":
        command = [str(Path(args.dsref) / "bin" / "torchrun")]
        env["DS_ACCELERATOR"] = "cpu"
    else:
        command = [sys.executable, "-m", "torch.distributed.run"]
    command += ["--nproc_per_node", "2", "--master_port", str(ds_comm.testing.free_port()), str(RUNNER), *flags]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _collect(backend: str, process: subprocess.Popen, args: argparse.Namespace, out: str) -> dict:
    log, _ = process.communicate(timeout=3600)
    if process.returncode:
        raise RuntimeError(f"bench_moe: the {backend} job failed (exit {process.returncode}):\n{log[-5000:]}")
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]
    steps = [max(r["times"][i] for r in ranks) for i in range(args.steps)]
    return {"steps": steps, "median": statistics.median(steps[args.warmup:]), "first_loss": ranks[0]["losses"][0],
            "losses": ranks[0]["losses"], "expert_bytes": [r["expert_bytes"] for r in ranks]}


def deepspeed(args: argparse.Namespace, shape: Shape, report: dict) -> None:
    torchrun = Path(args.dsref) / "bin" / "torchrun"
    if not torchrun.exists():
        print(f"deepspeed: {torchrun} not found: DeepSpeed's comparison skipped", flush=True)
        return
    print(f"deepspeed: MoE ep=2 under DeepSpeed 0.19.8 ({args.dsref}) and ds-all, same runner; per round both jobs "
          f"run at once and step in turn (a turn file: one step of one job, then one of the other), {args.repeats} "
          f"round(s) of {args.steps} steps each, medians of steps {args.warmup + 1}..{args.steps}", flush=True)
    runs: dict[str, list[dict]] = {"ds_all": [], "deepspeed": []}
    ratios: list[float] = []
    workdir = tempfile.mkdtemp(prefix="bench_moe_")
    try:
        for r in range(args.repeats):
            order = ["ds_all", "deepspeed"][::1 if r % 2 == 0 else -1]
            turn = os.path.join(workdir, f"turn{r}")
            Path(turn).write_text(order[0])  # who steps first alternates between rounds
            outs = {b: os.path.join(workdir, f"{b}{r}") for b in order}
            jobs = {b: _launch(b, args, shape, outs[b], turn) for b in order}
            done = {b: _collect(b, jobs[b], args, outs[b]) for b in order}
            for backend in order:
                run = done[backend]
                runs[backend].append(run)
                print(f"  round {r + 1} {backend:<9} {run['median']:.3f} s/step  (steps: "
                      f"{' '.join(f'{t:.2f}' for t in run['steps'])}; first loss {run['first_loss']:.6f})", flush=True)
            ratios += [a / b for a, b in zip(done["ds_all"]["steps"][args.warmup:],
                                             done["deepspeed"]["steps"][args.warmup:], strict=True)]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    ours = statistics.median(t for run in runs["ds_all"] for t in run["steps"][args.warmup:])
    theirs = statistics.median(t for run in runs["deepspeed"] for t in run["steps"][args.warmup:])
    paired = statistics.median(ratios)
    # same model, seed, data and config: the two backends' losses agree step by step
    diff = max(abs(a - b) for x, y in zip(runs["ds_all"], runs["deepspeed"], strict=True)
               for a, b in zip(x["losses"], y["losses"], strict=True))
    report["deepspeed"] = {"ds_all_s": ours, "deepspeed_s": theirs, "ratio": ours / theirs, "paired_ratio": paired,
                           "max_loss_difference": diff, "runs": runs}
    print(f"  losses of the two backends, step by step: largest difference {diff:.2e}", flush=True)
    print(f"  ds-all {ours:.3f} s/step, DeepSpeed 0.19.8 {theirs:.3f} s/step (medians of all timed steps): "
          f"{ours / theirs:.3f}x; median of the adjacent steps' ratios {paired:.3f}x (goal <= 1.0x: "
          f"{'met' if paired <= 1.0 else 'missed'})", flush=True)


# ---- aux-loss-free balancing against the aux loss ----------------------------------------------------------

def _arms(speeds: list[float]) -> dict[str, tuple[float, float]]:
    """Arm name -> (aux-loss coefficient, bias_update_speed)."""
    return {"none": (0.0, 0.0), "aux_loss": (0.01, 0.0), **{f"bias_{v:g}": (0.0, v) for v in speeds}}


def run_balance(rank: int, world_size: int, shape: Shape, stage: int, steps: int, speeds: list[float], skew: float,
                lr: float) -> dict:
    torch.set_num_threads(1)
    arms = {}
    for name, (coeff, bias) in _arms(speeds).items():
        moe = Moe(ep_size=2, aux_coeff=coeff, bias_update_speed=bias)
        model = build_gpt(shape, moe, _moe_cls())
        arms[name] = (moe, model, _trainer(model, shape, stage, lr))
    names = list(arms)
    out = {name: {"ce": [], "loads": []} for name in names}
    for step in range(steps):
        batch = tokens(shape, step, rank, skew)
        shift = step % len(names)
        for name in names[shift:] + names[:shift]:
            moe, model, step_fn = arms[name]
            out[name]["ce"].append(step_fn(batch, moe.aux_coeff))
            loads = torch.stack(model.exp_counts).to(torch.int64)  # [layers, E] routes chosen on this rank
            out[name]["loads"].append(loads.tolist())
    return out


def balance(args: argparse.Namespace, report: dict) -> None:
    shape = Shape(args.balance_vocab, args.balance_d_model, args.balance_layers, args.balance_heads,
                  args.balance_seq, args.micro_batch)
    print(f"balance: {shape}, 8 experts top-2, ep=2, skewed tokens (Zipf {args.skew}), {args.balance_steps} steps, "
          f"lr {args.balance_lr}; arms stepping in turn: none, aux loss 0.01, bias_update_speed "
          f"{' and '.join(f'{v:g}' for v in args.bias_update_speed)}; figures over the last {args.balance_window} "
          "steps", flush=True)
    results = spawn(run_balance, world_size=2, args=(shape, args.stage, args.balance_steps, args.bias_update_speed,
                                                     args.skew, args.balance_lr), timeout=7200)
    tokens_per_rank = shape.micro_batch * shape.seq
    capacity = -(-2 * tokens_per_rank // 8)  # top-2 at capacity factor 1.0: ceil(2 S / E), as the gate
    rows = {}
    for name in _arms(args.bias_update_speed):
        window = range(args.balance_steps - args.balance_window, args.balance_steps)
        per_layer_ratio, dropped = [], []
        for i in window:
            loads = [torch.tensor(r[name]["loads"][i], dtype=torch.float64) for r in results]  # [layers, E] per rank
            total = sum(loads)
            per_layer_ratio.append(total.max(dim=1).values / total.mean(dim=1))
            dropped.append(sum(float((x - capacity).clamp(min=0).sum()) for x in loads) / float(total.sum()))
        ratio = torch.stack(per_layer_ratio).mean(dim=0)  # per layer, mean over the window
        ce = statistics.mean(statistics.mean(r[name]["ce"][i] for r in results) for i in window)
        rows[name] = {"max_over_mean_load": float(ratio.mean()), "worst_layer": float(ratio.max()),
                      "per_layer": ratio.tolist(), "dropped_share": statistics.mean(dropped), "ce": ce,
                      "ce_first": statistics.mean(r[name]["ce"][0] for r in results)}
        print(f"  {name:<10} max/mean expert load {rows[name]['max_over_mean_load']:.3f} (mean over layers; worst "
              f"layer {rows[name]['worst_layer']:.3f}), routes dropped {rows[name]['dropped_share']:.1%}, "
              f"cross entropy {ce:.4f} (step 1: {rows[name]['ce_first']:.4f})", flush=True)
    report["balance"] = {"shape": asdict(shape), "steps": args.balance_steps, "window": args.balance_window,
                         "skew": args.skew, "bias_update_speed": args.bias_update_speed, "arms": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS[:4]),
                        help="what to run (default: all but profile)")
    parser.add_argument("--steps", type=int, default=8, help="steps per variant (speed) and per run (deepspeed)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    parser.add_argument("--repeats", type=int, default=2, help="pairs of runs, ds-all and DeepSpeed")
    parser.add_argument("--a2a-steps", type=int, default=3)
    parser.add_argument("--stage", type=int, default=1, choices=[0, 1, 2])
    for name, default in asdict(Shape()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    parser.add_argument("--dsref", default="/work/dsref", help="DeepSpeed 0.19.8's venv")
    parser.add_argument("--balance-steps", type=int, default=150)
    parser.add_argument("--balance-window", type=int, default=20)
    parser.add_argument("--balance-vocab", type=int, default=1024)
    parser.add_argument("--balance-d-model", type=int, default=128)
    parser.add_argument("--balance-layers", type=int, default=4)
    parser.add_argument("--balance-heads", type=int, default=4)
    parser.add_argument("--balance-seq", type=int, default=128)
    parser.add_argument("--balance-lr", type=float, default=1e-3)
    parser.add_argument("--bias-update-speed", type=float, nargs="+", default=[1e-3, 1e-2],
                        help="one aux-loss-free arm per value")
    parser.add_argument("--skew", type=float, default=1.2, help="Zipf exponent of the balance run's tokens")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    if not 0 < args.balance_window <= args.balance_steps:
        parser.error("--balance-window must be in 1..--balance-steps")
    shape = Shape(args.vocab, args.d_model, args.layers, args.heads, args.seq, args.micro_batch)
    print(f"bench_moe: GPT {shape}, MLPs -> MoE 8 experts top-2 (expert {shape.d_model} -> {4 * shape.d_model} -> "
          f"{shape.d_model}), dense baseline hidden {2 * 4 * shape.d_model}; 2 ranks x 1 thread, gloo, AdamW, "
          f"ZeRO stage {args.stage}, fp32; torch {torch.__version__}", flush=True)
    report: dict = {"shape": asdict(shape), "args": vars(args)}
    if "speed" in args.parts or "a2a" in args.parts:
        speed(args, shape, report)
    if "deepspeed" in args.parts:
        deepspeed(args, shape, report)
    if "balance" in args.parts:
        balance(args, report)
    if "profile" in args.parts:
        profile_step(args, shape, report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
