"""The parts of ``bench_gpu.py`` (see its docstring), each run in its own process: the GPT model, the
figures' recorder and the five measurements. Not a benchmark by itself (nox's ``bench`` session runs
``bench_*.py`` only)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import socket
import statistics
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

# the yardstick's one definition (ARCHITECTURE.md, "The yardstick workload"), from ds-zero's benchmarks folder by
# path: benchmarks are not installed, and this package gains no dependency on ds-zero
sys.path.append(str(Path(__file__).resolve().parents[2] / "ds-zero" / "benchmarks"))
from _yardstick import GPT, Shape

logger = logging.getLogger("bench_gpu")
LR, WEIGHT_DECAY = 3e-4, 0.01
LOSS_TOLERANCE = 0.02  # relative, the last step's loss against plain PyTorch's
HOST_BYTES_PER_PARAM = 18  # ZeRO-Offload on the host: fp32 master, exp_avg, exp_avg_sq, fp32 grad; bf16 staging

GPT_350M = Shape(50304, 1024, 20, 16, 1024, 8)
OFFLOAD_SIZES = {"5.2B": Shape(50304, 4096, 24, 32, 1024, 4), "6.0B": Shape(50304, 4096, 28, 32, 1024, 4),
                 "3.6B": Shape(50304, 4096, 16, 32, 1024, 4), "2.0B": Shape(50304, 4096, 8, 32, 1024, 4)}
SMOKE = Shape(256, 64, 2, 4, 32, 2)
SMOKE_OFFLOAD = {"s2": Shape(256, 64, 3, 4, 32, 2), "s1": Shape(256, 64, 2, 4, 32, 2)}


def _model_classes():
    """The yardstick GPT (``_yardstick.py``) whose loss is the cross entropy of float32 logits (the engine's runs
    are in bf16)."""
    return functools.partial(GPT, float_loss=True)


# ---------------------------------------------------------------- inside a part's process


class Recorder:
    """The part's figures, rewritten to ``path`` at each change (atomically): a part killed at its time
    limit leaves what it had measured."""

    def __init__(self, path: str):
        self.path, self.data = path, {}

    def __setitem__(self, key, value):
        self.data[key] = value
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, self.path)


@contextlib.contextmanager
def _guard(rec: Recorder, key: str):
    """A failure inside is recorded under ``key`` (type, message, the traceback's end) and the part goes on."""
    try:
        yield
    except Exception as error:  # a benchmark part records every failure and goes on
        logger.exception("%s failed", key)
        rec[key] = {"error": f"{type(error).__name__}: {error}"[:2000],
                    "traceback": traceback.format_exc()[-3000:]}


class Ctx:
    def __init__(self, smoke: bool, deadline: float):
        import torch

        self.torch, self.smoke, self.deadline = torch, smoke, deadline
        self.cuda = torch.cuda.is_available() and not smoke
        self.device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        if self.cuda:
            torch.cuda.set_device(0)
            torch.backends.cuda.matmul.allow_tf32 = True

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def left(self) -> float:
        return self.deadline - time.time()

    def tokens(self, shape: Shape, count: int, seed: int = 0):
        """``count`` batches of tokens from the first 1024 ids (a distribution the model learns within steps,
        so the losses compared move), made on the CPU and moved before any timing."""
        g = self.torch.Generator().manual_seed(seed)
        high = min(shape.vocab, 1024)
        return [self.torch.randint(0, high, (shape.micro_batch, shape.seq), generator=g).to(self.device)
                for _ in range(count)]

    def peak_gib(self) -> float | None:
        return round(self.torch.cuda.max_memory_allocated() / 2**30, 2) if self.cuda else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_group(ctx: Ctx, rec: Recorder) -> None:
    """World size 1 from the environment, as a launcher would set it: nccl on the GPU, gloo on the CPU."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    backend = "nccl" if ctx.cuda else "gloo"
    import ds_comm

    ds_comm.init_distributed(dist_backend=backend, verbose=False)
    rec["process_group"] = backend


def _engine_config(shape: Shape, stage: int, **zero) -> dict:
    return {"train_micro_batch_size_per_gpu": shape.micro_batch, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
            "bf16": {"enabled": True}, "zero_optimization": {"stage": stage, **zero},
            "gradient_clipping": 0.0, "steps_per_print": 10**9}


def _timed(ctx: Ctx, fn):
    ctx.sync()
    begin = time.perf_counter()
    out = fn()
    ctx.sync()
    return time.perf_counter() - begin, out


def _device_time(ctx: Ctx, fn) -> float:
    """Seconds ``fn`` keeps the device busy: between CUDA events on the current stream (the host's own time
    when there is no GPU)."""
    if not ctx.cuda:
        return _timed(ctx, fn)[0]
    torch = ctx.torch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _plain_step(ctx: Ctx, model, optimizer, tokens):
    with ctx.torch.autocast(ctx.device.type, dtype=ctx.torch.bfloat16):
        loss = model(tokens)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def _engine_step(engine, tokens):
    loss = engine(tokens)
    engine.backward(loss)
    engine.step()
    return loss


def _inner_optimizer(engine) -> str:
    zero = getattr(engine, "zero", None) or getattr(engine, "optimizer", None)
    inner = getattr(zero, "optimizer", zero)
    return type(inner).__name__


def _compare(name_a: str, times_a: list, name_b: str, times_b: list, skip: int) -> dict:
    a, b = times_a[skip:], times_b[skip:]
    return {f"{name_a}_s": statistics.median(a), f"{name_b}_s": statistics.median(b),
            "ratio": statistics.median(x / y for x, y in zip(a, b, strict=True)), "steps_timed": len(a)}


def part_gpt(ctx: Ctx, rec: Recorder, stages: list[int]) -> None:
    torch = ctx.torch
    shape = SMOKE if ctx.smoke else GPT_350M
    steps, skip = (4, 1) if ctx.smoke else (10, 3)
    GPT = _model_classes()
    torch.manual_seed(0)
    plain = GPT(shape).to(ctx.device)
    init = {k: v.detach().clone() for k, v in plain.state_dict().items()}
    batches = ctx.tokens(shape, steps)
    rec["shape"] = {**asdict(shape), "params": sum(p.numel() for p in plain.parameters())}
    rec["baseline"] = "float32 weights, torch.autocast bf16, torch.optim.AdamW(fused=True on CUDA)"
    for stage in stages:
        if ctx.left() < (2 if ctx.smoke else 8):
            rec[f"stage{stage}"] = {"skipped": "out of the part's time"}
            continue
        with _guard(rec, f"stage{stage}"):
            rec[f"stage{stage}"] = _gpt_stage(ctx, GPT, shape, stage, plain, init, batches, skip)
        if ctx.cuda:
            torch.cuda.empty_cache()


def _gpt_stage(ctx: Ctx, GPT, shape: Shape, stage: int, plain, init: dict, batches: list, skip: int) -> dict:
    """One stage's engine against plain PyTorch from the same weights, steps alternating (which goes first too)."""
    torch = ctx.torch
    import ds_all

    plain.load_state_dict(init)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                                  fused=True if ctx.cuda else None)
    model = GPT(shape).to(ctx.device)
    model.load_state_dict(init)
    engine, *_ = ds_all.initialize(model=model, config=_engine_config(shape, stage))
    try:
        times, losses = {"plain": [], "ds": []}, {"plain": [], "ds": []}
        for i, tokens in enumerate(batches):
            order = [("plain", lambda t=tokens: _plain_step(ctx, plain, optimizer, t)),
                     ("ds", lambda t=tokens: _engine_step(engine, t))][:: 1 if i % 2 == 0 else -1]
            for name, fn in order:
                seconds, loss = _timed(ctx, fn)
                times[name].append(seconds)
                losses[name].append(float(loss.detach()))
        result = _compare("ds", times["ds"], "plain", times["plain"], skip)
        rel = abs(losses["ds"][-1] - losses["plain"][-1]) / abs(losses["plain"][-1])
        result.update(losses=losses, last_loss_rel_diff=rel, loss_ok=rel <= LOSS_TOLERANCE,
                      loss_decreased=losses["ds"][-1] < losses["ds"][0], goal_ratio=1.05,
                      ratio_ok=result["ratio"] <= 1.05, optimizer=_inner_optimizer(engine),
                      peak_gib=ctx.peak_gib())
        logger.info("stage %d: ds %.4f s/step, plain %.4f s/step, ratio %.3f; last loss %.4f vs %.4f", stage,
                    result["ds_s"], result["plain_s"], result["ratio"], losses["ds"][-1], losses["plain"][-1])
        return result
    finally:
        engine.destroy()


def part_adam(ctx: Ctx, rec: Recorder) -> None:
    torch = ctx.torch
    import ds_ops

    count, numel = (4, 2**18) if ctx.smoke else (100, 10**6)
    steps, skip = (5, 1) if ctx.smoke else (25, 5)
    rec["params"] = count * numel

    def tensors(seed):
        g = torch.Generator(device=ctx.device).manual_seed(seed)
        ps = [torch.randn(numel, device=ctx.device, generator=g).requires_grad_() for _ in range(count)]
        for p in ps:
            p.grad = torch.randn(numel, device=ctx.device, generator=g) * 1e-2
        return ps

    ours, theirs = tensors(0), tensors(0)
    fused = ds_ops.FusedAdam(ours, lr=1e-3, weight_decay=WEIGHT_DECAY, adam_w_mode=True)
    reference = torch.optim.AdamW(theirs, lr=1e-3, weight_decay=WEIGHT_DECAY, fused=True if ctx.cuda else None)

    times = {"ds": [], "torch": []}
    for i in range(steps):
        for name, opt in [("ds", fused), ("torch", reference)][:: 1 if i % 2 == 0 else -1]:
            times[name].append(_device_time(ctx, opt.step))
    result = _compare("ds", times["ds"], "torch", times["torch"], skip)
    result["speed_vs_torch"] = 1.0 / result.pop("ratio")  # > 1: ours faster
    result["max_abs_diff_vs_torch"] = max(float((a - b).detach().abs().max()) for a, b in zip(ours, theirs, strict=True))
    result["bytes_per_element"] = 28  # read p, g, exp_avg, exp_avg_sq; write p, exp_avg, exp_avg_sq (fp32)
    result["adam_gbps"] = 28 * count * numel / result["ds_s"] / 1e9
    result.update(goal_speed=0.95, speed_ok=result["speed_vs_torch"] >= 0.95)
    rec["fused_adam"] = result
    del ours, theirs, fused, reference
    with _guard(rec, "copy_probe"):
        n = (2**22) if ctx.smoke else (2**28)  # float32 elements: 16 MiB / 1 GiB
        src = torch.randn(n, device=ctx.device)
        dst = torch.empty_like(src)
        probes = [_device_time(ctx, lambda: dst.copy_(src)) for _ in range(8)]
        copy_gbps = 2 * n * 4 / statistics.median(probes[2:]) / 1e9  # bytes read and written
        fraction = result["adam_gbps"] / copy_gbps
        rec["copy_probe"] = {"bytes": n * 4, "gbps_read_plus_write": copy_gbps, "adam_fraction_of_copy": fraction,
                             "goal_fraction": 0.8, "fraction_ok": fraction >= 0.8}
    logger.info("FusedAdam: %.3f ms vs torch %.3f ms (speed %.3fx), %.0f GB/s", result["ds_s"] * 1e3,
                result["torch_s"] * 1e3, result["speed_vs_torch"], result["adam_gbps"])


def part_copies(ctx: Ctx, rec: Recorder) -> None:
    torch = ctx.torch
    if not ctx.cuda:
        rec["skipped"] = "no CUDA: device<->pinned copies need a GPU"
        return
    n = 2**29  # bf16 elements: 1 GiB
    rec["bytes"] = 2 * n
    device_buf = torch.randn(n, device=ctx.device, dtype=torch.bfloat16)
    rec["probe_gbps"] = probe = _probe_copies(ctx, device_buf)
    with _guard(rec, "copies"):
        rec["copies"] = _ds_copies(ctx, rec, device_buf, probe)


def _probe_copies(ctx: Ctx, device_buf) -> dict:
    """The probe: plain ``copy_(non_blocking=True)`` each way between ``device_buf`` and a torch-pinned
    buffer, the best of 5 (GB/s)."""
    host = ctx.torch.empty(device_buf.numel(), dtype=device_buf.dtype, pin_memory=True)
    nbytes = device_buf.numel() * device_buf.element_size()
    out = {}
    for name, fn in [("d2h", lambda: host.copy_(device_buf, non_blocking=True)),
                     ("h2d", lambda: device_buf.copy_(host, non_blocking=True))]:
        out[name] = nbytes / min(_timed(ctx, fn)[0] for _ in range(5)) / 1e9
    return out


def _ds_copies(ctx: Ctx, rec: Recorder, device_buf, probe: dict) -> dict:
    """The same copies through ds-zero's offload copy path (``ds_zero._transfer``), else torch's copies
    between a buffer pinned by ds-ops' accelerator and the device (the JSON's ``path`` says which)."""
    torch, n = ctx.torch, device_buf.numel()
    try:
        from ds_zero import _transfer
    except ImportError as error:
        rec["path"] = f"torch copies (ds_zero._transfer not importable: {error})"
        import ds_ops

        host = ds_ops.get_accelerator().pin_memory(torch.empty(n, dtype=torch.bfloat16))
        ours = {"d2h": lambda: host.copy_(device_buf, non_blocking=True),
                "h2d": lambda: device_buf.copy_(host, non_blocking=True)}
    else:
        rec["path"] = "ds_zero._transfer (host_buffer, copy_stream, device_to_host, host_to_device)"
        host = _transfer.host_buffer(n, torch.bfloat16, ctx.device)
        stream, counts = _transfer.copy_stream(ctx.device), _transfer.TransferCounts()
        ours = {"d2h": lambda: _transfer.wait_copies([_transfer.device_to_host(device_buf, host, stream=stream,
                                                                                counts=counts)]),
                "h2d": lambda: _transfer.host_to_device(host, device_buf, counts=counts)}
    rec["host_pinned"] = bool(host.is_pinned())
    out = {}
    for direction, fn in ours.items():
        gbps = n * device_buf.element_size() / min(_timed(ctx, fn)[0] for _ in range(5)) / 1e9
        fraction = gbps / probe[direction]
        out[direction] = {"ds_gbps": gbps, "probe_gbps": probe[direction], "fraction": fraction,
                          "goal_fraction": 0.8, "fraction_ok": fraction >= 0.8}
        logger.info("%s: ds %.1f GB/s, probe %.1f GB/s", direction, gbps, probe[direction])
    return out


def part_zero3_offload(ctx: Ctx, rec: Recorder) -> None:
    """ZeRO-3 with the parameters offloaded (offload_param cpu) against the same run with them on the GPU.
    ds-zero offloads parameters of a GPU model together with the optimizer (offload_optimizer cpu; alone it is
    refused, a README row), so the like-for-like baseline is the optimizer offload alone ("optimizer"): the
    ratio is what keeping the parameters on the host costs. The run with nothing offloaded is timed too."""
    torch = ctx.torch
    import ds_all

    shape = SMOKE if ctx.smoke else GPT_350M
    steps, skip = (4, 1) if ctx.smoke else (10, 3)
    GPT = _model_classes()
    torch.manual_seed(0)
    models = {name: GPT(shape).to(ctx.device) for name in ("offload", "optimizer", "none")}
    for name in ("optimizer", "none"):
        models[name].load_state_dict(models["offload"].state_dict())
    rec["shape"] = {**asdict(shape), "params": shape.params()}
    host = {"device": "cpu", "pin_memory": True}
    configs = {"offload": {"offload_param": host, "offload_optimizer": host}, "optimizer": {"offload_optimizer": host},
               "none": {}}
    engines = {name: ds_all.initialize(model=models[name], config=_engine_config(shape, 3, **configs[name]))[0]
               for name in models}
    times = {name: [] for name in engines}
    losses = {name: [] for name in engines}
    order = list(engines)
    for i, tokens in enumerate(ctx.tokens(shape, steps)):
        for name in order[i % len(order):] + order[:i % len(order)]:  # rotated: no engine always first
            seconds, loss = _timed(ctx, lambda e=engines[name], t=tokens: _engine_step(e, t))
            times[name].append(seconds)
            losses[name].append(float(loss.detach()))
        if ctx.left() < 3:
            break
    n = min(skip, len(times["none"]) - 1)
    result = _compare("offload", times["offload"], "optimizer", times["optimizer"], n)
    result["vs_no_offload"] = _compare("offload", times["offload"], "none", times["none"], n)
    result.update(losses=losses, goal_ratio=1.3, ratio_ok=result["ratio"] <= 1.3, peak_gib=ctx.peak_gib(),
                  same_losses=max(abs(a - b) for a, b in zip(losses["offload"], losses["optimizer"], strict=True))
                  <= 1e-3)
    rec["zero3"] = result
    logger.info("ZeRO-3 offload_param+optimizer %.4f s/step vs optimizer offload alone %.4f (ratio %.3f); "
                "vs nothing offloaded %.4f (ratio %.3f)", result["offload_s"], result["optimizer_s"], result["ratio"],
                result["vs_no_offload"]["none_s"], result["vs_no_offload"]["ratio"])


def part_offload(ctx: Ctx, rec: Recorder, size: str) -> None:
    torch = ctx.torch
    import ds_all

    shape = (SMOKE_OFFLOAD if ctx.smoke else OFFLOAD_SIZES)[size]
    params = shape.params()
    rec["size"], rec["shape"] = size, {**asdict(shape), "params": params}
    if ctx.cuda:
        free, _ = torch.cuda.mem_get_info()
        rec["gpu_free_gib"] = round(free / 2**30, 1)
    GPT = _model_classes()
    begin = time.perf_counter()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 on the device: no float32 copy of 5B parameters
    try:
        with torch.device(ctx.device):
            model = GPT(shape)
    finally:
        torch.set_default_dtype(default)
    rec["build_s"] = time.perf_counter() - begin
    begin = time.perf_counter()
    engine, *_ = ds_all.initialize(model=model, config=_engine_config(
        shape, 2, offload_optimizer={"device": "cpu", "pin_memory": True}))
    rec["initialize_s"] = time.perf_counter() - begin
    rec["optimizer"] = _inner_optimizer(engine)
    zero = getattr(engine, "zero", None)
    phases: dict[str, list[float]] = {}
    rec["instrumented"] = _instrument_offload(zero, phases)
    counts = _transfer_counts(zero)
    rows = []
    tokens_per_step = shape.micro_batch * shape.seq
    for i, tokens in enumerate(ctx.tokens(shape, 4 if ctx.smoke else 5)):
        if counts is not None:
            counts.reset()
        phases.clear()
        fwd, loss = _timed(ctx, lambda t=tokens: engine(t))
        bwd, _ = _timed(ctx, lambda lo=loss: engine.backward(lo))
        step, _ = _timed(ctx, engine.step)
        row = {"forward_s": fwd, "backward_s": bwd, "step_s": step, "total_s": fwd + bwd + step,
               "loss": float(loss.detach())}
        row.update({key: sum(values) for key, values in phases.items()})
        # the rest of step(): norms, the 16-bit copies, the host->device copies landing, the all-gather
        row["step_rest_s"] = step - sum(row.get(k, 0.0) for k in ("d2h_wait_s", "cpu_adam_s", "h2d_issue_s"))
        if counts is not None:
            row.update(d2h_bytes=counts.down_bytes, h2d_bytes=counts.up_bytes)
        rows.append(row)
        rec["steps"] = rows
        timed = rows[1:] if len(rows) > 1 else rows
        step_s = statistics.median(r["total_s"] for r in timed)
        breakdown = {k: statistics.median(r.get(k, 0.0) for r in timed) for k in row
                     if k.endswith("_s") and k != "total_s"}
        rec["result"] = {"params": params, "tokens_per_step": tokens_per_step, "step_s": step_s,
                         "breakdown_s": breakdown,
                         "tflops": 6 * params * tokens_per_step / step_s / 1e12,
                         "tflops_counts": "6 x parameters x tokens (attention's own flops not counted)",
                         "steps_done": len(rows), "peak_gpu_gib": ctx.peak_gib(), "host_peak_rss_gib": _rss_gib(),
                         "goal_params": 5e9, "params_ok": params >= 5e9}
        logger.info("offload %s step %d: %s", size, i, {k: round(v, 4) for k, v in row.items()})
        if ctx.left() < 2 * row["total_s"] + 2:
            break


def _wrap(owner, name: str, key: str, phases: dict) -> bool:
    """``owner.name`` (a method, or a module's function) timed into ``phases[key]`` at each call."""
    original = getattr(owner, name, None) if owner is not None else None
    if not callable(original):
        return False

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            phases.setdefault(key, []).append(time.perf_counter() - start)

    setattr(owner, name, timed)
    return True


def _instrument_offload(zero, phases: dict) -> list[str]:
    """Times the phases of ZeRO-Offload's step where ds-zero's (private) offload code has them: waiting for
    the gradients' device->host copies, the CPU Adam, issuing the host->device copies. Best effort: the
    names found are returned and written to the JSON; without them, the inner optimizer's step is timed."""
    found = []
    host = getattr(zero, "_host", None)
    if _wrap(host, "finish_downloads", "d2h_wait_s", phases):
        found.append("HostOffload.finish_downloads -> d2h_wait_s")
    try:
        from ds_zero import _offload
    except ImportError:
        _offload = None
    if _wrap(_offload, "fused_adam_step", "cpu_adam_s", phases):
        found.append("ds_zero._offload.fused_adam_step -> cpu_adam_s")
    elif _wrap(getattr(zero, "optimizer", None), "step", "cpu_adam_s", phases):
        found.append("inner optimizer.step -> cpu_adam_s")
    if _wrap(host, "upload", "h2d_issue_s", phases):
        found.append("HostOffload.upload -> h2d_issue_s")
    return found


def _transfer_counts(zero):
    """ds-zero's copy counter (``ds_zero._transfer.TransferCounts``) on the optimizer or one of its parts."""
    try:
        from ds_zero._transfer import TransferCounts
    except ImportError:
        return None
    for owner in (zero, getattr(zero, "_host", None)):
        for value in vars(owner).values() if owner is not None else ():
            if isinstance(value, TransferCounts):
                return value
    return None


def _rss_gib() -> float:
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 1)


def run_part(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format=f"[{args.part}] %(message)s")
    rec = Recorder(args.out)
    ctx = Ctx(args.smoke, args.deadline)
    rec["device"] = str(ctx.device)
    _init_group(ctx, rec)
    if args.part == "gpt":
        part_gpt(ctx, rec, args.stages)
    elif args.part == "offload":
        part_offload(ctx, rec, args.size)
    else:
        {"adam": part_adam, "copies": part_copies, "zero3_offload": part_zero3_offload}[args.part](ctx, rec)
    import ds_comm

    ds_comm.destroy_process_group()
