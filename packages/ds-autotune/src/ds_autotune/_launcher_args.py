"""`launcher_options`: an `Autotuner`'s arguments from a DeepSpeed launcher's parsed command line and the
resources it selected, as DeepSpeed's runner builds its ``Autotuner(args, active_resources)``.

``args`` is read by attribute (``deepspeed.launcher.runner.parse_args``'s namespace, which ds-launch's
``parse_deepspeed_args`` gives): ``user_script``, ``user_args``, ``num_nodes`` and ``num_gpus`` (-1: not
given). The launcher's options that shape how a rank runs (hostfile, launcher, core binding, ...) are passed on
to every experiment; ``--include``/``--exclude`` are not, since ``active_resources`` already applied them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

# attribute -> the ds-launch option every experiment gets when the attribute is set
_VALUE_OPTIONS = (("hostfile", "--hostfile"), ("launcher", "--launcher"), ("launcher_args", "--launcher_args"),
                  ("master_addr", "--master_addr"), ("ssh_port", "--ssh_port"), ("bind_core_list", "--bind_core_list"))
_FLAGS = (("force_multi", "--force_multi"), ("bind_cores_to_rank", "--bind_cores_to_rank"),
          ("module", "--module"), ("no_python", "--no_python"), ("no_local_rank", "--no_local_rank"))


def launcher_options(args: Any, active_resources: Mapping[str, Sequence[int]]) -> dict[str, Any]:
    """The keyword arguments of `Autotuner` for ``args`` (a DeepSpeed launcher's parsed command line) and
    ``active_resources`` (host -> slot ids the launcher selected): ``Autotuner(**launcher_options(args, res))``.
    Each experiment then runs on ``args.num_nodes`` nodes x ``args.num_gpus`` slots (when given, > 0), else on
    every node of ``active_resources`` with as many slots as the smallest of them has."""
    missing = [name for name in ("user_script", "user_args") if not hasattr(args, name)]
    if missing:
        raise ValueError(f"args must be a launcher's parsed command line (deepspeed.launcher.runner.parse_args); "
                         f"it has no {', '.join(missing)}: {args!r}")
    launcher_args = []
    for name, option in _VALUE_OPTIONS:
        value = getattr(args, name, None)
        if value is None or value == "":
            continue
        if name == "hostfile" and not os.path.isfile(value):
            raise ValueError(f"--hostfile {value!r} is not a file")
        launcher_args.append(f"{option}={value}")
    launcher_args += [option for name, option in _FLAGS if getattr(args, name, False) is True]
    return {"user_script": args.user_script, "user_args": list(args.user_args),
            "num_nodes": _requested(args, "num_nodes"), "num_gpus": _requested(args, "num_gpus"),
            "active_resources": active_resources, "launcher_args": launcher_args}


def _requested(args: Any, name: str) -> int | None:
    value = getattr(args, name, None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"args.{name} must be an integer (-1: not given), got {value!r}")
    return value if value > 0 else None
