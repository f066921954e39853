"""Whole models against counts computed by hand, and against torch's own FlopCounterMode."""

from __future__ import annotations

import json

import pytest
import torch
from _models import (
    GPT,
    MLP,
    ConvNet,
    LSTMClassifier,
    convnet_counts,
    count,
    gpt_block_counts,
    gpt_counts,
    lstm_classifier_counts,
    mlp_counts,
    profile,
)
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from ds_profiler import FlopsProfiler


def reference_matmul_flops(model, *args) -> int:
    """torch's aten-level counter (mm/bmm/conv/attention only, 2 flops per MAC): an independent
    reference for 2 * MACs. Math attention so that attention decomposes into counted bmms; grad
    enabled so that nn.MultiheadAttention's fused inference kernel (not counted by it) is not used."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(*args)
    return counter.get_total_flops()


def test_mlp_exact():
    assert count(MLP(), torch.randn(4, 16)) == mlp_counts(4)


def test_convnet_exact():
    model = ConvNet().eval()
    x = torch.randn(2, 3, 16, 16)
    flops, macs = count(model, x)
    assert (flops, macs) == convnet_counts(2)
    assert 2 * macs == reference_matmul_flops(model, x)


@pytest.mark.parametrize("manual", [False, True], ids=["sdpa", "manual-attention"])
def test_gpt_exact_and_matches_analytic_formula(manual):
    b, s, h, heads, layers, vocab = 2, 16, 32, 4, 2, 64
    model = GPT(vocab, s, h, heads, layers, manual=manual).eval()
    idx = torch.randint(0, vocab, (b, s))
    prof = profile(model, idx)
    try:
        assert (prof.get_total_flops(), prof.get_total_macs()) == gpt_counts(b, s, vocab, h, heads, layers, manual)
        tree = prof.get_profile()
        for i in range(layers):
            block = tree.find(f"blocks.{i}")
            assert (block.flops, block.macs) == gpt_block_counts(b, s, h, heads, manual)
            # 24·b·s·h² + 4·b·s²·h per layer: 2 * MACs of the block
            assert 2 * block.macs == 24 * b * s * h * h + 4 * b * s * s * h
            attention = tree.find(f"blocks.{i}.attn")
            assert attention.self_macs == 2 * b * s * s * h  # Q K^T and A V, outside any submodule
        assert 2 * prof.get_total_macs() == reference_matmul_flops(model, idx)
    finally:
        prof.end_profile()


def test_lstm_exact():
    model = LSTMClassifier()
    x = torch.randn(3, 5, 6)
    assert count(model, x) == lstm_classifier_counts(3, 5)


def test_module_called_twice_is_counted_per_call():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(torch.relu(self.lin(x)))

    model = Twice()
    prof = profile(model, torch.randn(4, 8))
    one_linear = 2 * 4 * 8 * 8 + 4 * 8
    lin = prof.get_profile().find("lin")
    assert (lin.calls, lin.flops) == (2, 2 * one_linear)
    assert prof.get_total_flops() == 2 * one_linear + 4 * 8  # + relu, in the parent itself
    prof.end_profile()


def test_shared_instance_under_two_parents_is_counted_where_it_runs():
    shared = nn.Linear(8, 8)

    class TwoParents(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Sequential(shared)
            self.b = nn.Sequential(shared)

        def forward(self, x):
            return self.a(x)

    prof = profile(TwoParents(), torch.randn(4, 8))
    tree = prof.get_profile()
    one = 2 * 4 * 8 * 8 + 4 * 8
    assert prof.get_total_flops() == one  # once, though the instance sits in the tree twice
    assert tree.find("a").flops == one and tree.find("b").flops == 0
    assert tree.find("a.0").flops == tree.find("b.0").flops == one  # the same instance, same record
    prof.end_profile()


def test_nested_modules_count_each_op_once():
    model = nn.Sequential(nn.Sequential(nn.Sequential(nn.Linear(4, 4))), nn.ReLU())
    prof = profile(model, torch.randn(2, 4))
    tree = prof.get_profile()
    linear = 2 * 2 * 4 * 4 + 2 * 4
    assert [tree.find(n).flops for n in ("", "0", "0.0", "0.0.0", "1")] == [linear + 8, linear, linear, linear, 8]
    prof.end_profile()


def test_container_shows_the_sum_of_its_children():
    b, s = 2, 16
    prof = profile(GPT().eval(), torch.zeros(b, s, dtype=torch.long))
    tree = prof.get_profile()
    blocks = tree.find("blocks")
    assert blocks.calls == 0
    assert blocks.macs == sum(child.macs for child in blocks.children) == 2 * gpt_block_counts(b, s, 32, 4)[1]
    prof.end_profile()


def test_ignore_list_by_type_and_instance():
    b, s, h = 2, 16, 32
    model = GPT().eval()
    idx = torch.zeros(b, s, dtype=torch.long)
    full_flops, full_macs = gpt_counts(b, s)
    layer_norms = 5 * 7 * b * s * h  # 2 per block, 2 blocks, + ln_f
    assert count(model, idx, ignore_list=[nn.LayerNorm]) == (full_flops - layer_norms, full_macs)
    head_macs = b * s * h * 64
    assert count(model, idx, ignore_list=[model.head]) == (full_flops - 2 * head_macs, full_macs - head_macs)
    prof = profile(model, idx, ignore_list=[model.blocks[0]])
    tree = prof.get_profile()
    assert tree.find("blocks.0").ignored and tree.find("blocks.0.attn.qkv").ignored
    assert tree.find("blocks.0.attn.qkv").flops == 0 and not tree.find("blocks.1").ignored
    assert prof.get_total_flops() == full_flops - gpt_block_counts(b, s, h, 4)[0]
    prof.end_profile()


def test_ignoring_one_parent_of_a_shared_instance_does_not_ignore_it_under_the_other():
    shared = nn.Linear(8, 8)

    class TwoParents(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Sequential(shared)
            self.b = nn.Sequential(shared)

        def forward(self, x):
            return self.b(x)

    model = TwoParents()
    one = 2 * 4 * 8 * 8 + 4 * 8
    prof = profile(model, torch.randn(4, 8), ignore_list=[model.a])
    tree = prof.get_profile()
    assert prof.get_total_flops() == one  # run through b, which is not ignored
    assert tree.find("a").ignored and tree.find("a.0").ignored  # shown as ignored where it sits under a
    assert not tree.find("b").ignored and not tree.find("b.0").ignored
    assert tree.find("b.0").flops == one
    prof.end_profile()


def test_calls_accumulate_reset_and_stop():
    model = MLP()
    x = torch.randn(4, 16)
    one = mlp_counts(4)[0]
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(x)
    model(x)
    assert prof.get_total_flops() == 2 * one
    prof.reset_profile()
    assert prof.get_total_flops() == 0
    model(x)
    assert prof.get_total_flops() == one
    prof.stop_profile()
    model(x)  # not profiled any more
    assert prof.get_total_flops() == one
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    prof.end_profile()


def test_totals_include_a_submodule_called_on_its_own():
    model = MLP()
    x = torch.randn(4, 16)
    prof = FlopsProfiler(model)
    prof.start_profile()
    with torch.no_grad():
        model.fc1(x)  # outside the model's forward, as an encoder-decoder's generate() calls its encoder
        model(x)
    prof.stop_profile()
    fc1 = 2 * 4 * 16 * 32 + 4 * 32
    tree = prof.get_profile()
    assert (tree.flops, tree.find("fc1").flops) == (mlp_counts(4)[0], 2 * fc1)
    assert prof.get_total_flops() == mlp_counts(4)[0] + fc1
    assert prof.get_total_macs() == mlp_counts(4)[1] + 4 * 16 * 32
    assert prof.get_total_duration() > tree.duration > 0
    prof.reset_profile()
    assert (prof.get_total_flops(), prof.get_total_macs(), prof.get_total_duration()) == (0, 0, 0.0)
    prof.end_profile()


def test_params_total_and_trainable():
    model = MLP()
    model.fc1.requires_grad_(False)
    prof = profile(model, torch.randn(2, 16))
    assert prof.get_total_params() == sum(p.numel() for p in model.parameters()) == 16 * 32 + 32 + 32 * 8 + 8
    assert prof.get_total_params(trainable_only=True) == 32 * 8 + 8
    assert prof.get_profile().find("fc2").params == 32 * 8 + 8
    prof.end_profile()


def test_latency_is_measured_and_nested():
    model = ConvNet().eval()
    prof = profile(model, torch.randn(2, 3, 16, 16))
    tree = prof.get_profile()
    assert tree.duration == prof.get_total_duration() > 0
    assert all(child.duration > 0 for child in tree.children)
    assert sum(child.duration for child in tree.children) <= tree.duration
    prof.end_profile()


def test_profile_tree_mirrors_the_model_and_serialises():
    model = GPT().eval()
    prof = profile(model, torch.zeros(1, 8, dtype=torch.long))
    tree = prof.get_profile()
    assert [r.name for r in tree.walk()] == [name for name, _ in model.named_modules()]
    assert [r.type_name for r in tree.walk()] == [type(m).__name__ for _, m in model.named_modules()]
    data = json.loads(json.dumps(tree.to_dict()))
    assert data["flops"] == prof.get_total_flops() and data["children"][0]["name"] == "wte"
    with pytest.raises(KeyError, match="no module named 'nope'"):
        tree.find("nope")
    prof.end_profile()


def test_training_mode_counts_dropout():
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    x = torch.randn(4, 8)
    linear = 2 * 4 * 8 * 8 + 4 * 8
    assert count(model.train(), x)[0] == linear + 4 * 8
    assert count(model.eval(), x)[0] == linear
