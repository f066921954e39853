"""Parameters replicated over a subgroup of ZeRO's data-parallel group (a parameter group's ``process_group``,
as Mixture-of-Experts experts are over their expert-data-parallel group).

A toy model written here: a dense Linear every rank holds, and "expert" Linears. At "ep 2" rank r holds
expert r alone (its process group the singleton ``new_group([r])``) and processes every rank's tokens for
it (what an all-to-all would bring); at "ep 1" both experts are on both ranks in one group of 2 (ZeRO's
own) and each rank processes its own tokens. The reference is plain torch: ``loss.backward()``, dense
gradients all-reduced / world, expert gradients all-reduced over their group / world (DeepSpeed's
``_reduce_expert_gradients``), the global norm over every parameter once (gathered by global name), clipping,
``torch.optim.AdamW``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ds_comm
from ds_comm.testing import spawn
from ds_zero import (
    ZeroOptimizer,
    load_zero_checkpoint,
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
    save_zero_checkpoint,
)

WIDTH, EXPERTS, STEPS, CLIP, LR = 8, 2, 5, 0.05, 1e-2


class Toy(nn.Module):
    def __init__(self, held: list[int]):
        super().__init__()
        torch.manual_seed(0)
        self.dense = nn.Linear(WIDTH, WIDTH)
        every = [nn.Linear(WIDTH, WIDTH) for _ in range(EXPERTS)]  # global expert e starts the same everywhere
        self.experts = nn.ModuleList(every[e] for e in held)
        self.held = held

    def loss(self, step: int, rank: int, world_size: int, ep: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * step + rank)
        dtype = self.dense.weight.dtype  # (16-bit under fp16/bf16)
        loss = torch.tanh(self.dense(torch.randn(4, WIDTH, generator=g).to(dtype))).square().mean()
        first = rank // ep * ep  # ep > 1: the tokens of this rank's expert-parallel group come to its expert
        sources = range(first, first + ep)
        for local, e in enumerate(self.held):
            for source in sources:
                seed = torch.Generator().manual_seed(7919 * step + 31 * source + e)
                tokens = torch.randn(3, WIDTH, generator=seed).to(dtype)
                loss = loss + self.experts[local](torch.tanh(self.dense(tokens))).square().mean()
        return loss

    def global_names(self) -> dict[str, str]:
        """Local name -> global (checkpoint) name, for the experts whose ids differ from their index."""
        return {f"experts.{i}.{k}": f"experts.{e}.{k}" for i, e in enumerate(self.held) for k in ("weight", "bias")
                if i != e}


def _layout(rank: int, world_size: int, ep: int):
    """The experts held here and their process group, DeepSpeed's expert-data-parallel group: expert e on
    the ranks r with r % ep == e (every rank makes every group, as new_group wants)."""
    if ep == 1:
        group = ds_comm.new_group(list(range(world_size)))
        return list(range(EXPERTS)), group
    groups = [ds_comm.new_group([r for r in range(world_size) if r % ep == e]) for e in range(ep)]
    return [rank % ep], groups[rank % ep]


def _param_groups(model: Toy, group, ep: int) -> list[dict]:
    return [{"params": list(model.dense.parameters())},
            {"params": list(model.experts.parameters()), "process_group": group, "moe": True,
             "name": f"ep_size_{ep}"}]


def _zero(model: Toy, group, ep: int, stage: int, offload: bool = False, **precision) -> ZeroOptimizer:
    config = {"stage": stage, "reduce_bucket_size": 100}
    if offload:
        config["offload_optimizer"] = {"device": "cpu"}
    return ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs={"lr": LR}, config=config, gradient_clipping=CLIP,
                         param_groups=_param_groups(model, group, ep), checkpoint_names=model.global_names(),
                         **precision)


def _by_global_name(model: Toy, values) -> dict[str, torch.Tensor]:
    names = model.global_names()
    return {names.get(n, n): v for n, v in values}


def _everyone(model: Toy, values) -> dict[str, torch.Tensor]:
    """Every rank's {global name: tensor}, merged (dense ones are the same on every rank)."""
    mine = {n: v.detach().clone() for n, v in _by_global_name(model, values).items()}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    out: dict[str, torch.Tensor] = {}
    for d in gathered:
        out.update(d)
    return out


def _reference(rank: int, world_size: int, ep: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    held, group = _layout(rank, world_size, ep)
    model = Toy(held)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    norms = []
    for step in range(STEPS):
        optimizer.zero_grad()
        model.loss(step, rank, world_size, ep).backward()
        for p in model.dense.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world_size
        for p in model.experts.parameters():
            dist.all_reduce(p.grad, group=group)
            p.grad /= world_size  # ZeRO's data-parallel world size, not the group's
        grads = _everyone(model, [(n, p.grad) for n, p in model.named_parameters()])
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
        norms.append(norm.item())
        coefficient = min(1.0, CLIP / (norm.item() + 1e-6))
        for p in model.parameters():
            p.grad *= coefficient
        optimizer.step()
    return _everyone(model, model.named_parameters()), norms


def _trained(rank: int, world_size: int, ep: int, stage: int, offload: bool
             ) -> tuple[dict[str, torch.Tensor], list[float]]:
    held, group = _layout(rank, world_size, ep)
    model = Toy(held)
    zero = _zero(model, group, ep, stage, offload)
    assert all("process_group" not in g for g in zero.param_groups)  # not for the torch optimizer
    assert zero.param_groups[1]["moe"] and zero.param_groups[1]["name"] == f"ep_size_{ep}"  # harmless marks
    norms = []
    for step in range(STEPS):
        zero.backward(model.loss(step, rank, world_size, ep))
        assert zero.step()
        norms.append(zero.get_global_grad_norm())
        zero.zero_grad()
    return _everyone(model, model.named_parameters()), norms


def matches_reference(rank: int, world_size: int, stage: int, offload: bool):
    out = {}
    for ep in (2, 1):
        out[ep] = (_reference(rank, world_size, ep), _trained(rank, world_size, ep, stage, offload))
    return out


@pytest.mark.parametrize("stage, world_size, offload", [(0, 2, False), (1, 2, False), (2, 2, False), (2, 4, False),
                                                        (2, 2, True)])
def test_replicated_groups_train_as_the_plain_torch_reference(stage, world_size, offload):
    """World size 2: each expert on one rank (singleton groups); 4: each expert on two ranks (ranks 0 and 2,
    1 and 3), whose buckets split over its group at stages 1-2. Also with ZeRO-Offload (CPU)."""
    for out in spawn(matches_reference, world_size=world_size, args=(stage, offload)):
        for ep, ((want, want_norms), (got, got_norms)) in out.items():
            assert set(got) == set(want) == {"dense.weight", "dense.bias", "experts.0.weight", "experts.0.bias",
                                             "experts.1.weight", "experts.1.bias"}
            assert min(want_norms) > CLIP  # clipping changes every step: the norm matters
            for name in want:
                assert torch.allclose(got[name], want[name], atol=1e-6, rtol=0), (ep, name)
            assert got_norms == pytest.approx(want_norms, rel=1e-5), ep
        # the same global data at ep 2 and ep 1: the same experts (what a MoE's numerics rest on)
        for name in out[1][1][0]:
            assert torch.allclose(out[2][1][0][name], out[1][1][0][name], atol=1e-6, rtol=0), name
        assert out[2][1][1] == pytest.approx(out[1][1][1], rel=1e-5)


def overflow_on_one_rank(rank: int, world_size: int):
    """An inf in rank 1's expert gradient only (its group is rank 1 alone): every rank skips the step."""
    out = []
    for stage in (0, 1, 2):
        for precision in ({"fp16": {"enabled": True, "initial_scale_power": 4}},
                          {"bf16": {"enabled": True, "check_grad_overflow": True}}):
            held, group = _layout(rank, world_size, 2)
            model = Toy(held)
            zero = _zero(model, group, 2, stage, **precision)
            if rank == 1:
                model.experts[0].weight.register_hook(lambda g: g * float("inf"))
            before = [p.detach().clone() for p in model.parameters()]
            zero.backward(model.loss(0, rank, world_size, 2).float())
            stepped = zero.step()
            unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
            out.append((stage, next(iter(precision)), stepped, zero.skipped_steps, unchanged))
            zero.close()
    return out


def test_an_overflow_in_one_groups_gradients_skips_the_step_on_every_rank():
    for cases in spawn(overflow_on_one_rank, world_size=2):
        assert [(stepped, skipped, unchanged) for _, _, stepped, skipped, unchanged in cases] == \
            [(False, 1, True)] * 6, cases


def _states(zero: ZeroOptimizer, model: Toy) -> dict[str, torch.Tensor]:
    values = [(n, torch.cat([safe_get_full_fp32_param(p).reshape(-1),
                             safe_get_full_optimizer_state(p, "exp_avg").reshape(-1),
                             safe_get_full_optimizer_state(p, "exp_avg_sq").reshape(-1)]))
              for n, p in model.named_parameters()]
    return _everyone(model, values)


def _run(rank: int, world_size: int, ep: int, stage: int, steps: range, load: str | None = None,
         save: str | None = None):
    held, group = _layout(rank, world_size, ep)
    model = Toy(held)
    if load is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()  # everything must come from the checkpoint
    zero = _zero(model, group, ep, stage)
    if load is not None:
        load_zero_checkpoint(zero, load)
    loaded = _states(zero, model) if load is not None else None
    for step in steps:
        zero.backward(model.loss(step, rank, world_size, ep))
        zero.step()
        zero.zero_grad()
        if save is not None and step == steps[0] + 1:
            save_zero_checkpoint(zero, save)
            saved = _states(zero, model)
    assert zero.param_groups[1]["name"] == f"ep_size_{ep}"  # a loaded checkpoint's options, this run's grouping
    zero.close()
    return loaded, (saved if save is not None else None), _everyone(model, model.named_parameters())


def resume_at_other_grouping(rank: int, world_size: int, path: str, cases: list):
    out = []
    for (save_ep, save_stage), (load_ep, load_stage) in cases:
        where = f"{path}/{save_ep}{save_stage}{load_ep}{load_stage}"
        _, saved, uninterrupted = _run(rank, world_size, save_ep, save_stage, range(STEPS), save=where)
        loaded, _, resumed = _run(rank, world_size, load_ep, load_stage, range(2, STEPS), load=where)
        out.append((saved, loaded, uninterrupted, resumed))
    return out


# ((ep, stage) saved, (ep, stage) loaded): at ep 2 each expert is on half the ranks, at ep 1 on all of them
GROUPINGS = {2: [((2, 2), (1, 0)), ((2, 1), (1, 2)), ((1, 1), (2, 2)), ((1, 0), (2, 0))],
             4: [((2, 2), (1, 1)), ((1, 2), (2, 1))]}


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_checkpoint_loads_at_another_expert_grouping_and_back(tmp_path, world_size):
    for cases in spawn(resume_at_other_grouping, world_size=world_size,
                       args=(str(tmp_path), GROUPINGS[world_size])):
        for saved, loaded, uninterrupted, resumed in cases:
            assert set(saved) == set(loaded) == set(uninterrupted) == set(resumed)
            for name in saved:  # weights, exp_avg and exp_avg_sq as saved
                assert torch.equal(saved[name], loaded[name]), name
                assert saved[name][2 * uninterrupted[name].numel():].abs().sum() > 0  # Adam's states exist
            for name in uninterrupted:
                assert torch.allclose(uninterrupted[name], resumed[name], atol=1e-6, rtol=0), name


def bad_input(rank: int, world_size: int, case: str):
    model = Toy([rank])
    others = [ds_comm.new_group([r]) for r in range(world_size)]
    everyone = ds_comm.new_group(list(range(world_size)))
    config, group, pg = {"stage": 1}, None, others[rank]
    groups = None
    if case == "not this rank":
        pg = others[1 - rank]
    elif case == "outside zero's group":
        group = others[rank]  # ZeRO over this rank alone; the experts' group holds both
        pg = everyone
    elif case == "stage 3":
        config = {"stage": 3}
    elif case == "not a group":
        pg = "ep_size_2"
    elif case == "twice":
        groups = [{"params": list(model.parameters())},
                  {"params": list(model.experts.parameters()), "process_group": pg}]
    groups = groups or _param_groups(model, pg, 2)
    try:
        ZeroOptimizer(model, torch.optim.AdamW, config=config, group=group, param_groups=groups)
    except (ValueError, NotImplementedError) as e:
        return type(e).__name__, str(e)
    return None, None


@pytest.mark.parametrize("case, kind, words", [
    ("not this rank", "ValueError", ["param_groups[1]", "process_group", "does not contain this rank ({rank})"]),
    ("outside zero's group", "ValueError", ["param_groups[1]", "holds ranks [0, 1]", "not in ZeRO's"]),
    ("stage 3", "NotImplementedError", ["process_group", "stage 3"]),
    ("not a group", "ValueError", ["param_groups[1]", "process group", "str"]),
    ("twice", "ValueError", ["param_groups[0] and param_groups[1]"]),
])
def test_bad_process_groups_are_named(case, kind, words):
    for rank, (got_kind, message) in enumerate(spawn(bad_input, world_size=2, args=(case,))):
        assert got_kind == kind, message
        for word in words:
            assert word.format(rank=rank) in message, message
