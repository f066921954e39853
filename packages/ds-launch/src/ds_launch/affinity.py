"""Core binding: split this node's cores evenly among its local ranks (``--bind_cores_to_rank``).

Unbound ranks each start as many OpenMP threads as the machine has cores and fight over them; on a
CPU-offload run that is the usual cause of a slow optimizer step. Binding gives each rank its own
slice and sets OMP_NUM_THREADS to the slice's size.
"""

from __future__ import annotations

import os
import re

from .resources import LaunchError

_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_MAX_CORE = 65535


def parse_core_list(text: str) -> list[int]:
    """``"0-3,8,10-11"`` → ``[0, 1, 2, 3, 8, 10, 11]``."""
    cores: list[int] = []
    for part in text.split(","):
        m = _RANGE.fullmatch(part.strip())
        if not m:
            raise LaunchError(f"--bind_core_list {text!r}: {part!r} is not a core number or a range like 0-3")
        lo, hi = int(m[1]), int(m[2] or m[1])
        if hi < lo:
            raise LaunchError(f"--bind_core_list {text!r}: range {part!r} runs backwards")
        if hi > _MAX_CORE:
            raise LaunchError(f"--bind_core_list {text!r}: core {hi} is beyond {_MAX_CORE}")
        cores.extend(range(lo, hi + 1))
    if len(set(cores)) != len(cores):
        raise LaunchError(f"--bind_core_list {text!r} names a core twice")
    return cores


def available_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def split_cores(num_ranks: int, core_list: str | None, available: list[int] | None = None) -> list[tuple[int, ...]]:
    """Contiguous, near-equal slices of the cores, one per local rank (the first ranks get the rest)."""
    available = available_cores() if available is None else available
    cores = available
    if core_list is not None:
        cores = parse_core_list(core_list)
        missing = sorted(set(cores) - set(available))
        if missing:
            raise LaunchError(
                f"--bind_core_list {core_list!r} names cores {_brief(format_cores(missing))} that this "
                f"process may not use (available: {_brief(format_cores(available))})"
            )
    if len(cores) < num_ranks:
        raise LaunchError(f"cannot bind {num_ranks} local ranks to {len(cores)} cores ({format_cores(cores)})")
    share, extra = divmod(len(cores), num_ranks)
    slices, start = [], 0
    for r in range(num_ranks):
        size = share + (1 if r < extra else 0)
        slices.append(tuple(cores[start:start + size]))
        start += size
    return slices


def _brief(text: str, limit: int = 40) -> str:
    """A core list for a one-line message: at most ``limit`` characters, cut at a comma."""
    if len(text) <= limit:
        return text
    return text[:text.rfind(",", 0, limit)] + ",..."


def format_cores(cores) -> str:
    """``[0, 1, 2, 5]`` → ``"0-2,5"`` (taskset's notation)."""
    out, cores = [], sorted(cores)
    i = 0
    while i < len(cores):
        j = i
        while j + 1 < len(cores) and cores[j + 1] == cores[j] + 1:
            j += 1
        out.append(str(cores[i]) if i == j else f"{cores[i]}-{cores[j]}")
        i = j + 1
    return ",".join(out)
