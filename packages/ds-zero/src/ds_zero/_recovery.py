"""The recovery scripts of a checkpoint folder: ``zero_to_fp32.py`` and ``zero_to_torch.py``.

DeepSpeed copies these two scripts into every checkpoint folder, and the Transformers guide tells users to
run ``python zero_to_fp32.py . output_dir`` there. ds writes its own two, with DeepSpeed's command lines,
running ds-zero's export (any stage and world size, in one process). Imported as modules (``import
zero_to_fp32`` from the folder), they give the export's functions under DeepSpeed's names.
"""

from __future__ import annotations

import argparse
import os
import stat
from collections.abc import Sequence
from pathlib import Path

from ._export import convert_zero_checkpoint_to_state_dict

SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
DTYPES = ("bf16", "bfloat16", "float16", "float32", "fp16", "fp32")  # DeepSpeed's OUTPUT_DTYPE_NAMES

_SCRIPT = '''#!/usr/bin/env python3
# Written by ds-zero into this checkpoint folder, where DeepSpeed writes its {name}: the same command line, run by
# ds-zero's export (pip install ds-zero). Importing this file gives the export's functions under DeepSpeed's names.
"""{summary}

    python {name} . output_dir{usage} [--safe_serialization] [--max_shard_size 5GB] [-t TAG] [--exclude_frozen_parameters]
"""

import sys

from ds_zero import (  # noqa: F401  (DeepSpeed's names, for `import {stem}`)
    convert_zero_checkpoint_to_fp32_state_dict,
    convert_zero_checkpoint_to_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
    recovery_main,
)

if __name__ == "__main__":
    sys.exit(recovery_main({stem!r}, sys.argv[1:]))
'''


def _script(name: str) -> str:
    stem = name.removesuffix(".py")
    if stem == "zero_to_fp32":
        summary, usage = "Consolidate this ZeRO checkpoint into float32 weights (output_dir/pytorch_model.bin).", ""
    else:
        summary = "Consolidate this ZeRO checkpoint into float32, float16 or bfloat16 weights."
        usage = " --dtype bf16"
    return _SCRIPT.format(name=name, stem=stem, summary=summary, usage=usage)


def write_recovery_scripts(directory: str | os.PathLike) -> list[Path]:
    """Write ``zero_to_fp32.py`` and ``zero_to_torch.py`` into ``directory`` (a checkpoint folder, the one
    holding ``latest``), executable, as DeepSpeed's save does. The paths written."""
    written = []
    for name in SCRIPTS:
        path = Path(directory) / name
        tmp = path.with_name(f".{name}.tmp")
        tmp.write_text(_script(name))
        os.replace(tmp, path)
        try:
            path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        except PermissionError:  # a share that refuses the mode bit: `python zero_to_fp32.py` still runs
            pass
        written.append(path)
    return written


def recovery_main(script: str, argv: Sequence[str] | None = None) -> int:
    """The command line of DeepSpeed's ``zero_to_fp32.py`` (``script="zero_to_fp32"``) or ``zero_to_torch.py``
    (``"zero_to_torch"``, with a required ``--dtype``): the weights of ``checkpoint_dir`` written under
    ``output_dir``."""
    if script not in ("zero_to_fp32", "zero_to_torch"):
        raise ValueError(f"recovery_main: script must be 'zero_to_fp32' or 'zero_to_torch', got {script!r}")
    parser = argparse.ArgumentParser(prog=f"{script}.py", description="Convert a ZeRO checkpoint (any world size "
                                     "and stage) into PyTorch weights, in one process.")
    parser.add_argument("checkpoint_dir", help="the checkpoint folder (with 'latest'), e.g. path/checkpoint-12")
    parser.add_argument("output_dir", help="the folder for the weights (pytorch_model.bin, or shards with an index)")
    if script == "zero_to_torch":
        parser.add_argument("--dtype", choices=DTYPES, required=True, help="the weights' dtype")
    parser.add_argument("--max_shard_size", default="5GB", help="the largest shard, e.g. 5GB or 500MB")
    parser.add_argument("--safe_serialization", action="store_true", help="write safetensors (model.safetensors)")
    parser.add_argument("-t", "--tag", default=None, help="the tag to read (default: the one 'latest' names)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="leave frozen parameters out")
    parser.add_argument("-d", "--debug", action="store_true", help="accepted for DeepSpeed's command line")
    args = parser.parse_args(argv)
    try:
        written = convert_zero_checkpoint_to_state_dict(
            args.checkpoint_dir, args.output_dir, getattr(args, "dtype", "fp32"), args.max_shard_size,
            args.safe_serialization, args.tag, args.exclude_frozen_parameters)
    except (FileNotFoundError, ValueError) as e:
        parser.exit(2, f"{script}.py: {e}\n")
    print(f"{script}.py: wrote {', '.join(str(p) for p in written)}")
    return 0
