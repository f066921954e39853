"""Messages between pipeline ranks: a small header, the tensors' shapes when they are new, the tensors.

Every message from one rank to another travels on one tag, in the order the sender's schedule sends
them; the schedules are checked deadlock-free under blocking sends, which makes that order the order in
which the receiver's schedule receives them. The header names the message (kind, micro-batch, the virtual stage it feeds),
so a mismatch is an error, not silent garbage. Shapes and dtypes go once per (peer, kind, virtual stage) and
are cached; a stage whose output changes shape later is an error on both sides. With ``dynamic_shape`` a
change travels as new shapes instead. A failing rank sends
an error header to its neighbours, so a rank waiting on it raises instead of hanging.

Sends are non-blocking (``isend``): a stage goes on computing while its neighbour is busy. The tensors
sent are kept until their sends complete (`Channel.drain`).

Every buffer lives on the channel's ``wire`` device (`_device.wire_device`): the stage's device when the
backend moves it (NCCL: headers and shapes on the GPU too), the CPU through gloo; tensors received are
handed over on the stage's ``device``.
"""

from __future__ import annotations

from collections import deque

import torch

import ds_comm

TAG = 7
OK, META, ERROR = 0, 1, 2
ACTIVATION, GRAD = 0, 1
KIND_NAMES = {ACTIVATION: "activation", GRAD: "gradient"}
HEADER = 5  # status, kind, micro_batch, boundary (virtual stage), payload length
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64]
_CODE = {dtype: code for code, dtype in enumerate(DTYPES)}


class PeerFailed(RuntimeError):
    """A neighbouring rank failed during the batch; its error message is in this one's."""

    def __init__(self, message: str, source: int | None = None):
        super().__init__(message)
        self.source = source  # the rank that told this one (it needs no word back)

    def __reduce__(self):  # pickled with its source rank, not the message alone
        return type(self), (str(self), self.source)


def _describe(meta: list[tuple]) -> str:
    return ", ".join(f"{str(dtype).removeprefix('torch.')}{list(shape)}" for dtype, shape, _ in meta)


def meta_of(tensors: tuple[torch.Tensor, ...]) -> list[tuple]:
    return [(t.dtype, tuple(t.shape), t.requires_grad) for t in tensors]


def _encode_meta(meta: list[tuple], device: torch.device) -> torch.Tensor:
    values = [len(meta)]
    for dtype, shape, requires_grad in meta:
        values += [_CODE[dtype], int(requires_grad), len(shape), *shape]
    return torch.tensor(values, dtype=torch.int64, device=device)


def _decode_meta(values: list[int]) -> list[tuple]:
    meta, i = [], 1
    for _ in range(values[0]):
        dtype, requires_grad, ndim = DTYPES[values[i]], bool(values[i + 1]), values[i + 2]
        meta.append((dtype, tuple(values[i + 3:i + 3 + ndim]), requires_grad))
        i += 3 + ndim
    return meta


class Channel:
    """This rank's messages to and from its pipeline neighbours (global ranks)."""

    def __init__(self, rank: int, describe_rank, group=None, dynamic_shape: bool = False,
                 device: torch.device | None = None, wire: torch.device | None = None):
        self.rank, self.group, self.dynamic_shape = rank, group, dynamic_shape  # a group of the executor's own: a failed batch's leftovers stay there
        self.device = torch.device("cpu") if device is None else torch.device(device)  # the stage's tensors
        self.wire = self.device if wire is None else torch.device(wire)  # where messages travel (NCCL: the device)
        self._describe_rank = describe_rank  # global rank -> "stage 1 (rank 3)"
        self._sent_meta: dict[tuple, list[tuple]] = {}
        self._recv_meta: dict[tuple, list[tuple]] = {}
        self._pending: list[tuple] = []  # (work, tensors kept alive)
        self._local: deque = deque()  # messages to this rank itself (a stage feeding its own next chunk)

    def send(self, peer: int, kind: int, micro_batch: int, boundary: int, tensors: tuple[torch.Tensor, ...]) -> None:
        """``boundary``: the virtual stage that consumes the activation (it receives the activation and
        sends its gradient back), which names the message the same way on both sides."""
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"ds_pipe: a stage's output must be a tensor or a tuple of tensors; micro-batch "
                                 f"{micro_batch} sent a {type(t).__name__}")
        if peer == self.rank:
            self._local.append(((kind, micro_batch, boundary), tuple(t.detach() for t in tensors)))
            return
        meta = meta_of(tensors)
        key = (peer, kind, boundary)
        cached = self._sent_meta.get(key)
        changed = cached is not None and [m[:2] for m in cached] != [m[:2] for m in meta]
        if changed and not self.dynamic_shape:
            raise ValueError(f"ds_pipe: the {KIND_NAMES[kind]} of micro-batch {micro_batch} sent to "
                             f"{self._describe_rank(peer)} is {_describe(meta)}, but earlier micro-batches sent "
                             f"{_describe(cached)}; a stage must keep its output's shapes and dtypes across micro-batches")
        payload = [] if cached is not None and not changed else [_encode_meta(meta, self.wire)]
        self._sent_meta[key] = meta
        header = torch.tensor([META if payload else OK, kind, micro_batch, boundary,
                               payload[0].numel() if payload else 0], dtype=torch.int64, device=self.wire)
        for t in [header, *payload, *(t.detach().to(self.wire).contiguous() for t in tensors)]:
            self._pending.append((ds_comm.isend(t, peer, group=self.group, tag=TAG), t))
        self._pending = [(w, t) for w, t in self._pending if not w.is_completed()]

    def recv(self, peer: int, kind: int, micro_batch: int, boundary: int) -> tuple[torch.Tensor, ...]:
        want = (kind, micro_batch, boundary)
        if peer == self.rank:
            got, tensors = self._local.popleft()
            if got != want:
                raise RuntimeError(f"ds_pipe: expected {want} from this rank itself, found {got}")
            return tensors
        header = torch.empty(HEADER, dtype=torch.int64, device=self.wire)
        ds_comm.recv(header, peer, group=self.group, tag=TAG)
        status, *got, length = header.tolist()
        if status == ERROR:
            text = torch.empty(length, dtype=torch.uint8, device=self.wire)
            ds_comm.recv(text, peer, group=self.group, tag=TAG)
            raise PeerFailed(bytes(text.tolist()).decode(errors="replace"), source=peer)
        if tuple(got) != want:
            raise RuntimeError(f"ds_pipe: expected the {KIND_NAMES[kind]} of micro-batch {micro_batch} at virtual stage "
                               f"{boundary} from {self._describe_rank(peer)}, received the {KIND_NAMES.get(got[0])} of "
                               f"micro-batch {got[1]} at virtual stage {got[2]}: the two ranks run different schedules")
        key = (peer, kind, boundary)
        if status == META:
            values = torch.empty(length, dtype=torch.int64, device=self.wire)
            ds_comm.recv(values, peer, group=self.group, tag=TAG)
            self._recv_meta[key] = _decode_meta(values.tolist())
        tensors = []
        for dtype, shape, requires_grad in self._recv_meta[key]:
            t = torch.empty(shape, dtype=dtype, device=self.wire)
            ds_comm.recv(t, peer, group=self.group, tag=TAG)
            t = t.to(self.device)  # the same tensor where the wire is the stage's device
            tensors.append(t.requires_grad_() if requires_grad else t)
        return tuple(tensors)

    def forget_shapes(self) -> None:
        """The next message of each kind carries its shapes again (they may differ from the last ones)."""
        self._sent_meta.clear()

    def send_error(self, peers, message: str) -> None:
        """Tell ``peers`` that this rank failed (each raises `PeerFailed` at its next receive from here)."""
        data = torch.tensor(list(message.encode()[:4000]), dtype=torch.uint8, device=self.wire)
        header = torch.tensor([ERROR, 0, 0, 0, data.numel()], dtype=torch.int64, device=self.wire)
        for peer in sorted(set(peers) - {self.rank}):
            for t in (header, data):
                self._pending.append((ds_comm.isend(t, peer, group=self.group, tag=TAG), t))

    def drain(self) -> None:
        """Wait for every send of this rank to be received (call only once every rank finished its stream)."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
        if self._local:
            raise RuntimeError(f"ds_pipe: {len(self._local)} messages of this rank to itself were never received")
