"""DeepSpeed's ``deepspeed.sequence.fpdt_layer`` (FPDT: Ulysses attention computed chunk by chunk, its chunks
offloaded to host memory).

`FPDT_InputConstruct` is built: it reorders a batch's tokens into FPDT's load-balanced order and gives this
rank its part (ds-parallel's `fpdt_token_order`). The attention itself, ``_FPDTGPUOffloadingAttentionImpl_``,
is DeepSpeed's CUDA path over flash-attn's private kernels (``_flash_attn_forward`` / ``_backward``), which
DeepSpeed runs only on a GPU with flash-attn: it is not built in ds, and calling it raises
``NotImplementedError``. The name exists so that code importing it loads."""

from __future__ import annotations

from typing import Any

import torch

from ds_parallel import fpdt_token_order

__all__ = ["FPDT_InputConstruct", "_FPDTGPUOffloadingAttentionImpl_"]


class FPDT_InputConstruct(torch.nn.Module):  # DeepSpeed's name
    """``FPDT_InputConstruct(tokens, labels, loss_mask, attention_mask, position_ids, args, sp_size, sp_rank)``:
    ``tokens`` is ``[batch, seq, ...]`` (the whole sequence); ``args.ds_sequence_parallel_fpdt_chunk_size`` is
    FPDT's chunk length over the whole group, so each rank holds ``seq / chunk_size`` chunks. ``generate()``
    returns ``(tokens, labels, loss_mask, attention_mask, position_ids)`` of this rank in FPDT's order: tokens,
    labels and position ids this rank's ``seq / sp_size`` positions, ``loss_mask`` the whole sequence reordered
    and ``attention_mask`` as given (DeepSpeed's behaviour); None stays None."""

    def __init__(self, tokens: torch.Tensor, labels: Any, loss_mask: Any, attention_mask: Any, position_ids: Any,
                 args: Any, sp_size: int, sp_rank: int) -> None:
        super().__init__()
        if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2:
            raise ValueError(f"FPDT_InputConstruct: tokens must be a [batch, seq, ...] tensor, got "
                             f"{getattr(tokens, 'shape', type(tokens).__name__)}")
        chunk = getattr(args, "ds_sequence_parallel_fpdt_chunk_size", None)
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"FPDT_InputConstruct: args.ds_sequence_parallel_fpdt_chunk_size must be an integer "
                             f">= 1, got {chunk!r}")
        if isinstance(sp_size, bool) or not isinstance(sp_size, int) or sp_size < 1 or not 0 <= sp_rank < sp_size:
            raise ValueError(f"FPDT_InputConstruct: sp_rank must be in [0, sp_size), got sp_size={sp_size!r}, "
                             f"sp_rank={sp_rank!r}")
        seq = tokens.shape[1]
        if seq % sp_size or seq % chunk or (seq // sp_size) % (seq // chunk):
            raise ValueError(f"FPDT_InputConstruct: the sequence length {seq} must be divisible by sp_size {sp_size} "
                             f"and by the chunk size {chunk}, and each rank's {seq // max(sp_size, 1)} tokens by the "
                             f"{seq // chunk} chunks per rank")
        self.tokens, self.labels, self.loss_mask = tokens, labels, loss_mask
        self.attention_mask, self.position_ids = attention_mask, position_ids
        self.num_chunk_per_gpu = seq // chunk
        self.global_seq_len, self.local_seq_len = seq, seq // sp_size
        self.chunk_size = self.local_seq_len // self.num_chunk_per_gpu
        self.sp_size, self.sp_rank = sp_size, sp_rank
        self.batch_size = tokens.shape[0]
        self.device = tokens.device

    def generate(self) -> tuple[Any, Any, Any, Any, Any]:
        order = fpdt_token_order(self.global_seq_len, self.sp_size, self.num_chunk_per_gpu, device=self.device)
        mine = order[self.sp_rank * self.local_seq_len:(self.sp_rank + 1) * self.local_seq_len]

        def pick(t: Any, index: torch.Tensor) -> Any:
            return t[:, index] if t is not None else None

        return (pick(self.tokens, mine), pick(self.labels, mine), pick(self.loss_mask, order), self.attention_mask,
                pick(self.position_ids, mine))


class _FPDTGPUOffloadingAttentionImpl_(torch.autograd.Function):  # DeepSpeed's (private) name
    """DeepSpeed's FPDT attention with host offloading: a CUDA path over flash-attn, not built in ds."""

    @staticmethod
    def forward(ctx: Any, *args: Any) -> torch.Tensor:
        raise NotImplementedError("FPDT's offloading attention (_FPDTGPUOffloadingAttentionImpl_) is DeepSpeed's "
                                  "CUDA path over flash-attn's kernels and is not built in ds; use Ulysses "
                                  "(ds_all.sequence.layer.DistributedAttention) with any local attention instead")

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # never reached: forward refuses
        raise NotImplementedError("_FPDTGPUOffloadingAttentionImpl_ is not built in ds")
