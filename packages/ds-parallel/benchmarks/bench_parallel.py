"""Tensor and sequence parallelism on 2 ranks (gloo, 1 thread a rank, fp32): the figures of issue 30.

* **tp** -- per-rank parameter + gradient + optimizer memory of the yardstick GPT (ARCHITECTURE.md, "The yardstick workload") (vocab 8192, d_model 512,
  8 layers, 8 heads, seq 256, micro-batch 4, AdamW) at TP=2 against DP=2 (goal <= 0.55x). The TP=2 model is
  built from ds-parallel's Megatron layers: `VocabParallelEmbedding`, q/k/v and the MLP's first linear
  `ColumnParallelLinear` (``gather_output=False``: each rank attends over its 4 heads), the attention projection and
  the MLP's second linear `RowParallelLinear` (``input_is_parallel=True``), an LM head `ColumnParallelLinear` into
  `vocab_parallel_cross_entropy` (no full logits on any rank); layer norms, positions and row biases replicated.
  The DP=2 model is the same GPT with torch's layers, gradients all-reduced. Bytes are counted from the tensors
  after one step (``p``, ``p.grad``, every tensor in the optimizer's state); step times are printed too.
* **ulysses** -- a small GPT (d_model 256, 8 heads, 2 layers, vocab 8192) on one sequence of ``--seq`` tokens
  (8192 by default), the sequence split over 2 ranks with ds-parallel's `DistributedAttention` around torch's SDPA
  (causal; on CPU a flash kernel, so no seq x seq matrix anywhere), against one rank holding the whole sequence:
  - peak activation memory per rank, measured two ways: (1) the bytes autograd saves for backward in forward
    (``torch.autograd.graph.saved_tensors_hooks``, distinct storages, parameters left out) and (2) the growth of
    the process's peak resident memory over one training step (``/proc/self/clear_refs`` resets VmHWM, malloc's
    mmap threshold pinned at 64 KiB so freed tensors leave the process): what the step really needs, gradients
    and transient buffers included. Goal <= 0.55x.
  - step time (median, the slower rank) against the one-rank step, in a second pair of processes (malloc left
    alone), SP steps and one-rank steps alternating; the share of the SP step spent in collectives (ds-comm's
    comms logger: the all-to-alls and the gradient all-reduce, waits for the peer included).
  - torch's own context parallelism (``torch.distributed.tensor.experimental.context_parallel``, ring attention
    over a CPU DeviceMesh): tried on the same model; its error is printed when it does not run on CPU.
* **deepspeed** -- DeepSpeed 0.19.8's ``deepspeed.sequence.layer.DistributedAttention`` (``--dsref``, its venv)
  on the same model and step, and ours, each under its own torchrun (``_bench_parallel_parts.py``), jobs in the
  order ours, DeepSpeed, DeepSpeed, ours (``--ds-rounds 2``); medians of the slower rank's step times after each
  job's first step. The losses of the two are compared too.

    python benchmarks/bench_parallel.py [--json out.json]      # the issue's figures
    python benchmarks/bench_parallel.py --quick                # a smoke run (small shapes, ~1 minute)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_parallel_parts import (
    GPT,
    ULYSSES,
    Shape,
    average_gradients,
    batch,
    sdpa_causal,
    sp_step,
)

import ds_comm
from ds_comm.testing import free_port, spawn

RUNNER = Path(__file__).resolve().parent / "_bench_parallel_parts.py"
PARTS = ("tp", "ulysses", "deepspeed")
MB = 2**20


# ---- TP=2 against DP=2: per-rank memory ---------------------------------------------------------------------
def _tp_gpt(shape: Shape):
    """The yardstick GPT's shape in Megatron's parallel layers: its modules are not the yardstick's (q, k and v
    are separate column-parallel linears, each forward returns ``(output, bias)``), so it is built here."""
    from ds_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    d, heads = shape.d_model, shape.heads

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
            self.q, self.k, self.v = (ColumnParallelLinear(d, d, gather_output=False) for _ in range(3))
            self.proj = RowParallelLinear(d, d, input_is_parallel=True)
            self.fc = ColumnParallelLinear(d, 4 * d, gather_output=False)
            self.out = RowParallelLinear(4 * d, d, input_is_parallel=True)

        def forward(self, x):
            b, s, _ = x.shape
            h = self.ln1(x)
            q, k, v = (lin(h)[0].view(b, s, -1, d // heads) for lin in (self.q, self.k, self.v))
            x = x + self.proj(sdpa_causal(q, k, v).reshape(b, s, -1))[0]
            return x + self.out(F.gelu(self.fc(self.ln2(x))[0]))[0]

    class TPGPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = VocabParallelEmbedding(shape.vocab, d)
            self.pos = torch.nn.Embedding(shape.seq, d)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(shape.layers))
            self.ln = torch.nn.LayerNorm(d)
            self.head = ColumnParallelLinear(d, shape.vocab, bias=False, gather_output=False)

        def forward(self, tokens):
            x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln(x))[0]  # this rank's vocabulary slice of the logits

    return TPGPT()


def _state_bytes(model, optimizer) -> dict:
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    states = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor))
    return {"params": params, "grads": grads, "optimizer": states, "total": params + grads + states}


def run_tp(rank: int, world: int, shape: Shape, steps: int) -> dict:
    from ds_parallel import vocab_parallel_cross_entropy

    torch.set_num_threads(1)
    result = {}
    for mode in ("dp", "tp"):
        torch.manual_seed(0)
        model = GPT(shape, sdpa_causal) if mode == "dp" else _tp_gpt(shape)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        times, losses = [], []
        for step in range(steps):
            # DP: each rank its own micro-batch; TP: both ranks the same one
            tokens, targets = batch(shape, 2 * step + (rank if mode == "dp" else 0))
            ds_comm.barrier()
            start = time.perf_counter()
            if mode == "dp":
                loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
                loss.backward()
                average_gradients(model, world, ds_comm.all_reduce)
            else:
                loss = vocab_parallel_cross_entropy(model(tokens), targets).mean()
                loss.backward()
            optimizer.step()
            times.append(time.perf_counter() - start)
            losses.append(float(loss.detach()))
            if step < steps - 1:
                optimizer.zero_grad(set_to_none=True)
        result[mode] = {"bytes": _state_bytes(model, optimizer), "times": times, "losses": losses}
        del model, optimizer
    return result


def tp_part(args, report: dict) -> None:
    shape = Shape() if not args.quick else \
        Shape(vocab=1024, d_model=128, layers=2, heads=4, seq=64, micro_batch=2)
    print(f"tp: GPT {asdict(shape)}, AdamW fp32, {args.tp_steps} steps, 2 ranks", flush=True)
    ranks = spawn(run_tp, world_size=2, args=(shape, args.tp_steps), timeout=3600)
    rows = {}
    for mode in ("dp", "tp"):
        b = [r[mode]["bytes"] for r in ranks]
        step = statistics.median(max(r[mode]["times"][i] for r in ranks) for i in range(1, args.tp_steps)) \
            if args.tp_steps > 1 else max(r[mode]["times"][0] for r in ranks)
        rows[mode] = {"per_rank_bytes": b, "max_total": max(x["total"] for x in b), "step_s": step,
                      "losses": ranks[0][mode]["losses"]}
    for mode, label in (("tp", "ours TP=2 "), ("dp", "base DP=2 ")):
        b = rows[mode]["per_rank_bytes"][0]
        print(f"  {label} per rank: params {b['params'] / MB:8.1f} MiB  grads {b['grads'] / MB:8.1f} MiB  "
              f"AdamW {b['optimizer'] / MB:8.1f} MiB  total {rows[mode]['max_total'] / MB:8.1f} MiB  "
              f"step {rows[mode]['step_s']:.3f} s  loss {rows[mode]['losses'][0]:.4f}", flush=True)
    ratio = rows["tp"]["max_total"] / rows["dp"]["max_total"]
    print(f"  ratio TP/DP per-rank params+grads+optimizer: {ratio:.3f}x (goal <= 0.55x)  "
          f"step time TP/DP: {rows['tp']['step_s'] / rows['dp']['step_s']:.2f}x", flush=True)
    report["tp"] = {"shape": asdict(shape), **rows, "memory_ratio": ratio}


# ---- Ulysses: activation memory, step time, collectives -------------------------------------------------------
def _pin_malloc() -> bool:
    """Make freed large blocks go back to the OS at once (a fixed 64 KiB mmap threshold), so RSS follows tensors."""
    try:
        return ctypes.CDLL("libc.so.6").mallopt(-3, 65536) == 1  # M_MMAP_THRESHOLD
    except OSError:
        return False


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _measure(step, params) -> dict:
    """Run ``step()`` once: bytes saved for backward (distinct storages, parameters excluded) and the growth of
    the peak resident memory over the step."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    before = _status_kib("VmRSS")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return {"saved_bytes": sum(saved.values()), "peak_rss_growth_bytes": (_status_kib("VmHWM") - before) * 1024}


def _try_context_parallel(shape: Shape, rank: int, world: int, steps: int) -> dict:
    """torch's ring-attention context parallelism on the same model; its error if it does not run here."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        model = GPT(shape, sdpa_causal)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        times = []
        for step in range(steps):
            tokens, targets = (t.contiguous() for t in batch(shape, step))
            positions = torch.arange(shape.seq).expand(shape.micro_batch, -1).contiguous()
            ds_comm.barrier()
            start = time.perf_counter()
            with context_parallel(mesh, buffers=[tokens, targets, positions], buffer_seq_dims=[1, 1, 1]):
                loss = F.cross_entropy(model(tokens, positions=positions).flatten(0, 1), targets.flatten())
                loss.backward()
            average_gradients(model, world, ds_comm.all_reduce)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
        return {"times": times}
    except Exception as e:  # reported, not hidden: the figure says why it is missing
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}


def _models(shape: Shape, rank: int, world: int, whole: bool):
    """This rank's SP step and (``whole``) the one-rank step on the whole sequence, each ``f(step)``, with their
    models' parameters; both models from seed 0."""
    from ds_parallel import DistributedAttention

    attention = DistributedAttention(sdpa_causal, None)
    torch.manual_seed(0)
    model = GPT(shape, lambda q, k, v: attention(q, k, v, 0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def sp(step):
        tokens, targets = batch(shape, step)
        return sp_step(model, optimizer, tokens, targets, rank, world, ds_comm.all_reduce)

    if not whole:
        return (sp, list(model.parameters())), None
    torch.manual_seed(0)
    single = GPT(shape, sdpa_causal)
    opt = torch.optim.AdamW(single.parameters(), lr=1e-4)

    def one(step):
        tokens, targets = batch(shape, step)
        loss = F.cross_entropy(single(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return (sp, list(model.parameters())), (one, list(single.parameters()))


def run_ulysses_memory(rank: int, world: int, shape: Shape) -> dict:
    """Activation memory: the SP step, then (rank 0, the other waiting) the one-rank step, each measured
    after a warm-up step (so the optimizer's state exists), malloc pinned."""
    torch.set_num_threads(1)
    out: dict = {"malloc_pinned": _pin_malloc()}
    (sp, sp_params), _ = _models(shape, rank, world, whole=False)
    sp(0)
    out["sp_memory"] = _measure(lambda: sp(1), sp_params)
    sp = sp_params = None  # free the SP model before the one-rank model is built
    if rank == 0:
        _, (one, one_params) = _models(shape, rank, world, whole=True)
        one(0)
        out["one_memory"] = _measure(lambda: one(1), one_params)
    ds_comm.barrier()
    return out


def run_ulysses_time(rank: int, world: int, shape: Shape, steps: int) -> dict:
    """Step times, SP=2 and one rank on the whole sequence alternating (so the machine's drift hits both), the
    SP steps with the comms logger on; then torch's context parallelism."""
    torch.set_num_threads(1)
    (sp, _), whole = _models(shape, rank, world, whole=rank == 0)
    sp(0)
    if rank == 0:
        whole[0](0)
    ds_comm.barrier()
    out: dict = {"sp_times": [], "sp_comm": [], "one_times": []}
    for step in range(steps):
        ds_comm.configure(enabled=True)
        ds_comm.comms_logger.reset()
        ds_comm.barrier()
        start = time.perf_counter()
        sp(1 + step)
        out["sp_times"].append(time.perf_counter() - start)
        out["sp_comm"].append({r.op: r.total_s for r in ds_comm.comms_logger.records() if r.op != "barrier"})
        ds_comm.configure(enabled=False)
        if rank == 0:  # one rank holding the whole sequence (the other waits at the barrier)
            start = time.perf_counter()
            whole[0](1 + step)
            out["one_times"].append(time.perf_counter() - start)
        ds_comm.barrier()
    sp = whole = None
    out["context_parallel"] = _try_context_parallel(shape, rank, world, steps)
    return out


def ulysses_part(args, report: dict) -> None:
    shape = replace(ULYSSES, seq=args.seq) if not args.quick else \
        Shape(vocab=1024, d_model=64, layers=2, heads=4, seq=1024, micro_batch=1)
    print(f"ulysses: GPT {asdict(shape)}, SP=2 (DistributedAttention around SDPA, causal) vs one rank with the "
          f"whole sequence; memory: one step after a warm-up, malloc pinned; time: {args.steps} steps of each, alternating, "
          f"after a warm-up, malloc untouched", flush=True)
    memory = spawn(run_ulysses_memory, world_size=2, args=(shape,), timeout=3600)
    ranks = spawn(run_ulysses_time, world_size=2, args=(shape, args.steps), timeout=3600)
    r0 = ranks[0]
    sp_mem = {k: max(r["sp_memory"][k] for r in memory) for k in memory[0]["sp_memory"]}
    one_mem = memory[0]["one_memory"]
    sp_step_s = statistics.median(max(r["sp_times"][i] for r in ranks) for i in range(args.steps))
    one_step_s = statistics.median(r0["one_times"])
    share = statistics.median(sum(ops.values()) / r["sp_times"][i] for r in ranks for i, ops in enumerate(r["sp_comm"]))
    a2a = statistics.median(ops.get("all_to_all_single", 0.0) / r["sp_times"][i]
                            for r in ranks for i, ops in enumerate(r["sp_comm"]))
    for key, label in (("saved_bytes", "saved for backward"), ("peak_rss_growth_bytes", "peak RSS growth over a step")):
        print(f"  activation memory per rank ({label}): ours SP=2 {sp_mem[key] / MB:9.1f} MiB  base one rank "
              f"{one_mem[key] / MB:9.1f} MiB  ratio {sp_mem[key] / one_mem[key]:.3f}x (goal <= 0.55x)", flush=True)
    if not memory[0]["malloc_pinned"]:
        print("  (mallopt failed: the RSS figure may under-count freed-and-reused memory)", flush=True)
    print(f"  step time: ours SP=2 {sp_step_s:.3f} s  base one rank, whole sequence {one_step_s:.3f} s  "
          f"ratio {sp_step_s / one_step_s:.2f}x", flush=True)
    print(f"  collectives' share of the SP step: {share * 100:.1f}% (all-to-alls {a2a * 100:.1f}%, the rest the "
          f"gradient all-reduce; waits for the peer included)", flush=True)
    cp = [r["context_parallel"] for r in ranks]
    if "error" in cp[0]:
        print(f"  torch context_parallel on CPU/gloo: does not run -- {cp[0]['error']}", flush=True)
        cp_step = None
    else:
        cp_step = statistics.median(max(r["times"][i] for r in cp) for i in range(args.steps))
        print(f"  step time: ours SP=2 {sp_step_s:.3f} s  torch context_parallel {cp_step:.3f} s  "
              f"ratio {sp_step_s / cp_step:.2f}x", flush=True)
    report["ulysses"] = {"shape": asdict(shape), "sp_memory": sp_mem, "one_memory": one_mem,
                         "memory_ratio": {k: sp_mem[k] / one_mem[k] for k in sp_mem},
                         "sp_step_s": sp_step_s, "one_step_s": one_step_s, "comm_share": share,
                         "all_to_all_share": a2a, "context_parallel": cp[0] if cp_step is None else
                         {"step_s": cp_step, "ratio": sp_step_s / cp_step}}


# ---- DeepSpeed 0.19.8's Ulysses ------------------------------------------------------------------------------
def _torchrun(backend: str, args, shape: Shape, out: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    if backend == "deepspeed":
        command = [str(Path(args.dsref) / "bin" / "torchrun")]
        env["DS_ACCELERATOR"] = "cpu"
    else:
        command = [sys.executable, "-m", "torch.distributed.run"]
    command += ["--nproc_per_node", "2", "--master_port", str(free_port()), str(RUNNER), "--backend", backend,
                "--out", out, "--steps", str(args.steps + 1)]
    command += [x for k, v in asdict(shape).items() for x in (f"--{k.replace('_', '-')}", str(v))]
    # a session of its own, so that a timeout ends torchrun's ranks too (not only torchrun)
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=args.ds_timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        raise RuntimeError(f"the {backend} job did not finish within {args.ds_timeout:g} s:\n{log[-3000:]}") from None
    if proc.returncode:
        raise RuntimeError(f"the {backend} job failed (exit {proc.returncode}):\n{log[-3000:]}")
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]
    steps = [max(r["times"][i] for r in ranks) for i in range(1, args.steps + 1)]
    return {"step_s": statistics.median(steps), "steps": steps, "losses": ranks[0]["losses"]}


def deepspeed_part(args, report: dict) -> None:
    shape = replace(ULYSSES, seq=args.seq) if not args.quick else \
        Shape(vocab=1024, d_model=64, layers=2, heads=4, seq=1024, micro_batch=1)
    if not (Path(args.dsref) / "bin" / "torchrun").exists():
        print(f"deepspeed: {args.dsref}/bin/torchrun not found: DeepSpeed's comparison skipped", flush=True)
        return
    order = ["ds", "deepspeed", "deepspeed", "ds"] if args.ds_rounds > 1 else ["ds", "deepspeed"]
    print(f"deepspeed: the same SP=2 step under torchrun, DeepSpeed 0.19.8's DistributedAttention ({args.dsref}) "
          f"and ours, jobs in the order {order}, medians of {args.steps} steps after one per job",
          flush=True)
    runs: dict[str, list[dict]] = {"ds": [], "deepspeed": []}
    with tempfile.TemporaryDirectory(prefix="bench_parallel_") as tmp:
        for i, backend in enumerate(order):
            try:
                runs[backend].append(_torchrun(backend, args, shape, str(Path(tmp) / f"{backend}{i}")))
            except RuntimeError as e:
                print(f"  {backend}: did not run -- {str(e).splitlines()[0]}", flush=True)
                report["deepspeed"] = {"error": str(e)[-2000:]}
                return
    ours = statistics.median(t for r in runs["ds"] for t in r["steps"])
    theirs = statistics.median(t for r in runs["deepspeed"] for t in r["steps"])
    same = max(abs(a - b) for a, b in zip(runs["ds"][0]["losses"], runs["deepspeed"][0]["losses"], strict=True))
    print(f"  step time: ours {ours:.3f} s  DeepSpeed 0.19.8 {theirs:.3f} s  ratio {ours / theirs:.2f}x  "
          f"(per job: ours {[round(r['step_s'], 3) for r in runs['ds']]}, DeepSpeed "
          f"{[round(r['step_s'], 3) for r in runs['deepspeed']]}; max loss difference {same:.2e})", flush=True)
    report["deepspeed"] = {"ours_step_s": ours, "deepspeed_step_s": theirs, "ratio": ours / theirs,
                           "max_loss_diff": same, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes: a smoke run")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--seq", type=int, default=8192, help="Ulysses: the whole sequence's tokens")
    parser.add_argument("--steps", type=int, default=3, help="Ulysses: timed steps")
    parser.add_argument("--tp-steps", type=int, default=3, help="TP/DP: steps (the first is not timed)")
    parser.add_argument("--dsref", default="/work/dsref", help="DeepSpeed 0.19.8's venv")
    parser.add_argument("--ds-rounds", type=int, default=2, help="DeepSpeed part: 2 = jobs ours, DS, DS, ours; 1 = ours, DS")
    parser.add_argument("--ds-timeout", type=float, default=1800, help="seconds for each torchrun job")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.tp_steps, args.ds_rounds = 2, 2, 1
    report: dict = {"args": vars(args), "torch": torch.__version__}
    started = time.perf_counter()
    for part, run in (("tp", tp_part), ("ulysses", ulysses_part), ("deepspeed", deepspeed_part)):
        if part in args.parts:
            run(args, report)
    print(f"total {time.perf_counter() - started:.0f} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
