"""Checkpoints of MoE models through the engine (2 ranks, fp32, AdamW, ZeRO 1 and 2): a tiny model (an
embedding, 2 pre-LN blocks whose MLP is ``ds_all.moe.layer.MoE`` with 4 experts, top-2; the second
layer balanced by ``expert_bias``, aux-loss-free) trains 3 steps at one ``ep_size``, saves, and trains 3
more (losses L_a). A fresh run at the same ``ep_size`` loads the checkpoint and continues bit for bit;
at the other ``ep_size`` (2 -> 1 and 1 -> 2) it continues within 1e-6. Right after the load, every
weight, buffer and Adam state equals what was saved, by *global* expert id (the reference in this file
maps local to global ids by DeepSpeed's rule, ``global = ep_rank * num_local + local``, with
``ep_rank = rank % ep_size``). Also ``load_module_only``, ``load_optimizer_states=False`` and the
float32 export (experts under their global ids), which trains on like the module-only load. Experts
holding buffers (a BatchNorm's statistics) at ep_size 2 load at ep_size 1 and 2 by global expert id."""

from __future__ import annotations

import logging
import re
import zlib

import pytest
import torch
from torch import nn

import ds_all
import ds_zero
from ds_comm.testing import spawn

VOCAB, D, SEQ, EXPERTS = 32, 16, 8, 4
SAVE_AT, STEPS = 3, 6
_EXPERT = re.compile(r"(.*\.deepspeed_experts\.)(\d+)(\..*)")


def _moe(ep: int, bias_update_speed: float) -> nn.Module:
    from ds_all.moe.layer import MoE

    expert = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
    return MoE(D, expert, num_experts=EXPERTS, ep_size=ep, k=2, capacity_factor=1.0, min_capacity=2,
               bias_update_speed=bias_update_speed)


class Block(nn.Module):
    def __init__(self, ep: int, bias_update_speed: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        # no projection biases: the key's gets a zero gradient (softmax ignores it), so its Adam steps are
        # rounding noise made lr-sized, which no two layouts of the reduction would agree on
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True, bias=False)
        self.moe = _moe(ep, bias_update_speed)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.ln1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        out, l_aux, _ = self.moe(self.ln2(x))
        return x + out, l_aux


class TinyMoE(nn.Module):
    def __init__(self, ep: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block(ep, 0.0), Block(ep, 0.01)])
        self.head = nn.Linear(D, VOCAB)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, aux = self.embed(tokens), torch.zeros((), device=tokens.device)
        for block in self.blocks:
            x, l_aux = block(x)
            aux = aux + l_aux
        return self.head(x), aux


def _global(name: str, ep: int, rank: int) -> str:
    """The reference: ``...deepspeed_experts.<local>.rest`` -> ``...deepspeed_experts.<global>.rest``."""
    match = _EXPERT.fullmatch(name)
    if match is None:
        return name
    local = int(match.group(2))
    return f"{match.group(1)}{(rank % ep) * (EXPERTS // ep) + local}{match.group(3)}"


def _model(ep: int, seed: int) -> TinyMoE:
    """The dense part from ``seed``; each expert's weights from ``seed`` and its global id, so that experts
    differ from each other and a model at another ``ep_size`` holds the same expert under the same id."""
    torch.manual_seed(seed)
    model = TinyMoE(ep)
    rank = torch.distributed.get_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if _EXPERT.fullmatch(name):
                g = torch.Generator().manual_seed(seed * 7919 + zlib.crc32(_global(name, ep, rank).encode()))
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "allgather_bucket_size": 300}}


def _engine(ep: int, stage: int, seed: int):
    from ds_all.moe.utils import split_params_into_different_moe_groups_for_optimizer

    model = _model(ep, seed)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                   "name": "parameters"})
    engine, *_ = ds_all.initialize(model=model, model_parameters=groups, config=_config(stage))
    return engine


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + torch.distributed.get_rank())
    return torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)


def _train(engine, until: int) -> list[float]:
    losses = []
    while engine.global_steps < until:
        tokens = _batch(engine.global_steps)
        logits, aux = engine(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)) + 0.01 * aux
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _merged(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, local)
    out: dict[str, torch.Tensor] = {}
    for part in gathered:
        for name, value in part.items():
            if name in out:  # held by several ranks (dense, or an expert at ep 1): the replicas agree
                assert torch.equal(out[name], value), name
            out[name] = value
    return out


def _snapshot(engine, ep: int, optimizer: bool = True) -> dict[str, dict[str, torch.Tensor]]:
    """Every weight and buffer, and (``optimizer``) Adam's states, whole, by global name (a collective)."""
    rank = torch.distributed.get_rank()
    out = {"w": _merged({_global(k, ep, rank): v.detach().clone() for k, v in engine.module.state_dict().items()})}
    for key in ("exp_avg", "exp_avg_sq") if optimizer else ():
        out[key] = _merged({_global(name, ep, rank): ds_zero.safe_get_full_optimizer_state(p, key).clone()
                            for name, p in engine.module.named_parameters()})
    return out


def save_run(rank, world_size, path, stage, ep):
    engine = _engine(ep, stage, seed=0)
    _train(engine, SAVE_AT)
    saved = _snapshot(engine, ep)
    engine.save_checkpoint(path, tag="moe3", client_state={"note": "moe", "ids": torch.arange(4)},
                           async_save=stage == 1)  # written while the next steps run
    losses = _train(engine, STEPS)
    final = _snapshot(engine, ep, optimizer=False)["w"]
    engine.destroy()
    return losses, saved, final


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def resume_run(rank, world_size, path, stage, ep):
    engine = _engine(ep, stage, seed=99)
    log = _Messages()
    logging.getLogger("ds_all").addHandler(log)
    loaded, client = engine.load_checkpoint(path)
    logging.getLogger("ds_all").removeHandler(log)
    resharded = any("was saved at another ep_size" in m for m in log.messages)
    assert loaded.endswith("moe3") and engine.global_steps == SAVE_AT
    assert client["note"] == "moe" and torch.equal(client["ids"], torch.arange(4))
    state = _snapshot(engine, ep)
    losses = _train(engine, STEPS)
    final = _snapshot(engine, ep, optimizer=False)["w"]
    engine.destroy()
    return losses, state, final, resharded


def module_run(rank, world_size, path, stage, ep, how):
    """``how``: ``module_only`` (weights only), ``no_optimizer`` (weights and counters) or ``export`` (the
    float32 export's global names mapped to this rank's local ones, into a fresh engine's model)."""
    if how == "export":
        whole = ds_zero.get_fp32_state_dict_from_zero_checkpoint(path, tag="moe3")
        model = _model(ep, seed=99)
        model.load_state_dict({k: whole[_global(k, ep, rank)] for k in model.state_dict()})
        from ds_all.moe.utils import split_params_into_different_moe_groups_for_optimizer

        groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                       "name": "parameters"})
        engine, *_ = ds_all.initialize(model=model, model_parameters=groups, config=_config(stage))
        steps, whole = 0, {k: v.clone() for k, v in whole.items()}
    else:
        engine = _engine(ep, stage, seed=99)
        if how == "module_only":  # the optimizer's states are not read though load_optimizer_states is True
            engine.load_checkpoint(path, load_module_only=True)
        else:
            engine.load_checkpoint(path, load_optimizer_states=False)
        steps, whole = engine.global_steps, None
    state = _snapshot(engine, ep, optimizer=False)
    torch.manual_seed(5 + rank)  # the gates' sampling: the same in every way of loading
    losses = []
    for step in range(SAVE_AT, STEPS):
        tokens = _batch(step)
        logits, aux = engine(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)) + 0.01 * aux
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    return losses, state, steps, whole


def _assert_states_equal(got: dict, expected: dict, atol: float = 0.0) -> None:
    assert sorted(got) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=atol, msg=name)


@pytest.fixture(scope="module", params=[(1, 2), (2, 2), (2, 1)], ids=lambda p: f"stage{p[0]}-ep{p[1]}")
def saved(request, tmp_path_factory):
    stage, ep = request.param
    path = tmp_path_factory.mktemp(f"moe_s{stage}_ep{ep}")
    return stage, ep, path, spawn(save_run, world_size=2, args=(str(path), stage, ep), timeout=240)


@pytest.mark.parametrize("ep_to", [1, 2])
def test_moe_checkpoint_resumes_at_any_ep_size(saved, ep_to):
    stage, ep_from, path, first = saved
    resumed = spawn(resume_run, world_size=2, args=(str(path), stage, ep_to), timeout=240)
    expected_names = {f"blocks.{b}.moe.deepspeed_moe.experts.deepspeed_experts.{e}.{i}.{w}"
                      for b in range(2) for e in range(EXPERTS) for i in (0, 2) for w in ("weight", "bias")}
    assert [r[3] for r in resumed] == [ep_to != ep_from, False]  # logged by rank 0
    for (losses_a, saved_state, final_a), (losses_b, state, final_b, _) in zip(first, resumed, strict=True):
        assert expected_names <= set(saved_state["w"])  # every expert, under its global id
        assert "blocks.1.moe.deepspeed_moe.gate.expert_bias" in saved_state["w"]
        assert saved_state["w"]["blocks.1.moe.deepspeed_moe.gate.expert_bias"].abs().sum() > 0
        for key in ("w", "exp_avg", "exp_avg_sq"):  # what was saved is what is loaded, at any ep_size
            _assert_states_equal(state[key], saved_state[key])
        if ep_to == ep_from:  # the same layout: bit for bit
            assert losses_b == losses_a
            _assert_states_equal(final_b, final_a)
        else:
            torch.testing.assert_close(torch.tensor(losses_b), torch.tensor(losses_a), rtol=0, atol=1e-6)
            _assert_states_equal(final_b, final_a, atol=1e-6)


@pytest.mark.parametrize("stage, ep_from, ep_to", [(2, 2, 1), (1, 1, 2)])
def test_moe_module_only_and_fp32_export(tmp_path, stage, ep_from, ep_to):
    """``load_module_only`` and ``load_optimizer_states=False`` load the weights and buffers (fresh Adam
    states), as a fresh engine does from the float32 export, whose experts are under their global ids."""
    first = spawn(save_run, world_size=2, args=(str(tmp_path), stage, ep_from), timeout=240)
    saved_w = first[0][1]["w"]
    runs = {how: spawn(module_run, world_size=2, args=(str(tmp_path), stage, ep_to, how), timeout=240)
            for how in ("module_only", "no_optimizer", "export")}
    export = runs["export"][0][3]
    _assert_states_equal(export, saved_w)  # every parameter and buffer, experts by global id
    assert runs["module_only"][0][2] == 0 and runs["no_optimizer"][0][2] == SAVE_AT
    for how, ranks in runs.items():
        for rank, (losses, state, _, _) in enumerate(ranks):
            _assert_states_equal(state["w"], saved_w)
            assert losses == runs["export"][rank][0], how
    for rank, ranks_first in enumerate(first):  # fresh Adam states: another trajectory than the resumed one
        assert runs["export"][rank][0] != ranks_first[0]


def one_rank_run(rank, world_size, path):
    engine = _engine(1, 0, seed=99)  # every expert on the one rank, ZeRO stage 0
    engine.load_checkpoint(path)
    state = _snapshot(engine, 1)
    losses = _train(engine, SAVE_AT + 2)
    engine.destroy()
    return state, losses


def test_moe_checkpoint_of_two_ranks_loads_on_one_at_another_stage(tmp_path):
    """ep 2 on 2 ranks at ZeRO 2 -> ep 1 on 1 rank at ZeRO 0: every expert, under its global id, with its
    Adam states; training goes on from there."""
    first = spawn(save_run, world_size=2, args=(str(tmp_path), 2, 2), timeout=240)
    [(state, losses)] = spawn(one_rank_run, world_size=1, args=(str(tmp_path),), timeout=240)
    for key in ("w", "exp_avg", "exp_avg_sq"):
        _assert_states_equal(state[key], first[0][1][key])
    assert len(losses) == 2 and all(0 < loss < 10 for loss in losses)


class _BatchNormMoE(nn.Module):
    """One MoE layer whose experts hold a BatchNorm (running statistics: buffers, each expert's its own)."""

    def __init__(self, ep: int) -> None:
        super().__init__()
        from ds_all.moe.layer import MoE

        expert = nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D))
        self.moe = MoE(D, expert, num_experts=EXPERTS, ep_size=ep, k=1, min_capacity=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, l_aux, _ = self.moe(x)
        return out.pow(2).mean() + 0.01 * l_aux


def _expert_buffers(engine, ep: int) -> dict[str, torch.Tensor]:
    """Every expert buffer, whole, by global name (a collective)."""
    rank = torch.distributed.get_rank()
    return _merged({_global(k, ep, rank): v.clone() for k, v in engine.module.named_buffers() if _EXPERT.fullmatch(k)})


def buffer_run(rank, world_size, path, ep, save):
    torch.manual_seed(0 if save else 99)
    engine, *_ = ds_all.initialize(model=_BatchNormMoE(ep), config=_config(1))
    if save:
        for step in range(2):
            g = torch.Generator().manual_seed(10 * step + rank)
            engine.backward(engine(torch.randn(16, D, generator=g) * (1 + rank)))
            engine.step()
        engine.save_checkpoint(path, tag="bn")
    else:
        engine.load_checkpoint(path, tag="bn")
    state = _expert_buffers(engine, ep)
    engine.destroy()
    return state


@pytest.mark.parametrize("ep_to", [1, 2])
def test_expert_buffers_load_by_global_expert_id(tmp_path, ep_to):
    """ep 2 -> ep 1 and ep 2: each expert's BatchNorm statistics (buffers) are saved under its global
    expert id by the rank holding it and read back into that expert, wherever it is now."""
    saved = spawn(buffer_run, world_size=2, args=(str(tmp_path), 2, True), timeout=240)[0]
    prefix = "moe.deepspeed_moe.experts.deepspeed_experts."
    assert sorted(saved) == sorted(f"{prefix}{e}.1.{b}" for e in range(EXPERTS)
                                   for b in ("running_mean", "running_var", "num_batches_tracked"))
    means = [saved[f"{prefix}{e}.1.running_mean"] for e in range(EXPERTS)]
    assert all(not torch.equal(means[i], means[j]) for i in range(EXPERTS) for j in range(i))  # mix-ups show
    assert all(saved[f"{prefix}{e}.1.num_batches_tracked"] == 2 for e in range(EXPERTS))
    for loaded in spawn(buffer_run, world_size=2, args=(str(tmp_path), ep_to, False), timeout=240):
        _assert_states_equal(loaded, saved)
