"""A checkpoint the engine wrote at main 67798cc loads bit for bit and trains on identically.

``fixtures/engine_checkpoint/`` holds a checkpoint of 2 ranks written by ``DeepSpeedEngine.save_checkpoint`` at
main 67798cc (before the engine was split into parts, issue 44), with every stateful feature a tiny run can turn
on at once: ZeRO stage 2 with gradient clipping, a ``WarmupDecayLR`` schedule, the legacy ``curriculum_learning``
(seqlen) and ``progressive_layer_drop``, random-LTD over two of three wrapped blocks, the data-efficiency data
sampler (``training_data`` with a curriculum metric: its position, difficulty and draws), an MoE layer of 2
experts at ep_size 2 (each rank's expert by global id), and a client state of JSON values and a tensor. Beside
it, ``expected_rank<r>.pt`` holds what the saving rank held at the save (whole parameters, fp32 masters, Adam
moments and steps, the counters, the schedule's, curriculum's, PLD's, random-LTD's and the data sampler's
states, the client state) and what it went on to compute (the losses of ``CONTINUE`` more optimizer steps and the
parameters after them).

The test loads the checkpoint into engines built from a model initialised otherwise, compares every value
element for element (and type for type), then trains on and compares the losses and parameters with the
saving run's, bit for bit. The fixture is data: never write it again with newer code
(``fixtures/engine_checkpoint/write_fixture.py`` is how it was made, kept to show what it holds).
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import ds_all
import ds_data
from ds_all.moe.layer import MoE
from ds_comm.testing import spawn
from ds_data import convert_to_random_ltd
from ds_zero import safe_get_full_fp32_param, safe_get_full_optimizer_state

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "engine_checkpoint")
TAG = "global_step3"
N, SEQ, VOCAB, WIDTH, LAYERS = 64, 8, 8, 8, 3
MICRO, GAS = 2, 2
SAVE_AT, CONTINUE = 3, 3  # optimizer steps before the save, and after it
LTD_IDS = [0, 2]


def _config(index: str) -> dict:
    metric = {"index_to_sample_path": f"{index}/seqlen/seqlen_index_to_sample",
              "index_to_metric_path": f"{index}/seqlen/seqlen_index_to_metric",
              "difficulty_type": "value", "clustering_type": "schedule_based", "min_difficulty": 2,
              "max_difficulty": SEQ, "schedule_type": "fixed_linear",
              "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 2}}
    return {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "steps_per_print": 100,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                          "warmup_num_steps": 2, "total_num_steps": 20}},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 200},
        "curriculum_learning": {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 4,
                                "max_difficulty": SEQ, "schedule_type": "fixed_linear",
                                "schedule_config": {"total_curriculum_step": 5, "difficulty_step": 2}},
        "progressive_layer_drop": {"enabled": True, "theta": 0.5, "gamma": 0.1},
        "data_efficiency": {
            "enabled": True, "seed": 1234,
            "data_sampling": {"enabled": True, "num_epochs": 2, "num_workers": 0, "curriculum_learning": {
                "enabled": True, "data_cluster_path": f"{index}/clusters", "curriculum_metrics": {"seqlen": metric}}},
            "data_routing": {"enabled": True, "random_ltd": {
                "enabled": True, "total_layer_num": LAYERS, "random_ltd_layer_num": len(LTD_IDS),
                "random_ltd_layer_id": LTD_IDS, "model_mask_name": "attention_mask", "model_type": "decoder",
                "hidden_state_order": "batch_seq_dim",
                "random_ltd_schedule": {"min_value": 2, "max_value": SEQ, "schedule_type": "fixed_linear",
                                        "schedule_config": {"require_steps": 6, "seq_per_step": 2}}}}},
    }


def length(i: int) -> int:
    return 2 + (i * 5) % (SEQ - 1)


class Sequences(torch.utils.data.Dataset):
    """Sample ``i``: ``length(i)`` tokens in [1, VOCAB), then padding 0."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        tokens = torch.zeros(SEQ, dtype=torch.long)
        tokens[:length(i)] = 1 + (i + torch.arange(length(i))) % (VOCAB - 1)
        return {"index": torch.tensor(i), "tokens": tokens}


def seqlen_metric(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (batch["tokens"] != 0).sum(dim=1).to(torch.int64)


def build_index(root: str) -> str:
    """The data sampler's index of the ``seqlen`` metric (deterministic: the same files every time)."""
    analyzer = ds_data.DataAnalyzer(Sequences(), ["seqlen"], [seqlen_metric], ["single_value_per_sample"],
                                    [np.int64], root, batch_size=8)
    analyzer.run_map()
    analyzer.run_reduce()
    return root


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x, attention_mask=None):
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        attended = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], attn_mask=attention_mask)
        x = x + self.proj(attended[:, 0])
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """Blocks (random-LTD wraps them), an MoE layer, and DeepSpeed's keyword arguments used: the sequence cut at
    ``curriculum_seqlen``, the residual stream scaled by PLD's ``pld_theta``."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        expert = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
        self.moe = MoE(hidden_size=WIDTH, expert=expert, num_experts=2, ep_size=2, k=1)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens, curriculum_seqlen=None, progressive_layer_drop=None, pld_theta=None):
        if curriculum_seqlen is not None:
            tokens = tokens[:, :curriculum_seqlen]
        s = tokens.shape[1]
        mask = torch.ones(s, s, dtype=torch.bool).tril()[None, None]
        x = self.embed(tokens) + self.pos(torch.arange(s))
        for block in self.blocks:
            x = block(x, attention_mask=mask)
        if progressive_layer_drop:
            x = x * (0.5 + 0.5 * pld_theta)
        out, l_aux, _ = self.moe(x)
        logits = self.head(x + out)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1), ignore_index=0)
        return loss + 0.01 * l_aux


def build(seed: int, index: str):
    model = TinyLM(seed)
    engine, _, loader, _ = ds_all.initialize(model=model, config=_config(index), training_data=Sequences())
    convert_to_random_ltd(engine, Block)
    return engine, loader


def train(engine, batches, steps: int) -> list[float]:
    """``steps`` optimizer steps; the loss of each micro-step."""
    losses = []
    until = engine.global_steps + steps
    while engine.global_steps < until:
        loss = engine(next(batches)["tokens"])
        losses.append(loss.item())
        engine.backward(loss)
        engine.step()
    return losses


def values(engine) -> dict:
    """What the rank holds now: tensors by name (whole parameters, fp32 masters, Adam moments) and the plain
    state of every stateful feature."""
    module, zero = engine.module, engine.optimizer
    out: dict = {f"param/{n}": p.detach().clone() for n, p in module.named_parameters()}
    for name, p in module.named_parameters():
        out[f"master/{name}"] = safe_get_full_fp32_param(p)
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{key}/{name}"] = safe_get_full_optimizer_state(p, key)
    out["adam_steps"] = sorted({float(s["step"]) for s in zero.optimizer.state.values()})
    out["lr"] = engine.get_lr()
    out["counters"] = {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                       "micro_steps": engine.micro_steps, "skipped_steps": engine.skipped_steps}
    out["lr_scheduler"] = engine.lr_scheduler.state_dict()
    out["curriculum_learning"] = engine.curriculum_scheduler_legacy.state_dict()
    out["progressive_layer_drop"] = engine.progressive_layer_drop.state_dict()
    out["random_ltd"] = engine.random_ltd_scheduler.state_dict()
    out["data_sampler"] = engine.training_dataloader.data_sampler.state_dict()
    out["rng"] = torch.get_rng_state()
    return out


def save_run(rank: int, world_size: int, index: str, path: str) -> None:
    engine, loader = build(0, index)
    batches = iter(loader)
    train(engine, batches, SAVE_AT)
    client_state = {"epoch": 1, "note": "fixture", "nested": {"a": [1, 2.5]}, "tensor": torch.arange(4.0) * 0.5}
    engine.save_checkpoint(path, client_state=client_state)
    expected = values(engine)
    expected["client_state"] = {**client_state, "tensor": client_state["tensor"]}
    expected["continued_losses"] = train(engine, batches, CONTINUE)
    expected["continued"] = {k: v for k, v in values(engine).items() if k.startswith(("param/", "master/"))}
    torch.save(expected, os.path.join(path, f"expected_rank{rank}.pt"))
    engine.destroy()


def write_fixture(index_root: str) -> None:
    """How the fixture was made (main 67798cc): ``fixtures/engine_checkpoint/write_fixture.py``."""
    for name in os.listdir(FIXTURE):  # all but the script
        if name != "write_fixture.py":
            target = os.path.join(FIXTURE, name)
            shutil.rmtree(target) if os.path.isdir(target) else os.remove(target)
    spawn(save_run, world_size=2, args=(build_index(index_root), FIXTURE), timeout=600)


def _differences(expected: dict, loaded: dict, prefix: str = "") -> list[str]:
    wrong = []
    for key in sorted(set(expected) | set(loaded)):
        a, b = expected.get(key), loaded.get(key)
        if key not in loaded or key not in expected:
            wrong.append(f"{prefix}{key}: missing")
        elif torch.is_tensor(a) or torch.is_tensor(b):
            if not (torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)):
                wrong.append(f"{prefix}{key}")
        elif isinstance(a, dict) and isinstance(b, dict):
            wrong += _differences(a, b, f"{prefix}{key}/")
        elif type(a) is not type(b) or a != b:
            wrong.append(f"{prefix}{key}: saved {a!r}, loaded {b!r}")
    return wrong


def load_run(rank: int, world_size: int, index: str) -> list[str]:
    engine, loader = build(1, index)  # other weights: everything must come from the checkpoint
    expected = torch.load(os.path.join(FIXTURE, f"expected_rank{rank}.pt"), weights_only=True)
    path, client_state = engine.load_checkpoint(FIXTURE)
    wrong = [] if path == os.path.join(FIXTURE, TAG) else [f"path {path}"]
    loaded = values(engine)
    loaded["client_state"] = client_state
    wrong += _differences({k: v for k, v in expected.items() if not k.startswith("continued")}, loaded)
    losses = train(engine, iter(loader), CONTINUE)
    if losses != expected["continued_losses"]:
        wrong.append(f"continued losses: saving run {expected['continued_losses']}, loaded {losses}")
    after = {k: v for k, v in values(engine).items() if k.startswith(("param/", "master/"))}
    wrong += _differences(expected["continued"], after, "continued/")
    engine.destroy()
    return wrong


def test_a_checkpoint_of_main_67798cc_loads_bit_for_bit_and_trains_on_identically(tmp_path):
    index = build_index(str(tmp_path / "index"))
    for rank, wrong in enumerate(spawn(load_run, world_size=2, args=(index,), timeout=300)):
        assert wrong == [], f"rank {rank}"


def test_the_fixture_is_small_and_complete():
    files = {os.path.relpath(os.path.join(root, f), FIXTURE): os.path.getsize(os.path.join(root, f))
             for root, _, names in os.walk(FIXTURE) for f in names}
    assert {"latest", f"{TAG}/engine_meta.json", f"{TAG}/zero_meta.json", f"{TAG}/.metadata",
            "expected_rank0.pt", "expected_rank1.pt", "write_fixture.py"} <= set(files)
    assert sum(files.values()) < 600_000

