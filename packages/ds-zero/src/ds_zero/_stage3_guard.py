"""Stage 3's guard against ranks that take different paths through the model (a part of `Stage3`).

Ranks must issue the same gathers in the same order: a rank that asks for other modules would issue
collectives of other sizes, which hang or mix data. The guard keeps that from happening at one tiny
all-gather per forward and per backward once the ranks repeat themselves:

* **Checked** (a segment, forward or backward, with nothing to expect): every request that gathers
  first all-gathers a tiny record of what it is about to gather, on a gloo group of its own, so the
  ranks agree before any gather is issued.
* **Trusted** (a segment that follows one of the same kind every rank agreed on): each rank compares
  each gather with the agreed log *locally* and issues it unchecked; the segment ends with one check
  of the count and a digest of the gathers.
* **A rank that leaves the log** (a gather or gradient reduction other than the next one, or an end
  before the log's) issues nothing more: it sends an *alarm* to every other rank of the group (a tiny
  send, read by a listening thread) and posts the group's next check with what it asks for. The other
  ranks either reach the same check at their end of the segment, or wait for a collective the leaver
  never issued: a wait in a trusted segment also wakes on an alarm, and then joins that check with the
  gather it waits for. Before raising, every rank issues the log's collectives it has not issued and
  another rank has (into scratch buffers), so none is left half-issued on the data group. So every rank
  fails at once with the module each rank asked for, and none hangs. If every rank left the log in the
  same way (a path that changed on all ranks), the check agrees and the segment goes on checked.
* Trusted segments need one guard on the check group (one `Stage3` over those ranks): with more (frozen
  parameters' own `Stage3`, a `ZeroInference` beside training) their gathers interleave on the data
  group, and every segment is checked.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

import ds_comm

END_OF_FORWARD, END_OF_BACKWARD, REDUCTION = -1, -2, -16  # REDUCTION - b: bucket b's
ALARM_TAG = 0x5A3  # the alarms' sends on the check group (collectives there use tags of their own)


class PathGuard:
    """One `Stage3`'s path checks: ``names`` maps a unit to its module's name, for the errors. ``host``: the
    data group's waits block this thread (gloo); on a GPU they only order streams."""

    def __init__(self, group: Any, names: dict[int, str], host: bool = True):
        self.channel, self.host = _channel(group), host
        self.group, self.world_size, self._names = self.channel.group, self.channel.world_size, names
        self.id = self.channel.register(self)  # this guard's number on its check group (the same on every rank)
        # the end that opened a segment -> the collectives of the last such segment, and how to issue each again
        self._logs: dict[int, tuple[list[int], list[Callable[[], Any]]]] = {}
        self._opened_by = END_OF_BACKWARD  # (the first forward follows no backward: nothing to expect yet)
        self._log: list[int] = []  # this segment's collectives: 2 × unit + 1 in backward, or REDUCTION - bucket
        self._again: list[Callable[[], Any]] = []  # each issued again into scratch buffers
        self._digest = 0
        self._expected: tuple[list[int], list[Callable[[], Any]]] | None = None  # trusted: what this segment issues
        self._works: dict[int, int] = {}  # id of a reduction's work in flight -> its place in the log
        self._requests: list[int] = []  # this segment's requests
        self.checks = 0  # check all-gathers posted (tests)

    # ------------------------------------------------------------------------------ checked
    def check(self, code: int, gathers: list[int] = ()) -> None:
        """Before an on-demand gather: in a checked segment every rank must be about to issue the same."""
        if self._expected is None:
            self._verify(*self._start(code, gathers))

    def announce(self, code: int, gathers: list[int]) -> Any:
        """Prefetches: their check starts now and is waited for before they are issued (`confirm`)."""
        return None if self._expected is not None else self._start(code, gathers)

    def confirm(self, announced: Any) -> None:
        if announced is not None:
            self._verify(*announced)

    def _start(self, code: int, gathers: list[int], count: int | None = None,
               digest: int | None = None) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """Post the group's next check: ``code`` (2 × the unit requested + 1 in backward, or an END) with the
        units about to be gathered, or with the ``count`` and ``digest`` of the segment's collectives."""
        if digest is None:
            digest = 0
            for u in gathers:
                digest = (digest * 1_000_003 + u + 1) % (1 << 61)
        mine = torch.tensor([code, len(gathers) if count is None else count, digest, len(self._requests)],
                            dtype=torch.int64, device="cpu")
        everyone = torch.empty(4 * self.world_size, dtype=torch.int64, device="cpu")
        self.channel.posted += 1
        self.checks += 1
        work = ds_comm.all_gather_into_tensor(everyone, mine, group=self.group, async_op=True)
        return work, everyone, mine

    def _verify(self, work: Any, everyone: torch.Tensor, mine: torch.Tensor) -> None:
        work.wait()
        rows = everyone.view(-1, 4)
        if self._expected is None:  # checked: every rank's request now (the requests before agreed)
            if bool((rows[:, :3] == mine[:3]).all()):
                return
            asked = rows[:, 0].tolist()
        else:
            if bool((rows == mine).all()):
                return
            asked = self._square_up(rows, int(mine[0]))
        asked = "; ".join(f"rank {r}: {self._describe(int(c))}" for r, c in enumerate(asked))
        raise RuntimeError(f"ZeRO stage 3: the ranks took different paths through the model ({asked}). Every rank "
                           "must call the same modules in the same order (data-dependent branches must decide the "
                           "same on every rank), since each module's parameters are gathered from all ranks")

    def _square_up(self, rows: torch.Tensor, code: int) -> list[int]:
        """A trusted segment where the ranks parted: each issues what another issued of the log and it did
        not (scratch buffers), so no collective is left half-issued; then every rank's request at the first
        request where they parted (an extra check: errors only)."""
        again = self._expected[1]
        works = [again[k]() for k in range(len(self._log), int(rows[:, 1].max()))]
        for w in works:
            w.wait()
        first = int(rows[:, 3].min())
        mine = torch.tensor([self._requests[first] if first < len(self._requests) else code], dtype=torch.int64,
                            device="cpu")
        everyone = torch.empty(self.world_size, dtype=torch.int64, device="cpu")
        self.channel.posted += 1
        ds_comm.all_gather_into_tensor(everyone, mine, group=self.group)
        return everyone.tolist()

    def requested(self, code: int) -> None:
        """A request of the segment (2 × unit + 1 in backward), gathering or not: named if the ranks part."""
        self._requests.append(code)

    def _describe(self, code: int) -> str:
        if code == END_OF_FORWARD:
            return "the end of the forward"
        if code == END_OF_BACKWARD:
            return "the end of the backward"
        if code <= REDUCTION:
            return f"the reduction of {self._names.get(REDUCTION - code, 'a bucket')!r}'s gradients (backward)"
        unit, backward = divmod(code, 2)
        return f"the parameters of {self._names.get(unit, f'unit {unit}')!r} ({'backward' if backward else 'forward'})"

    # ------------------------------------------------------------------------------ the log
    def issuing(self, code: int, again: Callable[[], Any]) -> None:
        """Just before a collective of the segment is issued on the data group (a gather, or bucket b's
        reduction: ``REDUCTION - b``): in a trusted segment it must be the log's next. ``again`` issues
        the same collective into scratch buffers (to square up the ranks when one leaves the log)."""
        if self._expected is not None:
            at, expected = len(self._log), self._expected[0]
            if at >= len(expected) or expected[at] != code:
                self._leave(code)  # raises, unless every rank left the log here alike
        self._log.append(code)
        self._again.append(again)
        self._digest = (self._digest * 1_000_003 + code + 17) % (1 << 61)

    def issued(self, work: Any) -> Any:
        """The work of the reduction just logged: its wait (`wait`) knows its place in the log."""
        self._works[id(work)] = len(self._log) - 1
        return work

    def end(self, code: int) -> None:
        """End of a forward or backward: one check of every rank's count and digest of its collectives; the
        next segment expects what the last one opened by this end issued (when every rank agreed on it)."""
        if self._expected is not None and len(self._log) != len(self._expected[0]):
            self._alarm()
        self._verify(*self._start(code, [], len(self._log), self._digest))
        self._logs[self._opened_by] = (self._log, self._again)
        self._opened_by, self._log, self._again, self._digest, self._works = code, [], [], 0, {}
        self._requests = []
        self._expected = self._logs.get(code) if self.channel.alone(self) else None

    def abandon(self) -> None:
        """A forward that raised: its segment goes on checked."""
        self._expected = None

    def close(self) -> None:
        self.channel.unregister(self)

    def _leave(self, code: int) -> None:
        """This rank leaves the log: alarm the others, then the check they join (or reach at their end)."""
        self._alarm()
        self._verify(*self._start(code, [], len(self._log), self._digest))
        self._expected = None  # every rank left here alike: checked from here on

    def _alarm(self) -> None:
        self.channel.alarm(self.id, len(self._log))

    # ------------------------------------------------------------------------------ waits
    def wait(self, work: Any, unit: int | None = None) -> None:
        """Wait for a gather (of ``unit``) or a reduction of this rank's. In a trusted segment a host wait
        also wakes on another rank's alarm, and then joins its check instead (and raises)."""
        if work is None:
            return
        if self._expected is None or not self.host or work.is_completed():
            work.wait()  # (on a GPU this only orders the stream: a leaver is caught at the segment's end)
            return
        at = self._works.pop(id(work), None) if unit is None else self._place(unit)
        if at is None:  # a gather of no segment (GatheredParameters)
            work.wait()
            return
        finished, woken = threading.Event(), threading.Event()  # the work done; the work done or an alarm

        def landed(_: Any) -> None:
            finished.set()
            woken.set()

        try:
            work.get_future().add_done_callback(landed)
            poll = None
        except (AttributeError, RuntimeError, NotImplementedError):  # no future: polled
            poll = 1e-4
        try:
            while not finished.is_set() and not work.is_completed():
                alarm = self.channel.pending(woken)
                if alarm is not None and alarm[1] == self.id and at < alarm[2]:
                    break  # the leaver issued this one before it left: it completes
                if alarm is not None:
                    self._verify(*self._start(self._log[at], [], len(self._log), self._digest))
                    raise RuntimeError("ZeRO stage 3: another rank left this segment's gathers")  # (rows agreed)
                woken.wait(poll)
                woken.clear()
        finally:
            self.channel.forget(woken)
        work.wait()

    def _place(self, unit: int) -> int | None:
        for k in range(len(self._log) - 1, -1, -1):
            if self._log[k] >= 0 and self._log[k] // 2 == unit:
                return k
        return None


class _Channel:
    """A check group and what arrives on it out of turn: the alarms of ranks that left a trusted segment's
    gathers, received by a daemon thread (a recv from any rank, posted again after each) and handed to the
    waits of `PathGuard.wait`. ``posted`` counts the checks posted on the group, the same on every rank
    when any of them posts its next: an alarm names the check its sender posts, so an old one is ignored."""

    def __init__(self, group: Any):
        self.group, self.world_size, self.rank = group, ds_comm.get_world_size(group), ds_comm.get_rank(group)
        self.posted = 0
        self._guards: list[Any] = []  # the guards on this group, open now
        self._registered = 0
        self._lock = threading.Lock()
        self._alarms: list[tuple[int, ...]] = []  # (check, guard, collectives issued before it)
        self._waiters: set[threading.Event] = set()
        self._sent: list[Any] = []
        self._listener: threading.Thread | None = None

    def register(self, guard: Any) -> int:
        self._guards.append(guard)
        self._registered += 1
        if self._listener is None and self.world_size > 1:
            self._listener = threading.Thread(target=self._listen, name="ds-zero-path-alarms", daemon=True)
            self._listener.start()
        return self._registered - 1

    def unregister(self, guard: Any) -> None:
        self._guards = [g for g in self._guards if g is not guard]

    def alone(self, guard: Any) -> bool:
        """Whether ``guard`` is the only one open on this group (its segments may be trusted)."""
        return len(self._guards) == 1 and self._guards[0] is guard

    def _listen(self) -> None:
        import torch.distributed as dist

        received = torch.zeros(3, dtype=torch.int64, device="cpu")
        while True:
            try:
                dist.irecv(received, group=self.group, tag=ALARM_TAG).wait()
            except Exception:  # the group is gone (destroyed with its world)
                return
            with self._lock:
                self._alarms.append(tuple(int(x) for x in received))
                for waiter in self._waiters:
                    waiter.set()

    def alarm(self, guard: int, issued: int) -> None:
        """Tell every other rank that this one posts check number ``posted`` next, out of turn."""
        import torch.distributed as dist

        message = torch.tensor([self.posted, guard, issued], dtype=torch.int64, device="cpu")
        for r in range(self.world_size):
            if r != self.rank:
                dst = dist.get_global_rank(self.group, r) if self.group is not None else r
                self._sent.append((message, dist.isend(message, dst=dst, group=self.group, tag=ALARM_TAG)))

    def pending(self, waiter: threading.Event | None) -> tuple[int, ...] | None:
        """The alarm for the next check, if one came; else ``waiter`` is set when one comes."""
        with self._lock:
            self._alarms = [a for a in self._alarms if a[0] >= self.posted]
            if waiter is not None:
                self._waiters.add(waiter)
            return next((a for a in self._alarms if a[0] == self.posted), None)

    def forget(self, waiter: threading.Event | None) -> None:
        with self._lock:
            self._waiters.discard(waiter)


_channels: dict[tuple[int, ...], _Channel] = {}  # ranks -> the check group's channel


def _channel(group: Any) -> _Channel:
    import torch.distributed as dist

    check = check_group(group)
    ranks = tuple(dist.get_process_group_ranks(check))
    channel = _channels.get(ranks)
    if channel is None or channel.group is not check:
        channel = _channels[ranks] = _Channel(check)
    return channel

_check_groups: dict[tuple[int, ...], Any] = {}  # ranks -> the check group (also of groups this rank is not in)
_everyone: list[Any] = []  # a gloo group of every rank, to learn each rank's data group (cleared with the world)


def _registered(group) -> bool:
    """Whether ``group`` belongs to the process group now running (torch's public lookup of a group's
    ranks knows only those; one made before ``destroy_process_group`` and a new init is not among them)."""
    import torch.distributed as dist

    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


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
    if not _everyone or not _registered(_everyone[0]):
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
