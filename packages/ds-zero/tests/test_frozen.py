"""Frozen parameters (``requires_grad=False``) under `ZeroOptimizer` at stages 0-3, on 2 ranks: a frozen
backbone part (the token embedding and the first block) and a LoRA-like half-frozen layer (the LM head's
weight frozen, a trainable adapter beside it). The trainable parameters equal torch's DDP with AdamW over
the same model bit for bit, the frozen ones never change and get no gradient; at stage 3 they are
partitioned (empty outside their module's forward, whole inside `GatheredParameters`), and checkpoints
save and restore them (or leave them out with ``exclude_frozen_parameters``) across world sizes and
stages; the fp32 export holds them, so a strict ``load_state_dict`` takes it."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ds_comm.testing import spawn
from ds_zero import (
    GatheredParameters,
    Init,
    ZeroOptimizer,
    get_fp32_state_dict_from_zero_checkpoint,
    load_zero_checkpoint,
    save_zero_checkpoint,
)


def _sibling(name: str):
    """A module of this directory (the tests run with --import-mode=importlib: no package, no path)."""
    spec = importlib.util.spec_from_file_location(f"_ds_zero_tests_{name}", Path(__file__).with_name(f"{name}.py"))
    module = sys.modules.get(spec.name) or importlib.util.module_from_spec(spec)
    if spec.name not in sys.modules:
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module


_gpt = _sibling("test_zero_vs_ddp")
VOCAB, D_MODEL, TinyGPT, _batch, _ddp = _gpt.VOCAB, _gpt.D_MODEL, _gpt.TinyGPT, _gpt._batch, _gpt._ddp
ADAMW = {"lr": 1e-2, "weight_decay": 0.01}
STAGE3 = {"stage": 3, "stage3_param_persistence_threshold": 100, "stage3_prefetch_bucket_size": 5000}
STEPS = 4


class Adapted(nn.Module):
    """A frozen linear layer with a trainable low-rank adapter (LoRA's arrangement)."""

    def __init__(self, base: nn.Linear, rank: int = 4):
        super().__init__()
        self.base = base
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


def _frozen_model() -> nn.Module:
    torch.manual_seed(0)
    model = TinyGPT()
    model.head = Adapted(model.head)
    model.tok.weight.requires_grad_(False)
    model.blocks[0].requires_grad_(False)
    model.head.base.weight.requires_grad_(False)
    return model


def _config(stage: int) -> dict:
    return STAGE3 if stage == 3 else {"stage": stage, "reduce_bucket_size": 2000}


def _frozen_names(model) -> list[str]:
    return [name for name, p in model.named_parameters() if not p.requires_grad]


def _whole(model) -> dict[str, torch.Tensor]:
    with GatheredParameters(list(model.parameters())):
        return {name: p.detach().clone() for name, p in model.named_parameters()}


def against_ddp(rank, world_size, stage, under_init=False):
    base = _frozen_model()
    reference, ref_losses = _ddp(copy.deepcopy(base), STEPS, 1, 0.0)
    initial = {name: p.detach().clone() for name, p in base.named_parameters()}
    if under_init:  # each rank holds a shard of every parameter from the start, the frozen ones too
        with Init():
            model = _frozen_model()
    else:
        model = copy.deepcopy(base)
    zero = ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs=ADAMW, config=_config(stage))
    frozen = [p for p in model.parameters() if not p.requires_grad]
    losses, inside, grads = [], [], []
    hook = model.head.base.register_forward_hook(lambda m, a, o: inside.append(m.weight.numel()))
    live = []  # stage 3: frozen elements gathered when backward leaves the frozen block (the head's and the
    # block's units were gathered in this backward: each is released once backward gathers the next)
    if stage == 3:
        model.blocks[0].register_full_backward_hook(lambda *_: live.append(zero._frozen.stage3.live_numel()))
    for step in range(STEPS):
        loss = model(_batch(step, 0, rank))
        zero.backward(loss)
        grads.append(all(p.grad is None for p in frozen))
        zero.step()
        zero.zero_grad()
        losses.append(loss.item())
    hook.remove()
    outside = [(p.numel(), getattr(p, "ds_persist", None)) for p in frozen]
    whole = _whole(model)
    names = [name for name, _ in model.named_parameters()]
    same = {name: torch.equal(whole[name], ref) for name, ref in zip(names, reference, strict=True)}
    unchanged = all(torch.equal(whole[name], initial[name]) for name in _frozen_names(model))
    moved = any(not torch.equal(whole[name], initial[name]) for name, p in model.named_parameters() if p.requires_grad)
    zero.close()
    return same, unchanged, moved, grads, outside, inside, losses == ref_losses, live


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_frozen_parameters_are_not_stepped_and_the_rest_equals_ddp(stage):
    for same, unchanged, moved, grads, outside, inside, same_losses, live in spawn(against_ddp, world_size=2,
                                                                            args=(stage,)):
        assert all(same.values()), [name for name, ok in same.items() if not ok]
        assert unchanged and moved and all(grads) and same_losses
        if stage == 3:  # partitioned: nothing held outside a forward (but the small persistent units, whole
            # as the trainable ones), the whole weight inside its module's forward
            assert all(numel == 0 for numel, persist in outside if not persist), outside
            assert sum(numel == 0 for numel, _ in outside) >= 6, outside
            assert inside == [VOCAB * D_MODEL] * STEPS
            # at most one of the block's linear layers (4224 elements) of the 14496 touched in backward
            assert len(live) == STEPS and max(live) <= 4 * D_MODEL * D_MODEL + 4 * D_MODEL, live
        else:
            assert all(numel > 0 and persist is None for numel, persist in outside)


def test_frozen_parameters_built_under_init_stay_partitioned_and_train_as_ddp():
    for same, unchanged, moved, grads, outside, inside, same_losses, _ in spawn(against_ddp, world_size=2,
                                                                         args=(3, True)):
        assert all(same.values()), [name for name, ok in same.items() if not ok]
        assert unchanged and moved and all(grads) and same_losses
        assert all(numel == 0 for numel, persist in outside if not persist), outside
        assert inside == [VOCAB * D_MODEL] * STEPS


def modified_on_one_rank(rank, world_size):
    model = _frozen_model()
    zero = ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs=ADAMW, config=STAGE3)
    weight = model.head.base.weight
    with GatheredParameters([weight], modifier_rank=0):
        if rank == 0:
            weight.data.fill_(0.5)
    tokens = _batch(0, 0, rank)
    seen = []
    hook = model.head.base.register_forward_hook(lambda m, a, o: seen.append(m.weight.detach().clone()))
    model(tokens)
    hook.remove()
    empty = weight.numel()
    zero.close()
    return bool((seen[0] == 0.5).all()), empty, bool((weight == 0.5).all())


def test_a_frozen_parameter_modified_under_gathered_parameters_keeps_the_value():
    for in_forward, empty, after_close in spawn(modified_on_one_rank, world_size=2):
        assert in_forward and empty == 0 and after_close


def save_run(rank, world_size, stage, path, exclude):
    model = _frozen_model()
    zero = ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs=ADAMW, config=_config(stage))
    for step in range(2):
        zero.backward(model(_batch(step, 0, rank)))
        zero.step()
        zero.zero_grad()
    save_zero_checkpoint(zero, path, exclude_frozen_parameters=exclude)
    whole = _whole(model)
    zero.close()
    return whole


def load_run(rank, world_size, stage, path):
    model = _frozen_model()
    with torch.no_grad():  # other values everywhere: what the checkpoint holds must come back
        for p in model.parameters():
            p.add_(1.0)
    zero = ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs=ADAMW, config=_config(stage))
    load_zero_checkpoint(zero, path)
    whole = _whole(model)
    loss = model(_batch(5, 0, 0)).item()
    zero.close()
    return whole, loss


@pytest.mark.parametrize(("saved", "loaded"), [((3, 2), (3, 2)), ((3, 2), (1, 1)), ((2, 2), (3, 2))])
@pytest.mark.parametrize("exclude", [False, True])
def test_checkpoints_keep_frozen_parameters_across_world_sizes_and_stages(tmp_path, saved, loaded, exclude):
    path = str(tmp_path / "ckpt")
    trained = spawn(save_run, world_size=saved[1], args=(saved[0], path, exclude))[0]
    fresh = {name: p.detach() + 1.0 for name, p in _frozen_model().named_parameters()}
    for whole, _ in spawn(load_run, world_size=loaded[1], args=(loaded[0], path)):
        for name, value in whole.items():
            frozen = not dict(_frozen_model().named_parameters())[name].requires_grad
            expected = fresh[name] if frozen and exclude else trained[name]
            assert torch.equal(value, expected), name
    exported = get_fp32_state_dict_from_zero_checkpoint(path)
    model = _frozen_model()
    if exclude:  # DeepSpeed's export leaves them out too: a strict load names them
        assert not set(_frozen_names(model)) & set(exported)
    else:  # strict: every parameter and buffer is there, the frozen ones included
        model.load_state_dict(exported)
        for name, p in model.named_parameters():
            assert torch.equal(p.detach(), trained[name].float()), name
