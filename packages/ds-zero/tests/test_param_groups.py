"""Parameter groups with options of their own (weight decay off for biases and norms, another learning
rate): at every stage, with CPU offload and with bf16, ZeRO trains as torch's AdamW with the same groups
on the whole batch; a checkpoint saved with groups resumes at another stage; bad groups are named."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_comm.testing import spawn
from ds_zero import GatheredParameters, ZeroOptimizer, load_zero_checkpoint, save_zero_checkpoint

WIDTH, STEPS = 24, 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH),
                         nn.Tanh(), nn.Linear(WIDTH, 4))


def _groups(model: nn.Module) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() == 2]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() == 2)]
    return [{"params": decay, "weight_decay": 0.5}, {"params": rest, "weight_decay": 0.0, "lr": 3e-3}]


def _batch(step: int, rank: int, world_size: int) -> torch.Tensor:
    return torch.randn(8 // world_size, WIDTH, generator=torch.Generator().manual_seed(100 * step + rank))


def _zero(model, stage, *, offload=False, bf16=False):
    config = {"stage": stage, "reduce_bucket_size": 300}  # several buckets, parameters split across ranks
    if stage == 3:
        config["stage3_param_persistence_threshold"] = 0
    if offload:
        config["offload_optimizer"] = {"device": "cpu"}
    return ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs={"lr": 1e-2}, config=config,
                         bf16={"enabled": bf16}, param_groups=_groups(model))


def _params(model) -> list[torch.Tensor]:
    with GatheredParameters(list(model.parameters())):
        return [p.detach().float().clone() for p in model.parameters()]


def _train(zero, model, rank, world_size, start, stop):
    for step in range(start, stop):
        zero.backward(model(_batch(step, rank, world_size).to(next(model.parameters()).dtype)).float().square().mean())
        zero.step()
        zero.zero_grad()


def _reference(world_size: int, stop: int) -> list[torch.Tensor]:
    """torch's AdamW with the same groups, one process, the whole batch of every step."""
    model = _model()
    optimizer = torch.optim.AdamW(_groups(model), lr=1e-2)
    for step in range(stop):
        batch = torch.cat([_batch(step, r, world_size) for r in range(world_size)])
        optimizer.zero_grad()
        model(batch).square().mean().backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


CASES = [(0, False, False), (1, False, False), (2, False, False), (3, False, False), (2, True, False),
         (1, False, True)]


def matches_torch(rank, world_size):
    reference = _reference(world_size, STEPS)
    out = []
    for stage, offload, bf16 in CASES:
        model = _model()
        zero = _zero(model, stage, offload=offload, bf16=bf16)
        _train(zero, model, rank, world_size, 0, STEPS)
        error = max((a - b).abs().max().item() for a, b in zip(_params(model), reference, strict=True))
        out.append((error, [(g["weight_decay"], g["lr"]) for g in zero.param_groups]))
        zero.close()
    return out


def test_groups_train_as_torch_adamw_with_the_same_groups():
    for results in spawn(matches_torch, world_size=2):
        for (stage, offload, bf16), (error, options) in zip(CASES, results, strict=True):
            assert options == [(0.5, 1e-2), (0.0, 3e-3)], (stage, offload, bf16)
            # fp32: reduction order only; CPU Adam: its own arithmetic; bf16: the model is bf16
            bound = 2e-2 if bf16 else 1e-5 if offload else 1e-6
            assert error < bound, (stage, offload, bf16, error)


def test_the_groups_options_matter_here():
    """The comparison above can fail: one set of options for every parameter ends far from the groups'."""
    grouped = _reference(2, STEPS)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.5)
    for step in range(STEPS):
        optimizer.zero_grad()
        model(torch.cat([_batch(step, r, 2) for r in range(2)])).square().mean().backward()
        optimizer.step()
    assert max((a - b).abs().max().item() for a, b in zip(grouped, model.parameters(), strict=True)) > 1e-3


def resume_at_another_stage(rank, world_size, path):
    model = _model()
    zero = _zero(model, 2)
    _train(zero, model, rank, world_size, 0, 2)
    save_zero_checkpoint(zero, path)
    _train(zero, model, rank, world_size, 2, STEPS)
    uninterrupted = _params(model)
    out = []
    for stage in (0, 3):
        resumed_model = _model()
        for p in resumed_model.parameters():
            nn.init.zeros_(p)  # everything must come from the checkpoint
        resumed = _zero(resumed_model, stage)
        load_zero_checkpoint(resumed, path)
        _train(resumed, resumed_model, rank, world_size, 2, STEPS)
        out.append(max((a - b).abs().max().item() for a, b in zip(uninterrupted, _params(resumed_model),
                                                                    strict=True)))
        resumed.close()
    return out


def test_a_checkpoint_with_groups_resumes_at_another_stage(tmp_path):
    for errors in spawn(resume_at_another_stage, world_size=2, args=(str(tmp_path / "ck"),)):
        assert max(errors) < 1e-6, errors


def nvme_with_groups(rank, world_size, path):
    model = _model()
    try:
        ZeroOptimizer(model, torch.optim.AdamW, config={"stage": 3, "offload_optimizer": {
            "device": "nvme", "nvme_path": path}}, param_groups=_groups(model))
    except NotImplementedError as e:
        return str(e), all(p.data._base is None for p in model.parameters())  # no view of ZeRO's flat buffer
    return None, None


def test_nvme_offload_with_two_groups_is_refused_before_touching_the_model(tmp_path):
    for message, untouched in spawn(nvme_with_groups, world_size=2, args=(str(tmp_path),)):
        assert "offload_optimizer.device 'nvme' steps one set of Adam options" in message
        assert "got 2 parameter groups" in message
        assert untouched


@pytest.mark.parametrize(("make", "message"), [
    (lambda m: {"params": list(m.parameters())}, "param_groups must be a list of dicts with 'params'"),
    (lambda m: [list(m.parameters())], "param_groups must be a list of dicts with 'params'"),
    (lambda m: [{"params": list(m.parameters())}, {"params": [m[0].bias]}],
     r"parameter 0\.bias is in param_groups\[0\] and param_groups\[1\]"),
    (lambda m: [{"params": []}], r"param_groups hold none of the model's 8 trainable parameters"),
    (lambda m: [{"params": [*m.parameters(), torch.zeros(3)]}],
     r"param_groups\[0\] holds a tensor of shape \(3,\) that is not a trainable parameter"),
])
def test_bad_groups_are_named_before_any_collective(make, message):
    model = _model()
    with pytest.raises(ValueError, match=message):
        ZeroOptimizer(model, torch.optim.AdamW, param_groups=make(model))


def groups_leave_some_out(rank, world_size, stage):
    model = _model()
    left_out = [p.detach().clone() for p in model[3].parameters()]
    trained = [p for i, layer in enumerate(model) if i != 3 for p in layer.parameters()]
    config = {"stage": stage, "reduce_bucket_size": 300}
    if stage == 3:
        config["stage3_param_persistence_threshold"] = 0
    zero = ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs={"lr": 1e-2}, config=config,
                         param_groups=[{"params": trained, "weight_decay": 0.5}])
    groups = [[id(p) for p in group] for group in zero.fp16_groups] == [[id(p) for p in trained]]
    _train(zero, model, rank, world_size, 0, STEPS)
    after = _params(model)
    reference = _model()  # torch's AdamW over the same parameters, the whole batch
    optimizer = torch.optim.AdamW([p for i, layer in enumerate(reference) if i != 3 for p in layer.parameters()],
                                  lr=1e-2, weight_decay=0.5)
    for step in range(STEPS):
        batch = torch.cat([_batch(step, r, world_size) for r in range(world_size)])
        optimizer.zero_grad()
        reference(batch).square().mean().backward()
        optimizer.step()
    zero.close()
    close = all(torch.allclose(a, b.detach(), atol=1e-5) for a, b in zip(after, reference.parameters(), strict=True))
    return groups, close, [torch.equal(a, b) for a, b in zip(after[4:6], left_out, strict=True)]


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_parameters_in_no_group_keep_their_values(stage):
    for groups, close, untouched in spawn(groups_leave_some_out, world_size=2, args=(stage,)):
        assert groups and close and all(untouched)
