"""Convergence, scaled down: a small next-token model on sequences that walk a fixed successor table (10 %
random jumps) trains 300 steps on 2 ranks; the final loss of 1-bit Adam and 0/1 Adam is within 2 % of
Adam's, and 1-bit LAMB's within 2 % of LAMB's (ds-ops' FusedLamb under DDP), all far below the loss of
guessing. benchmarks/bench_onebit.py runs the same comparison on a GPT and prints the curves."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from torch import nn

import ds_comm
from ds_comm.testing import spawn
from ds_zero import OneBitAdam, OneBitLamb, ZeroOneAdam, ZeroOptimizer

VOCAB, WIDTH, SEQ, BATCH, STEPS, WARM = 64, 64, 16, 8, 300, 100
LAMB_LR = 1e-2
BETAS = (0.9, 0.99)  # the variance settles within the warm-up (a third of the run)


class NextToken(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH), nn.GELU(),
                                 nn.Linear(WIDTH, VOCAB))

    def forward(self, tokens):
        logits = self.net(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _walks(step: int, rank: int) -> torch.Tensor:
    successor = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(10_000 * step + rank)
    tokens = torch.empty(BATCH, SEQ, dtype=torch.int64)
    tokens[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=g)
    for t in range(1, SEQ):
        jump = torch.rand(BATCH, generator=g) < 0.1
        tokens[:, t] = torch.where(jump, torch.randint(0, VOCAB, (BATCH,), generator=g), successor[tokens[:, t - 1]])
    return tokens


def _optimizer(kind: str):
    common = {"weight_decay": 0.01, "betas": BETAS}
    return {
        "adam": lambda t: torch.optim.AdamW(t, lr=3e-3, **common),
        "onebit": lambda t: OneBitAdam(t, lr=3e-3, freeze_step=WARM, **common),
        "zeroone": lambda t: ZeroOneAdam(t, lr=3e-3, var_freeze_step=WARM, var_update_scaler=8, local_step_scaler=30,
                                         local_step_clipper=4, **common),
        "onebitlamb": lambda t: OneBitLamb(t, lr=LAMB_LR, freeze_step=WARM, **common),
    }[kind]


def train_all(rank, world_size):
    torch.set_num_threads(1)
    finals = {}
    for kind in ("adam", "onebit", "zeroone", "lamb", "onebitlamb"):
        model = NextToken()
        if kind == "lamb":
            from ds_ops import FusedLamb

            ddp = nn.parallel.DistributedDataParallel(model)
            lamb = FusedLamb(ddp.parameters(), lr=LAMB_LR, weight_decay=0.01, betas=BETAS)
        else:
            zero = ZeroOptimizer(model, _optimizer(kind), config={"stage": 0})
        losses = []
        for step in range(STEPS):
            if kind == "lamb":
                loss = ddp(_walks(step, rank))
                loss.backward()
                lamb.step()
                lamb.zero_grad()
            else:
                loss = model(_walks(step, rank))
                zero.backward(loss)
                zero.step()
                zero.zero_grad()
            mean = loss.detach().clone()
            ds_comm.all_reduce(mean)
            losses.append(mean.item() / world_size)
        finals[kind] = statistics.mean(losses[-20:])
    return finals


@pytest.fixture(scope="module")
def finals():
    return spawn(train_all, world_size=2, timeout=600)[0]


@pytest.mark.parametrize(("kind", "base"), [("onebit", "adam"), ("zeroone", "adam"), ("onebitlamb", "lamb")])
def test_final_loss_within_2_percent_of_the_uncompressed_optimizer(finals, kind, base):
    assert finals[base] < 0.5 * math.log(VOCAB)  # it learned: guessing costs ln(64) = 4.16
    assert abs(finals[kind] / finals[base] - 1) <= 0.02, finals
