"""`parse_deepspeed_args`: ds-launch's command line read as DeepSpeed's runner reads it
(``deepspeed.launcher.runner.parse_args``): the same parser and checks as ``ds-launch``, but argparse's way out
on bad input (the message on stderr, then ``SystemExit(2)``) and the namespace under DeepSpeed's names and
"not given" values, so code written against DeepSpeed's runner (its autotuner, a wrapper script) reads it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .cli import parse_args
from .resources import LaunchError


def parse_deepspeed_args(args: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``args`` (default ``sys.argv[1:]``) as DeepSpeed's runner does.

    Bad input (an unknown option, a missing or invalid value such as ``--autotuning test``) prints
    ``ds-launch: error: ...`` to stderr and raises ``SystemExit(2)``; ``--help`` and ``--version`` exit 0.
    Beside ds-launch's own fields the namespace has DeepSpeed's: ``num_gpus`` (ds-launch's ``--num_gpus``),
    ``num_nodes``, ``num_gpus`` and ``node_rank`` -1 when not given, ``autotuning`` "" when not given
    (else "tune" or "run"), ``save_pid`` True/False (the path of ``--save_pid=PATH`` in ``save_pid_path``,
    None for DeepSpeed's default file).
    """
    argv = list(sys.argv[1:] if args is None else args)
    if not all(isinstance(word, str) for word in argv):
        raise TypeError(f"args must be a list of strings (a command line), got {args!r}")
    try:
        parsed = parse_args(argv)
    except LaunchError as e:
        print(f"ds-launch: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    out = vars(parsed).copy()
    num_procs = out.pop("num_procs")
    out["num_gpus"] = -1 if num_procs is None else num_procs
    out["num_nodes"] = -1 if out["num_nodes"] is None else out["num_nodes"]
    out["node_rank"] = -1 if out["node_rank"] is None else out["node_rank"]
    out["autotuning"] = out["autotuning"] or ""
    save_pid = out.pop("save_pid")
    out["save_pid"], out["save_pid_path"] = save_pid is not None, save_pid or None
    return argparse.Namespace(**out)
