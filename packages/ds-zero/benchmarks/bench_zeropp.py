"""ZeRO++ (qwZ, hpZ, qgZ) against plain ZeRO-3 on 4 gloo ranks playing 2 nodes × 2 ranks (issue 45).

* ``--part bytes``: the yardstick GPT of ARCHITECTURE.md (``_yardstick.py``; micro-batch 1, sequence 64: the
  bytes do not depend on the batch), ZeRO-3 with every unit gathered (``stage3_param_persistence_threshold``
  0, no prefetch so that forward and backward are counted apart exactly), one step after two of warm-up
  counted by the comms logger, forward and backward apart: the parameter
  all-gather bytes, the backward's gather bytes crossing the node boundary, the gradient reduction's bytes
  crossing it; fp32 and bf16. Goals: qwZ ≤ 0.27× plain (fp32), ≤ 0.52× (bf16); hpZ: 0 backward bytes across
  nodes; qgZ ≤ 0.3× the gradient bytes across nodes.
* ``--part convergence``: a small GPT (vocab 512, d_model 128, 2 layers, sequence 64) on sequences walking a
  fixed successor table, 300 steps of plain ZeRO-3 and of all three on, same seed and data; the final loss is
  the mean of the last 20 steps. Goal: within 1 % of plain ZeRO-3's.
* ``--part speed``: the yardstick GPT (micro-batch ``--micro``), plain ZeRO-3 and all three on, steps
  alternating in the same 4 rank processes. Ranks 0-1 run in one network namespace and ranks 2-3 in another,
  joined by a veth pair: traffic inside a "node" stays on its own stack, traffic between them crosses the
  veth, which ``tc`` limits to ``--rate`` (a token bucket each way), and once more without the limit (the
  quantization's compute cost on this CPU). Needs root (``ip netns``). Goal: ≤ 0.6× plain ZeRO-3's step on
  the 1 Gbit/s link.

    python benchmarks/bench_zeropp.py [--part bytes convergence speed] [--rate 1gbit] [--steps 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _yardstick import GPT, Shape, tokens

import ds_comm
from ds_comm.testing import spawn
from ds_zero import ZeroOptimizer

TWO_BY_TWO = {"LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
KINDS = {"plain": {}, "qwZ": {"zero_quantized_weights": True}, "hpZ": {"zero_hpz_partition_size": 2},
         "qgZ": {"zero_quantized_gradients": True},
         "all": {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}}
STAGE3 = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}
ADAMW = {"lr": 1e-4, "weight_decay": 0.01}


def _zero(model, kind: str, precision: str, lr: float = 1e-4, prefetch: bool = True) -> ZeroOptimizer:
    """``prefetch`` False: each gather completes inside its request, so the comms logger's count after the
    forward holds the forward's gathers exactly (prefetches issued at its end complete during the backward)."""
    return ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs={**ADAMW, "lr": lr},
                         config={**STAGE3, **KINDS[kind], **({} if prefetch else {"stage3_prefetch_bucket_size": 0})},
                         bf16={"enabled": precision == "bf16"})


# ---------------------------------------------------------------------------------------------- bytes
def _traffic() -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for r in ds_comm.comms_logger.records():
        row = out.setdefault(r.op, [0, 0])
        row[0] += r.msg_bytes * r.count
        row[1] += int(r.cross_node_bytes or 0)
    return out


PARAM_GATHERS = ("all_gather_bucket", "quantized_all_gather")  # (not the path checks' small all-gathers)
GRAD_REDUCTIONS = ("reduce_scatter_bucket", "quantized_reduce_scatter")


def bytes_rank(rank, world_size, precision):
    shape = Shape(micro_batch=1, seq=64)
    out = {}
    for kind in KINDS:
        torch.manual_seed(0)
        model = GPT(shape)
        zero = _zero(model, kind, precision, prefetch=False)
        for step in range(3):
            if step == 2:
                ds_comm.configure(enabled=True, prof_all=True)
                ds_comm.comms_logger.reset()
            loss = model(tokens(step, 0, rank, shape))
            forward = _traffic()
            zero.backward(loss)
            zero.step()  # (reductions still in flight when backward returned complete here)
            total = _traffic()
            zero.zero_grad()
        ds_comm.configure(enabled=False)
        backward = {op: [b - forward.get(op, [0, 0])[0], c - forward.get(op, [0, 0])[1]] for op, (b, c) in total.items()}
        gathers = sum(b for op, (b, _) in total.items() if op in PARAM_GATHERS)
        out[kind] = {"gather_bytes": gathers,
                     "backward_gather_cross": sum(c for op, (_, c) in backward.items() if op in PARAM_GATHERS),
                     "grad_cross": sum(c for op, (_, c) in total.items() if op in GRAD_REDUCTIONS),
                     "ops": sorted(total)}
        zero.close()
    return out


def part_bytes(results: dict) -> None:
    for precision in ("fp32", "bf16"):
        rows = spawn(bytes_rank, world_size=4, args=(precision,), env=TWO_BY_TWO, timeout=1800)
        r0, plain = rows[0], rows[0]["plain"]
        print(f"\nbytes per step, rank 0 of 4 (2 nodes x 2), {precision}, yardstick GPT "
              f"({Shape().params() / 1e6:.1f}M parameters)")
        print(f"{'kind':<7}{'gather MB':>11}{'vs plain':>10}{'bwd gather across MB':>22}{'grad across MB':>16}"
              f"{'vs plain':>10}")
        for kind, row in r0.items():
            print(f"{kind:<7}{row['gather_bytes'] / 2**20:>11.2f}{row['gather_bytes'] / plain['gather_bytes']:>9.3f}x"
                  f"{row['backward_gather_cross'] / 2**20:>22.2f}{row['grad_cross'] / 2**20:>16.2f}"
                  f"{row['grad_cross'] / plain['grad_cross']:>9.3f}x")
        worst = {kind: {"gather": max(r[kind]["gather_bytes"] / r["plain"]["gather_bytes"] for r in rows),
                        "bwd_cross": max(r[kind]["backward_gather_cross"] for r in rows),
                        "grad": max(r[kind]["grad_cross"] / r["plain"]["grad_cross"] for r in rows)} for kind in KINDS}
        goal = 0.27 if precision == "fp32" else 0.52
        print(f"qwZ: parameter all-gather bytes {worst['qwZ']['gather']:.3f}x plain (goal <= {goal}: "
              f"{'met' if worst['qwZ']['gather'] <= goal else 'missed'}), every rank")
        print(f"hpZ: backward gather bytes crossing nodes {worst['hpZ']['bwd_cross']} (goal 0: "
              f"{'met' if worst['hpZ']['bwd_cross'] == 0 else 'missed'}); plain: {plain['backward_gather_cross']}")
        print(f"qgZ: gradient bytes crossing nodes {worst['qgZ']['grad']:.3f}x plain (goal <= 0.3: "
              f"{'met' if worst['qgZ']['grad'] <= 0.3 else 'missed'}), every rank")
        results[f"bytes_{precision}"] = {"rank0": r0, "worst": worst}


# ---------------------------------------------------------------------------------------- convergence
SMALL = Shape(vocab=512, d_model=128, layers=2, heads=4, seq=64, micro_batch=8)


def _walks(step: int, rank: int) -> torch.Tensor:
    """Sequences walking a fixed successor table (each token's next is one of 2), from random starts."""
    table = torch.randint(0, SMALL.vocab, (SMALL.vocab, 2), generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(10_000 * step + rank)
    seq = [torch.randint(0, SMALL.vocab, (SMALL.micro_batch,), generator=g)]
    for _ in range(SMALL.seq - 1):
        pick = torch.randint(0, 2, (SMALL.micro_batch,), generator=g)
        seq.append(table[seq[-1], pick])
    return torch.stack(seq, dim=1)


def convergence_rank(rank, world_size, steps, kinds):
    curves = {}
    for kind in kinds:
        torch.manual_seed(0)
        model = GPT(SMALL)
        zero = _zero(model, kind, "fp32", lr=3e-3)
        losses = []
        for step in range(steps):
            loss = model(_walks(step, rank))
            zero.backward(loss)
            zero.step()
            zero.zero_grad()
            losses.append(loss.item())
        zero.close()
        curves[kind] = losses
    return curves


def part_convergence(results: dict, steps: int) -> None:
    curves = spawn(convergence_rank, world_size=4, args=(steps, ["plain", "all"]), env=TWO_BY_TWO, timeout=3600)[0]
    print(f"\nconvergence: small GPT, 4 ranks (2 nodes x 2), {steps} steps, rank 0's loss")
    print(f"{'step':>6}{'plain':>10}{'all three':>11}")
    for step in [*range(0, steps, 25), steps - 1]:
        print(f"{step:>6}{curves['plain'][step]:>10.4f}{curves['all'][step]:>11.4f}")
    final = {kind: statistics.fmean(c[-20:]) for kind, c in curves.items()}
    gap = final["all"] / final["plain"] - 1
    print(f"final loss (mean of the last 20 steps): plain {final['plain']:.4f}, all three {final['all']:.4f} "
          f"({gap:+.2%}; goal within 1 %: {'met' if abs(gap) <= 0.01 else 'missed'})")
    results["convergence"] = {"curves": curves, "final": final, "gap": gap}


# ---------------------------------------------------------------------------------------------- speed
NAMESPACES = ("dszpp0", "dszpp1")
LINKS = ("dszpp-a", "dszpp-b")
ADDRESSES = ("10.77.0.1", "10.77.0.2")


def speed_rank(out: str, steps: int, micro: int, kinds: list[str]) -> None:
    """One rank of the speed part (ds-launch's variables in the environment): plain and all three, steps
    alternating; rank 0 writes each kind's step times."""
    ds_comm.init_distributed()
    rank = ds_comm.get_rank()
    shape = Shape(micro_batch=micro)
    runs = {}
    for kind in kinds:
        torch.manual_seed(0)
        model = GPT(shape)
        runs[kind] = (model, _zero(model, kind, "fp32"))
    times: dict[str, list[float]] = {kind: [] for kind in runs}
    for step in range(steps + 2):
        for kind, (model, zero) in (list(runs.items()) if step % 2 else list(runs.items())[::-1]):
            ds_comm.barrier()
            start = time.perf_counter()
            zero.backward(model(tokens(step, 0, rank, shape)))
            zero.step()
            zero.zero_grad()
            ds_comm.barrier()
            if step >= 2:
                times[kind].append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    for _, zero in runs.values():
        zero.close()
    ds_comm.destroy_process_group()


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True)


def _namespaces(rate: str | None) -> None:
    _teardown()
    for ns in NAMESPACES:
        _sh("ip", "netns", "add", ns)
    _sh("ip", "link", "add", LINKS[0], "type", "veth", "peer", "name", LINKS[1])
    for ns, link, address in zip(NAMESPACES, LINKS, ADDRESSES, strict=True):
        _sh("ip", "link", "set", link, "netns", ns)
        run_in = ("ip", "netns", "exec", ns)
        _sh(*run_in, "ip", "link", "set", "lo", "up")
        _sh(*run_in, "ip", "addr", "add", f"{address}/24", "dev", link)
        _sh(*run_in, "ip", "link", "set", link, "up")
        if rate:
            _sh(*run_in, "tc", "qdisc", "add", "dev", link, "root", "tbf", "rate", rate, "burst", "1mb",
                "latency", "2s")


def _teardown() -> None:
    for ns in NAMESPACES:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def speed_run(rate: str | None, steps: int, micro: int, kinds: list[str]) -> dict[str, list[float]]:
    _namespaces(rate)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "times.json")
            ranks = []
            for rank in range(4):
                node = rank // 2
                env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(rank % 2),
                       "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": ADDRESSES[0], "MASTER_PORT": "29631",
                       "GLOO_SOCKET_IFNAME": LINKS[node], "OMP_NUM_THREADS": "1"}
                ranks.append(subprocess.Popen(["ip", "netns", "exec", NAMESPACES[node], sys.executable, __file__,
                                               "--rank-of-speed", out, "--steps", str(steps), "--micro", str(micro),
                                               "--kinds", *kinds],
                                              env=env))
            codes = [p.wait(timeout=3600) for p in ranks]
            if any(codes):
                raise RuntimeError(f"speed ranks exited with {codes}")
            return json.loads(Path(out).read_text())
    finally:
        _teardown()


def part_speed(results: dict, rate: str, steps: int, micro: int, kinds: list[str]) -> None:
    kinds = ["plain", *[k for k in kinds if k != "plain"]]
    for label, limit in ((f"inter-node link limited to {rate}", rate), ("veth without a limit", None)):
        times = speed_run(limit, steps, micro, kinds)
        print(f"\nspeed, {label}: yardstick GPT, micro-batch {micro}, 4 ranks (2 nodes x 2), {steps} steps each, "
              "alternating")
        row = {}
        for kind in kinds:
            ratio = statistics.median(a / p for a, p in zip(times[kind], times["plain"], strict=True))
            print(f"{kind:<6} {statistics.median(times[kind]):.2f} s/step, {ratio:.3f}x plain ZeRO-3's (median of "
                  "same-step ratios)")
            row[kind] = {"times": times[kind], "ratio": ratio}
        if limit and "all" in row:
            print(f"goal: all three <= 0.6x plain ZeRO-3's step on the limited link: "
                  f"{'met' if row['all']['ratio'] <= 0.6 else 'missed'}")
        results[f"speed_{'limited' if limit else 'unlimited'}"] = row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", nargs="+", default=["bytes", "convergence", "speed"],
                        choices=["bytes", "convergence", "speed"])
    parser.add_argument("--rate", default="1gbit", help="the inter-node link's rate for tc")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per kind (speed)")
    parser.add_argument("--micro", type=int, default=1, help="micro-batch per rank (speed)")
    parser.add_argument("--kinds", nargs="+", default=["plain", "all"], choices=list(KINDS), help="(speed)")
    parser.add_argument("--convergence-steps", type=int, default=300)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--rank-of-speed", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of_speed:
        speed_rank(args.rank_of_speed, args.steps, args.micro, args.kinds)
        return
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs", flush=True)
    results: dict = {}
    if "bytes" in args.part:
        part_bytes(results)
    if "convergence" in args.part:
        part_convergence(results, args.convergence_steps)
    if "speed" in args.part:
        part_speed(results, args.rate, args.steps, args.micro, args.kinds)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
