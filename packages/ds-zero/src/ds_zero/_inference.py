"""`ZeroInference`: ZeRO stage 3 without an optimizer (evaluation), DeepSpeed's ``DeepSpeedZeRoOffload``.

Every parameter of the model (trainable or frozen) is partitioned as `ZeroOptimizer` partitions a
stage-3 model (one unit per module that owns parameters, each rank keeping one shard of each unit),
and `Stage3`'s hooks gather a module's units around its forward and release them after. Nothing
here computes gradients or steps: a model built under `Init` (or not) runs its forward with 1/N of
its parameters held between forwards. The model stays on its device (a GPU's or the CPU): the gather
buffers are there, and the partition too, or on the host with ``offload_param: {device: cpu}``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import ds_comm

from ._model import (
    broadcast_from_first_rank,
    check_same_model,
    param_name,
    version,
)
from ._not_built import refuse_what_is_not_built
from ._params import stage3_owner
from ._policy import require_partitioned_params
from ._precision import DTYPES, cast_floating_inputs
from ._sharded import ShardedParams, full_state_dict
from ._stage3 import Stage3
from ._zeropp import UnitGathers
from .config import BF16Config, FP16Config, ZeroConfig, mixed_precision


class ZeroInference:
    """Partition ``model`` for ZeRO stage 3 with no optimizer: each rank keeps one shard of every
    parameter, and a module's parameters are gathered around its forward (DeepSpeed's engine does
    this, with its ``DeepSpeedZeRoOffload``, when stage 3 is given no optimizer)::

        with ds_zero.Init():
            model = GPT()
        zero = ds_zero.ZeroInference(model, config={"stage": 3})
        with torch.no_grad():
            logits = model(tokens)

    ``config``: the ``zero_optimization`` section (or a whole DeepSpeed config; its stage must be 3).
    ``fp16``/``bf16``: those sections (or the whole config): with either enabled the floating-point
    parameters become 16-bit (buffers keep their dtype, as DeepSpeed 0.19.8's engine casts them), and
    ``fp16.auto_cast`` casts the forward's floating-point inputs. ``group``: the data-parallel process
    group (default: all ranks). ``close()`` makes every parameter whole again and removes the hooks (a
    collective: every rank closes)."""

    def __init__(self, model: nn.Module, *, config: Any = None, fp16: Any = None, bf16: Any = None,
                 group: Any = None):
        if not isinstance(model, nn.Module):
            raise ValueError(f"ZeroInference: model must be a torch.nn.Module, got {type(model).__name__}")
        self.config = ZeroConfig.from_section_or_ds_config(config)
        require_partitioned_params(self.config, "ZeroInference")
        refuse_what_is_not_built(self.config)
        if self.config.zero_quantized_nontrainable_weights:
            raise NotImplementedError("ZeroInference: zero_optimization.zero_quantized_nontrainable_weights (MixZ++) "
                                      f"is implemented for ZeroOptimizer's frozen parameters in ds-zero {version()}, "
                                      "not for ZeroInference; remove it (zero_quantized_weights quantizes the "
                                      "gathers)")
        fp16_config = FP16Config.from_section_or_ds_config(fp16)
        precision = mixed_precision(fp16_config, BF16Config.from_section_or_ds_config(bf16))
        if self.config.offload_param is not None and self.config.offload_param.device == "nvme":
            raise NotImplementedError(f"ZeroInference: offload_param.device 'nvme' is not implemented in ds-zero "
                                      f"{version()} without an optimizer; use 'cpu' or 'none'")
        if not ds_comm.is_initialized():
            raise RuntimeError("ZeroInference: the process group is not initialised; call ds_comm.init_distributed() "
                               "first")
        seen: set[int] = set()
        params = [p for p in model.parameters() if not (id(p) in seen or seen.add(id(p)))]
        if not params:
            raise ValueError("ZeroInference: the model has no parameter to partition")
        for p in params:
            if stage3_owner(p) is not None:
                raise ValueError(f"ZeroInference: parameter {param_name(model, p)} is managed by another stage-3 "
                                 "ZeroOptimizer or ZeroInference; close() that one first")
        if precision != "fp32":
            for p in params:
                if p.is_floating_point() and p.dtype != DTYPES[precision] and not hasattr(p, "ds_init_store"):
                    p.data = p.data.to(DTYPES[precision])
        devices = {p.device for p in params if not p.is_meta}
        if len(devices) > 1:
            raise ValueError(f"ZeroInference: the model's parameters are on several devices "
                             f"({sorted(map(str, devices))}); move the model to one device first")
        self.device = devices.pop() if devices else torch.device("cpu")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"ZeroInference: the model's parameters have several dtypes ({sorted(map(str, dtypes))}); "
                             "stage 3 keeps one flat partition of one dtype: cast the model first")
        self.model, self.group = model, group
        self.world_size, self.rank = ds_comm.get_world_size(group), ds_comm.get_rank(group)
        self.dtype = dtypes.pop()
        check_same_model(model, params, group, self.world_size, self.device)
        broadcast_from_first_rank(model, group)
        sharded = ShardedParams(model, params, config=self.config, group=group, dtype=self.dtype, device=self.device)
        self.layout, self._partition = sharded.layout, sharded.partition
        sharded.fill()  # (whole or built under Init: this rank's shards, then released)
        # qwZ's gathers with zero_quantized_weights (hpZ and qgZ act in a backward: none here)
        self._stage3: Stage3 | None = sharded.attach(
            gatherer=UnitGathers(group, quantized=bool(self.config.zero_quantized_weights)))
        self._hooks = []
        if precision == "fp16" and fp16_config.auto_cast:
            self._hooks.append(model.register_forward_pre_hook(cast_floating_inputs(self.dtype), with_kwargs=True))

    def full_state_dict(self, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The model's ``state_dict()`` with every parameter whole, as copies (a collective: every rank calls
        it). With ``rank0_only`` the other ranks get ``{}`` and hold no copy."""
        return full_state_dict(self.model, [self._stage3], keep=not rank0_only or self.rank == 0)

    def empty_partition_cache(self) -> None:
        """Release every gathered parameter not persistent or in use, and the pooled gather buffers."""
        if self._stage3 is not None:
            self._stage3.empty_cache()

    def close(self) -> None:
        """Every parameter whole again, the hooks removed (a collective: every rank closes)."""
        if self._stage3 is not None:
            self._stage3.gather_all()
            self._stage3 = None
            self._partition = None
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
