"""1-bit Adam and 0/1 Adam against references written here from the papers' equations in plain torch
(Tang et al. 2021, Algorithm 1; Lu et al. 2022, Algorithm 1), simulating every rank in one process:
identical parameters through warm-up, within float rounding of the same 1-bit compression after it;
alone and under ZeroOptimizer (stage 0, which averages only on the steps the optimizer asks for); the
bytes on the wire; checkpoints that carry the error feedback; bad input named."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

import ds_comm
from ds_comm.testing import spawn
from ds_zero import (
    OneBitAdam,
    OneBitLamb,
    ZeroOneAdam,
    ZeroOptimizer,
    load_zero_checkpoint,
    save_zero_checkpoint,
)

WIDTH = 12
LR, BETAS, EPS, DECAY = 1e-2, (0.9, 0.999), 1e-8, 0.01


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 3))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1000 * step + rank))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).sin().square().mean()


# ------------------------------------------------------------------------------------ the references
def _chunk_compress(x: torch.Tensor) -> torch.Tensor:
    """The paper's C[x] on one chunk: sign(x) times the chunk's RMS (||x||_2 / sqrt(n))."""
    scale = x.norm() / math.sqrt(x.numel())
    return torch.where(x >= 0, 1.0, -1.0) * scale


class _Wire:
    """Error-compensated 1-bit averaging of W flat tensors: each worker compresses its chunk for each
    server (with its error), each server averages its chunk, compresses it (with its error) and sends
    it back to everyone."""

    def __init__(self, numel: int, world: int, mask: torch.Tensor | None = None):
        self.mask = mask  # DeepSpeed's exp_avg_mask: positions whose compressed value is dropped
        unit = 8 * world
        self.padded = -(-numel // unit) * unit
        self.world, self.numel = world, numel
        self.worker = [torch.zeros(self.padded) for _ in range(world)]
        self.server = [torch.zeros(self.padded // world) for _ in range(world)]

    def average(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        world, chunk = self.world, self.padded // self.world
        sent = []
        for r, t in enumerate(tensors):
            work = torch.zeros(self.padded)
            work[:self.numel] = t
            work += self.worker[r]
            compressed = torch.cat([_chunk_compress(c) for c in work.view(world, chunk)])
            self.worker[r] = work - compressed
            sent.append(compressed.view(world, chunk))
        out = torch.empty(self.padded)
        for s in range(world):
            mean = torch.stack([sent[r][s] for r in range(world)]).mean(0) + self.server[s]
            compressed = _chunk_compress(mean)
            self.server[s] = mean - compressed
            out[s * chunk:(s + 1) * chunk] = compressed
        return out[:self.numel] if self.mask is None else out[:self.numel] * self.mask


def _adam_update(m, v, p):
    return m / (v.sqrt() + EPS) + DECAY * p


class RefOneBitAdam:
    """Tang et al. 2021: Adam (no bias correction) on the averaged gradient for freeze_step steps;
    then m_r = b1 m + (1 - b1) g_r locally, m = C-average(m_r), v frozen."""

    def __init__(self, params: torch.Tensor, world: int, freeze_step: int, mask=None):
        self.p, self.m, self.v = params.clone(), torch.zeros_like(params), torch.zeros_like(params)
        self.world, self.freeze_step, self.t = world, freeze_step, 0
        self.wire = _Wire(params.numel(), world, mask)

    def step(self, grads: list[torch.Tensor]) -> None:
        b1, b2 = BETAS
        if self.t < self.freeze_step:
            g = torch.stack(grads).mean(0)
            self.m = b1 * self.m + (1 - b1) * g
            self.v = b2 * self.v + (1 - b2) * g * g
        else:
            self.m = self.wire.average([b1 * self.m + (1 - b1) * g for g in grads])
        self.p = self.p - LR * _adam_update(self.m, self.v, self.p)
        self.t += 1


class RefZeroOneAdam:
    """Lu et al. 2022: variance updated (from the averaged gradient) on steps t with t % interval == 0,
    the interval doubling every var_update_scaler such steps, none after var_freeze_step; otherwise the
    gradient is C-averaged. After var_freeze_step each rank steps alone, summing its updates in u; every
    local_step_interval steps the ranks undo them, C-average u * (sqrt(v) + eps), apply it and set
    m = -average / (sum of the local steps' lr)."""

    def __init__(self, params: torch.Tensor, world: int, var_freeze_step: int, var_update_scaler: int,
                 local_step_scaler: int, local_step_clipper: int, mask=None):
        self.world, self.mask = world, mask
        self.p = [params.clone() for _ in range(world)]
        self.m = [torch.zeros_like(params) for _ in range(world)]
        self.u = [torch.zeros_like(params) for _ in range(world)]
        self.v = torch.zeros_like(params)
        self.freeze, self.var_scaler = var_freeze_step, var_update_scaler
        self.local_scaler, self.clipper = local_step_scaler, local_step_clipper
        self.t, self.var_interval, self.var_counter = 0, 1, 0
        self.local_interval, self.local_counter, self.lrs = 1, 0, 0.0
        self.wire = _Wire(params.numel(), world, mask)
        self.sent = 0  # steps that sent anything

    def step(self, grads: list[torch.Tensor]) -> None:
        b1, b2 = BETAS
        t = self.t + 1
        if self.t < self.freeze:
            if t % self.var_interval == 0:
                g = torch.stack(grads).mean(0)
                self.v = b2 * self.v + (1 - b2) * g * g
                self.var_counter += 1
                if self.var_counter == self.var_scaler:
                    self.var_counter, self.var_interval = 0, self.var_interval * 2
            else:
                g = self.wire.average(grads)
            self.sent += 1
            for r in range(self.world):
                self.m[r] = b1 * self.m[r] + (1 - b1) * g
                self.p[r] = self.p[r] - LR * _adam_update(self.m[r], self.v, self.p[r])
            if t == self.freeze:
                self.wire = _Wire(self.p[0].numel(), self.world, self.mask)  # the errors restart for u
        else:
            self.lrs += LR
            for r in range(self.world):
                self.m[r] = b1 * self.m[r] + (1 - b1) * grads[r]
                update = _adam_update(self.m[r], self.v, self.p[r])
                self.p[r] = self.p[r] - LR * update
                self.u[r] = self.u[r] - LR * update
            if t % self.local_interval == 0:
                denominator = self.v.sqrt() + EPS
                average = self.wire.average([u * denominator for u in self.u])
                for r in range(self.world):
                    self.p[r] = self.p[r] - self.u[r] + average / denominator
                    self.m[r] = -average / self.lrs
                    self.u[r] = torch.zeros_like(self.u[r])
                self.lrs = 0.0
                self.sent += 1
            self.local_counter += 1
            if self.local_counter == self.local_scaler:
                self.local_counter, self.local_interval = 0, min(self.clipper, self.local_interval * 2)
        self.t = t


class RefOneBitLamb:
    """Li et al. 2021, per parameter: LAMB warm-up (trust ratio clamped to [min, max], its running average
    kept); then local momenta scaled to one magnitude, C-averaged, scaled back; the variance frozen, a
    fresh one from the reconstructed gradients; trust ratio = average x factor, the factor clamped."""

    MIN, MAX, BETA, F_MIN, F_MAX, THRESHOLD = 0.01, 10.0, 0.9, 0.5, 4.0, 0.1

    def __init__(self, params: list[torch.Tensor], world: int, freeze_step: int, flat_of, unflat, mask=None):
        self.p = [t.clone() for t in params]
        self.m, self.v, self.fresh = ([torch.zeros_like(t) for t in params] for _ in range(3))
        self.averaged, self.last_factor, self.scaling = [0.0] * len(params), [1.0] * len(params), None
        self.world, self.freeze_step, self.t = world, freeze_step, 0
        self.flat_of, self.unflat = flat_of, unflat
        self.wire = _Wire(flat_of(params).numel(), world, mask)

    def step(self, grads: list[list[torch.Tensor]]) -> None:
        b1, b2 = BETAS
        n = len(self.p)
        if self.t < self.freeze_step:
            for i in range(n):
                g = torch.stack([grads[r][i] for r in range(self.world)]).mean(0)
                self.m[i] = b1 * self.m[i] + (1 - b1) * g
                self.v[i] = b2 * self.v[i] + (1 - b2) * g * g
                if self.t + 1 == self.freeze_step:
                    self.fresh[i] = self.v[i].clone()
                update = _adam_update(self.m[i], self.v[i], self.p[i])
                w, u = self.p[i].norm().item(), update.norm().item()
                coeff = min(max(w / u, self.MIN), self.MAX) if w and u else 1.0
                if coeff != 1.0:
                    self.averaged[i] = self.BETA * self.averaged[i] + (1 - self.BETA) * coeff
                self.p[i] = self.p[i] - LR * coeff * update
        else:
            if self.scaling is None:
                rms = [m.norm().item() / math.sqrt(m.numel()) for m in self.m]
                united = sum(rms) / n
                self.scaling = [united / r for r in rms]
            last = [m.clone() for m in self.m]
            local = [self.flat_of([(b1 * self.m[i] + (1 - b1) * grads[r][i]) * self.scaling[i] for i in range(n)])
                     for r in range(self.world)]
            averaged = self.unflat(self.wire.average(local))
            for i in range(n):
                self.m[i] = averaged[i] / self.scaling[i]
                reconstructed = (self.m[i] - b1 * last[i]) / (1 - b1)
                self.fresh[i] = b2 * self.fresh[i] + (1 - b2) * reconstructed * reconstructed
                denominator = self.v[i].sqrt() + EPS
                prelim = self.m[i] / denominator
                update = prelim + DECAY * self.p[i]
                factor = (denominator / (self.fresh[i].sqrt() + EPS)).max().item()
                share = min(1.0, prelim.norm().item() / update.norm().item())
                factor = factor * share + (1 - share)
                factor = min(max(factor, self.F_MIN), self.F_MAX)
                factor = min(max(factor, self.last_factor[i] * (1 - self.THRESHOLD)),
                             self.last_factor[i] * (1 + self.THRESHOLD))
                self.last_factor[i] = factor
                self.p[i] = self.p[i] - LR * self.averaged[i] * factor * update
        self.t += 1


# ------------------------------------------------------------------------------------ the runs
def _grads_of(model: nn.Module, step: int, rank: int) -> list[torch.Tensor]:
    model.zero_grad()
    _loss(model, _batch(step, rank)).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _flatten(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


ONEBIT = {"freeze_step": 3}
LAMB = {"freeze_step": 3}
ZEROONE = {"var_freeze_step": 6, "var_update_scaler": 2, "local_step_scaler": 2, "local_step_clipper": 4}
STEPS = 12


def _unflat_of(flat_of):
    """The inverse of ``flat_of`` for the model's parameters."""
    shapes = [p.shape for p in _model().parameters()]
    where = []
    for i, shape in enumerate(shapes):
        marker = [torch.zeros(s) for s in shapes]
        marker[i] = torch.ones(shape)
        where.append(flat_of(marker).bool())
    return lambda flat: [flat[w].view(shape) for w, shape in zip(where, shapes, strict=True)]


def _reference_lamb(world: int, flat_of, mask=None) -> list[list[torch.Tensor]]:
    model = _model()
    ref = RefOneBitLamb([p.detach() for p in model.parameters()], world, LAMB["freeze_step"], flat_of,
                        _unflat_of(flat_of), mask)
    trace = []
    for step in range(STEPS):
        with torch.no_grad():
            for p, value in zip(model.parameters(), ref.p, strict=True):
                p.copy_(value)
        ref.step([_grads_of(model, step, r) for r in range(world)])
        trace.append([flat_of(ref.p)] * world)
    return trace


def _reference(kind: str, world: int, flat_of, mask=None) -> list[list[torch.Tensor]]:
    """The reference's flat parameters of every rank after each step; ``flat_of(list of tensors)`` lays
    a model's tensors out as the optimizer under test does."""
    if kind == "lamb":
        return _reference_lamb(world, flat_of, mask)
    model = _model()
    start = flat_of([p.detach() for p in model.parameters()])
    ref = RefOneBitAdam(start, world, **ONEBIT, mask=mask) if kind == "onebit" else \
        RefZeroOneAdam(start, world, **ZEROONE, mask=mask)
    trace = []
    for step in range(STEPS):
        grads = []
        for r in range(world):  # each rank's gradient at its own parameters
            params = ref.p if kind == "onebit" else ref.p[r]
            _unflatten_into(model, params, flat_of)
            grads.append(flat_of(_grads_of(model, step, r)))
        ref.step(grads)
        trace.append([ref.p.clone()] * world if kind == "onebit" else [p.clone() for p in ref.p])
    return trace


def _unflatten_into(model: nn.Module, flat: torch.Tensor, flat_of) -> None:
    """Set the model's parameters from a flat vector laid out by ``flat_of``."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            marker = [torch.zeros_like(q) for q in model.parameters()]
            marker[i] = torch.ones_like(p)
            where = flat_of(marker).bool()
            p.copy_(flat[where].view_as(p))


def _optimizer(kind: str, params, **kwargs):
    cls, options = {"onebit": (OneBitAdam, ONEBIT), "zeroone": (ZeroOneAdam, ZEROONE), "lamb": (OneBitLamb, LAMB)}[kind]
    return cls(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY, **options, **kwargs)


def alone_vs_reference(rank, world_size, kind):
    model = _model()
    optimizer = _optimizer(kind, model.parameters())
    errors, averaged = [], []
    for step in range(STEPS):
        averaged.append(optimizer.wants_averaged_gradients())
        model.zero_grad()
        _loss(model, _batch(step, rank)).backward()  # local gradients: the optimizer communicates
        optimizer.step()
        errors.append(_flatten([p.detach() for p in model.parameters()]))
    trace = _reference(kind, world_size, _flatten)
    diffs = [(mine - ref[rank]).abs().max().item() for mine, ref in zip(errors, trace, strict=True)]
    skipped = getattr(optimizer, "local_steps_skipped", 0)
    return diffs, averaged, optimizer.compressed_calls, skipped


def _exact_steps(kind: str) -> int:
    """Steps before the first compressed message: 1-bit Adam's warm-up; 0/1 Adam's steps 1-2 (variance
    steps at interval 1, then step 3 sends its gradient compressed)."""
    return 2 if kind == "zeroone" else 3


KINDS = ("onebit", "zeroone", "lamb")
_RUNS: dict = {}


def every_kind(rank, world_size, name, *args):
    """One spawn runs a rank function for every optimizer (a spawn costs seconds of imports)."""
    return {kind: globals()[name](rank, world_size, kind, *args) for kind in KINDS}


def _runs(name: str, world: int, *args) -> dict[str, list]:
    """Each rank's result of ``name`` by optimizer kind, spawned once per module."""
    key = (name, world, *args)
    if key not in _RUNS:
        results = spawn(every_kind, world_size=world, args=(name, *args), timeout=300)
        _RUNS[key] = {kind: [r[kind] for r in results] for kind in KINDS}
    return _RUNS[key]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_alone_the_optimizers_follow_the_papers_equations(kind, world):
    results = _runs("alone_vs_reference", world)[kind]
    for diffs, averaged, compressed, skipped in results:
        assert max(diffs[:_exact_steps(kind)]) < 1e-6, diffs  # full-precision averaging: the same arithmetic
        # compressed: the same 1-bit compression; float summation order may differ in the last bits
        assert max(diffs) < 1e-5, diffs
        if kind in ("onebit", "lamb"):
            assert averaged == [True] * 3 + [False] * (STEPS - 3)
            assert compressed == STEPS - 3
        else:
            # variance steps at t = 1, 2 (interval 1, twice), 4, 6 (interval 2); frozen after step 6; 1-bit
            # gradients at 3, 5; then local steps 7-12 at intervals 1, 1, 2, 2, 4, 4: syncs at 7, 8, 10, 12
            assert averaged == [True, True, False, True, False, True] + [False] * 6
            assert compressed == 2 + 4
            assert skipped == 2


def under_zero(rank, world_size, kind):
    model = _model()
    zero = ZeroOptimizer(model, lambda tensors: _optimizer(kind, tensors), config={"stage": 0})
    layout = zero.layout

    def flat_of(tensors):  # ZeRO's flat layout (reverse order, padded): what the optimizer steps
        flat = torch.zeros(layout.numel)
        for slot, t in zip(layout.slots, tensors, strict=True):
            flat[slot.offset:slot.offset + slot.numel] = t.reshape(-1)
        return flat

    reduced_steps = []
    mine = []
    for step in range(STEPS):
        ds_comm.configure(enabled=True)
        ds_comm.comms_logger.reset()
        zero.backward(_loss(model, _batch(step, rank)))
        zero.step()
        zero.zero_grad()
        reduced_steps.append(sum(r.count for r in ds_comm.comms_logger.records() if r.op == "all_reduce"))
        ds_comm.configure(enabled=False)
        mine.append(flat_of([p.detach() for p in model.parameters()]))
    used = torch.zeros(layout.numel, dtype=torch.bool)
    for slot in layout.slots:
        used[slot.offset:slot.offset + slot.numel] = True
    trace = _reference(kind, world_size, flat_of, mask=used.float())  # ZeRO masks its padding
    diffs = [(a - ref[rank])[used].abs().max().item() for a, ref in zip(mine, trace, strict=True)]
    return diffs, reduced_steps


@pytest.mark.parametrize("kind", KINDS)
def test_under_zero_stage_0_the_full_precision_reduction_runs_only_when_asked(kind):
    for diffs, reduced in _runs("under_zero", 2)[kind]:
        assert max(diffs) < 1e-5, diffs
        full = [n > 0 for n in reduced]
        if kind in ("onebit", "lamb"):
            assert full == [True] * 3 + [False] * (STEPS - 3)
        else:
            assert full == [True, True, False, True, False, True] + [False] * 6


def checkpoint_resume(rank, world_size, kind, root):
    path = f"{root}/{kind}"
    def run(model, zero, start, stop):
        for step in range(start, stop):
            zero.backward(_loss(model, _batch(step, rank)))
            zero.step()
            zero.zero_grad()

    model = _model()
    zero = ZeroOptimizer(model, lambda tensors: _optimizer(kind, tensors), config={"stage": 0})
    run(model, zero, 0, 8)  # inside the compressed phase: the error feedback is not zero
    errors = {k: t.abs().sum().item() for k, t in zero.optimizer.rank_state().items()}
    save_zero_checkpoint(zero, path)
    run(model, zero, 8, STEPS)
    uninterrupted = [p.detach().clone() for p in model.parameters()]
    resumed_model = _model()
    resumed = ZeroOptimizer(resumed_model, lambda tensors: _optimizer(kind, tensors), config={"stage": 0})
    load_zero_checkpoint(resumed, path)
    loaded_errors = {k: t.abs().sum().item() for k, t in resumed.optimizer.rank_state().items()}
    run(resumed_model, resumed, 8, STEPS)
    same = all(torch.equal(a, b) for a, b in zip(uninterrupted, resumed_model.parameters(), strict=True))
    return same, errors, loaded_errors, resumed.optimizer.steps


@pytest.mark.parametrize("kind", KINDS)
def test_a_checkpoint_carries_the_error_feedback_and_resumes_exactly(tmp_path_factory, kind):
    root = _RUNS.setdefault("checkpoint root", str(tmp_path_factory.mktemp("onebit_checkpoints")))
    for same, errors, loaded, steps in _runs("checkpoint_resume", 2, root)[kind]:
        assert errors and all(v > 0 for v in errors.values())
        assert loaded == errors
        assert steps == STEPS
        assert same


def refusals(rank, world_size):
    out = {}
    for name, make in (
        ("stage 1", lambda m: ZeroOptimizer(m, OneBitAdam, config={"stage": 1})),
        ("stage 2 by callable", lambda m: ZeroOptimizer(m, lambda t: ZeroOneAdam(t), config={"stage": 2})),
        ("fp16", lambda m: ZeroOptimizer(m, OneBitAdam, fp16={"enabled": True})),
        ("by hand", lambda m: ZeroOptimizer(m, OneBitAdam, reduce_in_backward=False)),
        ("freeze_step 0", lambda m: OneBitAdam(m.parameters(), freeze_step=0)),
        ("var_freeze_step", lambda m: ZeroOneAdam(m.parameters(), var_freeze_step=-1)),
        ("backend", lambda m: OneBitAdam(m.parameters(), comm_backend_name="carrier-pigeon")),
        ("amsgrad", lambda m: ZeroOneAdam(m.parameters(), amsgrad=True)),
        ("rank state", lambda m: OneBitAdam(m.parameters()).load_rank_state(
            {"0/worker_error": torch.zeros(5), "0/server_error": torch.zeros(3)})),
    ):
        try:
            make(_model())
            out[name] = "NOT REFUSED"
        except (ValueError, NotImplementedError) as e:
            out[name] = str(e)
    return out


def test_bad_input_is_named():
    out = spawn(refusals, world_size=2)[0]
    assert "zero_optimization.stage is 1: OneBitAdam compresses" in out["stage 1"]
    assert "runs with stage 0 only" in out["stage 1"]
    assert "zero_optimization.stage is 2: ZeroOneAdam" in out["stage 2 by callable"]
    assert "fp16 with OneBitAdam is not implemented" in out["fp16"]
    assert "reduce_in_backward=False" in out["by hand"]
    assert "OneBitAdam: freeze_step must be an integer >= 1, got 0" in out["freeze_step 0"]
    assert "ZeroOneAdam: var_freeze_step must be an integer >= 1, got -1" in out["var_freeze_step"]
    assert "comm_backend_name must be one of nccl, mpi, hccl, compressed, gloo, got 'carrier-pigeon'" in out["backend"]
    assert "amsgrad is not supported" in out["amsgrad"]
    assert re.fullmatch(r"OneBitAdam.load_rank_state: group 0's error feedback has 5 \+ 3 elements, this optimizer's "
                        r"needs \d+ \+ \d+ \(ds_comm.error_buffer_sizes\): saved for other parameters, .*",
                        out["rank state"]), out["rank state"]
