"""The parts of ``bench_efficiency.py`` (see its docstring): the GPT (the yardstick's pre-LN decoder, its
sizes as arguments, a forward that takes DeepSpeed's ``curriculum_seqlen`` and ``pld_theta``), the Markov
walks with a known loss floor, and the forward FLOPs of each arm's state from ds-profiler. Not a benchmark by
itself (nox's ``bench`` session runs ``bench_*.py`` only)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ds_profiler import get_model_profile

SUCCESSORS = 4  # each token's next token is one of 4, uniformly: the loss floor is ln 4
LOSS_FLOOR = math.log(SUCCESSORS)


@dataclass(frozen=True)
class Shape:
    vocab: int
    d_model: int
    layers: int
    heads: int
    seq: int
    micro_batch: int


class Block(nn.Module):
    """The yardstick's pre-LN block (``packages/ds-zero/benchmarks/bench_zero.py``), sizes as arguments."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.fc, self.out = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(attn)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """The yardstick GPT; ``forward(tokens, curriculum_seqlen=None, progressive_layer_drop=None,
    pld_theta=None)`` returns the next-token loss. ``curriculum_seqlen`` truncates the sequences (as
    DeepSpeed's Megatron example does with the engine's value); ``pld_theta`` goes to every block (wrap them in
    ``ds_data.ProgressiveLayerDropBlock`` first)."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.vocab = shape.vocab
        self.tok, self.pos = nn.Embedding(shape.vocab, shape.d_model), nn.Embedding(shape.seq, shape.d_model)
        self.blocks = nn.ModuleList(Block(shape.d_model, shape.heads) for _ in range(shape.layers))
        self.norm, self.head = nn.LayerNorm(shape.d_model), nn.Linear(shape.d_model, shape.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, curriculum_seqlen: int | None = None,
                progressive_layer_drop: bool | None = None, pld_theta: float | None = None) -> torch.Tensor:
        if curriculum_seqlen is not None and curriculum_seqlen < tokens.shape[1]:
            tokens = tokens[:, :curriculum_seqlen]
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        pld = {} if pld_theta is None else {"progressive_layer_drop": progressive_layer_drop, "pld_theta": pld_theta}
        for block in self.blocks:
            x = block(x, **pld)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, self.vocab), tokens[:, 1:].reshape(-1))


class MarkovWalks:
    """Batches of walks on a fixed random graph over the vocabulary where every token has ``SUCCESSORS``
    distinct successors, each taken with equal probability: the best possible next-token loss is ln 4. The
    batch of step ``t`` is the same for every caller (seeded by ``seed`` and ``t``)."""

    def __init__(self, shape: Shape, seed: int = 0) -> None:
        self.shape, self.seed = shape, seed
        g = torch.Generator().manual_seed(seed)
        self.successors = torch.stack([torch.randperm(shape.vocab, generator=g)[:SUCCESSORS]
                                       for _ in range(shape.vocab)])
        self._cache: dict[int, torch.Tensor] = {}

    def batch(self, step: int) -> torch.Tensor:
        if step not in self._cache:
            self._cache = {step: self._walks(1 + step, self.shape.micro_batch)}
        return self._cache[step]

    def held_out(self, samples: int) -> torch.Tensor:
        """Walks no training step draws (seed -1), for the evaluation loss."""
        return self._walks(-1, samples)

    def _walks(self, stream: int, samples: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1_000_003 * self.seed + stream)
        tokens = torch.empty(samples, self.shape.seq, dtype=torch.int64)
        tokens[:, 0] = torch.randint(0, self.shape.vocab, (samples,), generator=g)
        for t in range(1, self.shape.seq):
            pick = torch.randint(0, SUCCESSORS, (samples,), generator=g)
            tokens[:, t] = self.successors[tokens[:, t - 1], pick]
        return tokens


class ForwardFlops:
    """Forward FLOPs of one micro-batch, counted by ds-profiler's ``get_model_profile`` (cached per shape):
    the plain model at a sequence length, and one block at a number of tokens per sample."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        torch.manual_seed(0)
        self._model, self._block = GPT(shape), Block(shape.d_model, shape.heads)
        self._cache: dict[tuple[str, int], int] = {}

    def _profile(self, key: tuple[str, int]) -> int:
        if key not in self._cache:
            kind, length = key
            b = self.shape.micro_batch
            if kind == "model":
                module, args = self._model, (torch.zeros(b, length, dtype=torch.int64),)
            else:
                module, args = self._block, (torch.zeros(b, length, self.shape.d_model),)
            flops, _, _ = get_model_profile(module, args=args, print_profile=False, detailed=False, warm_up=0,
                                            as_string=False)
            self._cache[key] = int(flops)
        return self._cache[key]

    def model(self, seqlen: int | None = None) -> int:
        """The plain model's forward at ``seqlen`` tokens (the full sequence by default)."""
        return self._profile(("model", seqlen or self.shape.seq))

    def block(self, tokens: int) -> int:
        """One block's forward on ``tokens`` tokens per sample."""
        return self._profile(("block", tokens))

    def pld(self, theta: float) -> float:
        """The expected forward under progressive layer dropping at ``theta``: block ``i`` runs with probability
        ``1 - (i + 1) / L * (1 - theta)`` (``ds_data.ProgressiveLayerDropBlock``)."""
        layers = self.shape.layers
        skipped = sum((i + 1) / layers * (1.0 - theta) for i in range(layers))
        return self.model() - skipped * self.block(self.shape.seq)

    def random_ltd(self, kept: int, dropping_layers: int) -> int:
        """The forward with ``dropping_layers`` blocks running on ``kept`` of the sequence's tokens."""
        return self.model() - dropping_layers * (self.block(self.shape.seq) - self.block(min(kept, self.shape.seq)))
