"""Mixed precision pieces of `ZeroOptimizer`: dtypes, the reduction dtype, and the fused Adam step.

With fp16/bf16 the model's parameters are 16-bit views of one flat buffer and each rank keeps a
float32 master copy of the part it steps (none with ``bf16.bf16_master_weights_and_grads``: the
optimizer steps the bf16 partition, under DeepSpeed's rules, `_policy`). An Adam-family
optimizer (``torch.optim.Adam``/``AdamW``, ``ds_ops.CPUAdam``/``FusedAdam``) is stepped by
``ds_ops.adam_step`` on buffers ds-zero owns, in one pass per step: the 16-bit gradients are read
as they are, the loss scale and the clipping coefficient are folded into one multiplier, and the
new 16-bit parameters are written in the same pass. Its states live in the optimizer's ``state``
in torch's format ("step", "exp_avg", "exp_avg_sq"), so ``optimizer.state_dict()`` and
learning-rate schedulers work as usual.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import ds_ops

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_COMM_NAMES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
               torch.float32: torch.float32, torch.float16: torch.float16, torch.bfloat16: torch.bfloat16}


def communication_dtype(value: Any, precision: str) -> torch.dtype:
    """``communication_data_type`` resolved: as given ("fp32", "fp16", "bf16" or a torch dtype), else
    float32 for bf16 gradients (the reference's advice: bf16 sums lose precision) and the gradients'
    own dtype otherwise."""
    if value is None:
        return torch.float32 if precision == "bf16" else DTYPES[precision]
    if value not in _COMM_NAMES:
        raise ValueError(f'communication_data_type must be "fp32", "fp16" or "bf16" (or null), got {value!r}')
    return _COMM_NAMES[value]


@dataclass(frozen=True)
class AdamRecipe:
    """How to step an Adam-family optimizer's groups with ``ds_ops.adam_step``."""

    adamw: bool | None  # None: per group (torch's decoupled_weight_decay)

    def hyperparameters(self, group: dict) -> dict[str, Any]:
        adamw = self.adamw if self.adamw is not None else bool(group.get("decoupled_weight_decay", False))
        return {"lr": float(group["lr"]), "betas": tuple(float(b) for b in group["betas"]), "eps": float(group["eps"]),
                "weight_decay": float(group["weight_decay"]), "adamw_mode": adamw,
                "bias_correction": bool(group.get("bias_correction", True))}

    @staticmethod
    def state_dtype(group: dict, param_dtype: torch.dtype = torch.float32) -> torch.dtype:
        """The dtype of the moments of a ``param_dtype`` tensor of ``group``: ds-ops' ``state_dtype``
        ("param", DeepSpeed's ``fp32_optimizer_states=False``: bfloat16 for bfloat16 tensors), else float32."""
        kind = group.get("state_dtype")
        if kind == "bfloat16" or (kind == "param" and param_dtype == torch.bfloat16):
            return torch.bfloat16
        return torch.float32


def adam_recipe(optimizer: torch.optim.Optimizer) -> AdamRecipe | None:
    """An `AdamRecipe` when ``optimizer`` is one ``ds_ops.adam_step`` computes exactly (Adam or AdamW
    without amsgrad/maximize), else None."""
    if isinstance(optimizer, (ds_ops.CPUAdam, ds_ops.FusedAdam)):
        return AdamRecipe(adamw=bool(optimizer.adamw_mode))
    if isinstance(optimizer, torch.optim.Adam):  # AdamW is a subclass
        if any(g.get("amsgrad") or g.get("maximize") or g.get("differentiable") for g in optimizer.param_groups):
            return None
        return AdamRecipe(adamw=None)
    return None


def fused_adam_step(optimizer: torch.optim.Optimizer, recipe: AdamRecipe, masters: list[torch.Tensor],
                    grads: list[torch.Tensor], copies: list[torch.Tensor] | None, grad_scale: float) -> None:
    """One Adam step of every group of ``optimizer`` (built over ``masters``) through
    ``ds_ops.adam_step``: ``grads[i]`` (any float dtype) divided by ``grad_scale`` updates
    ``masters[i]``, and ``copies[i]`` (16-bit) receives the new value in the same pass."""
    index = {id(t): i for i, t in enumerate(masters)}
    for group in optimizer.param_groups:
        members = [index[id(t)] for t in group["params"]]
        if not members:
            continue
        exp_avg, exp_avg_sq = [], []
        step = 0.0
        for i in members:
            dtype = recipe.state_dtype(group, masters[i].dtype)
            state = optimizer.state[masters[i]]
            for key, out in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
                tensor = state.get(key)
                if tensor is None or tensor.dtype != dtype:
                    tensor = torch.zeros_like(masters[i], dtype=dtype, device=masters[i].device) if tensor is None \
                        else tensor.to(dtype)
                    state[key] = tensor
                out.append(tensor)
            previous = state.get("step")
            step = (float(previous) if previous is not None else 0.0) + 1.0
            state["step"] = torch.tensor(step, dtype=torch.float32)
        ds_ops.adam_step([masters[i] for i in members], [grads[i] for i in members], exp_avg, exp_avg_sq, int(step),
                         grad_scale=grad_scale, half_copy=None if copies is None else [copies[i] for i in members],
                         check_finite=False, **recipe.hyperparameters(group))


BF16_MASTER = "bf16.bf16_master_weights_and_grads"


def check_bf16_master_optimizer(optimizer: torch.optim.Optimizer, offload: bool, bf16_states: bool) -> None:
    """With bf16 master weights: under ZeRO-Offload the optimizer is ds-ops' CPU Adam (DeepSpeed's
    DeepSpeedCPUAdam), and with ``bf16.bf16_optimizer_states`` it keeps its states in bf16 (ds-ops'
    optimizers say so in each group's ``state_dtype``; torch's keep them in the parameters' dtype)."""
    name = type(optimizer).__name__
    if offload and not isinstance(optimizer, ds_ops.CPUAdam):
        raise ValueError(f"{BF16_MASTER} with zero_optimization.offload_optimizer needs ds_ops.CPUAdam (DeepSpeed: "
                         f"DeepSpeedCPUAdam) to step the bf16 partition, got {name}")
    float32 = [i for i, group in enumerate(optimizer.param_groups) if group.get("state_dtype") == "float32"]
    if bf16_states and float32:
        fix = "fp32_optimizer_states=False" if hasattr(optimizer, "fp32_optimizer_states") else \
            "state_dtype=torch.bfloat16"
        raise ValueError(f"bf16.bf16_optimizer_states keeps the optimizer states in bf16, but {name} keeps them in "
                         f"float32 (param group {float32[0]}): build it with {fix}"
                         + (" (DeepSpeed requires this of DeepSpeedCPUAdam under ZeRO-Offload)" if offload else ""))


def needs_whole_tensors(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer`` cannot step flat slices of many parameters (None when it can)."""
    if callable(getattr(optimizer, "set_segments", None)):  # told where each parameter lies (1-bit LAMB)
        return None
    if isinstance(optimizer, ds_ops.FusedLamb) or "lamb" in type(optimizer).__name__.lower():
        return "LAMB scales each tensor's update by its own trust ratio (norm of the weights over norm of the update)"
    if isinstance(optimizer, torch.optim.LBFGS):
        return "LBFGS needs a closure and whole-model line searches"
    return None


def cast_floating_inputs(dtype: torch.dtype):
    """A forward pre-hook (``with_kwargs=True``) that casts the floating-point tensor arguments of a
    forward to ``dtype`` (fp16.auto_cast)."""
    def cast(value):
        return value.to(dtype) if torch.is_tensor(value) and value.is_floating_point() else value

    def hook(module, args, kwargs):
        return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}

    return hook
