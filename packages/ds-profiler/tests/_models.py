"""The analytic test models, and their flop counts computed by hand from the README's conventions.

The formulas here are written from the definitions of the models, op by op, not from the
profiler's code: a test compares the profiler against them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ds_profiler import FlopsProfiler

LAYER_NORM = 5 + 2  # mean, subtract, square, sum, scale + weight and bias
SOFTMAX = 5  # max, subtract, exp, sum, divide


def profile(model: nn.Module, *args, ignore_list=None, **kwargs) -> FlopsProfiler:
    """One profiled forward under no_grad; returns the stopped profiler (caller reads, then ends)."""
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=ignore_list)
    with torch.no_grad():
        model(*args, **kwargs)
    prof.stop_profile()
    return prof


def count(model: nn.Module, *args, **kwargs) -> tuple[int, int]:
    prof = profile(model, *args, **kwargs)
    try:
        return prof.get_total_flops(), prof.get_total_macs()
    finally:
        prof.end_profile()


class Lambda(nn.Module):
    """A custom module calling ``fn``: everything it counts comes from functional/tensor ops."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def count_fn(fn, *args, **kwargs) -> tuple[int, int]:
    return count(Lambda(fn), *args, **kwargs)


# -- MLP ------------------------------------------------------------------------------------------

class MLP(nn.Module):
    def __init__(self, d_in=16, hidden=32, d_out=8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def mlp_counts(b, d_in=16, hidden=32, d_out=8) -> tuple[int, int]:
    macs = b * d_in * hidden + b * hidden * d_out
    flops = 2 * macs + b * hidden + b * hidden + b * d_out  # biases, relu, bias
    return flops, macs


# -- conv net -------------------------------------------------------------------------------------

class ConvNet(nn.Module):
    def __init__(self, classes=10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        x = self.pool(F.relu(self.bn(self.conv1(x))))
        x = F.relu(self.conv2(x))
        return self.fc(torch.flatten(self.gap(x), 1))


def convnet_counts(b, size=16, classes=10) -> tuple[int, int]:
    out1 = b * 8 * size * size
    macs1 = out1 * 3 * 3 * 3
    pooled = b * 8 * (size // 2) ** 2
    out2 = b * 16 * (size // 2) ** 2
    macs2 = out2 * 8 * 3 * 3
    macs_fc = b * 16 * classes
    flops = (2 * macs1 + out1  # conv1 + bias
             + 4 * out1  # eval batch norm: subtract mean, scale, weight, bias
             + out1  # relu
             + 4 * pooled  # 2x2 max pool: 4 elements per output
             + 2 * macs2 + out2 + out2  # conv2 + bias, relu
             + out2  # global average pool: every element once
             + 2 * macs_fc + b * classes)
    return flops, macs1 + macs2 + macs_fc


# -- GPT ------------------------------------------------------------------------------------------

class Attention(nn.Module):
    def __init__(self, h, heads, manual=False) -> None:
        super().__init__()
        self.heads = heads
        self.manual = manual
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=2)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        if self.manual:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / (h // self.heads) ** 0.5)
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            y = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class FeedForward(nn.Module):
    def __init__(self, h) -> None:
        super().__init__()
        self.fc = nn.Linear(h, 4 * h)
        self.proj = nn.Linear(4 * h, h)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, h, heads, manual=False) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(h)
        self.attn = Attention(h, heads, manual)
        self.ln2 = nn.LayerNorm(h)
        self.mlp = FeedForward(h)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab=64, seq=16, h=32, heads=4, layers=2, manual=False) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, h)
        self.wpe = nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(Block(h, heads, manual) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)
        self.head = nn.Linear(h, vocab, bias=False)

    def forward(self, idx):
        s = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(s, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt_block_counts(b, s, h, heads, manual=False) -> tuple[int, int]:
    """One block: the analytic 24bsh^2 + 4bs^2h matmul flops plus the elementwise ops."""
    macs = 12 * b * s * h * h + 2 * b * s * s * h
    scores = b * heads * s * s
    elementwise = (
        2 * LAYER_NORM * b * s * h  # ln1, ln2
        + b * s * (3 * h + h + 4 * h + h)  # biases of qkv, proj, fc, proj
        + (SOFTMAX + 1) * scores  # softmax and the 1/sqrt(d) scale of every score
        + (0 if manual else scores)  # sdpa's causal mask: one flop per score (masked_fill is free)
        + 4 * b * s * h  # gelu
        + 2 * b * s * h  # two residual adds
    )
    assert 2 * macs == 24 * b * s * h * h + 4 * b * s * s * h
    return 2 * macs + elementwise, macs


def gpt_counts(b, s, vocab=64, h=32, heads=4, layers=2, manual=False) -> tuple[int, int]:
    block_flops, block_macs = gpt_block_counts(b, s, h, heads, manual)
    macs = layers * block_macs + b * s * h * vocab
    flops = layers * block_flops + b * s * h + LAYER_NORM * b * s * h + 2 * b * s * h * vocab
    return flops, macs


# -- LSTM -----------------------------------------------------------------------------------------

class LSTMClassifier(nn.Module):
    def __init__(self, d_in=6, hidden=10, layers=2, classes=3) -> None:
        super().__init__()
        self.lstm = nn.LSTM(d_in, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


def lstm_step(d_in, hidden, bias=True) -> tuple[int, int]:
    """One LSTM cell, one sample, one step: 4 gates of W_ih x + b_ih + W_hh h + b_hh, then
    3 sigmoids + tanh, c' = f*c + i*g (3), h' = o*tanh(c') (2)."""
    gates = 4 * hidden
    macs = gates * d_in + gates * hidden
    flops = 2 * macs + gates + (2 * gates if bias else 0) + 4 * hidden + 3 * hidden + 2 * hidden
    return flops, macs


def lstm_classifier_counts(b, t, d_in=6, hidden=10, layers=2, classes=3) -> tuple[int, int]:
    flops = macs = 0
    for layer in range(layers):
        f, m = lstm_step(d_in if layer == 0 else hidden, hidden)
        flops += f * b * t
        macs += m * b * t
    macs += b * hidden * classes
    flops += 2 * b * hidden * classes + b * classes
    return flops, macs
