"""``get_model_profile``: profile one forward (or ``generate``) call of a model in one line."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from ._format import flops_to_string, macs_to_string, params_to_string
from .profiler import FlopsProfiler

logger = logging.getLogger(__name__)

MODES = ("forward", "generate")


def _check_shape(input_shape) -> tuple[int, ...]:
    if not isinstance(input_shape, (tuple, list)) or not input_shape or not all(
        isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in input_shape
    ):
        raise ValueError(f"input_shape must be a non-empty tuple of positive integers, got {input_shape!r}")
    return tuple(input_shape)


def _check_count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return value


def _input_from_shape(model: nn.Module, shape: tuple[int, ...]) -> torch.Tensor:
    """A random tensor of the model's floating dtype on the model's device (float32 on CPU if the
    model has no parameters). Seeded, so that two runs see the same input."""
    dtype, device = torch.float32, torch.device("cpu")
    for p in model.parameters():
        device = p.device
        if p.is_floating_point():
            dtype = p.dtype
            break
    generator = torch.Generator().manual_seed(0)
    return torch.randn(shape, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)


@contextmanager
def profiled_call(model: nn.Module, args: Sequence, kwargs: dict, *, mode: str = "forward", warm_up: int = 1,
                  ignore_modules=None, note: str | None = None) -> Iterator[FlopsProfiler]:
    """Run ``warm_up`` plain calls, then one profiled call, and yield the stopped profiler.

    Eval mode and ``torch.no_grad()`` during the calls; afterwards the profiler is ended and the
    modules' train/eval flags are restored, also when the model raises (``note`` is then added
    to the model's exception, and only to that: not to an error of the ``with`` body).
    """
    call = model.generate if mode == "generate" else model
    profiler = FlopsProfiler(model)
    training = {m: m.training for m in model.modules()}
    model.eval()
    try:
        try:
            with torch.no_grad():
                if warm_up:
                    logger.info("flops profiler: %d warm-up call(s)", warm_up)
                for _ in range(warm_up):
                    call(*args, **kwargs)
                profiler.start_profile(ignore_list=ignore_modules)
                call(*args, **kwargs)
                profiler.stop_profile()
        except Exception as error:
            if note:
                error.add_note(note)
            raise
        yield profiler
    finally:
        profiler.end_profile()
        for module, flag in training.items():
            module.training = flag


def get_model_profile(
    model: nn.Module,
    input_shape: Sequence[int] | None = None,
    args: Sequence | None = None,
    kwargs: dict | None = None,
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | os.PathLike | None = None,
    ignore_modules: Sequence | None = None,
    mode: str = "forward",
):
    """Profile one call of ``model`` and return ``(flops, macs, params)``.

    The input is ``args``/``kwargs``, or, with ``input_shape``, one random tensor of that shape
    (the model's dtype and device) as the only positional argument. ``warm_up`` unprofiled calls
    run first (for steady timings). ``mode="generate"`` profiles ``model.generate(...)``: every
    forward call it makes is counted. The model runs in eval mode under ``torch.no_grad()``; its
    train/eval flags are restored afterwards. With ``as_string`` the numbers come back formatted
    (``'2.2 G'``, ``'1.1 GMACs'``, ``'1.2 M'``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
    if mode == "generate" and not callable(getattr(model, "generate", None)):
        raise ValueError(f"mode='generate' needs a model with a generate() method; {type(model).__name__} has none")
    _check_count("warm_up", warm_up)
    args = list(args) if args is not None else []
    kwargs = dict(kwargs) if kwargs is not None else {}
    shape = None
    if input_shape is not None:
        shape = _check_shape(input_shape)
        args = [_input_from_shape(model, shape)]
    elif not args and not kwargs:
        raise ValueError("get_model_profile needs the model's input: input_shape, args or kwargs")

    note = None
    if shape is not None:
        note = (f"ds_profiler: the model was called with one {args[0].dtype} tensor of input_shape={shape}; "
                "if it expects other inputs, pass args= or kwargs=")
    with profiled_call(model, args, kwargs, mode=mode, warm_up=warm_up, ignore_modules=ignore_modules,
                       note=note) as profiler:
        flops = profiler.get_total_flops()
        macs = profiler.get_total_macs()
        params = profiler.get_total_params()
        if print_profile:
            profiler.print_model_profile(profile_step=warm_up, module_depth=module_depth,
                                         top_modules=top_modules, detailed=detailed, output_file=output_file)
    if as_string:
        return flops_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
