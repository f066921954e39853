"""DeepSpeed's ``deepspeed.launcher.runner``: the ``deepspeed`` command's ``parse_args`` and ``main``, which are
ds-launch's command line (the same flags, ``--autotuning {tune,run}`` included; see ds-launch's README for
where its options differ from DeepSpeed's)."""

from __future__ import annotations

from collections.abc import Sequence

from ds_launch import main as _launch
from ds_launch import parse_deepspeed_args as parse_args

__all__ = ["main", "parse_args"]


def main(args: Sequence[str] | None = None) -> None:
    """Launch as the ``deepspeed`` command does (``args`` default ``sys.argv[1:]``): returns when every rank
    succeeded, else raises ``SystemExit`` with the launch's exit code (2 for bad input, the message on stderr)."""
    code = _launch(None if args is None else list(args))
    if code:
        raise SystemExit(code)
