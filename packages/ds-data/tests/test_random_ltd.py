"""Random-LTD: the layer wrapper against the plain layer (every token kept: exactly; tokens dropped: dropped
positions are the inputs, kept positions the layer applied to the kept tokens alone, gathered independently
here), for both hidden-state orders and both mask shapes; the conversion of a model; the kept-length schedule
against DeepSpeed's formula at every step."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_data import RandomLayerTokenDrop, RandomLTDScheduler, convert_to_random_ltd

B, S, H, KEPT = 3, 12, 8, 5


class Block(nn.Module):
    """A pre-LN self-attention + MLP block with position ids and an attention mask as keywords: a 4-D additive
    mask [b, 1, s, s] or a 2-D [b, s] key mask (1 keep, 0 pad). ``seq_first``: hidden states [s, b, h]."""

    def __init__(self, seq_first: bool = False) -> None:
        super().__init__()
        self.seq_first = seq_first
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.qkv, self.proj = nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.mlp = nn.Sequential(nn.Linear(H, 2 * H), nn.GELU(), nn.Linear(2 * H, H))
        self.pos = nn.Embedding(64, H)

    def forward(self, x, attention_mask=None, position_ids=None):
        if self.seq_first:
            x = x.transpose(0, 1)
        if position_ids is not None:
            x = x + self.pos(position_ids)
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(H)
        if attention_mask is not None:
            if attention_mask.dim() == 2:
                scores = scores.masked_fill(attention_mask[:, None, :] == 0, -1e9)
            else:
                scores = scores + attention_mask[:, 0]
        x = x + self.proj(scores.softmax(-1) @ v)
        x = x + self.mlp(self.ln2(x))
        return x.transpose(0, 1) if self.seq_first else x


def _inputs(seed: int = 0, mask: str = "4d"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, H, generator=g)
    if mask == "4d":
        causal = torch.full((S, S), -1e9).triu(1)
        pad = torch.zeros(B, S)
        pad[0, -3:] = -1e9  # sample 0 pads its last three keys: a mask that is not just causal
        m = causal[None, None] + pad[:, None, None, :]
    else:
        m = torch.ones(B, S, dtype=torch.long)
        m[1, -4:] = 0
    positions = torch.arange(S).expand(B, S).contiguous() + 3
    return x, m, positions


def _wrapped(seq_first: bool, seed: int = 1):
    torch.manual_seed(seed)
    block = Block(seq_first)
    order = "seq_batch_dim" if seq_first else "batch_seq_dim"
    wrapper = RandomLayerTokenDrop(block, hidden_state_order=order, mask_name="attention_mask",
                                   generator=torch.Generator().manual_seed(7))
    return block, wrapper


@pytest.mark.parametrize("seq_first", [False, True])
@pytest.mark.parametrize("length", [None, S, S + 4])
def test_every_token_kept_is_the_plain_layer_exactly(seq_first, length):
    block, wrapper = _wrapped(seq_first)
    wrapper.reserved_length = length
    x, m, p = _inputs()
    x = x.transpose(0, 1).contiguous() if seq_first else x
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    plain = block(x1, attention_mask=m, position_ids=p)
    grads_plain = torch.autograd.grad(plain.square().sum(), [x1, *block.parameters()])
    out = wrapper(x2, attention_mask=m, position_ids=p)
    grads = torch.autograd.grad(out.square().sum(), [x2, *block.parameters()])
    assert torch.equal(out, plain)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_plain, strict=True))


@pytest.mark.parametrize("seq_first", [False, True])
@pytest.mark.parametrize("mask", ["4d", "2d"])
def test_dropped_tokens_pass_unchanged_and_kept_tokens_see_only_the_kept_tokens(seq_first, mask):
    block, wrapper = _wrapped(seq_first)
    wrapper.reserved_length = KEPT
    x, m, p = _inputs(mask=mask)
    hidden = x.transpose(0, 1).contiguous() if seq_first else x
    out = wrapper(hidden, attention_mask=m, position_ids=p)
    out = out.transpose(0, 1) if seq_first else out  # [b, s, h] from here on
    idx = wrapper.last_indices
    assert idx.shape == (B, KEPT) and idx.dtype == torch.int64
    for row in idx:  # distinct, sorted, in range
        assert row.tolist() == sorted(set(row.tolist())) and row.min() >= 0 and row.max() < S
    assert len({tuple(r) for r in idx.tolist()}) > 1  # each sample draws its own subset

    # the reference: plain advanced indexing of the same indices, the layer on the kept tokens alone
    rows = torch.arange(B)[:, None]
    x_kept = x[rows, idx]
    m_kept = m[rows[:, :, None], 0, idx[:, :, None], idx[:, None, :]][:, None] if mask == "4d" else m[rows, idx]
    p_kept = p[rows, idx]
    with torch.no_grad():
        ref = block(x_kept.transpose(0, 1).contiguous() if seq_first else x_kept, attention_mask=m_kept, position_ids=p_kept)
    ref = ref.transpose(0, 1) if seq_first else ref
    dropped = torch.ones(B, S, dtype=torch.bool)
    dropped[rows, idx] = False
    assert torch.equal(out[dropped], x[dropped])
    assert torch.equal(out[rows, idx].detach(), ref)


def test_gradients_pass_dropped_tokens_through_and_reach_the_layer():
    block, wrapper = _wrapped(False)
    wrapper.reserved_length = KEPT
    x, m, p = _inputs()
    x.requires_grad_()
    weight = torch.randn(B, S, H, generator=torch.Generator().manual_seed(3))
    (wrapper(x, attention_mask=m, position_ids=p) * weight).sum().backward()
    idx = wrapper.last_indices
    dropped = torch.ones(B, S, dtype=torch.bool)
    dropped[torch.arange(B)[:, None], idx] = False
    assert torch.equal(x.grad[dropped], weight[dropped])
    assert all(param.grad is not None and param.grad.abs().sum() > 0 for param in block.parameters()
               if param is not block.pos.weight)


def test_evaluation_and_a_shared_mask_and_tuple_outputs():
    block, wrapper = _wrapped(False)
    wrapper.reserved_length = KEPT
    x, m, p = _inputs()
    wrapper.eval()
    assert torch.equal(wrapper(x, attention_mask=m, position_ids=p), block(x, attention_mask=m, position_ids=p))
    wrapper.train()
    shared = torch.full((S, S), -1e9).triu(1)[None, None]  # [1, 1, s, s]: broadcast over the batch
    out = wrapper(x, attention_mask=shared, position_ids=torch.arange(S))  # [s] position ids
    idx = wrapper.last_indices
    rows = torch.arange(B)[:, None]
    with torch.no_grad():
        ref = block(x[rows, idx], attention_mask=shared[0, 0][idx[:, :, None], idx[:, None, :]][:, None],
                    position_ids=idx)
    assert torch.equal(out[rows, idx].detach(), ref)

    class Pair(nn.Module):
        def forward(self, x):
            return 2 * x, "extra"

    pair = RandomLayerTokenDrop(Pair(), generator=torch.Generator().manual_seed(0))
    pair.reserved_length = KEPT
    full, extra = pair(x)
    kept = torch.zeros(B, S, dtype=torch.bool)
    kept[rows, pair.last_indices] = True
    assert extra == "extra" and torch.equal(full[kept], 2 * x[kept]) and torch.equal(full[~kept], x[~kept])


def test_draws_repeat_with_the_seed_and_bad_values_are_named():
    a, b = (RandomLayerTokenDrop(nn.Identity(), generator=torch.Generator().manual_seed(5)) for _ in range(2))
    a.reserved_length = b.reserved_length = KEPT
    x = torch.randn(B, S, H)
    a(x), b(x)
    assert torch.equal(a.last_indices, b.last_indices)
    with pytest.raises(ValueError, match="reserved_length must be a positive integer"):
        a.reserved_length = 0
    with pytest.raises(ValueError, match="hidden_state_order must be one of 'batch_seq_dim', 'seq_batch_dim'"):
        RandomLayerTokenDrop(nn.Identity(), hidden_state_order="bsh")
    with pytest.raises(ValueError, match=r"attention mask must be .* got \(3, 7\)"):
        w = RandomLayerTokenDrop(nn.Identity(), mask_name="m")
        w.reserved_length = 2
        w(x, m=torch.ones(3, 7))


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(H, H)
        self.layers = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(H, 1)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_convert_wraps_the_layers_of_a_type_and_keeps_the_model_while_every_token_is_kept():
    torch.manual_seed(0)
    model = Tiny()
    x = torch.randn(B, S, H)
    before = model(x)
    assert convert_to_random_ltd(model, Block) is model
    assert all(isinstance(layer, RandomLayerTokenDrop) for layer in model.layers)
    assert torch.equal(model(x), before)
    assert "layers.0.random_ltd_layer.qkv.weight" in model.state_dict()
    partial = convert_to_random_ltd(Tiny(), Block, layer_ids=[1, 3])
    assert [isinstance(layer, RandomLayerTokenDrop) for layer in partial.layers] == [False, True, False, True]
    with pytest.raises(ValueError, match=r"layer_ids \[4\] out of range: the model has 4 such modules"):
        convert_to_random_ltd(Tiny(), Block, layer_ids=[0, 4])
    with pytest.raises(ValueError, match=r"has no .*Conv1d"):
        convert_to_random_ltd(Tiny(), nn.Conv1d)
    with pytest.raises(ValueError, match="convert_type must be a class"):
        convert_to_random_ltd(Tiny(), "Block")
    with pytest.raises(ValueError, match="has no"):  # already converted: nothing left to wrap
        convert_to_random_ltd(model, Block)


def _config(low=16, high=128, require=10, step=8, total=4, ids=(1, 2)):
    return {"enabled": True, "total_layer_num": total, "random_ltd_layer_num": len(ids),
            "random_ltd_layer_id": list(ids), "model_mask_name": "attention_mask", "model_type": "decoder",
            "hidden_state_order": "batch_seq_dim",
            "random_ltd_schedule": {"min_value": low, "max_value": high, "schedule_type": "fixed_linear",
                                    "schedule_config": {"require_steps": require, "seq_per_step": step}}}


@pytest.mark.parametrize("low,high,require,step", [(16, 128, 10, 8), (128, 2048, 37, 16), (5, 23, 7, 3),
                                                   (29, 100, 100, 1), (64, 64, 5, 8)])
def test_the_schedule_is_deepspeeds_formula_at_every_step(low, high, require, step):
    gbs, total, n = 6, 4, 2
    scheduler = RandomLTDScheduler(_config(low, high, require, step), global_batch_size=gbs)
    assert scheduler.get_current_seq() == low and scheduler.state_dict()["current_steps"] == -1
    current, consumed = low, 0
    for g in range(require + 6):
        if current < high:  # DeepSpeed: moves only below max_value
            v = math.floor((float(g) / require) * (high - low) + low)
            current = min(v - v % step, high)
        consumed += gbs * (current * n + high * (total - n))
        assert scheduler.update_seq(g) == current == scheduler.get_current_seq(), g
        assert scheduler.update_seq(g) == current  # the same step again: counted once
        assert scheduler.state_dict() == {"consumed_layer_tokens": consumed, "current_steps": g,
                                          "current_value": current, "min_value": low, "max_value": high}
    assert current == high


def test_scheduler_state_round_trips_and_bad_values_are_named():
    a = RandomLTDScheduler(_config(), global_batch_size=2)
    for g in range(4):
        a.update_seq(g)
    b = RandomLTDScheduler({**_config(), "global_batch_size": 2, "micro_batch_size": 1})  # DeepSpeed's dict
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict() and b.update_seq(4) == a.update_seq(4)
    assert b.get_total_layer_tokens(3) == b.state_dict()["consumed_layer_tokens"]
    with pytest.raises(ValueError, match="a RandomLTDScheduler state has the keys"):
        b.load_state_dict({"current_value": 3})
    with pytest.raises(ValueError, match="min_value 200 is above max_value 128"):
        RandomLTDScheduler(_config(low=200))
    with pytest.raises(ValueError, match="schedule_type must be one of 'fixed_linear', got 'fixed_root'"):
        RandomLTDScheduler({**_config(), "random_ltd_schedule": {**_config()["random_ltd_schedule"],
                                                                  "schedule_type": "fixed_root"}})
    with pytest.raises(ValueError, match=r"random_ltd_layer_id \[4\] out of range"):
        RandomLTDScheduler(_config(ids=(1, 4)))
    with pytest.raises(ValueError, match="global_batch_size must be a positive integer"):
        RandomLTDScheduler(_config(), global_batch_size=0)
    with pytest.raises(NotImplementedError, match="layer_token_lr_schedule"):
        RandomLTDScheduler({**_config(), "layer_token_lr_schedule": {"enabled": True}})


def test_sdpa_style_boolean_mask_is_gathered():
    """A boolean [b, 1, s, s] mask (True: attend), as scaled_dot_product_attention takes it."""

    class Attend(nn.Module):
        def forward(self, x, attention_mask=None):
            return F.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None], attn_mask=attention_mask)[:, 0]

    wrapper = RandomLayerTokenDrop(Attend(), mask_name="attention_mask", generator=torch.Generator().manual_seed(2))
    wrapper.reserved_length = KEPT
    x = torch.randn(B, S, H)
    mask = torch.ones(S, S, dtype=torch.bool).tril()[None, None].expand(B, 1, S, S).clone()
    mask[2, :, :, 0] = False
    mask[2, :, 0, 0] = True
    out = wrapper(x, attention_mask=mask)
    idx, rows = wrapper.last_indices, torch.arange(B)[:, None]
    ref = Attend()(x[rows, idx], attention_mask=mask[rows[:, :, None], 0, idx[:, :, None], idx[:, None, :]][:, None])
    assert torch.equal(out[rows, idx], ref)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("generator", ["cuda", "cpu"])
def test_on_the_gpu_dropped_tokens_pass_and_kept_tokens_match_the_layer_on_them(generator):
    torch.manual_seed(1)
    block = Block().cuda()
    gen = torch.Generator(device=generator).manual_seed(3)
    wrapper = RandomLayerTokenDrop(block, mask_name="attention_mask", generator=gen)
    wrapper.reserved_length = KEPT
    x, m, p = (t.cuda() for t in _inputs())
    x.requires_grad_()
    out = wrapper(x, attention_mask=m, position_ids=p)
    out.sum().backward()
    idx = wrapper.last_indices
    assert idx.device == x.device
    rows = torch.arange(B, device="cuda")[:, None]
    with torch.no_grad():
        ref = block(x[rows, idx], attention_mask=m[rows[:, :, None], 0, idx[:, :, None], idx[:, None, :]][:, None],
                    position_ids=p[rows, idx])
    dropped = torch.ones(B, S, dtype=torch.bool, device="cuda")
    dropped[rows, idx] = False
    assert torch.equal(out[dropped], x[dropped]) and torch.equal(x.grad[dropped], torch.ones_like(x.grad[dropped]))
    torch.testing.assert_close(out[rows, idx].detach(), ref)
