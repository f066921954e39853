"""Consolidated float32 weights from a sharded ZeRO checkpoint, in one process, without the model's code.

    ds-zero-to-fp32 CHECKPOINT_DIR OUTPUT [--tag TAG] [--safetensors] [--max_shard_size 5GB]

``CHECKPOINT_DIR`` is an engine checkpoint directory (its ``latest`` names the tag) or a tag directory
(or any directory `save_zero_checkpoint` wrote). DCP reads every rank's shards into whole tensors
(``no_dist``: no process group), whatever the world size and stage of the run that saved them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from ._checkpoint import META_FILE, _dcp, read_zero_metadata
from ._deepspeed_format import deepspeed_tag_dir, fp32_state_dict

logger = logging.getLogger(__name__)


def _tag_dir(checkpoint_dir: Any, tag: str | None) -> Path:
    root = Path(checkpoint_dir)
    if tag is None and (root / META_FILE).exists():
        return root
    if tag is None:
        latest = root / "latest"
        if not latest.exists():
            raise FileNotFoundError(f"{root}: neither a ZeRO checkpoint ({META_FILE}) nor a directory with a 'latest' "
                                    "file; pass the tag directory or --tag")
        tag = latest.read_text().strip()
    path = root / tag
    if not (path / META_FILE).exists():
        raise FileNotFoundError(f"{path}: not a complete ZeRO checkpoint (no {META_FILE})")
    return path


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: Any, tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> OrderedDict:
    """The model's full state dict (float32 parameters from the master copy, buffers and frozen parameters
    as saved) from a checkpoint of any world size and ZeRO stage, read in this process alone (DeepSpeed's
    own checkpoints too: what its zero_to_fp32 returns). ``exclude_frozen_parameters``: without the
    frozen (``requires_grad=False``) parameters. ``lazy_mode`` (DeepSpeed's, to read tensors on use) is
    accepted; the tensors are read at once."""
    deepspeed_path = deepspeed_tag_dir(checkpoint_dir, tag)
    if deepspeed_path is not None and not (deepspeed_path / META_FILE).exists():
        return fp32_state_dict(deepspeed_path, exclude_frozen_parameters)
    path = _tag_dir(checkpoint_dir, tag)
    meta = read_zero_metadata(path)
    # torch.distributed.checkpoint: imported here, not with ds_zero
    from ._storage import SafeReader

    saved = SafeReader(str(path)).read_metadata().state_dict_metadata
    state: dict[str, torch.Tensor] = {}
    for name, shape in zip(meta["names"], meta["shapes"], strict=True):
        state[f"master/{name}"] = torch.empty(torch.Size(shape).numel(), dtype=torch.float32)
    for key, md in saved.items():
        if key.startswith("module/"):
            state[key] = torch.empty(md.size, dtype=md.properties.dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)  # one process, on purpose
        _dcp().load(state, storage_reader=SafeReader(str(path)), no_dist=True)
    out = OrderedDict()
    for name, shape in zip(meta["names"], meta["shapes"], strict=True):
        out[name] = state[f"master/{name}"].view(shape)
    for key, tensor in state.items():
        if key.startswith("module/"):
            out[key.removeprefix("module/")] = tensor
    for name in meta.get("frozen", []) if exclude_frozen_parameters else []:
        out.pop(name, None)
    for alias, source in meta.get("shared_params", {}).items():  # tied weights: every name, one tensor
        if source in out:
            out[alias] = out[source]
    return out


def convert_zero_checkpoint_to_state_dict(checkpoint_dir: Any, output_dir: Any, dtype: Any = torch.float32,
                                          max_shard_size: Any = "5GB", safe_serialization: bool = False,
                                          tag: str | None = None, exclude_frozen_parameters: bool = False) -> list[Path]:
    """DeepSpeed's: the weights of a ZeRO checkpoint (any stage and world size) written under ``output_dir``
    as ``pytorch_model.bin`` (``model.safetensors`` with ``safe_serialization``), in ``dtype`` (floating
    tensors; "fp32", "fp16", "bf16" or a torch dtype), split into ``pytorch_model-00001-of-0000N.bin``
    shards with a Hugging Face index when larger than ``max_shard_size`` (None: one file). The paths written."""
    names = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
             "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
    resolved = names.get(dtype.lower()) if isinstance(dtype, str) else dtype
    if resolved not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"convert_zero_checkpoint_to_state_dict: dtype must be float32, float16 or bfloat16 (or "
                         f"'fp32', 'fp16', 'bf16'), got {dtype!r}")
    limit = None if max_shard_size is None else \
        int(max_shard_size) if isinstance(max_shard_size, int) else parse_size(max_shard_size)
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    state = OrderedDict((k, v.to(resolved) if v.is_floating_point() else v) for k, v in state.items())
    output = Path(output_dir)
    output.mkdir(parents=True, exist_ok=True)
    weights = output / ("model.safetensors" if safe_serialization else "pytorch_model.bin")
    return write_fp32(state, weights, use_safetensors=safe_serialization, max_shard_size=limit)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: Any, output_dir: Any, max_shard_size: Any = "5GB",
                                               safe_serialization: bool = False, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> list[Path]:
    """DeepSpeed's: `convert_zero_checkpoint_to_state_dict` in float32."""
    return convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, torch.float32, max_shard_size,
                                                 safe_serialization, tag, exclude_frozen_parameters)


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir: Any, tag: str | None = None):
    """Load the consolidated float32 weights of a ZeRO checkpoint into ``model`` and return it. Not strict, as
    DeepSpeed's (a checkpoint saved with ``exclude_frozen_parameters`` lacks the frozen weights): the names
    the model has and the checkpoint lacks, or the reverse, are logged as a warning."""
    result = model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag), strict=False)
    if result.missing_keys or result.unexpected_keys:
        logger.warning("load_state_dict_from_zero_checkpoint: not in the checkpoint (kept as they are): %s; in the "
                       "checkpoint, not in the model (ignored): %s", result.missing_keys, result.unexpected_keys)
    return model


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """``5GB``, ``500MB``, ``1GiB`` or a number of bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ValueError(f"--max_shard_size must be a size like 5GB, 500MB or 1GiB, got {text!r}")
    size = int(float(match[1]) * _UNITS[(match[2] or "").upper()])
    if size < 1:
        raise ValueError(f"--max_shard_size must be positive, got {text!r}")
    return size


def _shards(state: OrderedDict, limit: int) -> list[OrderedDict]:
    shards, current, size = [], OrderedDict(), 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > limit:
            shards.append(current)
            current, size = OrderedDict(), 0
        current[name] = tensor
        size += nbytes
    shards.append(current)
    return shards


def write_fp32(state: OrderedDict, output: Any, *, use_safetensors: bool, max_shard_size: int | None,
               progress: Any = None) -> list[Path]:
    """Write ``state``: one file at ``output``, or (``max_shard_size``) ``output``'s stem numbered
    ``-00001-of-0000N`` shards with a Hugging Face style index (``<output>.index.json``)."""
    output = Path(output)
    if use_safetensors:
        try:
            from safetensors.torch import save_file
        except ImportError as e:
            raise ImportError("--safetensors needs the safetensors package: pip install safetensors") from e
    shards = _shards(state, max_shard_size) if max_shard_size else [state]
    written = []
    for i, shard in enumerate(shards, 1):
        target = output if len(shards) == 1 else \
            output.with_name(f"{output.stem}-{i:05d}-of-{len(shards):05d}{output.suffix}")
        temporary = target.with_name(target.name + ".tmp")
        contiguous, stored = {}, set()
        for name, tensor in shard.items():  # safetensors refuses tensors sharing memory (a tied weight's names)
            tensor = tensor.contiguous()
            if use_safetensors and tensor.untyped_storage().data_ptr() in stored:
                tensor = tensor.clone()
            stored.add(tensor.untyped_storage().data_ptr())
            contiguous[name] = tensor
        if use_safetensors:
            save_file(contiguous, str(temporary), metadata={"format": "pt"})
        else:
            torch.save(contiguous, temporary)
        os.replace(temporary, target)
        written.append(target)
        if progress is not None:
            progress.update(len(shard))
    if len(shards) > 1:
        weight_map = {name: written[i].name for i, shard in enumerate(shards) for name in shard}
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = output.with_name(output.name + ".index.json")
        index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        written.append(index)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ds-zero-to-fp32", description="Consolidate a ZeRO checkpoint (any world "
                                     "size and stage) into float32 weights, in one process.")
    parser.add_argument("checkpoint_dir", help="an engine checkpoint directory (with 'latest') or a tag directory")
    parser.add_argument("output", help="the file to write (with --max_shard_size: the stem of the shards)")
    parser.add_argument("--tag", default=None, help="the tag to read (default: the one 'latest' names)")
    parser.add_argument("--safetensors", action="store_true", help="write safetensors (what Hugging Face loads)")
    parser.add_argument("--max_shard_size", default=None, help="split into shards of at most this size (e.g. 5GB), "
                        "with an index")
    args = parser.parse_args(argv)
    try:
        limit = parse_size(args.max_shard_size) if args.max_shard_size else None
        state = get_fp32_state_dict_from_zero_checkpoint(args.checkpoint_dir, args.tag)
    except (FileNotFoundError, ValueError) as e:
        parser.exit(2, f"ds-zero-to-fp32: {e}\n")
    progress = None
    if sys.stderr.isatty():
        try:
            from tqdm import tqdm

            progress = tqdm(total=len(state), unit="tensor", file=sys.stderr)
        except ImportError:
            progress = None
    written = write_fp32(state, args.output, use_safetensors=args.safetensors, max_shard_size=limit,
                         progress=progress)
    if progress is not None:
        progress.close()
    numel = sum(t.numel() for t in state.values())
    print(f"{len(state)} tensors, {numel:,} elements -> {', '.join(str(p) for p in written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
