"""What DeepSpeed's engine asks of its ZeRO optimizer besides the loop and the offloads: a new number of
accumulation steps (``engine.set_train_batch_size``), the master copy taken again from the model's
weights after they were loaded into it (``refresh_fp32_params``), and stage 3's gathered parameters
and their buffers given back (``empty_partition_cache``). A mixin: `ZeroOptimizer` owns the state."""

from __future__ import annotations

import gc

from ._filling import fill_master, refuse_with_nvme


class EngineCalls:
    """See the module docstring."""

    @property
    def fp16_groups(self) -> list[list]:
        """The model's parameters this optimizer trains, one list per parameter group in the groups'
        order (DeepSpeed's ZeRO optimizers' ``fp16_groups``/``bit16_groups``: the parameters whatever their
        dtype; at stage 3 they are the partitioned parameters, made whole by `GatheredParameters`).
        Read-only: a new list each time."""
        groups: list[list] = [[] for _ in range(self._group_count)]
        for param, group in zip(self._params, self._group_of, strict=True):
            groups[group].append(param)
        return groups

    @property
    def bit16_groups(self) -> list[list]:
        """`fp16_groups` under DeepSpeed's other name (ZeRO-1/2)."""
        return self.fp16_groups

    @property
    def nccl_start_alignment_factor(self) -> int:
        """The number of elements each rank's partition of a bucket is a multiple of, so that every
        partition starts at a multiple of it (DeepSpeed's ZeRO-1/2: 2, four bytes of fp16; ds-zero: 1,
        or a 4 KiB page of elements for stage 3's parameters on NVMe)."""
        return self.layout.align

    def set_gradient_accumulation_steps(self, steps: int) -> None:
        """Accumulate ``steps`` micro-steps per optimizer step from the next accumulation on. Only at an
        accumulation's start (between a boundary's step and the next backward): a RuntimeError otherwise."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be an integer >= 1, got {steps!r}")
        if not self.reduce_in_backward and steps != 1:
            raise ValueError("ZeroOptimizer: reduce_in_backward=False means the caller accumulates the micro-steps "
                             f"(a pipeline stage); gradient_accumulation_steps must stay 1, got {steps}")
        if not self._last_step_was_boundary or self._reducer.accumulated or self._reducer.fired:
            raise RuntimeError("ZeroOptimizer.set_gradient_accumulation_steps: an accumulation is under way (micro-"
                               "steps since the last boundary); change it after the boundary's step()")
        self.gradient_accumulation_steps = steps
        self._micro_step = 0  # the next micro-step starts an accumulation of the new length

    def refresh_fp32_params(self) -> None:
        """Take the float32 master copy again from the model's parameters (DeepSpeed's name), after
        something wrote them directly (``model.load_state_dict``): otherwise the next step would put the
        master copy's values back. Nothing to do in float32 (the parameters are the master copy) or at
        stage 3 (`GatheredParameters` with a ``modifier_rank`` updates it)."""
        refuse_with_nvme(self._nvme, "refresh_fp32_params")
        if self._master is not None and not self.policy.shard_params:
            fill_master(self._master, self._params, self.layout, self.rank, sharded=self.policy.shard_optimizer,
                        dtype=self.dtype)

    def empty_partition_cache(self) -> None:
        """Stage 3: release every gathered parameter not persistent or in use, and the pooled gather
        buffers (DeepSpeed's name); they are gathered again when used. Nothing at stages 0-2."""
        if self._stage3 is not None:
            self._stage3.empty_cache()
            if self._frozen is not None:
                self._frozen.stage3.empty_cache()
            gc.collect()
