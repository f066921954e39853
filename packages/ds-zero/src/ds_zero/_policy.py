"""`ZeroPolicy`: what a ZeRO stage, a precision and an offload mean for one run, resolved once from the
``zero_optimization``, ``fp16`` and ``bf16`` sections and the model, before anything is built. It is the one
reader of ``zero_optimization.stage`` (besides the config's own validators and the memory estimator): the
rest of ds-zero asks the policy which states are sharded, where the master copy lives, whether gradients are
reduced each micro-step, whether there is a loss scale or an overflow check. Every refusal of a combination
(of sections, optimizer and arguments) is here, with the value and what is allowed.

How the stages map (`STAGES`, as the review of December 2026 and FSDP2 read them):

====== ================= ================ ===============
stage  optimizer states  gradients        parameters
====== ================= ================ ===============
0      whole             whole            whole
1      sharded           whole            whole
2      sharded           sharded          whole
3      sharded           sharded          sharded
====== ================= ================ ===============

``master`` says where the copy the optimizer steps lives: ``"inplace"`` (the flat parameters themselves:
float32 training, bf16 master weights, a 16-bit model stepped directly at stage 0), ``"device"`` (a float32
copy beside the 16-bit model), ``"host"`` (ZeRO-Offload's CPU copy) or ``"nvme"`` (ZeRO-Infinity's files).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ._compressed import CompressedOptimizer
from ._half import implied_precision
from ._model import param_name, version
from ._not_built import refuse_what_is_not_built
from ._params import stage3_owner
from ._precision import BF16_MASTER, DTYPES, communication_dtype
from ._replicas import refuse_replicas
from ._zenflow import check_zenflow
from ._zeropp import ZeroPlusPlus, zeropp_of
from .config import BF16Config, FP16Config, ZeroConfig, mixed_precision


@dataclass(frozen=True)
class Sharding:
    """Which of a run's states are split over the data-parallel ranks."""

    optimizer: bool
    grads: bool
    params: bool


STAGES = {0: Sharding(False, False, False), 1: Sharding(True, False, False), 2: Sharding(True, True, False),
          3: Sharding(True, True, True)}


def sharding(stage: int) -> Sharding:
    """What ZeRO stage ``stage`` shards (also of a checkpoint's recorded stage)."""
    if stage not in STAGES:
        raise ValueError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    return STAGES[stage]


def require_partitioned_params(config: ZeroConfig, who: str) -> None:
    """``who`` (ZeroInference) partitions parameters: only stage 3 does."""
    if not sharding(config.stage).params:
        raise ValueError(f"{who} partitions parameters at zero_optimization.stage 3, got stage {config.stage} "
                         "(stages 0-2 keep every parameter whole: run the model as it is)")


@dataclass(frozen=True)
class ZeroPolicy:
    """One run's ZeRO policy (see the module docstring). Built by `resolve`; immutable."""

    stage: int  # reported (checkpoint metadata, state_dict identity), never branched on outside this module
    shard_optimizer: bool  # each rank steps its shard of each bucket (stages 1-3); else every element
    shard_grads: bool  # gradients reduced into this rank's partition each micro-step (stages 2-3)
    shard_params: bool  # parameters partitioned, gathered around each module's use (stage 3)
    precision: str  # "fp32", "fp16", "bf16"
    dtype: torch.dtype  # the flat parameters' (and gradients') dtype
    communication_dtype: torch.dtype  # what gradients are reduced in
    master: str  # "inplace", "device", "host", "nvme" (see the module docstring)
    offload_device: str  # offload_optimizer.device: "none", "cpu", "nvme"
    params_on_nvme: bool  # offload_param.device "nvme" (stage 3)
    loss_scaling: bool  # fp16's dynamic loss scale and overflow skip
    check_overflow: bool  # bf16: a step with inf/NaN gradients is skipped
    bf16_master: bool  # no float32 copy: the 16-bit flat parameters are stepped
    bf16_optimizer_states: bool
    cast_model: bool  # the model's other floating-point tensors become ``dtype`` too (a section asked for it)
    auto_cast: bool  # fp16.auto_cast: the forward's floating-point inputs are cast
    reduce_in_backward: bool
    zeropp: ZeroPlusPlus = field(default_factory=ZeroPlusPlus)  # ZeRO++'s keys as they apply (stage 3 only)

    # ------------------------------------------------------------------------------------ derived
    @property
    def offload(self) -> bool:
        """The optimizer steps on the CPU (ds-ops' Adam): offload_optimizer.device cpu or nvme."""
        return self.offload_device in ("cpu", "nvme")

    @property
    def whole_grads(self) -> bool:
        """Every ``.grad`` is a view of one flat gradient buffer that backward accumulates into (stages 0-1)."""
        return not self.shard_grads

    @property
    def reduces_whole_accumulation(self) -> bool:
        """Stage 1: each reduction averages the whole local accumulation (kept in ``.grad``) into the partition
        anew, replacing it."""
        return self.shard_optimizer and not self.shard_grads

    # ------------------------------------------------------------------------------------ refusals
    def check_param_groups(self, group_options: list[dict[str, Any]] | None) -> None:
        if self.offload_device == "nvme" and group_options is not None and len(group_options) > 1:
            raise NotImplementedError("ZeroOptimizer: offload_optimizer.device 'nvme' steps one set of Adam options "
                                      f"in ds-zero {version()}; got {len(group_options)} parameter groups: use one "
                                      "group, or offload to 'cpu'")

    def check_params(self, model: nn.Module, params: list[nn.Parameter]) -> None:
        """The trainable parameters: not another stage-3 optimizer's, and in a dtype this precision trains."""
        for p in params:
            if stage3_owner(p) is not None:
                raise ValueError(f"ZeroOptimizer: parameter {param_name(model, p)} is managed by another stage-3 "
                                 "ZeroOptimizer; close() that one first")
            if p.dtype not in (torch.float32, self.dtype):
                raise ValueError(f"ZeroOptimizer: parameter {param_name(model, p)} is {p.dtype}; {self.precision} "
                                 f"training takes float32{'' if self.dtype == torch.float32 else f' or {self.dtype}'} "
                                 "parameters")

    def check_replicas(self, refuse: Any) -> None:
        """Parameters replicated over subgroups (`_replicas`): not with partitioned parameters (and so not
        with ZeRO-Infinity, which needs stage 3)."""
        if self.shard_params:
            refuse("zero_optimization.stage 3")

    def check_compressed(self, name: str, *, averaging_size: int | None = None, world_size: int | None = None,
                         replicated: bool = False) -> None:
        """A 1-bit optimizer runs at stage 0 in fp32 or bf16, reducing in its own backward hooks, averaging
        over ZeRO's whole group (``averaging_size`` its ``world_size``), without ``replicated`` parameters."""
        if averaging_size != world_size:
            raise NotImplementedError(f"ZeroOptimizer: a 1-bit optimizer ({name}) with gradient_averaging_size "
                                      f"{averaging_size} (not the group's {world_size} ranks: sequence parallelism) "
                                      f"is not implemented in ds-zero {version()}")
        if replicated:
            refuse_replicas(f"a 1-bit optimizer ({name})")
        if self.shard_optimizer:
            raise ValueError(f"zero_optimization.stage is {self.stage}: {name} compresses the data-parallel "
                             "communication itself and runs with stage 0 only (as DeepSpeed's 1-bit optimizers); "
                             "set zero_optimization.stage to 0")
        if self.precision == "fp16":
            raise NotImplementedError(f"fp16 with {name} is not implemented in ds-zero {version()}: its loss-scale "
                                      "check would read gradients that differ between ranks after warm-up; use bf16 "
                                      "or fp32")
        if not self.reduce_in_backward:
            raise ValueError(f"{name} decides per step whether gradients are averaged; it cannot be stepped by a "
                             "caller that reduces by hand (reduce_in_backward=False, a pipeline stage)")


def resolve(model: Any, optimizer: Any, config: Any, fp16: Any, bf16: Any, communication_data_type: Any,
            gradient_clipping: Any, gradient_accumulation_steps: Any, reduce_in_backward: bool
            ) -> tuple[ZeroPolicy, ZeroConfig, FP16Config, int]:
    """The policy of a `ZeroOptimizer` built with these arguments, its ``zero_optimization`` section, the
    fp16 section it trains with and its gradient accumulation steps (ZenFlow's ``update_interval`` replaces the
    argument, as in DeepSpeed); every refusal that needs no more than them (before the model is touched)."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"ZeroOptimizer: model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(optimizer):
        raise ValueError(f"ZeroOptimizer: optimizer must be an optimizer class or a callable, got {optimizer!r}")
    zero_config = ZeroConfig.from_section_or_ds_config(config)
    shards = sharding(zero_config.stage)
    fp16_config = FP16Config.from_section_or_ds_config(fp16)
    bf16_config = BF16Config.from_section_or_ds_config(bf16)
    # a 16-bit model without either section: DeepSpeed's arithmetic for it (_half); stage 0 steps it directly
    fp16_config, bf16_config, communication_data_type, implied = implied_precision(
        model, fp16_config, bf16_config, communication_data_type)
    direct = implied and not shards.optimizer
    precision = mixed_precision(fp16_config, bf16_config)
    offload_device = zero_config.offload_optimizer.device if zero_config.offload_optimizer is not None else "none"
    bf16_master = bool(bf16_config.bf16_master_weights_and_grads)
    bf16_states = bool(bf16_config.bf16_optimizer_states)
    if bf16_master:
        _check_bf16_master(precision, shards, offload_device, bf16_states)
    if precision == "fp16" and fp16_config.fp16_master_weights_and_grads:
        raise NotImplementedError("fp16.fp16_master_weights_and_grads is not implemented in ds-zero "
                                  f"{version()}: the master copy is float32; remove the key")
    dtype = DTYPES[precision]
    comm = communication_dtype(communication_data_type, precision)
    refuse_what_is_not_built(zero_config)
    if zero_config.zenflow is not None:  # `_zenflow`: DeepSpeed accumulates over update_interval micro-steps
        _check_zenflow_placement(zero_config.stage, shards, offload_device)
        check_zenflow(zero_config.zenflow, precision=precision, compute_grad_norm=zero_config.compute_grad_norm,
                      overlap_comm=bool(zero_config.overlap_comm))
        gradient_accumulation_steps = int(zero_config.zenflow.update_interval)
    if isinstance(gradient_clipping, bool) or not isinstance(gradient_clipping, (int, float)) \
            or not math.isfinite(gradient_clipping) or gradient_clipping < 0:
        raise ValueError(f"gradient_clipping must be a number >= 0 (0: off), got {gradient_clipping!r}")
    if isinstance(gradient_accumulation_steps, bool) or not isinstance(gradient_accumulation_steps, int) \
            or gradient_accumulation_steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be an integer >= 1, got {gradient_accumulation_steps!r}")
    if not reduce_in_backward and gradient_accumulation_steps != 1:
        raise ValueError("ZeroOptimizer: reduce_in_backward=False means the caller accumulates the micro-steps and "
                         "calls reduce_gradients() once per step; gradient_accumulation_steps must be 1, got "
                         f"{gradient_accumulation_steps}")
    if not reduce_in_backward and shards.params:
        raise ValueError("ZeroOptimizer: reduce_in_backward=False is for stages 0-2 (a pipeline stage's optimizer); "
                         "stage 3 gathers and releases parameters in the backward's hooks")
    bf16_master = bf16_master or direct  # no master copy: the 16-bit parameters are stepped
    if offload_device == "nvme":
        master = "nvme"
    elif offload_device == "cpu":
        master = "host"
    else:
        master = "device" if dtype != torch.float32 and not bf16_master else "inplace"
    policy = ZeroPolicy(
        stage=zero_config.stage, shard_optimizer=shards.optimizer, shard_grads=shards.grads, shard_params=shards.params,
        precision=precision, dtype=dtype, communication_dtype=comm, master=master, offload_device=offload_device,
        params_on_nvme=zero_config.offload_param is not None and zero_config.offload_param.device == "nvme",
        loss_scaling=precision == "fp16" and not direct,
        check_overflow=precision == "bf16" and bool(bf16_config.check_grad_overflow), bf16_master=bf16_master,
        bf16_optimizer_states=bf16_states, cast_model=dtype != torch.float32 and not implied,
        auto_cast=bool(fp16_config.auto_cast) and precision == "fp16", reduce_in_backward=bool(reduce_in_backward),
        zeropp=zeropp_of(zero_config, shards.params))
    if isinstance(optimizer, type) and issubclass(optimizer, CompressedOptimizer):
        policy.check_compressed(optimizer.__name__)  # before the model is touched
    return policy, zero_config, fp16_config, gradient_accumulation_steps


def _check_zenflow_placement(stage: int, shards: Sharding, offload_device: str) -> None:
    """Where ZenFlow (``zero_optimization.zenflow``) runs in ds-zero: with ZeRO-Offload's CPU optimizer (it steps
    the unselected columns there), at stage 2 (gradients sharded, parameters whole); DeepSpeed also runs it at
    stages 1 and 3. Its section's own refusals are `_zenflow.check_zenflow`'s."""
    if offload_device != "cpu":
        raise ValueError(f"zero_optimization.zenflow needs offload_optimizer.device 'cpu' (ZenFlow steps the "
                         f"unselected columns there), got {offload_device!r}")
    if not shards.grads or shards.params:
        raise NotImplementedError(f"zero_optimization.zenflow at stage {stage} is not implemented in ds-zero "
                                  f"{version()}: use stage 2 (DeepSpeed also runs it at stages 1 and 3)")


def _check_bf16_master(precision: str, shards: Sharding, offload_device: str, bf16_states: bool) -> None:
    """DeepSpeed's rules for ``bf16.bf16_master_weights_and_grads`` (no float32 master copy: the
    optimizer steps the bf16 partition with the bf16 gradients), checked before the model is touched:
    bf16 training, ZeRO stage 1-3, and float32 optimizer states (``bf16.bf16_optimizer_states``
    false) only under ZeRO-Offload, whose CPU Adam keeps them."""
    if precision != "bf16":
        raise ValueError(f"{BF16_MASTER} needs bf16.enabled true (the master weights are the bf16 model's own); "
                         f"this is {'fp16' if precision == 'fp16' else 'float32'} training")
    if not shards.optimizer:
        raise ValueError(f"{BF16_MASTER} needs zero_optimization.stage 1, 2 or 3 (as in DeepSpeed), got 0 (1-bit "
                         "optimizers, which run at stage 0, cannot use it either)")
    if offload_device == "nvme":
        raise NotImplementedError(f"{BF16_MASTER} with zero_optimization.offload_optimizer.device 'nvme' is not "
                                  f"implemented in ds-zero {version()} (ZeRO-Infinity's files hold float32 master "
                                  "weights and states); offload to 'cpu', or remove the key")
    if not bf16_states and offload_device != "cpu":
        raise ValueError(f"{BF16_MASTER} with bf16.bf16_optimizer_states false keeps the optimizer states in "
                         "float32, which DeepSpeed allows only with ZeRO-Offload and its CPU Adam: set "
                         "bf16.bf16_optimizer_states true, or zero_optimization.offload_optimizer.device 'cpu' "
                         "(with ds_ops.CPUAdam)")
