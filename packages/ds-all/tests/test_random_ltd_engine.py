"""Random-LTD through the engine (``data_efficiency.data_routing.random_ltd``): a tiny GPT whose blocks
`ds_data.convert_to_random_ltd` wrapped trains on 2 ranks; the chosen blocks run on the schedule's number of
tokens at every step (DeepSpeed's fixed_linear, written out here), the others and evaluation on all of them;
the schedule's state is in checkpoints; the parts of data_efficiency not wired are refused by key."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ds_all
from ds_all import Config
from ds_comm.testing import spawn
from ds_data import RandomLayerTokenDrop, convert_to_random_ltd

SEQ, VOCAB, WIDTH, LAYERS = 16, 8, 16, 4
LOW, HIGH, REQUIRE, STEP = 4, SEQ, 6, 4
IDS = [1, 2]
GAS, SAVE_AT, STEPS = 2, 3, 8


def _config(**extra):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS, "steps_per_print": 100,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
            "data_efficiency": {"enabled": True, "data_routing": {"enabled": True, "random_ltd": {
                "enabled": True, "total_layer_num": LAYERS, "random_ltd_layer_num": len(IDS),
                "random_ltd_layer_id": IDS, "model_mask_name": "attention_mask", "model_type": "decoder",
                "hidden_state_order": "batch_seq_dim",
                "random_ltd_schedule": {"min_value": LOW, "max_value": HIGH, "schedule_type": "fixed_linear",
                                        "schedule_config": {"require_steps": REQUIRE, "seq_per_step": STEP}}}}},
            **extra}


def expected_length(global_steps: int) -> int:
    """DeepSpeed: the forward prologue calls update_seq(global_steps); fixed_linear, latched at max_value."""
    current = LOW
    for g in range(global_steps + 1):
        if current < HIGH:
            v = math.floor(float(g) / REQUIRE * (HIGH - LOW) + LOW)
            current = min(v - v % STEP, HIGH)
    return current


class Block(nn.Module):
    """A pre-LN causal self-attention block; records the sequence length it ran on."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
        self.lengths: list[int] = []

    def forward(self, x, attention_mask=None):
        self.lengths.append(x.shape[1])
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        attended = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], attn_mask=attention_mask)
        x = x + self.proj(attended[:, 0])
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        s = ids.shape[1]
        mask = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()[None, None]  # [1, 1, s, s]
        x = self.embed(ids) + self.pos(torch.arange(s, device=ids.device))
        for block in self.blocks:
            x = block(x, attention_mask=mask)
        logits = self.head(x)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def _batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    start = torch.randint(0, VOCAB, (2, 1), generator=g)
    return (start + torch.arange(SEQ)) % VOCAB  # a learnable sequence: each token the previous + 1


def _blocks(engine):
    return [b.random_ltd_layer if isinstance(b, RandomLayerTokenDrop) else b for b in engine.module.blocks]


def _train(engine, rank: int, until: int) -> tuple[list, list]:
    """(global_steps at each forward, the lengths each block ran on), and the losses."""
    seen, losses = [], []
    while engine.global_steps < until:
        before = engine.global_steps
        loss = engine(_batch(engine.micro_steps, rank))
        seen.append((before, [block.lengths[-1] for block in _blocks(engine)]))
        losses.append(float(loss))
        engine.backward(loss)
        engine.step()
    return seen, losses


def first_run(rank, world_size, path):
    model = convert_to_random_ltd(TinyGPT(), Block)  # converted before initialize
    engine, *_ = ds_all.initialize(model=model, config=_config())
    assert engine.random_ltd_enabled() and engine.random_ltd_scheduler.get_current_seq() == LOW
    assert engine.random_ltd_config()["random_ltd_layer_id"] == IDS
    seen, losses = _train(engine, rank, SAVE_AT)
    engine.save_checkpoint(path)
    saved = engine.random_ltd_scheduler.state_dict()
    seen_after, losses_after = _train(engine, rank, STEPS)
    engine.eval()
    engine(_batch(0, rank))
    evaluated = [block.lengths[-1] for block in _blocks(engine)]
    engine.destroy()
    return seen + seen_after, saved, evaluated, losses + losses_after


def resumed_run(rank, world_size, path):
    engine, *_ = ds_all.initialize(model=TinyGPT(), config=_config())
    convert_to_random_ltd(engine, Block)  # DeepSpeed's order: convert the engine's model after initialize
    engine.load_checkpoint(path)
    restored = engine.random_ltd_scheduler.state_dict()
    seen, _ = _train(engine, rank, STEPS)
    engine.destroy()
    return restored, seen


def test_the_chosen_blocks_follow_the_schedule_on_two_ranks_and_a_checkpoint_restores_it(tmp_path):
    path = str(tmp_path / "ck")
    first = spawn(first_run, world_size=2, args=(path,))
    second = spawn(resumed_run, world_size=2, args=(path,))
    for (seen, saved, evaluated, losses), (restored, resumed) in zip(first, second, strict=True):
        assert len(seen) == STEPS * GAS
        for global_steps, lengths in seen:
            kept = expected_length(global_steps)
            assert lengths == [SEQ if i not in IDS else kept for i in range(LAYERS)], global_steps
        assert [lengths[1] for _, lengths in seen][::GAS] == [4, 4, 8, 8, 12, 12, 16, 16]
        assert evaluated == [SEQ] * LAYERS
        assert saved["current_value"] == expected_length(SAVE_AT - 1) and saved["current_steps"] == SAVE_AT - 1
        assert restored == saved
        assert resumed == seen[SAVE_AT * GAS:]
        assert all(math.isfinite(x) for x in losses) and sum(losses[-GAS:]) < sum(losses[:GAS])


def refusals(rank, world_size):
    out = {}
    config = _config()
    config["data_efficiency"]["data_routing"]["random_ltd"]["random_ltd_layer_id"] = [1, 3]
    model = convert_to_random_ltd(TinyGPT(), Block, layer_ids=[0, 1, 2])  # three wrappers: id 3 is not one
    try:
        ds_all.initialize(model=model, config=config)
    except ValueError as e:
        out["ids"] = str(e)
    engine, *_ = ds_all.initialize(model=TinyGPT(), config={k: v for k, v in _config().items()
                                                             if k != "data_efficiency"})
    out["off"] = (engine.random_ltd_enabled(), engine.random_ltd_scheduler, engine.data_efficiency_enabled())
    try:
        engine.random_ltd_initialize()
    except RuntimeError as e:
        out["initialize_off"] = str(e)
    engine.destroy()
    return out


def test_layer_ids_must_name_wrapped_layers_and_random_ltd_off_is_refused_by_name():
    for out in spawn(refusals, world_size=2):
        assert "random_ltd_layer_id [1, 3] out of range: the model has 3 random-LTD layers" in out["ids"]
        assert out["off"] == (False, None, False)
        assert "random-LTD is off" in out["initialize_off"]


def test_the_section_loads_in_the_whole_config_and_bad_values_are_named():
    config = Config.load({"train_batch_size": 4, **{k: v for k, v in _config().items() if k not in (
        "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")}})
    assert config.data_efficiency.data_routing.random_ltd.random_ltd_layer_id == IDS
    assert not Config.load({"train_batch_size": 4}).data_efficiency.data_routing.random_ltd.enabled
    bad = _config()
    bad["data_efficiency"]["data_routing"]["random_ltd"]["random_ltd_schedule"]["min_value"] = 32
    with pytest.raises(ValueError, match=r"data_efficiency\.data_routing\.random_ltd\.random_ltd_schedule\.min_value "
                                         r"32 is above max_value 16"):
        Config.load(bad)
    bad = _config()
    bad["data_efficiency"]["data_routing"]["random_ltd"]["random_ltd_layers"] = [1]
    with pytest.raises(ValueError, match=r"data_efficiency\.data_routing\.random_ltd\.random_ltd_layers: unknown key"):
        Config.load(bad)
