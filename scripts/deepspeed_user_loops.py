"""What DeepSpeed itself does with each training-loop pattern of ds's differential harness (issue 41).

Issue 41 sets DeepSpeed's behaviour as the standard for what user code may do to ``.grad``. This script runs
every row of ``PATTERNS`` in packages/ds-all/tests/test_user_loops.py (imported by path, loop bodies and
``Side`` unchanged) with engines from ``deepspeed.initialize`` (the harness's config dicts) against the
harness's plain-PyTorch + DDP-averaging reference, on 2 ranks over gloo, and prints one line per
(pattern, stage): equal to the reference (max |difference|), differs (max |difference|), weights unchanged,
or raises (the message).

It needs DeepSpeed, so it is not part of CI (and has no ``test_`` prefix, so pytest does not collect it):

    python3 -m venv /work/dsref
    /work/dsref/bin/pip install torch==2.13.0 deepspeed==0.19.8 numpy
    DS_ACCELERATOR=cpu /work/dsref/bin/python scripts/deepspeed_user_loops.py            # stages 0-3
    DS_ACCELERATOR=cpu /work/dsref/bin/python scripts/deepspeed_user_loops.py --offload  # stages 1-3, CPU offload

Options: ``--stages 0 1``, ``--only "p.grad = None"`` (a pattern name, repeatable), ``--harness-stages``
(only the stages each row lists; by default every row runs at every stage asked for, so a row the harness
skips at a stage still shows what DeepSpeed does there), ``--offload-optimizer client|cpu-adam``:
DeepSpeed refuses ZeRO-Offload with a client ``torch.optim.Adam`` unless ``zero_force_ds_cpu_optimizer``
is false; ``client`` (the default) sets that, keeping the harness's optimizer, ``cpu-adam`` gives each
engine a ``DeepSpeedCPUAdam`` instead (JIT-built by DeepSpeed on first use: ninja and a C++ compiler).

Where DeepSpeed differs, the line names what it computed when another reference matches it within the
harness's BOUND: PyTorch with ``zero_grad(set_to_none=True)`` after each step, the plain loop (an edit between
backward and step ignored), or a row's own alternatives (only the last of two backwards counted, a frozen
weight stepped with its previous gradient, ...). Besides the harness's rows it runs a few of its own: two
backwards before one step, and the DCGAN loop as DeepSpeedExamples' training/gan writes it (module forwards).
The last lines list where DeepSpeed parts from the harness's expectation for ds (trains equal, or the named
refusal). Runtime: about 40 s without offload, 2-3 min with ``cpu-adam`` (2 CPU cores).

DeepSpeed's ZeRO-3 leaves every parameter partitioned; the weights are read whole inside
``deepspeed.zero.GatheredParameters``. The ds modules the harness imports (``ds_all``, ``ds_comm``) are
stood in for here (``ds_comm`` by torch.distributed, ``ds_all.initialize`` by ``deepspeed.initialize``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import os
import socket
import sys
import tempfile
import traceback
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HARNESS = Path(__file__).resolve().parents[1] / "packages" / "ds-all" / "tests" / "test_user_loops.py"
WORLD = 2
_OPTIONS: dict = {}  # this worker's --offload-optimizer choice, read by _deepspeed_initialize


def _deepspeed_initialize(model, optimizer, config):
    """``ds_all.initialize`` as the harness calls it, answered by ``deepspeed.initialize``."""
    import deepspeed

    config = json.loads(json.dumps(config))
    if "offload_optimizer" in config["zero_optimization"] and _OPTIONS.get("offload_optimizer") == "client":
        config["zero_force_ds_cpu_optimizer"] = False  # keep the harness's torch.optim.Adam
    return deepspeed.initialize(model=model, optimizer=optimizer, config=config)


def _stand_ins() -> None:
    """The modules the harness imports that a DeepSpeed venv lacks: ds_all, ds_comm, (pytest)."""
    ds_all = types.ModuleType("ds_all")
    ds_all.initialize = _deepspeed_initialize
    ds_comm = types.ModuleType("ds_comm")
    ds_comm.get_world_size = dist.get_world_size
    ds_comm.get_rank = dist.get_rank
    ds_comm.all_reduce = lambda t: dist.all_reduce(t)
    testing = types.ModuleType("ds_comm.testing")
    testing.spawn = None
    ds_comm.testing = testing
    sys.modules.update({"ds_all": ds_all, "ds_comm": ds_comm, "ds_comm.testing": testing})
    try:
        import pytest
    except ImportError:
        pytest = types.ModuleType("pytest")
        pytest.mark = types.SimpleNamespace(parametrize=lambda *a, **k: lambda f: f)
        sys.modules["pytest"] = pytest


def _harness():
    _stand_ins()
    spec = importlib.util.spec_from_file_location("ds_user_loops_harness", HARNESS)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses looks its module up
    spec.loader.exec_module(module)
    return module


def _deepspeed_side(h):
    class DeepSpeedSide(h.Side):
        """The harness's Side with DeepSpeed engines; ``weights()`` gathers ZeRO-3's partitions."""

        def __init__(self, ds, stage, offload, gas, models):
            if not (ds and offload and _OPTIONS.get("offload_optimizer") == "cpu-adam"):
                super().__init__(ds, stage, offload, gas, models)
                return
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            adam = torch.optim.Adam  # the harness's client optimizer becomes DeepSpeedCPUAdam (Adam, not AdamW)
            torch.optim.Adam = lambda params, lr: DeepSpeedCPUAdam(params, lr=lr, adamw_mode=False)
            try:
                super().__init__(ds, stage, offload, gas, models)
            finally:
                torch.optim.Adam = adam

        def weights(self):
            if not self.ds:
                return super().weights()
            import deepspeed

            params = [p for m in self.models for p in m.parameters()]
            if any(hasattr(p, "ds_id") for p in params):  # ZeRO-3: partitioned
                with deepspeed.zero.GatheredParameters(params):
                    return [p.detach().clone() for p in params]
            return [p.detach().clone() for p in params]

    return DeepSpeedSide


def _first_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    if not text:  # a bare assert: where it failed
        frame = traceback.extract_tb(e.__traceback__)[-1]
        text = f"(bare assert) {Path(frame.filename).name}:{frame.lineno}: {frame.line}"
    return f"{type(e).__name__}: {text}"[:300]


def _references(h):
    class ToNoneReference(h.Side):
        """The reference with ``optimizer.zero_grad()`` (set_to_none, PyTorch's default) after each step."""

        def step(self, i: int) -> None:
            self._micro[i] += 1
            if self._micro[i] % self.gas == 0:
                self.clients[i].step()
                self.clients[i].zero_grad(set_to_none=True)

    return ToNoneReference


def _train(side, pattern, steps: int) -> list[torch.Tensor]:
    for step in range(steps):
        pattern.loop(side, step)
    return side.weights()


def _maxdiff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def _run_row(h, side_cls, pattern, stage: int, offload: bool, alternatives=()) -> dict:
    """One (pattern, stage) on DeepSpeed and on the reference; ``alternatives``: (label, loop) references
    that name what DeepSpeed computed when it differs."""
    models = pattern.models()
    sizes = [len(list(m.parameters())) for m in models]
    start = [p.detach().clone() for m in models for p in m.parameters()]
    ref = _train(h.Side(False, stage, False, pattern.gas, pattern.models()), pattern, h.STEPS)
    ref_none = _train(_references(h)(False, stage, False, pattern.gas, pattern.models()), pattern, h.STEPS)
    plain = None  # the plain loop on the same model: what an edit between backward and step that is ignored gives
    if pattern.gas == 1 and len(models) == 1:
        plain_row = h.Pattern("plain", h._plain, models=pattern.models)
        plain = _train(h.Side(False, stage, False, 1, pattern.models()), plain_row, h.STEPS)
    others = [(label, _train(h.Side(False, stage, False, pattern.gas, pattern.models()),
                             h.Pattern(label, loop, models=pattern.models, gas=pattern.gas), h.STEPS))
              for label, loop in alternatives]
    ref_moved = _maxdiff(ref, start)
    try:
        got = _train(side_cls(True, stage, offload, pattern.gas, pattern.models()), pattern, h.STEPS)
    except Exception as e:
        if os.environ.get("DS_USER_LOOPS_TRACE"):
            traceback.print_exc()
        return {"kind": "raises", "message": _first_line(e), "ref_moved": ref_moved}
    moved = [float((a - b).abs().max()) for a, b in zip(got, start, strict=True)]
    ref_moved_each = [float((a - b).abs().max()) for a, b in zip(ref, start, strict=True)]
    unmoved = sum(1 for m, r in zip(moved, ref_moved_each, strict=True) if m == 0.0 and r > 0.0)
    diff = _maxdiff(got, ref)
    if max(moved) == 0.0:
        kind = "unchanged"
    elif diff == 0.0:
        kind = "equal"
    elif diff <= h.BOUND:
        kind = "equal within bound"
    else:
        kind = "differs"
    out = {"kind": kind, "diff": diff, "moved": max(moved), "ref_moved": ref_moved,
           "tensors_unmoved": unmoved, "tensors": len(got), "notes": []}
    if kind == "differs":
        if len(models) > 1:
            edges = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
            per = [_maxdiff(got[a:b], ref[a:b]) for a, b in itertools.pairwise(edges)]
            out["notes"].append("per model " + ", ".join(f"{d:.3g}" for d in per))
        if _maxdiff(got, ref_none) <= h.BOUND:
            out["notes"].append(f"= PyTorch with zero_grad(set_to_none=True) after step ({_maxdiff(got, ref_none):.3g})")
        if plain is not None and _maxdiff(got, plain) <= h.BOUND:
            out["notes"].append(f"= the plain loop: the edit was ignored ({_maxdiff(got, plain):.3g})")
        for label, weights in others:
            if _maxdiff(got, weights) <= h.BOUND:
                out["notes"].append(f"= {label} ({_maxdiff(got, weights):.3g})")
    return out


def _describe(r: dict) -> str:
    if r["kind"] == "raises":
        return f"RAISES  {r['message']}"
    note = f" ({r['tensors_unmoved']}/{r['tensors']} tensors unchanged)" if r["tensors_unmoved"] else ""
    note += "".join(f" [{n}]" for n in r["notes"])
    if r["kind"] == "unchanged":
        if r["ref_moved"] == 0.0:
            return "weights unchanged, as the reference's (max |diff| 0)"
        return f"WEIGHTS UNCHANGED (reference moved {r['ref_moved']:.3g})"
    if r["kind"] == "equal":
        return f"equal (max |diff| 0){note}"
    label = "equal within 1e-6" if r["kind"] == "equal within bound" else "DIFFERS"
    return f"{label} (max |diff| {r['diff']:.3g}; moved {r['moved']:.3g}, reference moved {r['ref_moved']:.3g}){note}"


def _extra_patterns(h) -> tuple[list, dict]:
    """Rows of this script only: two backwards before one step (what the DCGAN's D does), and the DCGAN loop as
    DeepSpeedExamples' training/gan writes it, where every forward calls the module (``netD(fake)``), not
    the engine as the harness's ``_dcgan`` does. Returns the rows and {name: alternative references}."""

    def backwards(micros):
        def loop(side, step):
            side.models[0].zero_grad()
            for micro in micros:
                side.backward(0, h._mse(side, 0, step, micro))
            side.step(0)

        return loop

    def dcgan_module_forwards(side, step, freeze_d=False, drop_real=False, keep_d_grads=False):
        d, g = side.models
        bce = torch.nn.functional.binary_cross_entropy_with_logits
        real, _ = h._data(step, 0, dist.get_rank())
        noise = h._data(step, 1, dist.get_rank(), width=3)[0]
        ones, zeros = torch.ones(2, 1), torch.zeros(2, 1)
        if not keep_d_grads:  # keep_d_grads: a reference where G's backward through D reaches D's next step
            d.zero_grad()
        if not drop_real:  # drop_real: a reference where D's first backward (real data) never counted
            side.backward(0, bce(d(real), ones))
        fake = g(noise)
        side.backward(0, bce(d(fake.detach()), zeros))
        side.step(0)
        g.zero_grad()
        if freeze_d:  # the DCGAN tutorial's advice: D's requires_grad off for G's backward
            d.requires_grad_(False)
        side.backward(1, bce(d(fake), ones))
        d.requires_grad_(True)
        side.step(1)

    def models():
        return [h._model(0), torch.nn.Sequential(torch.nn.Linear(3, 4))]

    def toggled_stale(side, step):  # the harness's requires_grad row, had the frozen step (1) reused step 0's gradient
        first = side.models[0][0].weight

        def between(s):
            if step == 0:
                s.stale = first.grad.clone()
            elif step == 1:
                first.grad.copy_(s.stale)

        h._train_step(side, step, before=lambda s: s.models[0].zero_grad(set_to_none=False), between=between)

    two = "two backwards before one step (gas 1)"
    return [
        h.Pattern(two, backwards((0, 1)), reorders=True),
        h.Pattern("DCGAN, module forwards (as DeepSpeedExamples)", dcgan_module_forwards, models=models,
                  reorders=True),
        h.Pattern("DCGAN, module forwards, D frozen for G's backward",
                  lambda side, step: dcgan_module_forwards(side, step, freeze_d=True), models=models,
                  reorders=True),
    ], {two: [("only the last backward counted", backwards((1,))),
              ("only the first backward counted", backwards((0,)))],
        "requires_grad toggled for a step": [("the frozen weight stepped with its previous step's gradient",
                                              toggled_stale)],
        **{name: [("D's first backward (real) dropped", lambda side, step: dcgan_module_forwards(side, step, drop_real=True)),
                  ("G's backward through D reaches D's next step",
                   lambda side, step: dcgan_module_forwards(side, step, keep_d_grads=True))]
           for name in ("DCGAN: two engines, module.zero_grad() every iteration",
                        "DCGAN, module forwards (as DeepSpeedExamples)",
                        "DCGAN, module forwards, D frozen for G's backward")}}


def _worker(rank: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_SIZE": str(WORLD)})
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)
    _OPTIONS["offload_optimizer"] = args.offload_optimizer
    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel("ERROR")
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    h = _harness()
    side_cls = _deepspeed_side(h)
    extras, alternatives = _extra_patterns(h)
    results = []
    for stage in args.stages:
        for pattern in h.PATTERNS + extras:
            if args.only and pattern.name not in args.only:
                continue
            if args.harness_stages and stage not in pattern.stages:
                continue
            r = _run_row(h, side_cls, pattern, stage, args.offload, alternatives.get(pattern.name, ()))
            extra = pattern in extras
            r.update(pattern=pattern.name, stage=stage, in_harness=not extra and stage in pattern.stages,
                     ds_refuses=(pattern.refused or {}).get(stage))
            results.append(r)
            if rank == 0:
                tag = ("  [this script's row, not the harness's]" if extra else
                       "" if r["in_harness"] else "  [stage not in the harness's row]")
                print(f"stage {stage}{' offload' if args.offload else ''} | {pattern.name:55s} | "
                      f"{_describe(r)}{tag}", flush=True)
            dist.barrier()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+")
    parser.add_argument("--offload", action="store_true", help="offload_optimizer: {device: cpu}")
    parser.add_argument("--offload-optimizer", choices=["client", "cpu-adam"], default="client")
    parser.add_argument("--only", action="append", help="a pattern name (repeatable)")
    parser.add_argument("--harness-stages", action="store_true", help="only the stages each row lists")
    args = parser.parse_args()
    if args.stages is None:
        args.stages = [1, 2, 3] if args.offload else [0, 1, 2, 3]
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    print(f"DeepSpeed {deepspeed.__version__}, torch {torch.__version__}, {WORLD} ranks (gloo), "
          f"stages {args.stages}, offload {args.offload_optimizer if args.offload else 'off'}", flush=True)
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(_free_port(), args, out_dir), nprocs=WORLD, start_method="spawn")
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(WORLD)]
    mismatched = [a["pattern"] for a, b in zip(*ranks, strict=True) if a != b]
    if mismatched:
        print(f"ranks disagree on: {mismatched}")
    print("\nWhere DeepSpeed and ds's harness expectation part (ds refuses / DeepSpeed trains, or the reverse):")
    for r in ranks[0]:
        if not r["in_harness"]:
            continue
        trains = r["kind"] in ("equal", "equal within bound") or (r["kind"] == "unchanged" and r["ref_moved"] == 0)
        if r["ds_refuses"] is not None and trains:
            print(f"  stage {r['stage']} | {r['pattern']}: ds refuses ({r['ds_refuses']!r}), DeepSpeed {_describe(r)}")
        elif r["ds_refuses"] is None and not trains:
            print(f"  stage {r['stage']} | {r['pattern']}: DeepSpeed {_describe(r)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
