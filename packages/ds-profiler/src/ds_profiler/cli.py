"""``ds-profile``: profile a model from the command line.

    ds-profile torchvision.models:resnet18 --input-shape 1,3,224,224
    ds-profile my_models.py:build_gpt --call-kwargs '{"layers": 2}' --input-shape 4,128 --input-dtype int64

``MODULE:CALLABLE`` names an importable module (or a ``.py`` file) and a callable in it that
returns a ``torch.nn.Module`` (a Module class works: calling it builds one).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

from .api import MODES, profiled_call
from .profiler import _write_atomically

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64, "int64": torch.int64, "int32": torch.int32}


class UsageError(Exception):
    """Bad command line: one line on stderr, exit code 2."""


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.replace("x", ",").split(","))
    except ValueError:
        shape = ()
    if not shape or any(d <= 0 for d in shape):
        raise UsageError(f"--input-shape must be positive integers separated by commas (e.g. 2,3,32,32), got {text!r}")
    return shape


def _load_callable(spec: str):
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"the model must be given as MODULE:CALLABLE (e.g. torchvision.models:resnet18), got {spec!r}")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise UsageError(f"no such file: {module_name}")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[path.stem] = module
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            raise UsageError(f"cannot import {module_name!r} (from {spec!r}): {error}") from error
    target = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise UsageError(f"{module_name!r} has no attribute {attr!r} (from {spec!r})")
        target = getattr(target, part)
    if not callable(target):
        raise UsageError(f"{spec!r} is not callable (it is a {type(target).__name__})")
    return target


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ds-profile", description="Profile the flops, MACs, parameters and latency of a PyTorch model, per module.")
    parser.add_argument("model", help="MODULE:CALLABLE returning a torch.nn.Module (MODULE may be a .py file)")
    parser.add_argument("--input-shape", required=True, help="shape of the one input tensor, e.g. 2,3,32,32")
    parser.add_argument("--input-dtype", default=None, choices=sorted(DTYPES),
                        help="dtype of the input (default: the model's floating dtype); integer inputs are zeros")
    parser.add_argument("--call-kwargs", default="{}", help="JSON object of keyword arguments for CALLABLE")
    parser.add_argument("--device", default="cpu", help="device to run on (default cpu)")
    parser.add_argument("--mode", default="forward", choices=MODES, help="profile forward() or generate()")
    parser.add_argument("--warm-up", type=int, default=1, help="unprofiled calls first (default 1)")
    parser.add_argument("--module-depth", type=int, default=-1, help="depth of the aggregated profile (-1: all)")
    parser.add_argument("--top-modules", type=int, default=1, help="top modules per depth (default 1)")
    parser.add_argument("--no-detailed", action="store_true", help="omit the per-module tree")
    parser.add_argument("--output-file", default=None, help="write the profile here instead of stdout")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the numbers and the module tree as JSON")
    return parser


def _check_writable(option: str, text: str) -> Path:
    """Fail before the run, not after it: ``text`` must be a file that can be created or replaced."""
    path = Path(text)
    if path.is_dir():
        raise UsageError(f"{option} {text}: is a directory, expected a file path")
    blocker = next((p for p in path.parents if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise UsageError(f"{option} {text}: cannot write there: {blocker} is not a directory")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise UsageError(f"{option} {text}: cannot write there: {error.strerror or error}") from None
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(f"{option} {text}: the file exists and is not writable")
    return path


def _check_device(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except RuntimeError as error:
        raise UsageError(f"--device {text!r} is not a torch device: {error}") from error
    if device.type in ("cpu", "meta"):
        return device
    backend = getattr(torch, device.type, None)
    is_available = getattr(backend, "is_available", None)
    if callable(is_available) and not is_available():
        name = "CUDA" if device.type == "cuda" else device.type
        raise UsageError(f"--device {text}: {name} is not available on this machine (torch {torch.__version__}"
                         f"{', built without CUDA' if device.type == 'cuda' and torch.version.cuda is None else ''}); "
                         "use --device cpu")
    count = getattr(backend, "device_count", None)
    if device.index is not None and callable(count) and device.index >= count():
        raise UsageError(f"--device {text}: this machine has {count()} {device.type} device(s), "
                         f"indices 0 to {count() - 1}")
    return device


def _make_input(model: nn.Module, shape: tuple[int, ...], dtype_name: str | None, device: torch.device) -> torch.Tensor:
    if dtype_name is None:
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    else:
        dtype = DTYPES[dtype_name]
    if dtype.is_floating_point:
        generator = torch.Generator().manual_seed(0)
        return torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
    return torch.zeros(shape, dtype=dtype, device=device)  # token ids: 0 is valid for any vocabulary


def run(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    shape = _parse_shape(args.input_shape)
    try:
        call_kwargs = json.loads(args.call_kwargs)
    except json.JSONDecodeError as error:
        raise UsageError(f"--call-kwargs must be a JSON object, got {args.call_kwargs!r}: {error}") from error
    if not isinstance(call_kwargs, dict):
        raise UsageError(f"--call-kwargs must be a JSON object, got {args.call_kwargs!r}")
    if args.warm_up < 0 or args.top_modules < 1 or args.module_depth < -1:
        raise UsageError(f"need --warm-up >= 0, --top-modules >= 1, --module-depth >= -1; got "
                         f"{args.warm_up}, {args.top_modules}, {args.module_depth}")
    device = _check_device(args.device)
    json_path = _check_writable("--json", args.json) if args.json else None
    if args.output_file:
        _check_writable("--output-file", args.output_file)
    factory = _load_callable(args.model)
    model = factory(**call_kwargs)
    if not isinstance(model, nn.Module):
        raise UsageError(f"{args.model} returned a {type(model).__name__}, not a torch.nn.Module")
    model = model.to(device).eval()
    inputs = _make_input(model, shape, args.input_dtype, device)
    if args.mode == "generate" and not callable(getattr(model, "generate", None)):
        raise UsageError(f"--mode generate needs a model with a generate() method; {type(model).__name__} has none")
    note = f"ds-profile: the model was called with one {inputs.dtype} tensor of shape {shape}"
    with profiled_call(model, [inputs], {}, mode=args.mode, warm_up=args.warm_up, note=note) as profiler:
        profiler.print_model_profile(profile_step=args.warm_up, module_depth=args.module_depth,
                                     top_modules=args.top_modules, detailed=not args.no_detailed,
                                     output_file=args.output_file)
        if args.json:
            report = {"model": args.model, "input_shape": list(shape), "input_dtype": str(inputs.dtype),
                      "flops": profiler.get_total_flops(), "macs": profiler.get_total_macs(),
                      "params": profiler.get_total_params(), "duration": profiler.get_total_duration(),
                      "profile": profiler.get_profile().to_dict()}
            _write_atomically(json_path, json.dumps(report, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        return run(argv)
    except UsageError as error:
        print(f"ds-profile: error: {error}", file=sys.stderr)
        return 2
    except Exception as error:  # the model's own error: one paragraph, not a traceback
        notes = " ".join(getattr(error, "__notes__", []))
        print(f"ds-profile: error: {type(error).__name__}: {error}" + (f" ({notes})" if notes else ""), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
