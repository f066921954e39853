"""The engine's Mixture of Experts on 2 ranks: a tiny GPT whose MLPs are ``ds_all.moe.layer.MoE`` (8 experts,
top-2) trains at ep_size=2 exactly as at ep_size=1 (losses every step, every expert's final weights by global
expert id, the gates' exp_counts) at ZeRO stages 0, 1 and 2, and each equals a plain-torch loop written here
(every gradient all-reduced and averaged, clipped over the whole model, torch's AdamW); PR-MoE and a pyramid
(layers of different expert counts and ep sizes) likewise; DeepSpeed's module tree and groups functions answer;
what is not built or is wrong is refused by name."""

from __future__ import annotations

import importlib
import logging

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ds_all
import ds_comm
import ds_moe
from ds_all.moe.layer import MoE  # DeepSpeed's: from deepspeed.moe.layer import MoE
from ds_all.moe.utils import split_params_into_different_moe_groups_for_optimizer
from ds_comm.testing import spawn

VOCAB, D, HEADS, SEQ, BATCH, STEPS = 64, 32, 2, 16, 2, 10
MOE_LOSS_COEFF = 0.01  # DeepSpeed's examples: loss = CE + coeff * sum of the layers' l_aux
LR, WEIGHT_DECAY, CLIP = 1e-3, 0.01, 1.0
TOL = 1e-6


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # no qkv bias: the keys' bias has a zero gradient (softmax ignores a shift), whose rounding noise AdamW
        # would scale up to a full step, different at each ep size
        self.qkv, self.proj = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.reshape(b, s, HEADS, D // HEADS).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        scores = q @ k.transpose(-1, -2) / (D // HEADS) ** 0.5
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        out = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, s, D))


class Block(nn.Module):
    """Pre-LN decoder block whose MLP is an MoE layer."""

    def __init__(self, num_experts: int, ep_size: int, use_residual: bool) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(D), Attention(), nn.LayerNorm(D)
        expert = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.moe = MoE(hidden_size=D, expert=expert, num_experts=num_experts, ep_size=ep_size, k=2,
                       use_residual=use_residual)

    def forward(self, x: torch.Tensor):
        x = x + self.attn(self.ln1(x))
        out, l_aux, exp_counts = self.moe(self.ln2(x))
        return x + out, l_aux, exp_counts


class TinyGPT(nn.Module):
    def __init__(self, layers: list[tuple[int, int]], use_residual: bool = False) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, D), nn.Embedding(SEQ, D)
        self.blocks = nn.ModuleList(Block(e, ep, use_residual) for e, ep in layers)
        self.ln, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB)
        self.exp_counts: list[torch.Tensor] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        l_aux, self.exp_counts = 0.0, []
        for block in self.blocks:
            x, aux, counts = block(x)
            l_aux = l_aux + aux
            self.exp_counts.append(counts.detach().clone())
        logits = self.head(self.ln(x))
        ce = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        return ce + MOE_LOSS_COEFF * l_aux


def build(layers: list[tuple[int, int]], rank: int, use_residual: bool = False) -> TinyGPT:
    """The same model for every ep size: dense weights from one seed, each expert's weights from its global id
    (expert-parallel rank ``rank % ep_size`` holds experts ``ep_rank * num_local ...``)."""
    torch.manual_seed(0)
    model = TinyGPT(layers, use_residual)
    for li, block in enumerate(model.blocks):
        moe = block.moe
        ep_rank = rank % moe.ep_size
        for i, expert in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
            g = torch.Generator().manual_seed(1000 * li + ep_rank * moe.num_local_experts + i)
            with torch.no_grad():
                for _, p in sorted(expert.named_parameters()):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(100 * step + rank))


def config(stage: int, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, "torch_adam": True}},
            "zero_optimization": {"stage": stage}, "gradient_clipping": CLIP, "steps_per_print": 1000, **extra}


def global_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter by its global name (experts by global id), gathered from every rank."""
    rename = ds_moe.expert_checkpoint_names(model)
    mine = {rename.get(n, n): p.detach().clone() for n, p in model.named_parameters()}
    every: list = [None] * ds_comm.get_world_size()
    torch.distributed.all_gather_object(every, mine)
    out: dict[str, torch.Tensor] = {}
    for part in every:
        for name, value in part.items():
            out.setdefault(name, value)  # dense parameters: the same on every rank
    return out


def step_seed(step: int, rank: int) -> None:
    torch.manual_seed(10_000 + 100 * step + rank)  # top-2's second-expert sampling draws the same noise


def train_engine(layers, stage, rank, use_residual=False, groups_of=None, **initialize) -> dict:
    model = build(layers, rank, use_residual)
    if groups_of is not None:  # model_parameters made from the model
        initialize["model_parameters"] = groups_of(model)
    engine, *_ = ds_all.initialize(model=model, config=config(stage), **initialize)
    losses, counts = [], []
    for step in range(STEPS):
        step_seed(step, rank)
        loss = engine(batch(step, rank))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        counts.append([c.tolist() for c in model.exp_counts])
    facts = {"has_moe_layers": engine.has_moe_layers, "num_experts": engine.num_experts,
             "moe_layers": len(engine.moe_layers), "gate_modules": len(engine.gate_modules),
             "groups": [{k: v for k, v in g.items() if k in ("moe", "name")} for g in engine.optimizer.param_groups]}
    weights = global_weights(model)
    engine.destroy()
    return {"losses": losses, "counts": counts, "weights": weights, "facts": facts}


def train_reference(layers, rank, world_size, use_residual=False) -> dict:
    """Plain torch: every parameter replicated, loss.backward, every gradient all-reduced / world, clipped
    over the whole gradient, torch's AdamW."""
    model = build([(e, 1) for e, _ in layers], rank, use_residual)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    losses, counts = [], []
    for step in range(STEPS):
        step_seed(step, rank)
        loss = model(batch(step, rank))
        loss.backward()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            ds_comm.all_reduce(p.grad)
            p.grad /= world_size
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        counts.append([c.tolist() for c in model.exp_counts])
    return {"losses": losses, "counts": counts, "weights": global_weights(model)}


GPT = [(8, 2), (8, 2)]  # (num_experts, ep_size) per layer


def numerics(rank, world_size):
    ep1 = [(e, 1) for e, _ in GPT]
    out = {"reference": train_reference(GPT, rank, world_size)}
    for stage in (0, 1, 2):
        out[f"stage{stage} ep1"] = train_engine(ep1, stage, rank)
        out[f"stage{stage} ep2"] = train_engine(GPT, stage, rank)
    return out


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def gpt_runs():
    return spawn(numerics, world_size=2)


def _assert_same(run: dict, other: dict, weights_tol: float = TOL) -> None:
    assert max(abs(x - y) for x, y in zip(run["losses"], other["losses"], strict=True)) <= TOL
    assert _max_diff(run["weights"], other["weights"]) <= weights_tol
    assert run["counts"] == other["counts"]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_tiny_gpt_moe_ep2_equals_ep1_and_plain_torch(gpt_runs, stage):
    for got in gpt_runs:
        ep1, ep2, reference = got[f"stage{stage} ep1"], got[f"stage{stage} ep2"], got["reference"]
        assert len(ep2["weights"]) == len(reference["weights"])  # every expert of every layer, by global id
        assert sum(".deepspeed_experts.7." in name for name in ep2["weights"]) == 2 * 4  # 2 layers x 4 tensors
        _assert_same(ep2, ep1)
        _assert_same(ep2, reference)
        assert ep2["facts"]["has_moe_layers"] and ep2["facts"]["num_experts"] == [8, 8]
        assert ep2["facts"]["moe_layers"] == ep2["facts"]["gate_modules"] == 2
        # the experts in a group of their own (DeepSpeed's marks), split out automatically
        assert {"moe": True, "name": "ep_size_2"} in ep2["facts"]["groups"]
        assert {"moe": True, "name": "ep_size_1"} in ep1["facts"]["groups"]
        assert {"name": "dense-params"} in ep2["facts"]["groups"]  # DeepSpeed's name of the rest
    assert gpt_runs[0]["reference"]["losses"] != gpt_runs[1]["reference"]["losses"]  # each rank its own data


PYRAMID = [(4, 1), (8, 2)]


def variants(rank, world_size):
    out = {}
    for name, layers, residual in (("prmoe", GPT, True), ("pyramid", PYRAMID, False)):
        out[f"{name} ep"] = train_engine(layers, 2, rank, use_residual=residual)
        out[f"{name} ep1"] = train_engine([(e, 1) for e, _ in layers], 2, rank, use_residual=residual)
        out[f"{name} reference"] = train_reference(layers, rank, world_size, use_residual=residual)
    # the user's own split (DeepSpeed's way) and a client torch optimizer of one group train the same
    out["user groups"] = train_engine(GPT, 1, rank, groups_of=lambda model: (
        split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "dense"})))
    out["client optimizer"] = train_engine(GPT, 1, rank, optimizer=lambda p: torch.optim.AdamW(
        p, lr=LR, weight_decay=WEIGHT_DECAY))
    out["config stage 1"] = train_engine(GPT, 1, rank)
    return out


def client_optimizer_run(rank, world_size):
    model = build(GPT, rank)
    client = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    engine, optimizer, *_ = ds_all.initialize(model=model, optimizer=client, config=config(2, optimizer=None))
    assert optimizer is engine.optimizer and engine.optimizer.optimizer is client
    names = [g.get("name") for g in client.param_groups]
    losses = []
    for step in range(STEPS):
        step_seed(step, rank)
        loss = engine(batch(step, rank))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    weights = global_weights(model)
    engine.destroy()
    return {"names": names, "losses": losses, "weights": weights,
            "config": train_engine(GPT, 2, rank)}


def test_pr_moe_and_pyramid_train_as_at_ep_size_1():
    for got in spawn(variants, world_size=2):
        for name in ("prmoe", "pyramid"):
            # float32's summation order: at ep_size 2 an expert's weight gradient sums both ranks' tokens in one
            # product, at ep_size 1 each rank's then the all-reduce; AdamW scales the rounding of an expert's small
            # gradients up to ~2e-6 in 10 steps here (ep_size 1 equals the plain-torch loop bit for bit)
            _assert_same(got[f"{name} ep"], got[f"{name} ep1"], weights_tol=1e-5)
            _assert_same(got[f"{name} ep1"], got[f"{name} reference"], weights_tol=0.0)
            _assert_same(got[f"{name} ep"], got[f"{name} reference"], weights_tol=1e-5)
        assert got["pyramid ep"]["facts"]["num_experts"] == [4, 8]
        pyramid_groups = got["pyramid ep"]["facts"]["groups"]
        assert {"moe": True, "name": "ep_size_1"} in pyramid_groups and {"moe": True, "name": "ep_size_2"} in \
            pyramid_groups
        assert any("coefficient" in n for n in got["prmoe ep"]["weights"])  # PR-MoE's mixing coefficient trained
        _assert_same(got["user groups"], got["config stage 1"])
        assert got["user groups"]["facts"]["groups"] == [{"name": "dense"}, {"moe": True, "name": "ep_size_2"}]
        _assert_same(got["client optimizer"], got["config stage 1"])


def test_a_client_torch_optimizer_gets_the_expert_groups():
    for got in spawn(client_optimizer_run, world_size=2):
        assert got["names"] == [None, "ep_size_2"]  # its one group: the experts split out (DeepSpeed asserts)
        assert max(abs(x - y) for x, y in zip(got["losses"], got["config"]["losses"], strict=True)) <= TOL
        assert _max_diff(got["weights"], got["config"]["weights"]) <= TOL


def groups_and_timers(rank, world_size):
    from ds_all.utils import groups

    model = build(GPT, rank)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    log = logging.getLogger("ds_all")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    engine, *_ = ds_all.initialize(model=model, config=config(1, wall_clock_breakdown=True, steps_per_print=1))
    engine.backward(engine(batch(0, rank)))
    engine.step()
    engine.print_forward_breakdown(fwd_time=1.0)
    log.removeHandler(handler)
    layer = engine.moe_layers[0]
    out = {
        "ep_world": groups._get_expert_parallel_world_size("ep_size_2"),
        "ep_rank": groups._get_expert_parallel_rank("ep_size_2"),
        "ep_ranks": groups._get_expert_parallel_group_ranks("ep_size_2"),
        "edp_world": groups._get_expert_data_parallel_world_size("ep_size_2"),
        "edp_ranks": groups._get_expert_data_parallel_group_ranks("ep_size_2"),
        "max": (groups._get_max_expert_size(), groups._get_max_expert_size_name()),
        "names": sorted(groups._get_expert_parallel_group_dict()),
        "engine_groups": sorted(engine.expert_data_parallel_group),
        "same_group": groups._get_expert_parallel_group("ep_size_2") is layer.ep_group,
        "times": (layer.time_moe, layer.time_falltoall, layer.time_salltoall),
        "breakdown": [r for r in records if r.startswith("time (ms) | fwd: ") and "(fwd_moe: " in r],
    }
    engine.destroy()
    return out


def test_groups_functions_and_the_forward_breakdown_after_initialize():
    for rank, got in enumerate(spawn(groups_and_timers, world_size=2)):
        assert (got["ep_world"], got["ep_rank"], got["ep_ranks"]) == (2, rank, [0, 1])
        assert (got["edp_world"], got["edp_ranks"]) == (1, [rank])
        assert got["max"] == (2, "ep_size_2") and got["names"] == got["engine_groups"] == ["ep_size_2"]
        assert got["same_group"]
        assert all(t > 0 for t in got["times"])  # wall_clock_breakdown reached the layers
        if rank == 0:
            at_step, called = got["breakdown"]  # the engine's at steps_per_print, then the call's
            assert called.startswith("time (ms) | fwd: 1.00 (fwd_moe: ")
            for line in (at_step, called):
                assert "fwd_moe: 0.00," not in line and "1st_a2a: 0.00," not in line
        else:
            assert got["breakdown"] == []


def refusals(rank, world_size):
    def message(fn) -> str:
        try:
            fn()
        except (ValueError, NotImplementedError, RuntimeError) as e:
            return f"{type(e).__name__}: {e}"
        return "accepted"

    out = {
        "stage 3": message(lambda: ds_all.initialize(model=build(GPT, rank), config=config(3))),
        "ep_size 4 on 2 ranks": message(lambda: ds_all.initialize(model=build([(8, 4)], rank), config=config(1))),
        "num_experts % ep_size": message(lambda: MoE(D, nn.Linear(D, D), num_experts=3, ep_size=2)),
    }
    model = build(GPT, rank)
    client = torch.optim.AdamW(model.parameters(), lr=LR)
    schedule = torch.optim.lr_scheduler.LambdaLR(client, lambda step: 1.0)
    out["schedule over one group"] = message(lambda: ds_all.initialize(
        model=model, optimizer=client, lr_scheduler=schedule, config=config(1, optimizer=None)))
    torch.manual_seed(0)
    pipeline = ds_all.pipe.PipelineModule(layers=[nn.Linear(D, D), MoE(D, nn.Linear(D, D), num_experts=2, ep_size=2)],
                                          num_stages=1, loss_fn=lambda out, label: out[0].sum())
    out["pipeline"] = message(lambda: ds_all.initialize(model=pipeline, config=config(1)))
    grid = ds_comm.Grid(ds_comm.PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=1))
    out["model parallel"] = message(lambda: ds_all.initialize(model=build(GPT, rank), mpu=grid, config=config(1)))
    model = build(GPT, rank)
    mixed = [{"params": list(model.parameters()), "moe": True, "name": "ep_size_2"}]
    out["moe group with dense"] = message(lambda: ds_all.initialize(model=model, model_parameters=mixed,
                                                                    config=config(1)))
    return out


def test_what_is_not_built_or_wrong_is_refused_by_name():
    for got in spawn(refusals, world_size=2):
        assert got["stage 3"].startswith("NotImplementedError: initialize: a model with MoE layers")
        assert "zero_optimization.stage 3" in got["stage 3"]
        assert got["ep_size 4 on 2 ranks"].startswith("ValueError: ds_moe.groups: ep_size=4 does not divide the "
                                                      "world size 2")
        assert got["num_experts % ep_size"] == "ValueError: MoE: num_experts (3) must be divisible by ep_size (2)"
        assert got["schedule over one group"].startswith("ValueError: initialize: the lr_scheduler was built over "
                                                         "the optimizer's 1 parameter group(s)")
        assert got["pipeline"].startswith("NotImplementedError: initialize: a PipelineModule with MoE layers")
        assert got["model parallel"].startswith("NotImplementedError: initialize: MoE layers (ds_moe.MoE) with model "
                                                "parallelism (the mpu's data-parallel world size is 1 of 2 ranks)")
        assert got["moe group with dense"].startswith("ValueError: initialize: parameter group 0 is marked 'moe'")


MODULES = [("ds_all.moe.layer", "MoE", ds_moe.MoE), ("ds_all.moe.experts", "Experts", ds_moe.Experts),
           ("ds_all.moe.sharded_moe", "TopKGate", ds_moe.TopKGate),
           ("ds_all.moe.sharded_moe", "MOELayer", ds_moe.MOELayer),
           ("ds_all.moe.sharded_moe", "top1gating", ds_moe.top1gating),
           ("ds_all.moe.sharded_moe", "top2gating", ds_moe.top2gating),
           ("ds_all.moe.sharded_moe", "topkgating", ds_moe.topkgating),
           ("ds_all.moe.utils", "is_moe_param", ds_moe.is_moe_param),
           ("ds_all.moe.utils", "has_moe_layers", ds_moe.has_moe_layers),
           ("ds_all.moe.utils", "split_params_into_different_moe_groups_for_optimizer",
            ds_moe.split_params_into_different_moe_groups_for_optimizer),
           ("ds_all.moe.utils", "configure_moe_param_groups", ds_moe.configure_moe_param_groups),
           ("ds_all.moe.utils", "is_moe_param_group", ds_moe.is_moe_param_group),
           ("ds_all.moe.utils", "split_params_into_shared_and_expert_params",
            ds_moe.split_params_into_shared_and_expert_params),
           ("ds_all.moe.utils", "split_params_grads_into_shared_and_expert_params",
            ds_moe.split_params_grads_into_shared_and_expert_params),
           ("ds_all.utils.groups", "_create_expert_and_data_parallel", ds_moe.groups._create_expert_and_data_parallel),
           ("ds_all.utils.groups", "_get_expert_data_parallel_group", ds_moe.groups._get_expert_data_parallel_group)]


@pytest.mark.parametrize("path, name, owner", MODULES, ids=[f"{p}.{n}" for p, n, _ in MODULES])
def test_deepspeed_moe_module_tree(path, name, owner):
    # DeepSpeed's "from deepspeed.moe.layer import MoE" with deepspeed -> ds_all: ds-moe's own object
    assert getattr(importlib.import_module(path), name) is owner


def initialize_twice(rank, world_size):
    ds_comm.destroy_process_group()  # initialize makes (and destroy frees) its own group, and its expert groups
    losses = []
    for _ in range(2):  # both groups on the harness's MASTER_PORT, as a user's loop has it
        model = build(GPT, rank)
        engine, *_ = ds_all.initialize(model=model, config=config(1))
        step_seed(0, rank)
        loss = engine(batch(0, rank))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        engine.destroy()
    return losses, ds_comm.is_initialized()


def test_a_second_initialize_after_destroy_makes_new_expert_groups():
    for losses, initialized in spawn(initialize_twice, world_size=2):
        assert losses[0] == losses[1] and not initialized
