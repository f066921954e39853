"""``FlopsProfiler``: DeepSpeed's flops profiler API over a model's forward calls.

Between ``start_profile()`` and ``stop_profile()`` every module of the model carries a forward
pre-hook and an always-called forward hook. The pre-hook pushes a frame on a stack (and, for the
outermost module, pushes the counting mode on torch's mode stack); the counting mode adds each
op's flops to the top frame; the hook pops the frame, adds its totals to the module's record and
to its caller's frame (for the outermost module: to the profiler's totals, and pops the mode). A module called twice is
counted twice; a module's ops are counted once however deeply it is nested.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from functools import partial
from pathlib import Path

import torch
from ds_config import write_atomic
from torch import nn

from . import _report
from ._format import duration_to_string, flops_to_string, macs_to_string, params_to_string
from ._mode import CountingMode, Frame
from ._timing import CpuClock, clock_for
from .profile import ModuleProfile

logger = logging.getLogger(__name__)

# DeepSpeed's global timer names (engine.timers(name).elapsed(reset=False) -> milliseconds).
FORWARD_TIMER, BACKWARD_TIMER, STEP_TIMER = "fwd", "bwd", "step"


class _Record:
    """Per module instance: what its forward calls did since the last reset."""

    __slots__ = ("active", "calls", "duration", "flops", "ignored", "macs", "module", "name", "params",
                 "self_flops", "self_macs", "trainable_params")

    def __init__(self, module: nn.Module, name: str, ignored: bool) -> None:
        self.module = module
        self.name = name
        self.ignored = ignored
        self.params = 0
        self.trainable_params = 0
        for p in module.parameters():
            n = _numel(p)
            self.params += n
            if p.requires_grad:
                self.trainable_params += n
        self.reset()

    def reset(self) -> None:
        self.flops = self.macs = self.self_flops = self.self_macs = 0
        self.duration = 0.0
        self.calls = 0
        self.active = 0


class _Totals:
    """Every profiled call that emptied the module stack: the model's own forward calls, and a
    submodule called on its own (an encoder-decoder's ``generate`` runs ``get_encoder()(...)``
    outside the model's forward)."""

    __slots__ = ("duration", "flops", "macs")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.flops = self.macs = 0
        self.duration = 0.0


def _numel(p: torch.Tensor) -> int:
    """ZeRO-3 partitions parameters and keeps the full size in ``ds_numel``."""
    return int(getattr(p, "ds_numel", 0) or p.numel())


def _validate_print_options(profile_step, module_depth, top_modules) -> None:
    if isinstance(module_depth, bool) or not isinstance(module_depth, int) or module_depth < -1:
        raise ValueError(f"module_depth must be -1 (every depth) or an integer >= 0, got {module_depth!r}")
    if isinstance(top_modules, bool) or not isinstance(top_modules, int) or top_modules < 1:
        raise ValueError(f"top_modules must be an integer >= 1, got {top_modules!r}")
    if isinstance(profile_step, bool) or not isinstance(profile_step, int) or profile_step < 0:
        raise ValueError(f"profile_step must be an integer >= 0, got {profile_step!r}")


class FlopsProfiler:
    """Measures the flops, MACs, parameters and latency of a model's forward calls, per module.

    ``FlopsProfiler(model)``, then ``start_profile()``, run forward passes, ``stop_profile()``,
    read ``get_total_flops()`` etc. or ``print_model_profile()``, and ``end_profile()``.
    ``ds_engine`` (optional) supplies parallel sizes, batch size and fwd/bwd/step timers for the
    summary; ``recompute_fwd_factor`` is the fraction of the forward recomputed in the backward
    (activation checkpointing): the backward is estimated as ``2 + recompute_fwd_factor`` forwards.
    """

    def __init__(self, model: nn.Module, ds_engine=None, recompute_fwd_factor: float = 0.0) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"FlopsProfiler needs a torch.nn.Module, got {type(model).__name__}")
        if (isinstance(recompute_fwd_factor, bool) or not isinstance(recompute_fwd_factor, (int, float))
                or not math.isfinite(recompute_fwd_factor) or recompute_fwd_factor < 0):
            raise ValueError(f"recompute_fwd_factor must be a number >= 0, got {recompute_fwd_factor!r}")
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = float(recompute_fwd_factor)
        self.started = False
        self._records: dict[nn.Module, _Record] = {}
        self._totals = _Totals()
        self._handles: list = []
        self._stack: list[Frame] = []
        self._mode = CountingMode(self._stack)
        self._clock = CpuClock()
        self._clocks: dict[str, object] = {}

    # -- lifecycle ------------------------------------------------------------------------------

    def start_profile(self, ignore_list=None) -> None:
        """Attach the hooks and start counting from zero. ``ignore_list``: module classes or
        instances whose forward (and everything inside it) is not counted."""
        ignore_types, ignore_instances = _split_ignore_list(ignore_list)
        self._remove_hooks()
        self._abort_forward()
        self._records = {}
        for name, module in self.model.named_modules():
            # Only the module's own membership: what runs inside an ignored module is skipped at
            # run time (Frame.counting), so a module shared with a parent that is not ignored
            # still counts when that parent calls it.
            ignored = id(module) in ignore_instances or isinstance(module, ignore_types)
            self._records[module] = _Record(module, name, ignored)
        self._totals.reset()
        for module, record in self._records.items():
            self._handles.append(module.register_forward_pre_hook(partial(self._enter, record), with_kwargs=True))
            self._handles.append(module.register_forward_hook(partial(self._exit, record), always_call=True))
        self._clocks = {}
        self.started = True

    def stop_profile(self) -> None:
        """Detach the hooks: counting stops, the numbers stay readable."""
        self._remove_hooks()
        self._abort_forward()

    def reset_profile(self) -> None:
        """Zero the counts and times, keep profiling."""
        self._resolve_clocks()
        for record in self._records.values():
            record.reset()
        self._totals.reset()

    def end_profile(self) -> None:
        """Detach everything and drop the numbers (call after reading or printing them)."""
        self.stop_profile()
        self._records = {}
        self._totals.reset()
        self._clocks = {}
        self.started = False

    # -- hooks ----------------------------------------------------------------------------------

    def _enter(self, record: _Record, module, args, kwargs) -> None:
        stack = self._stack
        if stack:
            counting = stack[-1].counting and not record.ignored
        else:
            self._begin_forward(args, kwargs)
            counting = not record.ignored
        record.active += 1
        stack.append(Frame(record, counting, self._clock.start()))

    def _exit(self, record: _Record, module, args, output) -> None:
        stack = self._stack
        if not stack:
            return
        if stack[-1].record is not record:
            # Our pre-hook did not run for this call (an earlier pre-hook raised): nothing to close.
            if not any(frame.record is record for frame in stack):
                return
            while stack[-1].record is not record:
                self._close(stack.pop())
        self._close(stack.pop())
        if not stack:
            self._mode.leave()

    def _close(self, frame: Frame) -> None:
        record = frame.record
        record.active -= 1
        record.calls += 1
        flops = frame.self_flops + frame.child_flops
        macs = frame.self_macs + frame.child_macs
        record.self_flops += frame.self_flops
        record.self_macs += frame.self_macs
        timed = []
        if record.active == 0:  # a module inside itself is counted by its outermost call only
            record.flops += flops
            record.macs += macs
            timed.append(record)
        if self._stack:
            parent = self._stack[-1]
            parent.child_flops += flops
            parent.child_macs += macs
        else:  # the stack emptied: one whole profiled call, the model's or a submodule's alone
            totals = self._totals
            totals.flops += flops
            totals.macs += macs
            timed.append(totals)
        if timed:
            self._clock.stop(frame.start, *timed)

    def _begin_forward(self, args, kwargs) -> None:
        device_type = _device_type(self.model, args, kwargs)
        clock = self._clocks.get(device_type)
        if clock is None:
            clock = self._clocks[device_type] = clock_for(device_type)
        self._clock = clock
        self._mode.enter()

    def _abort_forward(self) -> None:
        """Undo a forward that never reached its end hook (e.g. interrupted by KeyboardInterrupt)."""
        self._stack.clear()
        for record in self._records.values():
            record.active = 0
        self._mode.leave()

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _resolve_clocks(self) -> None:
        for clock in self._clocks.values():
            clock.resolve(self._records.values())

    # -- reading the profile --------------------------------------------------------------------

    def _root(self) -> _Record:
        record = self._records.get(self.model)
        if record is None:
            raise RuntimeError("no profile to read: call start_profile() and run the model's forward first "
                               "(and read the profile before end_profile())")
        self._resolve_clocks()
        return record

    def get_total_flops(self, as_string: bool = False):
        """Floating-point operations of the profiled forward calls (``'2.2 G'`` with as_string):
        the model's, and those of submodules called outside the model's forward."""
        self._root()
        flops = self._totals.flops
        return flops_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False):
        """Multiply-accumulate operations of the profiled forward calls (``'1.1 GMACs'``)."""
        self._root()
        macs = self._totals.macs
        return macs_to_string(macs) if as_string else macs

    def get_total_params(self, as_string: bool = False, *, trainable_only: bool = False):
        """Parameters of the model (each tensor once), or only those with ``requires_grad``."""
        root = self._root()
        params = root.trainable_params if trainable_only else root.params
        return params_to_string(params) if as_string else params

    def get_total_duration(self, as_string: bool = False):
        """Seconds spent in the profiled forward calls (``'12.3 ms'``), as get_total_flops."""
        self._root()
        duration = self._totals.duration
        return duration_to_string(duration) if as_string else duration

    def get_profile(self) -> ModuleProfile:
        """The profile as a tree of :class:`ModuleProfile` records, shaped like the model."""
        self._root()
        return self._build(self.model, "", 0, False)

    def _build(self, module: nn.Module, name: str, depth: int, inside_ignored: bool) -> ModuleProfile:
        record = self._records.get(module)
        if record is None:  # a submodule added after start_profile()
            record = _Record(module, name, False)
        ignored = inside_ignored or record.ignored  # shown ignored below an ignored parent, here
        children = tuple(
            self._build(child, f"{name}.{key}" if name else key, depth + 1, ignored)
            for key, child in module.named_children()
        )
        flops, macs, duration = record.flops, record.macs, record.duration
        if record.calls == 0 and children and type(module).forward is nn.Module.forward:
            # A container that is iterated, never called (ModuleList, ModuleDict): its children's sum.
            flops = sum(child.flops for child in children)
            macs = sum(child.macs for child in children)
            duration = sum(child.duration for child in children)
        return ModuleProfile(
            name=name, type_name=type(module).__name__, depth=depth, params=record.params,
            trainable_params=record.trainable_params, flops=flops, macs=macs,
            self_flops=record.self_flops, self_macs=record.self_macs, duration=duration,
            calls=record.calls, ignored=ignored, extra_repr=module.extra_repr(), children=children,
        )

    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: str | os.PathLike | None = None) -> str:
        """Print the summary, the aggregated profile per depth and (``detailed``) the per-module
        tree, to stdout or to ``output_file``; returns the text."""
        _validate_print_options(profile_step, module_depth, top_modules)
        root = self.get_profile()
        text = _report.format_profile(
            root, self._summary(root), profile_step=profile_step, module_depth=module_depth,
            top_modules=top_modules, detailed=detailed, recompute_fwd_factor=self.recompute_fwd_factor,
        )
        if output_file is None:
            sys.stdout.write(text)
            sys.stdout.flush()
        else:
            _write_atomically(Path(output_file), text)
            logger.info("flops profile written to %s", output_file)
        return text

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> str:
        """Only the aggregated profile per depth (DeepSpeed's method of the same name)."""
        _validate_print_options(1, module_depth, top_modules)
        text = "\n".join(_report.format_aggregated(self.get_profile(), module_depth, top_modules)) + "\n"
        sys.stdout.write(text)
        return text

    def _summary(self, root: ModuleProfile) -> _report.Summary:
        totals = self._totals
        summary = _report.Summary(flops=totals.flops, macs=totals.macs, duration=totals.duration,
                                  fwd_latency=totals.duration)
        engine = self.ds_engine
        if engine is None:
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                summary.world_size = summary.dp_size = torch.distributed.get_world_size()
            return summary
        summary.from_engine = True
        summary.world_size = _engine_size(engine, "world_size", 1)
        summary.mp_size = _engine_size(engine, "mp_world_size", 1)
        # DeepSpeed's engine reports dp_world_size=None under Ulysses sequence parallelism; its
        # profiler then shows seq_dp_world_size, the effective data-parallel replication (#7483).
        summary.dp_size = _engine_size(engine, "dp_world_size", None)
        if summary.dp_size is None:
            summary.dp_size = _engine_size(engine, "seq_dp_world_size", max(1, summary.world_size // summary.mp_size))
        batch = _engine_value(engine, "train_micro_batch_size_per_gpu", None)
        summary.batch_size = int(batch) if batch is not None else None
        if _engine_value(engine, "wall_clock_breakdown", False) and hasattr(engine, "timers"):
            def elapsed(name):
                return engine.timers(name).elapsed(False) / 1000.0

            summary.fwd_latency = elapsed(FORWARD_TIMER)
            summary.bwd_latency = elapsed(BACKWARD_TIMER)
            summary.step_latency = elapsed(STEP_TIMER)
        return summary


def _engine_value(engine, name: str, default):
    value = getattr(engine, name, default)
    return value() if callable(value) else value


def _engine_size(engine, name: str, default):
    """A parallel size read from the engine; absent or None gives ``default``."""
    value = _engine_value(engine, name, None)
    if value is None:
        return default
    try:
        size = int(value)
    except (TypeError, ValueError):
        size = 0
    if size < 1 or size != value:
        raise ValueError(f"ds_engine.{name} must be a positive integer or None, got {value!r}")
    return size


def _split_ignore_list(ignore_list) -> tuple[tuple[type, ...], set[int]]:
    if ignore_list is None:
        return (), set()
    if isinstance(ignore_list, (type, nn.Module)):
        ignore_list = [ignore_list]
    types, instances = [], set()
    for item in ignore_list:
        if isinstance(item, type) and issubclass(item, nn.Module):
            types.append(item)
        elif isinstance(item, nn.Module):
            instances.add(id(item))
        else:
            raise TypeError(f"ignore_list items must be torch.nn.Module classes or instances, got {item!r}")
    return tuple(types), instances


def _device_type(model: nn.Module, args, kwargs) -> str:
    for tensor in model.parameters():
        return tensor.device.type
    for tensor in model.buffers():
        return tensor.device.type
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
    return "cpu"


def _write_atomically(path: Path, text: str) -> None:
    """``text`` to ``path`` (its directory made if missing), crash-safe (ds-config's write_atomic)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text)
