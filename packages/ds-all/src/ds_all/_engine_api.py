"""The rest of DeepSpeed's ``DeepSpeedEngine`` API on `DeepSpeedEngine`: batch-size and accumulation
controls, state moves, module state dicts, the data-parallel helpers, optimizer information; its
configuration getters and the calls of features ds-all has not built are in ``_engine_getters.py``.

Getters that report whether such a feature is on answer False (it is off: the config refuses it), as
DeepSpeed's do with the feature disabled; calls that would use it raise `NotImplementedError`. A mixin:
the engine (``_engine.py``) owns the state; nothing here computes what a package below computes.
"""

from __future__ import annotations

import gc
import logging
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

import ds_comm
import ds_ops
from ds_zero import OffloadDeviceEnum

from . import _moe
from ._engine_getters import _DTYPES, EngineGetters, _setting, not_built
from ._optimizers import optimizer_class

logger = logging.getLogger("ds_all")
_MISSING = object()


class EngineAPI(EngineGetters):
    """DeepSpeed's engine methods beyond the training loop (see the module docstring)."""

    def __getattr__(self, name: str) -> Any:
        """What the engine lacks is read from the wrapped model (``engine.some_model_attribute``), as
        DeepSpeed's engine passes attribute reads through to ``self.module``. The engine's own names never are:
        Python calls this also when one of the engine's properties raised AttributeError (a part lacking what the
        property reads), and then the property's own error is raised, not masked by the model's attribute of the
        same name; a part (`PART_NAMES`) read before the engine built it is an error too."""
        try:
            return super().__getattr__(name)  # nn.Module's: parameters, buffers, submodules
        except AttributeError:
            pass
        cls = type(self)
        for klass in cls.__mro__:  # the engine's own attribute, whose __get__ raised: again, for its error
            attribute = klass.__dict__.get(name, _MISSING)
            if attribute is not _MISSING:
                if hasattr(attribute, "__get__"):
                    return attribute.__get__(self, cls)
                break
        if name in getattr(cls, "PART_NAMES", ()):
            raise AttributeError(f"'{cls.__name__}' object has no part '{name}' yet: the engine builds it in "
                                 "__init__, and nothing reads it before")
        modules = self.__dict__.get("_modules")  # absent before nn.Module.__init__: no recursion
        module = modules.get("module") if modules is not None else None
        if module is not None:
            try:
                return getattr(module, name)
            except AttributeError:
                pass
        raise AttributeError(f"'{cls.__name__}' object has no attribute '{name}'")

    # The instance attributes DeepSpeed's engine sets that ds has values for (``__init__`` calls this).
    def _init_api_attributes(self, optimizer: Any, lr_scheduler: Any, training_data: Any, collate_fn: Any) -> None:
        self.client_optimizer, self.client_lr_scheduler = optimizer, lr_scheduler
        self.training_data, self.collate_fn = training_data, collate_fn
        self.gradient_average = True  # gradients are averaged over the data-parallel ranks
        self.enable_backward_allreduce = True  # ZeRO reduces in backward (there is no other way in ds)
        self.inside_no_sync_ctxt = False
        self.pipeline_parallelism = False
        self.dist_backend = torch.distributed.get_backend() if ds_comm.is_initialized() else None
        self._boundary_override: bool | None = None  # set_gradient_accumulation_boundary's (no_sync restores it)
        self.warn_unscaled_loss = True

    # ------------------------------------------------------------------------------ batch sizes
    def get_batch_info(self) -> tuple[int, int, int]:
        """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)``."""
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """A new global batch size, reached by changing the accumulation steps (the micro-batch stays);
        between accumulations only."""
        micro = self.train_micro_batch_size_per_gpu() * self.dp_world_size
        if isinstance(train_batch_size, bool) or not isinstance(train_batch_size, int) or train_batch_size < 1 \
                or train_batch_size % micro:
            raise ValueError(f"set_train_batch_size: train_batch_size must be a positive multiple of "
                             f"train_micro_batch_size_per_gpu {self.train_micro_batch_size_per_gpu()} × "
                             f"{self.dp_world_size} data-parallel ranks = {micro}, got {train_batch_size!r}")
        steps = train_batch_size // micro
        self._set_accumulation_steps(steps)
        self.config = self.config.model_copy(update={"train_batch_size": train_batch_size,
                                                     "gradient_accumulation_steps": steps})

    def _set_accumulation_steps(self, steps: int) -> None:
        if self.zero is not None:
            self.zero.set_gradient_accumulation_steps(steps)

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """A new micro-batch size; the accumulation steps stay, so the global batch size follows. The
        loader `initialize` built keeps its batch size (as DeepSpeed's)."""
        if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise ValueError(f"set_train_micro_batch_size: micro_batch_size must be a positive integer, got "
                             f"{micro_batch_size!r}")
        train = micro_batch_size * self.gradient_accumulation_steps() * self.dp_world_size
        self.config = self.config.model_copy(update={"train_batch_size": train,
                                                     "train_micro_batch_size_per_gpu": micro_batch_size})

    # ------------------------------------------------------------------- accumulation boundary
    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Decide the accumulation boundary by hand (DeepSpeed's pattern: False before the first
        ``gas - 1`` backwards, True before the last, then one ``step()``); None: counted again."""
        zero = self._require_optimizer("set_gradient_accumulation_boundary")
        zero.set_gradient_accumulation_boundary(is_boundary)
        self._boundary_override = is_boundary

    @contextmanager
    def no_sync(self):
        """Backwards inside accumulate gradients without reducing them (stages 0-1; the reduction of
        the next backward outside includes them); ``step()`` inside is an error."""
        zero = self._require_optimizer("no_sync")
        if self.zero_optimization_partition_gradients():
            raise RuntimeError(f"engine.no_sync: ZeRO stage {self.zero_optimization_stage()} partitions gradients as "
                               "they are produced; no_sync works with stages 0 and 1 (as in DeepSpeed)")
        if self.inside_no_sync_ctxt:
            raise RuntimeError("engine.no_sync: already inside no_sync (it does not nest)")
        zero.set_gradient_accumulation_boundary(False)
        self.inside_no_sync_ctxt = True
        try:
            yield
        finally:
            self.inside_no_sync_ctxt = False
            zero.set_gradient_accumulation_boundary(self._boundary_override)

    @contextmanager
    def coalesce_grad_reduction(self):
        raise not_built("coalesce_grad_reduction", "coalescing ZeRO's reductions of several backwards "
                        "(ds-zero reduces each bucket as backward completes it)")
        yield  # pragma: no cover

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` as `backward` would differentiate it (divided by the accumulation steps, times the fp16
        loss scale), for ``engine.scale(loss).backward()`` followed by ``engine.step()``."""
        zero = self._require_optimizer("scale")
        if not torch.is_tensor(loss) or loss.numel() != 1 or loss.grad_fn is None:
            raise ValueError(f"engine.scale: loss must be a one-element tensor with a grad_fn, got "
                             f"{type(loss).__name__}{tuple(loss.shape) if torch.is_tensor(loss) else ''}")
        if zero.gradient_accumulation_steps > 1:
            loss = loss / zero.gradient_accumulation_steps
        return loss.float() * zero.loss_scale if self.fp16_enabled() else loss

    # -------------------------------------------------------------------------- states and memory
    def offload_states(self, include: Any = None, device: OffloadDeviceEnum = OffloadDeviceEnum.cpu,
                       pin_memory: bool = True, non_blocking: bool = False) -> None:
        """Move ZeRO's states (``include``: `ds_zero.OffloadStateTypeEnum` values, default all) to the host
        until `reload_states`; see `ds_zero.ZeroOptimizer.offload_states`."""
        self._require_optimizer("offload_states").offload_states(include=include, device=device,
                                                                  pin_memory=pin_memory, non_blocking=non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Move the states `offload_states` moved back where they were."""
        self._require_optimizer("reload_states").reload_states(non_blocking=non_blocking)

    def empty_partition_cache(self) -> None:
        """Stage 3: give back the memory of gathered parameters (they are gathered again when used)."""
        partitioned = self.zero if self.zero is not None and self.zero.stage == 3 else \
            getattr(self, "_zero_inference", None)  # stage 3 without an optimizer
        if partitioned is not None:
            partitioned.empty_partition_cache()
            gc.collect()
            ds_ops.get_accelerator().empty_cache()

    def collect_python_gc(self) -> int:
        """Run Python's cyclic garbage collector now; returns what it found unreachable."""
        return gc.collect()

    def get_wall_clock_timers(self) -> dict[str, float]:
        """The engine's timers so far (``wall_clock_breakdown``), milliseconds by name."""
        return self.timers.elapsed_all()

    # ------------------------------------------------------------------------------ module state
    def module_state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> dict[str, Any]:
        """The module's ``state_dict()`` (at stage 3 its parameters are partitioned: use
        `save_16bit_model` or ``ds_zero.GatheredParameters`` for whole ones)."""
        state = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, p in self.module.named_parameters():
                if not p.requires_grad:
                    state.pop(prefix + name, None)
        return state

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """DeepSpeed's (Accelerate's ``get_state_dict`` and Transformers' ``Trainer.save_model`` call it at
        stage 3): the module's state dict with every parameter whole, in its training dtype, on rank 0,
        tied parameters one tensor under each name; ``None`` on the other ranks. Every rank calls it."""
        partitioned = self.zero if self.zero is not None else self._zero_inference
        if self.config.zero_optimization.stage != 3 or partitioned is None:
            raise ValueError("_zero3_consolidated_16bit_state_dict needs ZeRO stage 3, this engine runs stage "
                             f"{self.config.zero_optimization.stage}: use module.state_dict()")
        state = partitioned.full_state_dict()
        if self.global_rank != 0:
            return None
        frozen = {n for n, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad} \
            if exclude_frozen_parameters else set()
        return OrderedDict((k, v) for k, v in state.items() if k not in frozen)

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """DeepSpeed's: `_zero3_consolidated_16bit_state_dict` at stage 3; under AutoTP
        (``tensor_parallel.autotp_size`` > 1) the module's state dict with its tensor-parallel slices gathered,
        on rank 0 (None elsewhere); a ValueError otherwise, as DeepSpeed's. Every rank calls it."""
        if self.config.zero_optimization.stage == 3:
            return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        if self.autotp_size() > 1:
            return self.parallel_groups.tp_consolidated_16bit_state_dict()
        raise ValueError("_consolidated_16bit_state_dict is for partitioned weights (ZeRO stage 3 or tensor "
                         f"parallelism), this engine runs stage {self.config.zero_optimization.stage} without AutoTP")

    def load_module_state_dict(self, checkpoint: dict, strict: bool = True, custom_load_fn: Any = None,
                               fetch_z3_params: bool = False, z3_params_to_fetch: Any = None,
                               allowed_missing_keys: Any = None) -> None:
        """Load ``checkpoint["module"]`` into the module (``custom_load_fn(src=..., dst=module)`` instead,
        if given); ZeRO's float32 master copy follows. At stage 3 the parameters are gathered for it when
        ``fetch_z3_params`` (or ``z3_params_to_fetch``) says so, as in DeepSpeed."""
        import ds_zero

        if not isinstance(checkpoint, dict) or "module" not in checkpoint:
            raise ValueError(f"load_module_state_dict: checkpoint must be a dict with a 'module' entry, got "
                             f"{type(checkpoint).__name__}")
        if z3_params_to_fetch is not None:
            fetch = list(z3_params_to_fetch)
        else:
            fetch = list(self.module.parameters()) if fetch_z3_params and self.zero_optimization_stage() == 3 else []
        with ds_zero.GatheredParameters(fetch, modifier_rank=0, enabled=bool(fetch)):
            state = checkpoint["module"]
            if custom_load_fn is not None:
                custom_load_fn(src=state, dst=self.module)
            else:
                result = self.module.load_state_dict(state, strict=strict and allowed_missing_keys is None)
                if strict and allowed_missing_keys is not None:
                    missing = set(result.missing_keys) - set(allowed_missing_keys)
                    if missing or result.unexpected_keys:
                        raise RuntimeError(f"load_module_state_dict: missing keys {sorted(missing)}, unexpected "
                                           f"keys {sorted(result.unexpected_keys)}")
        if self.zero is not None:
            self.zero.refresh_fp32_params()

    @staticmethod
    def load_moe_state_dict(checkpoint_path: Any, tag: Any, state_dict: dict, old_moe_load: bool,
                            model: torch.nn.Module | None = None, mpu: Any = None, num_experts: Any = 1,
                            checkpoint_engine: Any = None, autoep_layers: Any = None, folding_spec: Any = None,
                            checkpoint_mp_rank: int | None = None) -> None:
        """DeepSpeed's: this rank's experts from a DeepSpeed checkpoint's per-expert files
        (``layer_<L>_expert_<global id>_mp_rank_<mp>_model_states.pt``; ``old_moe_load``:
        ``expert_<global id>_...``) into ``state_dict``, in place, under their local expert indices
        (``global id = expert-parallel rank * num_local_experts + local``). ``checkpoint_engine``: an object
        with DeepSpeed's ``load(path, map_location=)``; None reads with ``torch.load(weights_only=True)``."""
        _moe.load_moe_state_dict(checkpoint_path, tag, state_dict, old_moe_load, model=model, mpu=mpu,
                                 num_experts=num_experts, checkpoint_engine=checkpoint_engine,
                                 autoep_layers=autoep_layers, folding_spec=folding_spec,
                                 checkpoint_mp_rank=checkpoint_mp_rank)

    # ------------------------------------------------------------------ data-parallel helpers
    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are reduced in: ZeRO's (``communication_data_type``, else by precision)."""
        if self.zero is not None:
            return self.zero.communication_data_type
        if self.config.communication_data_type is not None:
            return _DTYPES[self.config.communication_data_type]
        return torch.float16 if self.fp16_enabled() else torch.bfloat16 if self.bfloat16_enabled() else torch.float32

    @communication_data_type.setter
    def communication_data_type(self, value: torch.dtype) -> None:
        if value != self.communication_data_type:
            raise RuntimeError(f"engine.communication_data_type: ZeRO's reduction buffers are built in "
                               f"{self.communication_data_type}; set communication_data_type in the config instead "
                               f"of {value}")

    def allreduce_bucket(self, bucket: list[torch.Tensor], dp_group: Any, dp_world_size: int | None = None
                         ) -> torch.Tensor:
        """The tensors of ``bucket`` flattened and averaged over ``dp_group`` (in `communication_data_type`,
        divided as ``prescale_gradients`` / ``gradient_predivide_factor`` say); returns the flat result."""
        tensor = _flatten_dense_tensors(bucket)
        reduced = tensor if tensor.dtype == self.communication_data_type else tensor.to(self.communication_data_type)
        n = dp_world_size if dp_world_size is not None else ds_comm.get_world_size(dp_group)
        factor = self.gradient_predivide_factor()
        if not self.gradient_average:
            ds_comm.all_reduce(reduced, group=dp_group)
        elif self.postscale_gradients():
            if factor != 1.0:
                reduced.mul_(1.0 / factor)
            ds_comm.all_reduce(reduced, group=dp_group)
            if factor != n:
                reduced.mul_(factor / n)
        else:
            reduced.mul_(1.0 / n)
            ds_comm.all_reduce(reduced, group=dp_group)
        if reduced is not tensor:
            tensor.copy_(reduced)
        return tensor

    def allreduce_and_copy(self, small_bucket: list[torch.Tensor], dp_group: Any,
                           dp_world_size: int | None = None) -> None:
        reduced = self.allreduce_bucket(small_bucket, dp_group, dp_world_size)
        for tensor, synced in zip(small_bucket, _unflatten_dense_tensors(reduced, small_bucket), strict=True):
            tensor.copy_(synced)

    def allreduce_no_retain(self, bucket: list[torch.Tensor], dp_group: Any, numel_per_bucket: int = 500_000_000,
                            dp_world_size: int | None = None) -> None:
        """Average ``bucket``'s tensors over ``dp_group`` in place, ``numel_per_bucket`` elements at a time."""
        small, numel = [], 0
        for tensor in bucket:
            small.append(tensor)
            numel += tensor.numel()
            if numel > numel_per_bucket:
                self.allreduce_and_copy(small, dp_group, dp_world_size)
                small, numel = [], 0
        if small:
            self.allreduce_and_copy(small, dp_group, dp_world_size)

    def buffered_allreduce_fallback(self, grads: list[torch.Tensor] | None = None,
                                    elements_per_buffer: int = 500_000_000) -> None:
        """Average ``grads`` over the data-parallel ranks in place, per dtype. Without ``grads`` (the
        model's own): ZeRO reduces those in backward already, so that is a RuntimeError."""
        if grads is None:
            raise RuntimeError("engine.buffered_allreduce_fallback: the model's gradients are ZeRO's, reduced in "
                               "backward bucket by bucket; pass the tensors to reduce (grads=[...])")
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for grad in grads:
            if grad.is_sparse:
                raise not_built("buffered_allreduce_fallback", "sparse gradients")
            by_dtype.setdefault(grad.dtype, []).append(grad)
        for tensors in by_dtype.values():
            self.allreduce_no_retain(tensors, self.data_parallel_group, elements_per_buffer)

    def all_gather_scalar(self, value: torch.Tensor, dp_group: Any) -> list[torch.Tensor]:
        out = [torch.zeros_like(value) for _ in range(ds_comm.get_world_size(dp_group))]
        ds_comm.all_gather(out, value, group=dp_group)
        return out

    def allreduce_gradients(self, bucket_size: int = 500_000_000) -> None:
        """DeepSpeed's: the data-parallel reduction of this backward's gradients. ds-zero issues it in
        backward's hooks, bucket by bucket; this completes what is in flight (``bucket_size`` is not read)."""
        if self.zero is None:
            raise RuntimeError("engine.allreduce_gradients: this engine has no optimizer (nothing reduces gradients)")
        self.zero.wait_reductions()

    def sparse_allreduce_no_retain(self, *args: Any, **kwargs: Any) -> None:
        raise not_built("sparse_allreduce_no_retain", "sparse gradients (sparse_gradients)")

    def sparse_allreduce_bucket(self, *args: Any, **kwargs: Any) -> None:
        raise not_built("sparse_allreduce_bucket", "sparse gradients (sparse_gradients)")

    def sparse_allreduce(self, *args: Any, **kwargs: Any) -> None:
        raise not_built("sparse_allreduce", "sparse gradients (sparse_gradients)")

    def sparse_all_gather(self, *args: Any, **kwargs: Any) -> None:
        raise not_built("sparse_all_gather", "sparse gradients (sparse_gradients)")

    def clip_fp32_gradients(self) -> None:
        raise NotImplementedError("engine.clip_fp32_gradients: ZeRO clips the reduced gradients inside step() "
                                  "(gradient_clipping); the module's .grad are its unreduced buffers")

    # --------------------------------------------------------------------------- optimizer info
    def _optimizer_param(self, name: str) -> list[Any]:
        if self.optimizer is None:
            return []
        return [group.get(name, 0.0) for group in self.optimizer.param_groups]

    def get_type(self) -> list[Any]:
        return self._optimizer_param("type")

    def get_mom(self) -> list[Any]:
        """Each group's ``momentum`` (SGD, RMSprop) or ``betas`` (the others)."""
        return self._optimizer_param("momentum" if self.optimizer_name() in ("SGD", "RMSprop") else "betas")

    def optimizer_name(self) -> str | None:
        """The client optimizer's class name, else the config's optimizer type (DeepSpeed's own types
        lower-cased, as DeepSpeed reports them)."""
        if self.client_optimizer is not None:
            return type(self.client_optimizer).__name__
        if self.config.optimizer is None:
            return None
        from ._monitor_config import OPTIMIZERS

        name = self.config.optimizer.type
        return name.lower() if name.lower() in OPTIMIZERS else name

    def optimizer_params(self) -> dict | None:
        return dict(self.config.optimizer.params) if self.config.optimizer is not None else None

    def optimizer_legacy_fusion(self) -> bool:
        return bool(_setting(self.config.optimizer, "legacy_fusion", False))

    def scheduler_name(self) -> str | None:
        return self.config.scheduler.type

    def scheduler_params(self) -> dict | None:
        return dict(self.config.scheduler.params) if self.config.scheduler.type is not None else None

    def get_optimizer_configuration(self, optimizer_parameters: dict, adam_w_mode: bool,
                                    allow_legacy_fallback: bool = False) -> tuple[type, dict[str, Any]]:
        """The Adam class DeepSpeed's rules pick (torch's with ``torch_adam``, CPU Adam with offload, else
        FusedAdam) and its mode arguments; ``torch_adam`` (and CPU Adam's ``fp32_optimizer_states``) are
        taken out of ``optimizer_parameters``, as DeepSpeed does."""
        torch_adam = optimizer_parameters.pop("torch_adam", False)
        fp32_states = optimizer_parameters.pop("fp32_optimizer_states", None)
        if torch_adam:
            foreach = optimizer_parameters.pop("foreach", None)
            return (torch.optim.AdamW if adam_w_mode else torch.optim.Adam), {"foreach": foreach}
        cls, kwargs = optimizer_class("adamw" if adam_w_mode else "adam", {"adam_w_mode": adam_w_mode},
                                      offload=self.zero_use_cpu_optimizer())
        if self.zero_use_cpu_optimizer():
            kwargs["fp32_optimizer_states"] = False if self.bf16_optimizer_states() else \
                (True if fp32_states is None else fp32_states)
        return cls, kwargs

    # ---------------------------------------------------------------------------- ranks, groups
    def get_data_parallel_rank(self) -> int:
        return self.mpu.get_data_parallel_rank() if self.mpu is not None else \
            ds_comm.get_rank(self.data_parallel_group)

    def get_model_parallel_rank(self) -> int:
        return self.mpu.get_model_parallel_rank() if self.mpu is not None else 0

    def get_tensor_parallel_rank(self) -> int:
        if self.mpu is None:
            return 0
        ask = getattr(self.mpu, "get_tensor_model_parallel_rank", None) or self.mpu.get_model_parallel_rank
        return ask()

    def get_sequence_parallel_group(self) -> Any:
        """The sequence-parallel (Ulysses) group of this rank: DeepSpeed's ``seq_parallel_group``."""
        if self.seq_parallel_group is None:
            raise RuntimeError("engine.get_sequence_parallel_group: this engine has no sequence parallelism "
                               "(sequence_parallel_size 1, and the mpu has no sequence-parallel group)")
        return self.seq_parallel_group
