"""Tiny models built in the tests: a BERT-like encoder (names as in DeepSpeed's examples) and a convnet."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.query, self.key, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, t, _ = x.shape
        heads = self.query.out_features // self.head_dim  # follows head pruning's resize

        def split(y):
            return y.view(b, t, heads, self.head_dim).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.head_dim), dim=-1)
        return (att @ v).transpose(1, 2).reshape(b, t, heads * self.head_dim)


class Dense(nn.Module):
    def __init__(self, i: int, o: int):
        super().__init__()
        self.dense = nn.Linear(i, o)

    def forward(self, x):
        return self.dense(x)


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.self = SelfAttention(dim, heads)
        self.output = Dense(dim, dim)

    def forward(self, x):
        return self.output(self.self(x))


class Layer(nn.Module):
    def __init__(self, dim, heads, ffn):
        super().__init__()
        self.attention = Attention(dim, heads)
        self.intermediate = Dense(dim, ffn)
        self.output = Dense(ffn, dim)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)

    def forward(self, x):
        x = self.norm1(x + self.attention(x))
        return self.norm2(x + self.output(torch.relu(self.intermediate(x))))


class Encoder(nn.Module):
    def __init__(self, vocab=32, dim=16, heads=4, ffn=32, layers=2, classes=3):
        super().__init__()
        self.embeddings = nn.Embedding(vocab, dim)
        self.layer = nn.ModuleList([Layer(dim, heads, ffn) for _ in range(layers)])
        self.classifier = nn.Linear(dim, classes)

    def forward(self, ids):
        x = self.embeddings(ids)
        for layer in self.layer:
            x = layer(x)
        return self.classifier(x.mean(dim=1))


class ConvNet(nn.Module):
    def __init__(self, classes=3):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, classes)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.fc(x.mean(dim=(2, 3)))


@pytest.fixture
def encoder():
    torch.manual_seed(0)
    return Encoder()


@pytest.fixture
def convnet():
    torch.manual_seed(0)
    return ConvNet()


@pytest.fixture
def make_encoder():
    return Encoder


def group(technique: str, shared: dict, groups: dict) -> dict:
    """A compression_training dict with one technique."""
    return {technique: {"shared_parameters": {"enabled": True, **shared}, "different_groups": groups}}


@pytest.fixture
def section():
    return group
