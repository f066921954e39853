"""ARCHITECTURE.md's yardstick workload, its one definition: the GPT-style pre-LN decoder and its synthetic tokens.

``Shape()`` is the yardstick (vocabulary 8192, d_model 512, 8 layers, 8 heads, sequence 256, micro-batch 4:
about 33.7M parameters with the untied LM head, no dropout); other benchmarks scale it with other sizes.
``GPT(shape)`` returns the next-token loss; ``tokens(step, micro, rank, shape)`` is a micro-batch of uniform
random tokens, the same for every caller.

Benchmarks are not installed, so each one loads this file by its path (``importlib``, as the module
``_yardstick``): no package gains a dependency on ds-zero, and a standalone install of any package is unaffected.
It imports torch only, so DeepSpeed's venv runs it too (the MoE and Ulysses runners). Not a benchmark by itself
(nox's ``bench`` session runs ``bench_*.py`` only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Shape:
    vocab: int = 8192
    d_model: int = 512
    layers: int = 8
    heads: int = 8
    seq: int = 256
    micro_batch: int = 4

    def params(self) -> int:
        """What ``GPT(self)`` holds: per block 12 d^2 + 13 d, the embeddings, the final norm, the LM head."""
        d = self.d_model
        return self.layers * (12 * d * d + 13 * d) + (2 * self.vocab + self.seq + 2) * d


class Block(nn.Module):
    """Pre-LN: ``x + proj(causal attention(ln1(x)))``, then ``x + out(gelu(fc(ln2(x))))``. ``mlp=False`` builds
    the attention half only (``ln2`` included), for a subclass that brings its own MLP (the MoE benchmark's)."""

    def __init__(self, d_model: int, heads: int, mlp: bool = True) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        if mlp:
            self.fc, self.out = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` plus its causal self-attention."""
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        return x + self.proj(attn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attend(x)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """The yardstick GPT; ``forward(tokens, curriculum_seqlen=None, progressive_layer_drop=None, pld_theta=None)``
    returns the next-token loss. ``curriculum_seqlen`` truncates the sequences (as DeepSpeed's Megatron example
    does with the engine's value); ``pld_theta`` goes to every block (wrap them in
    ``ds_data.ProgressiveLayerDropBlock`` first).

    ``block``: a factory for each of the ``shape.layers`` blocks (default ``Block(d_model, heads)``).
    ``float_loss``: the cross entropy of float32 logits (a bf16 model's loss as the GPU benchmark computes it);
    without it the logits keep the model's dtype (a no-op for a float32 model)."""

    def __init__(self, shape: Shape = Shape(), block: Callable[[], nn.Module] | None = None,
                 float_loss: bool = False) -> None:
        super().__init__()
        self.shape, self.vocab, self.float_loss = shape, shape.vocab, float_loss
        self.tok, self.pos = nn.Embedding(shape.vocab, shape.d_model), nn.Embedding(shape.seq, shape.d_model)
        self.blocks = nn.ModuleList(block() if block else Block(shape.d_model, shape.heads)
                                    for _ in range(shape.layers))
        self.norm, self.head = nn.LayerNorm(shape.d_model), nn.Linear(shape.d_model, shape.vocab, bias=False)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))

    def loss(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The next-token cross entropy of the last block's output ``x``."""
        logits = self.head(self.norm(x))
        if self.float_loss:
            logits = logits.float()
        return F.cross_entropy(logits[:, :-1].reshape(-1, self.vocab), tokens[:, 1:].reshape(-1))

    def forward(self, tokens: torch.Tensor, curriculum_seqlen: int | None = None,
                progressive_layer_drop: bool | None = None, pld_theta: float | None = None) -> torch.Tensor:
        if curriculum_seqlen is not None and curriculum_seqlen < tokens.shape[1]:
            tokens = tokens[:, :curriculum_seqlen]
        x = self.embed(tokens)
        pld = {} if pld_theta is None else {"progressive_layer_drop": progressive_layer_drop, "pld_theta": pld_theta}
        for block in self.blocks:
            x = block(x, **pld)
        return self.loss(x, tokens)


def tokens(step: int, micro: int = 0, rank: int = 0, shape: Shape = Shape()) -> torch.Tensor:
    """Micro-batch ``micro`` of step ``step`` on ``rank``: ``[micro_batch, seq]`` uniform random tokens."""
    g = torch.Generator().manual_seed(100_000 * step + 100 * micro + rank)
    return torch.randint(0, shape.vocab, (shape.micro_batch, shape.seq), generator=g)
