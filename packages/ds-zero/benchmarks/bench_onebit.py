"""1-bit Adam and 0/1 Adam against Adam, 2 gloo ranks, on plain loopback and on a slow link; and the
loss curves of the three (and of 1-bit LAMB against LAMB) over 300 steps.

Timing: the GPT of ARCHITECTURE.md, 'The yardstick workload' (``_yardstick.py``, ~34M parameters, micro-batch 4, 2 ranks x 1 thread),
each optimizer under ``ZeroOptimizer`` stage 0 in fresh rank processes: Adam is torch's AdamW with
ZeRO's overlapped all-reduce; 1-bit Adam warms up ``--warm`` steps, 0/1 Adam updates its variance on
steps 1-``--warm`` and then takes local steps (intervals 1, 2, 4, 4, ...). Time per step after warm-up
is the median over the timed steps; bytes per step are what the comms logger counts in one more step.
The slow link: both ranks run in a network namespace whose loopback is limited by ``tc`` (a token
bucket at ``--rate``), as between commodity nodes; the probes time one fp32 all-reduce and one 1-bit
all-reduce of the model's size there, and the ideal 1-bit step is compute (Adam's loopback step less its
loopback all-reduce) plus the 1-bit all-reduce on the link.

Convergence: a small GPT (vocab 512, d_model 128, 2 layers, sequence 64) on sequences walking a fixed
successor table (learnable: the loss falls far below ln(vocab)), 2 ranks, 300 steps each of Adam,
1-bit Adam, 0/1 Adam, LAMB and 1-bit LAMB; final loss = mean of the last 20 steps.

    python benchmarks/bench_onebit.py [--part timing convergence] [--rate 200mbit] [--json out.json]
    python benchmarks/bench_onebit.py --interleaved --part timing --timed 10   # loopback, steps alternating

Goals (issue 18): on the link, 1-bit Adam >= 3x faster than Adam after warm-up and within 20 % of the
ideal; on loopback no slower than Adam; final losses within 2 % of Adam's (LAMB's for 1-bit LAMB).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _yardstick import GPT, tokens

import ds_comm
from ds_comm.testing import spawn
from ds_zero import OneBitAdam, OneBitLamb, ZeroOneAdam, ZeroOptimizer

NAMESPACE = "ds_bench_onebit"


def _factory(kind: str, lr: float, warm: int, local_clipper: int = 4, betas=(0.9, 0.999),
             var_update_scaler: int = 1, local_step_scaler: int = 1):
    common = {"lr": lr, "weight_decay": 0.01, "betas": betas}
    if kind == "adam":
        return lambda t: torch.optim.AdamW(t, **common)
    if kind == "onebit":
        return lambda t: OneBitAdam(t, freeze_step=warm, **common)
    if kind == "onebitlamb":
        return lambda t: OneBitLamb(t, freeze_step=warm, **common)
    # variance steps until var_freeze_step (the interval doubling every var_update_scaler of them), then local
    # steps at intervals doubling every local_step_scaler steps up to local_clipper
    return lambda t: ZeroOneAdam(t, var_freeze_step=warm, var_update_scaler=var_update_scaler,
                                 local_step_scaler=local_step_scaler, local_step_clipper=local_clipper, **common)


# ------------------------------------------------------------------------------------------- timing
def timing_run(rank: int, world_size: int, kind: str, warm: int, timed: int) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT()
    zero = ZeroOptimizer(model, _factory(kind, 1e-4, warm), config={"stage": 0})
    times = []
    for step in range(warm + timed):
        ds_comm.barrier()
        start = time.perf_counter()
        zero.backward(model(tokens(step, 0, rank)))
        zero.step()
        zero.zero_grad()
        times.append(time.perf_counter() - start)
    ds_comm.configure(enabled=True)
    ds_comm.comms_logger.reset()
    zero.backward(model(tokens(warm + timed, 0, rank)))
    zero.step()
    zero.zero_grad()
    sent = sum(r.bus_bytes for r in ds_comm.comms_logger.records())
    ds_comm.configure(enabled=False)
    out = {"kind": kind, "step_s": statistics.median(times[warm:]), "times": times, "bytes": sent,
           "params": sum(p.numel() for p in model.parameters())}
    if kind == "adam":  # the probes: one full all-reduce and one 1-bit all-reduce of the model's size
        out.update(_probes(out["params"]))
    zero.close()
    return out


def _probes(numel: int) -> dict:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    worker, server = (torch.zeros(size) for size in ds_comm.error_buffer_sizes(numel, ds_comm.get_world_size()))
    full, onebit = [], []
    for _ in range(2):
        ds_comm.barrier()
        start = time.perf_counter()
        ds_comm.all_reduce(x.clone())
        full.append(time.perf_counter() - start)
        ds_comm.barrier()
        start = time.perf_counter()
        ds_comm.compressed_allreduce(x.clone(), worker, server)
        onebit.append(time.perf_counter() - start)
    return {"allreduce_s": min(full), "compressed_s": min(onebit)}


def timing(kinds: list[str], warm: int, timed: int) -> list[dict]:
    rows = []
    for kind in kinds:
        rows.append(spawn(timing_run, world_size=2, args=(kind, warm, timed), timeout=3600,
                          env={"GLOO_SOCKET_IFNAME": "lo"})[0])
        print(f"  {kind}: {rows[-1]['step_s']:.2f} s/step ({', '.join(f'{t:.2f}' for t in rows[-1]['times'])})",
              flush=True)
    return rows


def interleaved_run(rank: int, world_size: int, kinds: list[str], warm: int, timed: int) -> dict:
    """Every optimizer on its own copy of the model in one process pair, their steps alternating (the
    order rotating each step): each step's time of every optimizer over Adam's in the same step."""
    torch.set_num_threads(1)
    runs = {}
    for kind in kinds:
        torch.manual_seed(0)
        model = GPT()
        runs[kind] = (model, ZeroOptimizer(model, _factory(kind, 1e-4, warm), config={"stage": 0}))
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for step in range(warm + timed):
        order = kinds[step % len(kinds):] + kinds[:step % len(kinds)]
        for kind in order:
            model, zero = runs[kind]
            ds_comm.barrier()
            start = time.perf_counter()
            zero.backward(model(tokens(step, 0, rank)))
            zero.step()
            zero.zero_grad()
            times[kind].append(time.perf_counter() - start)
    for _, zero in runs.values():
        zero.close()
    return {kind: {"step_s": statistics.median(t[warm:]), "times": t,
                   "vs_adam": statistics.median(a / b for a, b in zip(times["adam"][warm:], t[warm:], strict=True))}
            for kind, t in times.items()}


def interleaved(kinds: list[str], warm: int, timed: int) -> dict:
    """``--interleaved`` (plain loopback): this machine drifts 10-30 % between separate runs, more than
    the few per cent that separate the optimizers there."""
    kinds = ["adam", *[k for k in kinds if k != "adam"]]
    rows = spawn(interleaved_run, world_size=2, args=(kinds, warm, timed), timeout=3600,
                 env={"GLOO_SOCKET_IFNAME": "lo"})
    slower = {kind: max(rows, key=lambda r: r[kind]["step_s"])[kind] for kind in kinds}  # the slower rank's
    print(f"\nplain loopback, interleaved ({timed} steps after {warm} of warm-up, the slower rank's medians)")
    print(f"{'optimizer':<12}{'s/step':>9}{'Adam / it, same step':>22}")
    for kind, r in slower.items():
        print(f"{kind:<12}{r['step_s']:>9.2f}{r['vs_adam']:>21.3f}x")
    for kind in kinds[1:]:
        ratio = slower[kind]["vs_adam"]
        print(f"{kind}: {ratio:.3f}x Adam's speed on loopback (goal: no slower, >= 1: "
              f"{'met' if ratio >= 1 else 'missed'})")
    return slower


def on_slow_link(rate: str, args: argparse.Namespace) -> list[dict]:
    """The timing part again, both ranks inside a network namespace whose loopback ``tc`` limits to ``rate``."""
    subprocess.run(["ip", "netns", "del", NAMESPACE], capture_output=True)
    subprocess.run(["ip", "netns", "add", NAMESPACE], check=True)
    try:
        run_in = ["ip", "netns", "exec", NAMESPACE]
        subprocess.run([*run_in, "ip", "link", "set", "lo", "up"], check=True)
        subprocess.run([*run_in, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate, "burst", "256kb",
                        "latency", "2s"], check=True)
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            subprocess.run([*run_in, sys.executable, __file__, "--inside", out, "--kinds", *args.kinds,
                            "--warm", str(args.warm), "--timed", str(args.timed)], check=True,
                           env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
            return json.loads(Path(out).read_text())
    finally:
        subprocess.run(["ip", "netns", "del", NAMESPACE], capture_output=True)


def print_timing(title: str, rows: list[dict], loopback: list[dict] | None = None) -> dict:
    adam = next(r for r in rows if r["kind"] == "adam")
    print(f"\n{title}: {adam['params'] / 1e6:.1f}M parameters; fp32 all-reduce of them {adam['allreduce_s']:.2f} s, "
          f"1-bit all-reduce {adam['compressed_s']:.2f} s")
    print(f"{'optimizer':<12}{'s/step':>9}{'vs Adam':>9}{'MB sent/step':>14}{'fewer bytes':>13}")
    for r in rows:
        print(f"{r['kind']:<12}{r['step_s']:>9.2f}{adam['step_s'] / r['step_s']:>8.2f}x{r['bytes'] / 2**20:>14.2f}"
              f"{(adam['bytes'] / r['bytes'] if r['bytes'] else math.inf):>12.1f}x")
    summary = {"adam_step_s": adam["step_s"]}
    if loopback is not None:
        loop_adam = next(r for r in loopback if r["kind"] == "adam")
        compute = loop_adam["step_s"] - loop_adam["allreduce_s"]
        ideal = compute + adam["compressed_s"]
        onebit = next((r for r in rows if r["kind"] == "onebit"), None)
        share = 1 - compute / adam["step_s"]
        print(f"compute per step {compute:.2f} s (Adam's loopback step less its all-reduce): Adam spends "
              f"{share:.0%} of its step communicating on this link")
        if onebit is not None:
            speedup, ideal_speedup = adam["step_s"] / onebit["step_s"], adam["step_s"] / ideal
            print(f"1-bit Adam: {speedup:.2f}x Adam (goal >= 3x: {'met' if speedup >= 3 else 'missed'}); ideal "
                  f"{ideal_speedup:.2f}x (compute + 1-bit all-reduce = {ideal:.2f} s): {speedup / ideal_speedup:.0%} "
                  f"of it (goal >= 80 %: {'met' if speedup >= 0.8 * ideal_speedup else 'missed'})")
            summary.update(speedup=speedup, ideal_speedup=ideal_speedup, comm_share=share)
    return summary


# ------------------------------------------------------------------------------------------- convergence
class SmallGPT(nn.Module):
    """A pre-LN decoder (torch's encoder layers with a causal mask) small enough for 300 steps in seconds.

    Not the yardstick's ``GPT`` scaled down: ``nn.TransformerEncoderLayer`` names and initializes its attention
    differently (``in_proj_weight``, Xavier), and the convergence figures were measured on this model."""

    VOCAB, D_MODEL, LAYERS, HEADS, SEQ = 512, 128, 2, 4, 64

    def __init__(self):
        super().__init__()
        d = self.D_MODEL
        self.tok, self.pos = nn.Embedding(self.VOCAB, d), nn.Embedding(self.SEQ, d)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(d, self.HEADS, 4 * d, dropout=0.0, activation="gelu",
                                                               batch_first=True, norm_first=True)
                                    for _ in range(self.LAYERS))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, self.VOCAB, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(self.SEQ), persistent=False)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x, src_mask=self.mask, is_causal=True)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, self.VOCAB), tokens[:, 1:].reshape(-1))


def _walks(step: int, rank: int, batch: int) -> torch.Tensor:
    """Sequences following a fixed successor table over the vocabulary, 10 % random jumps."""
    successor = torch.randperm(SmallGPT.VOCAB, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(10_000 * step + rank)
    tokens = torch.empty(batch, SmallGPT.SEQ, dtype=torch.int64)
    tokens[:, 0] = torch.randint(0, SmallGPT.VOCAB, (batch,), generator=g)
    for t in range(1, SmallGPT.SEQ):
        jump = torch.rand(batch, generator=g) < 0.1
        tokens[:, t] = torch.where(jump, torch.randint(0, SmallGPT.VOCAB, (batch,), generator=g),
                                   successor[tokens[:, t - 1]])
    return tokens


# beta2 0.99: the variance settles within the warm-up (a third of the run), as 0.999 does over the tens of
# thousands of warm-up steps of the papers' runs; 1-bit Adam freezes it (without bias correction, as the reference)
CONVERGENCE_BETAS = (0.9, 0.99)
CONVERGENCE_LR = {"adam": 1e-3, "onebit": 1e-3, "zeroone": 1e-3, "lamb": 1e-2, "onebitlamb": 1e-2}


def convergence_run(rank: int, world_size: int, kind: str, steps: int, warm: int) -> list[float]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = SmallGPT()
    if kind == "lamb":  # ZeRO steps flat buckets, LAMB needs whole tensors: DDP with ds-ops' FusedLamb
        from ds_ops import FusedLamb

        ddp = nn.parallel.DistributedDataParallel(model)
        optimizer = FusedLamb(ddp.parameters(), lr=CONVERGENCE_LR[kind], weight_decay=0.01, betas=CONVERGENCE_BETAS)
    else:
        zero = ZeroOptimizer(model, _factory(kind, CONVERGENCE_LR[kind], warm, betas=CONVERGENCE_BETAS, local_clipper=4,
                                             var_update_scaler=8, local_step_scaler=steps // 10),
                             config={"stage": 0})
    losses = []
    for step in range(steps):
        if kind == "lamb":
            loss = ddp(_walks(step, rank, 8))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        else:
            loss = model(_walks(step, rank, 8))
            zero.backward(loss)
            zero.step()
            zero.zero_grad()
        mean = loss.detach().clone()
        ds_comm.all_reduce(mean)  # the global batch's loss (both ranks' halves)
        losses.append(mean.item() / world_size)
    return losses


def convergence(steps: int, warm: int) -> dict[str, list[float]]:
    curves = {}
    for kind in ("adam", "onebit", "zeroone", "lamb", "onebitlamb"):
        started = time.perf_counter()
        curves[kind] = spawn(convergence_run, world_size=2, args=(kind, steps, warm), timeout=3600)[0]
        print(f"  {kind}: final {statistics.mean(curves[kind][-20:]):.4f} ({time.perf_counter() - started:.0f} s)",
              flush=True)
    return curves


def print_convergence(curves: dict[str, list[float]], warm: int) -> dict:
    final = {kind: statistics.mean(c[-20:]) for kind, c in curves.items()}
    steps = len(curves["adam"])
    marks = sorted({0, warm - 1, *(int(steps * f) - 1 for f in (0.25, 0.5, 0.75)), steps - 1})
    print(f"\nconvergence: small GPT ({SmallGPT.VOCAB} vocab, d_model {SmallGPT.D_MODEL}, {SmallGPT.LAYERS} layers), "
          f"2 ranks x batch 8, {len(curves['adam'])} steps, warm-up {warm} (ln(vocab) = {math.log(SmallGPT.VOCAB):.2f})")
    print(f"{'optimizer':<12}" + "".join(f"{'step ' + str(m + 1):>10}" for m in marks) + f"{'final':>9}{'vs base':>9}")
    for kind, c in curves.items():
        base = final["lamb" if "lamb" in kind else "adam"]
        print(f"{kind:<12}" + "".join(f"{c[m]:>10.4f}" for m in marks) + f"{final[kind]:>9.4f}"
              f"{final[kind] / base - 1:>+8.1%}")
    return final


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", nargs="+", default=["timing", "convergence"], choices=["timing", "convergence"])
    parser.add_argument("--kinds", nargs="+", default=["adam", "onebit", "zeroone"])
    parser.add_argument("--rate", default="200mbit", help="the slow link's rate for tc ('' to skip it)")
    parser.add_argument("--warm", type=int, default=2, help="timing: warm-up steps (1-bit freeze_step)")
    parser.add_argument("--timed", type=int, default=3, help="timing: steps timed after warm-up")
    parser.add_argument("--steps", type=int, default=300, help="convergence: steps")
    parser.add_argument("--convergence-warm", type=int, default=100, help="convergence: warm-up steps")
    parser.add_argument("--interleaved", action="store_true",
                        help="timing on plain loopback only, the optimizers' steps alternating in one process pair")
    parser.add_argument("--inside", help=argparse.SUPPRESS)  # the run inside the namespace writes its rows here
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    if args.inside:
        Path(args.inside).write_text(json.dumps(timing(args.kinds, args.warm, args.timed)))
        return
    report: dict = {"bench": "onebit"}
    if args.interleaved:
        report["interleaved"] = interleaved(args.kinds, args.warm, args.timed)
        args.part = [part for part in args.part if part != "timing"]
    if "timing" in args.part:
        print("timing on plain loopback", flush=True)
        loopback = timing(args.kinds, args.warm, args.timed)
        report["loopback"] = {"rows": loopback, **print_timing("plain loopback", loopback)}
        if args.rate:
            print(f"\ntiming on a {args.rate} link (tc token bucket on the namespace's loopback)", flush=True)
            link = on_slow_link(args.rate, args)
            report["link"] = {"rate": args.rate, "rows": link,
                              **print_timing(f"{args.rate} link", link, loopback)}
    if "convergence" in args.part:
        print("\nconvergence", flush=True)
        curves = convergence(args.steps, args.convergence_warm)
        report["convergence"] = {"curves": curves, "final": print_convergence(curves, args.convergence_warm)}
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
