"""ZeRO++'s quantized collectives (arXiv 2306.10209), as plain functions with explicit arguments.

* `quantized_all_gather` (qwZ): each rank's shard block-quantized to int8 with a float32 scale per
  group, all-gathered, dequantized: a quarter of an fp32 all-gather's bytes, half of a bf16 one's.
* `quantized_reduce_scatter` (qgZ): DeepSpeed's ``all_to_all_quant_reduce``. The tensor (``numel``
  divisible by the world size) is seen as one partition per rank; each rank quantizes the partitions
  (int4 by default) and an all-to-all inside its node hands local rank ``j`` the partitions bound for
  the ranks with local rank ``j`` on every node; it sums what its node sent, quantizes the sum again,
  and an all-to-all among the ranks with its local rank (one per node) hands every node its partition.
  Only that second exchange crosses the node boundary, with one node-summed quantized copy instead of
  a rank's full precision share: the same shard as a plain reduce-scatter, within the quantization
  error (README, "Quantized collectives").

The quantization is ds-ops' (``ds_ops.quantize_blockwise``: symmetric, round half to even, a scale of
``absmax / qmax`` per group, inf/nan groups dequantize to nan, zero groups to 0) when ds-ops is
installed (``pip install ds-comm[ops]``: its vectorised CPU kernels, torch ops on a device); without it
the same arithmetic in torch ops here, with the same bytes. Each message is a frame per destination:
its scales (float32), then its quantized values, padded to 4 bytes. The comms logger records each
exchange under the function's name with the bytes of those frames (one record for the all-gather, one
per stage of the reduce-scatter), and its records say which of them cross the node boundary.
"""

from __future__ import annotations

import torch

from .collectives import ReduceOp, _all_gather, _issue
from .distributed import _require_usable, get_rank, get_world_size
from .topology import HierarchicalGroups

_UNSET = object()
_ds_ops: object = _UNSET  # the ds_ops module once looked for, None when it is not installed


def _ops():
    """ds-ops (optional: ds-comm[ops]), imported on first use: ``import ds_comm`` stays light."""
    global _ds_ops
    if _ds_ops is _UNSET:
        try:
            import ds_ops

            _ds_ops = ds_ops if hasattr(ds_ops, "quantize_blockwise") else None
        except ImportError:  # ds-comm alone: the torch ops below
            _ds_ops = None
    return _ds_ops

__all__ = ["frame_bytes", "quantized_all_gather", "quantized_reduce_scatter"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_QMAX = {8: 127.0, 4: 7.0}
DEFAULT_GROUP_SIZE = 2048  # elements per scale (DeepSpeed's qwZ aims at 4-8k, its qgZ at numel / max(dims))


def frame_bytes(numel: int, group_size: int, bits: int) -> int:
    """Bytes of one frame of ``numel`` quantized values: ``4 * ceil(numel / group_size)`` bytes of
    scales, then ``numel`` (int8) or ``ceil(numel / 2)`` (int4) bytes of values, padded to a multiple of 4."""
    _check_quant("frame_bytes", group_size, bits)
    raw = 4 * -(-numel // group_size) + (numel if bits == 8 else (numel + 1) // 2)
    return -(-raw // 4) * 4


def quantized_all_gather(shard: torch.Tensor, group=None, *, group_size: int = DEFAULT_GROUP_SIZE, bits: int = 8,
                         out: torch.Tensor | None = None, async_op: bool = False):
    """Every rank's ``shard`` (float32, float16 or bfloat16; the same size on every rank), gathered in
    rank order into ``out`` (``world * numel`` elements of ``shard``'s dtype; a new flat tensor by
    default), through ``bits``-bit block quantization: each shard's values come back dequantized, this
    rank's own too (all ranks hold the same bytes). Returns ``out``; with ``async_op`` a work handle
    instead, whose ``wait()`` completes the exchange and writes ``out`` (``shard`` is read before this
    returns, so it may be a view of ``out``)."""
    _require_usable("quantized_all_gather")
    _check_float("quantized_all_gather", shard, "shard")
    _check_quant("quantized_all_gather", group_size, bits)
    world, n = get_world_size(group), shard.numel()
    if out is None:
        out = torch.empty(world * n, dtype=shard.dtype, device=shard.device)
    elif out.numel() != world * n or not out.is_contiguous() or out.device != shard.device:
        raise ValueError(f"ds_comm.quantized_all_gather: out must be a contiguous tensor of world_size ({world}) × "
                         f"{n} elements on {shard.device}, got {tuple(out.shape)} on {out.device}")
    frame = frame_bytes(n, group_size, bits)
    mine = torch.zeros(frame, dtype=torch.uint8, device=shard.device)
    _pack(mine, *_quantize(shard.reshape(-1), group_size, bits))
    gathered = torch.empty(world * frame, dtype=torch.uint8, device=shard.device)
    work = _issue("quantized_all_gather", gathered.numel(), group, (gathered, mine),
                  lambda a: _all_gather(gathered, mine, group, a), async_op)

    def dequantize() -> None:
        flat = out.view(-1)
        for r, received in enumerate(gathered.view(world, frame)):
            q, scales = _unpack(received, n, group_size, bits)
            flat[r * n:(r + 1) * n] = _dequantize(q, scales, n, group_size, bits, out.dtype)

    if async_op:
        return _ThenWork(work, dequantize)
    dequantize()
    return out


def quantized_reduce_scatter(tensor: torch.Tensor, groups: HierarchicalGroups, *, op=ReduceOp.AVG,
                             group_size: int = DEFAULT_GROUP_SIZE, bits: int = 4,
                             inter_bits: int | None = None) -> torch.Tensor:
    """This rank's partition (``numel / world_size`` elements, ``tensor``'s dtype) of the sum
    (``op=ReduceOp.SUM``) or mean (``ReduceOp.AVG``, the default) of every rank's ``tensor``, as
    ``reduce_scatter_tensor`` would return it, reduced hierarchically over ``groups``
    (`HierarchicalGroups`: the node layout and its intra- and inter-node groups) with ``bits``-bit
    quantization inside the node and ``inter_bits`` (default ``bits``) across nodes. Each partition is
    quantized on its own: groups of ``min(group_size, partition)`` elements (even for int4)."""
    _require_usable("quantized_reduce_scatter")
    _check_float("quantized_reduce_scatter", tensor, "tensor")
    inter_bits = bits if inter_bits is None else inter_bits
    _check_quant("quantized_reduce_scatter", group_size, bits)
    _check_quant("quantized_reduce_scatter", group_size, inter_bits)
    if not isinstance(groups, HierarchicalGroups):
        raise ValueError(f"ds_comm.quantized_reduce_scatter: groups must be a ds_comm.HierarchicalGroups, got "
                         f"{type(groups).__name__}")
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"ds_comm.quantized_reduce_scatter: op must be ReduceOp.SUM or ReduceOp.AVG, got {op}")
    topo = groups.topology
    world, nodes, local = topo.world_size, topo.num_nodes, topo.ranks_per_node
    if world != get_world_size() or groups.rank != get_rank():
        raise ValueError(f"ds_comm.quantized_reduce_scatter: groups were made for rank {groups.rank} of {world}, "
                         f"this is rank {get_rank()} of {get_world_size()}")
    if tensor.numel() % world:
        raise ValueError(f"ds_comm.quantized_reduce_scatter: tensor's {tensor.numel()} elements must divide into "
                         f"world_size ({world}) equal partitions")
    part = tensor.numel() // world
    if part == 0:
        return tensor.new_empty(0)
    group = min(group_size, part + (part % 2 if 4 in (bits, inter_bits) else 0))
    padded = -(-part // group) * group
    # [node, local, partition] -> [local, node, padded partition]: local rank j's chunk holds the
    # partitions of the ranks with local rank j, in node order
    rows = tensor.reshape(nodes, local, part)
    if padded != part:
        rows = torch.cat([rows, rows.new_zeros(nodes, local, padded - part)], dim=2)
    swizzled = rows.transpose(0, 1).reshape(-1)
    chunk = nodes * padded  # elements each local rank receives from each
    q, scales = _quantize(swizzled, group, bits)
    send = _frames(q, scales, local, chunk, group, bits)
    received = _exchange(send, groups.intra, local)
    q_in, scales_in = _unpack_stack(received, chunk, group, bits)
    if nodes == 1:
        total = _dequantize_sum(q_in, scales_in, chunk, group, bits)
    else:
        q2, scales2 = _requantize_sum(q_in, scales_in, chunk, group, bits, inter_bits)
        received2 = _exchange(_frames(q2, scales2, nodes, padded, group, inter_bits), groups.inter, nodes)
        total = _dequantize_sum(*_unpack_stack(received2, padded, group, inter_bits), padded, group, inter_bits)
    result = total[:part]
    if op == ReduceOp.AVG:
        result = result / world
    return result.to(tensor.dtype)


class _ThenWork:
    """An async exchange's handle whose first completed ``wait()`` also runs ``then`` (the
    dequantization into the caller's buffer); anything else goes to the backend's work."""

    def __init__(self, work, then):
        self._work, self._then = work, then

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        if self._then is not None:
            then, self._then = self._then, None
            then()
        return result

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def __getattr__(self, name):
        return getattr(self._work, name)


# ---- frames -------------------------------------------------------------------------------------------
def _pack(frame: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> None:
    nscale = 4 * scales.numel()
    frame[:nscale] = scales.view(torch.uint8)
    frame[nscale:nscale + q.numel()] = q.view(torch.uint8)


def _unpack(frame: torch.Tensor, n: int, group: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    nscale, nq = 4 * -(-n // group), (n if bits == 8 else (n + 1) // 2)
    scales = frame[:nscale].view(torch.float32)
    q = frame[nscale:nscale + nq]
    return (q.view(torch.int8) if bits == 8 else q), scales


def _frames(q: torch.Tensor, scales: torch.Tensor, count: int, n: int, group: int, bits: int) -> torch.Tensor:
    """``count`` frames of ``n`` values each from consecutive pieces of (q, scales)."""
    frame = frame_bytes(n, group, bits)
    out = torch.zeros(count, frame, dtype=torch.uint8, device=q.device)
    per_q, per_s = (n if bits == 8 else n // 2), n // group
    for i in range(count):
        _pack(out[i], q[i * per_q:(i + 1) * per_q], scales[i * per_s:(i + 1) * per_s])
    return out


def _unpack_stack(frames: torch.Tensor, n: int, group: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [_unpack(f, n, group, bits) for f in frames]
    return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])


def _exchange(send: torch.Tensor, group, size: int) -> torch.Tensor:
    """All-to-all of one frame per rank of ``group`` (``size`` ranks; none to make for one)."""
    if size == 1:
        return send
    received = torch.empty_like(send)
    _issue("quantized_reduce_scatter", send.numel(), group, (received, send),
           lambda a: torch.distributed.all_to_all_single(received.view(-1), send.view(-1), group=group, async_op=a),
           False)
    return received


# ---- quantization: ds-ops, or the same arithmetic in torch ops ----------------------------------------
def _quantize(x: torch.Tensor, group: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    if _ops() is not None:
        return _ops().quantize_blockwise(x, group, bits)
    n, qmax = x.numel(), _QMAX[bits]
    flat = x.reshape(-1).float()
    pad = -(-n // group) * group - n
    rows = torch.cat([flat, flat.new_zeros(pad)]).view(-1, group)
    absmax = rows.abs().amax(dim=1)
    scales = torch.where(torch.isfinite(absmax), absmax / qmax, torch.full_like(absmax, float("nan")))
    live = (scales > 0)[:, None]
    q = torch.clamp(torch.round(torch.where(live, rows / torch.where(live, scales[:, None], 1.0), 0.0)), -qmax, qmax)
    q = q.to(torch.int8).view(-1)[:n]
    if bits == 4:
        pairs = (torch.cat([q, q.new_zeros(n % 2)]).view(-1, 2).to(torch.int16) & 0xF)
        q = ((pairs[:, 0] << 4) | pairs[:, 1]).to(torch.uint8)
    return q, scales


def _values(q: torch.Tensor, scales: torch.Tensor, n: int, group: int, bits: int) -> torch.Tensor:
    if bits == 8:
        v = q.view(torch.int8)[:n].float()
    else:
        b = q.view(torch.int8).to(torch.int16)
        v = torch.stack([b >> 4, ((b & 0xF) ^ 8) - 8], dim=1).view(-1)[:n].float()
    return v * scales.repeat_interleave(group)[:n]


def _dequantize(q, scales, n: int, group: int, bits: int, dtype: torch.dtype) -> torch.Tensor:
    if _ops() is not None:
        return _ops().dequantize_blockwise(q, scales, n, group, bits, dtype)
    return _values(q, scales, n, group, bits).to(dtype)


def _dequantize_sum(q, scales, n: int, group: int, bits: int) -> torch.Tensor:
    if _ops() is not None:
        return _ops().dequantize_sum_blockwise(q, scales, n, group, bits)
    total = _values(q[0], scales[0], n, group, bits)
    for t in range(1, q.shape[0]):
        total = total + _values(q[t], scales[t], n, group, bits)
    return total


def _requantize_sum(q, scales, n: int, group: int, bits: int, out_bits: int):
    if _ops() is not None:
        return _ops().requantize_sum_blockwise(q, scales, n, group, bits, out_bits)
    return _quantize(_dequantize_sum(q, scales, n, group, bits), group, out_bits)


# ---- checks -------------------------------------------------------------------------------------------
def _check_float(call: str, tensor, name: str) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in _FLOATS:
        got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"ds_comm.{call}: {name} must be a float32, float16 or bfloat16 tensor, got {got}")


def _check_quant(call: str, group_size, bits) -> None:
    if isinstance(bits, bool) or bits not in _QMAX:
        raise ValueError(f"ds_comm.{call}: bits must be 8 or 4, got {bits!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or (
            bits == 4 and group_size % 2):
        raise ValueError(f"ds_comm.{call}: group_size must be a positive integer{', even for int4' if bits == 4 else ''}"
                         f", got {group_size!r}")
