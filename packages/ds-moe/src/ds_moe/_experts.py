"""`Experts`: this rank's local experts, computed together."""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn
from torch.func import functional_call

logger = logging.getLogger(__name__)


def _first(out):
    # DeepSpeed's convention: an expert returning (output, bias) contributes its output only.
    return out[0] if isinstance(out, tuple) else out


class Experts(nn.Module):
    """``num_local_experts`` deep copies of ``expert`` as ``deepspeed_experts`` (DeepSpeed's parameter names:
    ``deepspeed_experts.<i>.<the expert's own names>``). Every expert parameter is marked
    ``allreduce = False`` and ``group_name = expert_group_name`` (DeepSpeed's MoE marks).

    ``forward(inputs)`` takes ``[E_local, T, M]`` (expert ``i`` gets ``inputs[i]``) or DeepSpeed's
    ``[G, E_local, C, M]`` and returns the same layout with the experts' output width.

    The local experts run as one batched computation: each parameter is stacked over the experts
    (``torch.stack``, differentiable) and the expert runs once under ``torch.vmap`` through
    ``torch.func.functional_call``, so a linear layer becomes one batched GEMM over the experts. This
    works for any expert module without buffers or in-place updates of its state. An expert with
    buffers (e.g. BatchNorm), or one whose forward vmap cannot run (data-dependent control flow,
    ``.item()``), falls back to a Python loop over the experts; the fallback is chosen once, the first time
    vmap fails, and logged.

    ``batched``: None (the default) picks by device: the batched path on an accelerator, the loop on the
    CPU, where one GEMM per expert measured faster than the batched one (bench_moe on the §9 GPT, 2 ranks,
    ep 2: a step 0.95x the batched path's; oneDNN's batched GEMM and the stacked copy cost more than a
    kernel launch per expert, which a GPU pays and a CPU does not). True forces the batched path, False the
    loop; an expert with buffers always loops.
    """

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None) -> None:
        super().__init__()
        if not isinstance(expert, nn.Module):
            raise ValueError(f"Experts: expert must be a torch.nn.Module, got {type(expert).__name__}")
        if not isinstance(num_local_experts, int) or isinstance(num_local_experts, bool) or num_local_experts < 1:
            raise ValueError(f"Experts: num_local_experts must be a positive int, got {num_local_experts!r}")
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        for one in self.deepspeed_experts:
            for param in one.parameters():
                param.allreduce = False
                param.group_name = expert_group_name
        self.batched: bool | None = None if next(expert.buffers(), None) is None else False
        self._vmap_failed = False

    def _stacked(self) -> dict[str, torch.Tensor]:
        names = [name for name, _ in self.deepspeed_experts[0].named_parameters()]
        per_expert = [dict(one.named_parameters()) for one in self.deepspeed_experts]
        return {name: torch.stack([params[name] for params in per_expert]) for name in names}

    def _run_batched(self, inputs: torch.Tensor) -> torch.Tensor:
        template = self.deepspeed_experts[0]

        def one(params, x):
            return _first(functional_call(template, params, (x,)))

        return torch.vmap(one, randomness="different")(self._stacked(), inputs)

    def _run_loop(self, inputs: torch.Tensor) -> torch.Tensor:
        return torch.stack([_first(one(x)) for one, x in zip(self.deepspeed_experts, inputs.unbind(0), strict=True)])

    def _run(self, inputs: torch.Tensor) -> torch.Tensor:
        batched = self.batched if self.batched is not None else inputs.device.type != "cpu"
        if batched and not self._vmap_failed:
            try:
                return self._run_batched(inputs)
            except (RuntimeError, NotImplementedError, TypeError, ValueError) as err:
                self._vmap_failed = True
                logger.warning("Experts: torch.vmap cannot run %s (%s); computing the %d local experts one by "
                               "one", type(self.deepspeed_experts[0]).__name__, err, self.num_local_experts)
        return self._run_loop(inputs)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if inputs.dim() == 4:  # DeepSpeed's [G, E_local, C, M]
            if inputs.shape[1] != self.num_local_experts:
                raise ValueError(f"Experts: dimension 1 of a [G, E_local, C, M] input must be the "
                                 f"{self.num_local_experts} local experts, got shape {tuple(inputs.shape)}")
            g, e, c, m = inputs.shape
            out = self._run(inputs.transpose(0, 1).reshape(e, g * c, m))
            return out.reshape(e, g, c, -1).transpose(0, 1)
        if inputs.dim() < 2 or inputs.shape[0] != self.num_local_experts:
            raise ValueError(f"Experts: input must be [E_local={self.num_local_experts}, tokens, M] or "
                             f"[G, E_local, C, M], got shape {tuple(inputs.shape)}")
        return self._run(inputs)
