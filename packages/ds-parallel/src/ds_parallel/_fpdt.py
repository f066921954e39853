"""FPDT's token order (DeepSpeed's ``FPDT_InputConstruct``): with FPDT (Ulysses attention computed chunk by chunk)
the sequence is cut in ``sp_size * num_chunks`` chunks and rank ``r`` of the sequence-parallel group holds chunks
``r, r + sp_size, r + 2 sp_size, ...``, so that under a causal mask every rank has as much work as the others."""

from __future__ import annotations

import torch


def fpdt_token_order(seq_len: int, sp_size: int, num_chunks: int, *, device=None) -> torch.Tensor:
    """The positions of a ``seq_len``-token sequence in FPDT's load-balanced order: rank 0's ``seq_len / sp_size``
    tokens first (its ``num_chunks`` chunks in order), then rank 1's, and so on. Rank ``r``'s tokens are
    ``order[r * seq_len // sp_size:(r + 1) * seq_len // sp_size]``."""
    for name, value in (("seq_len", seq_len), ("sp_size", sp_size), ("num_chunks", num_chunks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"fpdt_token_order: {name} must be an integer >= 1, got {value!r}")
    if seq_len % (sp_size * num_chunks):
        raise ValueError(f"fpdt_token_order: seq_len {seq_len} must be divisible by sp_size {sp_size} × "
                         f"num_chunks {num_chunks}")
    chunk = seq_len // (sp_size * num_chunks)
    # chunk c covers [c * chunk, (c + 1) * chunk); rank r takes chunks r + k * sp_size, k = 0 .. num_chunks - 1
    chunks = torch.arange(sp_size * num_chunks, device=device).reshape(num_chunks, sp_size).t().reshape(-1)
    return (chunks[:, None] * chunk + torch.arange(chunk, device=device)).reshape(-1)
