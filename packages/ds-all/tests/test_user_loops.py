"""A differential harness for user code (issue 41): training-loop patterns real scripts use, each run on
ds_all (ZeRO stages 0-3, CPU offload on some) and as plain PyTorch with DDP's averaging on 2 ranks, the
weights compared after `STEPS` steps.

A pattern is one row of `PATTERNS`: a loop body written once against `Side` (the same calls reach an engine or
a plain model + torch.optim.Adam whose gradients are averaged after each backward, as DDP does: ``g * 1/world``
summed, skipped inside ``no_sync``/between accumulation micro-steps). The ds side must equal the reference
bitwise where the arithmetic is the same (one reduction per step: stage 0, and stages 1-3 without a second
backward before the step), and within `BOUND` where ZeRO sums in another order (two backwards before one
step at stages 1-3: ZeRO averages each rank's accumulation once, DDP averages after each backward). A pattern
ds refuses (what DeepSpeed ignores silently) names the error it must raise instead.

The rows: ``zero_grad()`` on the module / the client optimizer / the optimizer `initialize` returned, with
set_to_none True and False; ``p.grad = None``; reading ``.grad`` between backward and step; clipping it
(stage 0: honoured; stage 1: refused; stages 2-3: ``.grad`` is None after backward, as in DeepSpeed, so not
run); replacing ``.grad`` out of place; clearing it between backward and step (refused); toggling
``requires_grad``; eval/no_grad forwards in between; frozen parts; gradient accumulation; no_sync; and the
DCGAN loop of DeepSpeedExamples (two engines, ``module.zero_grad()`` every iteration).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import ds_all
import ds_comm
from ds_comm.testing import spawn

STEPS = 3
LR = 1e-2
BOUND = 1e-6  # |ds - reference| where ZeRO averages in another order (see the module docstring)


def _model(seed: int, sizes=(4, 6, 1)) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(sizes[0], sizes[1]), nn.Tanh(), nn.Linear(sizes[1], sizes[2]))


def _data(step: int, micro: int, rank: int, width: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(2, width, generator=g), torch.randn(2, 1, generator=g)


class Side:
    """One side of the comparison: ``ds`` (engines) or the plain-PyTorch reference with DDP's averaging."""

    def __init__(self, ds: bool, stage: int, offload: bool, gas: int, models: list[nn.Module]):
        self.ds, self.gas, self.world = ds, gas, ds_comm.get_world_size()
        self.models = models
        self.clients = [torch.optim.Adam(m.parameters(), lr=LR) for m in models]
        self._micro = [0] * len(models)
        self._quiet = False  # inside no_sync (reference)
        if ds:
            zero = {"stage": stage}
            if stage == 3:
                zero["stage3_param_persistence_threshold"] = 0
            if offload:
                zero["offload_optimizer"] = {"device": "cpu"}
            config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": gas,
                      "zero_optimization": zero, "steps_per_print": 10**6, "gradient_clipping": 0.0}
            self.engines = [ds_all.initialize(model=m, optimizer=o, config=config)[0]
                            for m, o in zip(models, self.clients, strict=True)]

    def forward(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return self.engines[i](x) if self.ds else self.models[i](x)

    def backward(self, i: int, loss: torch.Tensor) -> None:
        if self.ds:
            self.engines[i].backward(loss)
            return
        (loss / self.gas).backward()
        if not self._quiet and (self._micro[i] + 1) % self.gas == 0:  # DDP: every model's gradients averaged
            for model in self.models:
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(1.0 / self.world)
                        ds_comm.all_reduce(p.grad)

    def step(self, i: int) -> None:
        if self.ds:
            self.engines[i].step()
            return
        self._micro[i] += 1
        if self._micro[i] % self.gas == 0:
            self.clients[i].step()
            self.clients[i].zero_grad(set_to_none=False)  # ZeRO's zeroed buffers: a frozen step is a zero gradient

    def returned_optimizer(self, i: int):
        """The optimizer `initialize` returned (the reference's own optimizer)."""
        return self.engines[i].optimizer if self.ds else self.clients[i]

    @contextlib.contextmanager
    def no_sync(self, i: int):
        if self.ds:
            with self.engines[i].no_sync():
                yield
            return
        self._quiet = True
        try:
            yield
        finally:
            self._quiet = False

    def weights(self) -> list[torch.Tensor]:
        if self.ds:
            for engine in self.engines:
                engine.optimizer.close()  # stage 3: every parameter whole again
        return [p.detach().clone() for m in self.models for p in m.parameters()]


def _mse(side: Side, i: int, step: int, micro: int = 0) -> torch.Tensor:
    x, y = _data(step, micro, ds_comm.get_rank())
    return nn.functional.mse_loss(side.forward(i, x), y)


def _train_step(side: Side, step: int, before: Callable | None = None, between: Callable | None = None) -> None:
    if before is not None:
        before(side)
    side.backward(0, _mse(side, 0, step))
    if between is not None:
        between(side)
    side.step(0)


# ------------------------------------------------------------------------------------------------ patterns
def _plain(side, step):
    _train_step(side, step)


def _module_zero_grad(set_to_none):
    return lambda side, step: _train_step(side, step, before=lambda s: s.models[0].zero_grad(set_to_none=set_to_none))


def _client_zero_grad(set_to_none):
    return lambda side, step: _train_step(side, step, before=lambda s: s.clients[0].zero_grad(set_to_none=set_to_none))


def _returned_zero_grad(set_to_none):
    return lambda side, step: _train_step(
        side, step, before=lambda s: s.returned_optimizer(0).zero_grad(set_to_none=set_to_none))


def _grad_none(side, step):
    def clear(s):
        for p in s.models[0].parameters():
            p.grad = None
    _train_step(side, step, before=clear)


def _read_grad(side, step):
    def read(s):
        s.seen = [float(p.grad.abs().sum()) for p in s.models[0].parameters() if p.grad is not None]
    _train_step(side, step, before=lambda s: s.models[0].zero_grad(), between=read)


def _clip_grad(side, step):
    _train_step(side, step, between=lambda s: torch.nn.utils.clip_grad_norm_(s.models[0].parameters(), 0.05))


def _replace_grad(side, step):
    def clamp(s):
        for p in s.models[0].parameters():
            p.grad = p.grad.clamp(-0.01, 0.01)
    _train_step(side, step, between=clamp)


def _clear_after_backward(side, step):
    _train_step(side, step, between=lambda s: s.models[0].zero_grad())


def _toggle_requires_grad(side, step):
    first = side.models[0][0].weight
    first.requires_grad_(step != 1)  # frozen for step 1 only
    # set_to_none=False: torch.optim would skip a parameter whose .grad is None where ZeRO steps a zero
    # gradient (as DeepSpeed's ZeRO does; ds warns once)
    _train_step(side, step, before=lambda s: s.models[0].zero_grad(set_to_none=False))
    first.requires_grad_(True)


def _eval_between(side, step):
    def evaluate(s):
        s.models[0].eval()
        with torch.no_grad():
            s.forward(0, _data(step, 7, ds_comm.get_rank())[0])
        s.models[0].train()
    _train_step(side, step, before=evaluate)


def _accumulate(side, step):  # gradient_accumulation_steps 2 (the row's gas)
    for micro in range(2):
        side.models[0].zero_grad() if micro == 0 else None
        side.backward(0, _mse(side, 0, step, micro))
        side.step(0)


def _no_sync(side, step):
    side.models[0].zero_grad()
    with side.no_sync(0):
        side.backward(0, _mse(side, 0, step, 0))
    side.backward(0, _mse(side, 0, step, 1))
    side.step(0)


def _dcgan(side, step):
    """DeepSpeedExamples' training/gan loop: D (model 0) and G (model 1), module.zero_grad() every iteration."""
    d, g = side.models
    bce = nn.functional.binary_cross_entropy_with_logits
    real, _ = _data(step, 0, ds_comm.get_rank())
    noise = _data(step, 1, ds_comm.get_rank(), width=3)[0]
    ones, zeros = torch.ones(2, 1), torch.zeros(2, 1)
    d.zero_grad()
    side.backward(0, bce(side.forward(0, real), ones))
    fake = side.forward(1, noise)
    side.backward(0, bce(side.forward(0, fake.detach()), zeros))
    side.step(0)
    g.zero_grad()
    side.backward(1, bce(side.forward(0, fake), ones))  # G's loss flows through D: D's hooks fire too
    side.step(1)


def _two_models(side, step):
    """Two independent engines, each cleared with its module's zero_grad(), stepped in turn."""
    for i in range(2):
        side.models[i].zero_grad()
        side.backward(i, _mse(side, i, step))
        side.step(i)


@dataclass(frozen=True)
class Pattern:
    name: str
    loop: Callable
    models: Callable[[], list[nn.Module]] = lambda: [_model(0)]
    gas: int = 1
    stages: tuple[int, ...] = (0, 1, 2, 3)
    refused: dict[int, str] | None = None  # stage -> a phrase of the error ds must raise
    reorders: bool = False  # two backwards before a step: stages 1-3 within BOUND


def _frozen_models():
    model = _model(0)
    model[0].requires_grad_(False)
    return [model]


PATTERNS = [
    Pattern("plain", _plain),
    Pattern("module.zero_grad()", _module_zero_grad(True)),
    Pattern("module.zero_grad(set_to_none=False)", _module_zero_grad(False)),
    Pattern("client_optimizer.zero_grad()", _client_zero_grad(True)),
    Pattern("client_optimizer.zero_grad(set_to_none=False)", _client_zero_grad(False)),
    Pattern("initialize's optimizer.zero_grad()", _returned_zero_grad(True)),
    Pattern("initialize's optimizer.zero_grad(set_to_none=False)", _returned_zero_grad(False)),
    Pattern("p.grad = None", _grad_none),
    Pattern("read .grad between backward and step", _read_grad),
    Pattern("clip_grad_norm_ between backward and step", _clip_grad, stages=(0, 1),
            refused={1: "at ZeRO stage 1 the step uses this rank's shard"}),
    Pattern("p.grad = p.grad.clamp() between backward and step", _replace_grad, stages=(0, 1),
            refused={1: "was replaced between backward and step"}),
    Pattern("module.zero_grad() between backward and step", _clear_after_backward, stages=(0, 1),
            refused={0: "was cleared", 1: "was cleared"}),
    Pattern("requires_grad toggled for a step", _toggle_requires_grad),
    Pattern("eval() + no_grad forward between steps", _eval_between),
    Pattern("frozen first layer", _plain, models=_frozen_models),
    Pattern("gradient accumulation (2 micro-steps)", _accumulate, gas=2, reorders=True),
    Pattern("no_sync accumulation", _no_sync, stages=(0, 1)),
    Pattern("two engines, module.zero_grad()", _two_models, models=lambda: [_model(0), _model(1)]),
    Pattern("DCGAN: two engines, module.zero_grad() every iteration", _dcgan,
            models=lambda: [_model(0), nn.Sequential(nn.Linear(3, 4))], reorders=True),
]


def run_patterns(rank, world_size, stage, offload, names):
    """Every pattern of ``names`` at ``stage`` on ds and on the reference: {name: max |difference| or the error}."""
    out = {}
    for pattern in PATTERNS:
        if pattern.name not in names or stage not in pattern.stages:
            continue
        sides = []
        for ds in (True, False):
            side = Side(ds, stage, offload, pattern.gas, pattern.models())
            try:
                for step in range(STEPS):
                    pattern.loop(side, step)
            except RuntimeError as e:
                if not ds:
                    raise
                side.weights()
                out[pattern.name] = ("refused", str(e))
                break
            sides.append(side.weights())
        if len(sides) == 2:
            start = [p.detach() for m in pattern.models() for p in m.parameters()]
            moved = max(float((a - b).abs().max()) for a, b in zip(sides[1], start, strict=True))
            assert moved > 1e-3, f"{pattern.name}: the reference did not train (a pattern that cannot fail)"
            out[pattern.name] = ("diff", max(float((a - b).abs().max()) for a, b in zip(*sides, strict=True)))
    return out


def _check(results: dict, stage: int, names) -> None:
    for pattern in PATTERNS:
        if pattern.name not in names or stage not in pattern.stages:
            continue
        kind, value = results[pattern.name]
        refusal = (pattern.refused or {}).get(stage)
        if refusal is not None:
            assert kind == "refused" and refusal in value, (pattern.name, stage, kind, value)
            continue
        assert kind == "diff", (pattern.name, stage, value)
        if pattern.reorders and stage > 0:
            assert value <= BOUND, (pattern.name, stage, value)
        else:
            assert value == 0.0, (pattern.name, stage, value)


ALL = [p.name for p in PATTERNS]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_user_loops_train_as_pytorch_with_ddp(stage):
    results = spawn(run_patterns, world_size=2, args=(stage, False, ALL), timeout=240)
    assert results[0] == results[1]
    _check(results[0], stage, ALL)


OFFLOADED = ["module.zero_grad()", "client_optimizer.zero_grad()", "p.grad = None",
             "DCGAN: two engines, module.zero_grad() every iteration"]


@pytest.mark.parametrize("stage", [1, 2])
def test_user_loops_with_cpu_offload(stage):
    results = spawn(run_patterns, world_size=2, args=(stage, True, OFFLOADED), timeout=240)
    for name in OFFLOADED:  # CPU Adam's arithmetic is not torch's: within BOUND
        kind, value = results[0][name]
        assert kind == "diff" and value <= BOUND, (name, stage, kind, value)
