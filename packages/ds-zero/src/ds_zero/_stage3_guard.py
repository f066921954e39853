"""Stage 3's guard against ranks that take different paths through the model (see `_stage3`).

Every request that gathers first all-gathers a tiny record of what it is about to do, on a group of its
own, so ranks that call different modules fail at once with the module each rank asked for, instead of
issuing collectives of different sizes that hang or mix data.
"""

from __future__ import annotations

from typing import Any

import torch

import ds_comm

END_OF_FORWARD, END_OF_BACKWARD = -1, -2


class PathGuard:
    """`Stage3`'s checks (a mixin: uses its ``world_size``, ``_check_group`` and ``_names``)."""

    def _check(self, code: int, gathers: list[int] = ()) -> None:
        """All ranks must be at the same point and about to issue the same gathers (see `_start_check`)."""
        self._verify(*self._start_check(code, gathers))

    def _start_check(self, code: int, gathers: list[int]) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """Announce ``code`` (2 × the unit requested + 1 in backward, or an END) and the units about to
        be gathered, on a group of its own. Only requests that gather announce (a request served by a
        prefetch issues no collective), so a rank whose path differs is caught at its first gather
        that differs, or at the end of the forward or backward, before any collective of other sizes."""
        digest = 0
        for u in gathers:
            digest = (digest * 1_000_003 + u + 1) % (1 << 61)
        mine = torch.tensor([code, len(gathers), digest], dtype=torch.int64)
        everyone = torch.empty(3 * self.world_size, dtype=torch.int64)
        work = ds_comm.all_gather_into_tensor(everyone, mine, group=self._check_group, async_op=True)
        return work, everyone, mine

    def _verify(self, work: Any, everyone: torch.Tensor, mine: torch.Tensor) -> None:
        work.wait()
        if bool((everyone.view(-1, 3) == mine).all()):
            return
        asked = "; ".join(f"rank {r}: {self._describe(int(c))}" for r, c in enumerate(everyone.view(-1, 3)[:, 0]))
        raise RuntimeError(f"ZeRO stage 3: the ranks took different paths through the model ({asked}). Every rank "
                           "must call the same modules in the same order (data-dependent branches must decide the "
                           "same on every rank), since each module's parameters are gathered from all ranks")

    def _describe(self, code: int) -> str:
        if code == END_OF_FORWARD:
            return "the end of the forward"
        if code == END_OF_BACKWARD:
            return "the end of the backward"
        unit, backward = divmod(code, 2)
        return f"the parameters of {self._names.get(unit, f'unit {unit}')!r} ({'backward' if backward else 'forward'})"


_check_groups: dict[tuple[int, ...], Any] = {}  # ranks -> the check group (also of groups this rank is not in)
_everyone: list[Any] = []  # a gloo group of every rank, to learn each rank's data group (cleared with the world)


def check_group(group: Any) -> Any:
    """A process group of ``group``'s ranks for the path checks alone. On the data group a check
    would queue behind the gathers and reductions in flight (gloo runs a group's collectives in
    order), making every request wait for them: 27% of a step on the §9 workload. A gloo group: the
    checks' tensors are tiny host tensors, also where the data group is NCCL (a CUDA model).

    Creating a group is a collective of every rank, each group created in the same order everywhere:
    with several data groups (ZeRO beside tensor parallelism: ranks {0, 2} and {1, 3}) a rank that made
    only its own would pair with another rank's call, and two groups of other ranks would share one name
    (their ranks cross-wired, hanging). So the ranks first learn every rank's data group (a tiny
    all-gather), then each makes every group not made yet, in sorted order, and keeps its own."""
    import torch.distributed as dist

    world = dist.get_world_size()
    mine = tuple(sorted(dist.get_process_group_ranks(group))) if group is not None else tuple(range(world))
    if not _everyone or _everyone[0] not in dist.distributed_c10d._world.pg_map:
        _check_groups.clear()  # none yet, or made before the process group was destroyed and made again
        _everyone[:] = [ds_comm.new_group(list(range(world)), backend="gloo")]
    member = torch.zeros(world, dtype=torch.int32, device="cpu")  # host tensors: the group is gloo
    member[list(mine)] = 1
    rows = [torch.empty_like(member, device="cpu") for _ in range(world)]
    dist.all_gather(rows, member, group=_everyone[0])
    for ranks in sorted({tuple(int(r) for r in row.nonzero().flatten()) for row in rows}):  # the same on every rank
        if ranks not in _check_groups:
            _check_groups[ranks] = ds_comm.new_group(list(ranks), backend="gloo")
    return _check_groups[mine]
