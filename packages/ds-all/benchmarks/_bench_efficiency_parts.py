"""The parts of ``bench_efficiency.py`` (see its docstring): the GPT (the yardstick's, ``_yardstick.py`` in
ds-zero's benchmarks: its sizes as a ``Shape``, a forward that takes DeepSpeed's ``curriculum_seqlen`` and
``pld_theta``), the Markov walks with a known loss floor, and the forward FLOPs of each arm's state from
ds-profiler. Not a benchmark by itself (nox's ``bench`` session runs ``bench_*.py`` only)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

# the yardstick's one definition (ARCHITECTURE.md, "The yardstick workload"), from ds-zero's benchmarks folder by
# path: benchmarks are not installed, and this package gains no dependency on ds-zero
sys.path.append(str(Path(__file__).resolve().parents[2] / "ds-zero" / "benchmarks"))
from _yardstick import GPT, Block, Shape

from ds_profiler import get_model_profile

__all__ = ["GPT", "LOSS_FLOOR", "SUCCESSORS", "Block", "ForwardFlops", "MarkovWalks", "Shape"]

SUCCESSORS = 4  # each token's next token is one of 4, uniformly: the loss floor is ln 4
LOSS_FLOOR = math.log(SUCCESSORS)


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
