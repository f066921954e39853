"""ZeRO++'s quantized collectives at world size 4 as 2 nodes × 2 ranks (LOCAL_WORLD_SIZE=2, gloo):
each result against the plain collective and within the error bound the quantization allows (derived
below from the inputs' group maxima), and the comms logger's byte counts, all of them and those
crossing the node boundary, against the frames' sizes worked out here."""

from __future__ import annotations

import pytest
import torch

import ds_comm
from ds_comm.quantized import frame_bytes
from ds_comm.testing import spawn

TWO_BY_TWO = {"LOCAL_WORLD_SIZE": "2"}
QMAX = {8: 127, 4: 7}


def data(rank: int, n: int, dtype=torch.float32) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(100 + rank)) * (1 + rank)
    x[3::17] = 0.0
    return x.to(dtype)


def group_max(x: torch.Tensor, group: int) -> torch.Tensor:
    """Each element's group maximum |x| (groups of ``group`` from the start, the last one short)."""
    n = x.numel()
    rows = torch.cat([x.abs().double(), x.new_zeros(-(-n // group) * group - n).double()]).view(-1, group)
    return rows.amax(dim=1).repeat_interleave(group)[:n]


def all_gather_case(rank, world, n, bits, dtype):
    ds_comm.configure(enabled=True, prof_all=True)
    shard = data(rank, n, dtype)
    gathered = ds_comm.quantized_all_gather(shard, group_size=16, bits=bits)
    plain = torch.empty(world * n, dtype=dtype)
    ds_comm.all_gather_into_tensor(plain, shard)
    bound = torch.cat([group_max(data(r, n, dtype).float(), 16) for r in range(world)]) / QMAX[bits] / 2 * (1 + 2**-15)
    bound = bound + plain.double().abs() * (2**-7 if dtype == torch.bfloat16 else 2**-23)  # the output's rounding
    error = (gathered.double() - plain.double()).abs()
    assert bool((error <= bound).all()), (error - bound).max().item()
    assert not torch.equal(gathered, plain)  # it did quantize
    records = {r.op: r for r in ds_comm.comms_logger.records()}
    return gathered, {op: (r.msg_bytes, r.count, r.cross_node_bytes) for op, r in records.items()}


@pytest.mark.parametrize("bits, dtype", [(8, torch.float32), (8, torch.bfloat16), (4, torch.float32)])
def test_quantized_all_gather_is_the_all_gather_within_half_a_step(bits, dtype):
    n = 37  # 3 groups of 16, the last short: scales 12 bytes + values
    results = spawn(all_gather_case, world_size=4, args=(37, bits, dtype), env=TWO_BY_TWO)
    for gathered, _ in results[1:]:
        assert torch.equal(gathered, results[0][0])  # every rank holds the same values
    frame = frame_bytes(n, 16, bits)
    assert frame == -(-(12 + (37 if bits == 8 else 19)) // 4) * 4
    element = torch.empty(0, dtype=dtype).element_size()
    for _, records in results:
        # the quantized frames of 4 ranks; a rank sends its frame to 3 peers, 2 of them on the other node
        assert records["quantized_all_gather"] == (4 * frame, 1, 2 * frame)
        assert records["all_gather_into_tensor"] == (4 * n * element, 1, 2 * n * element)


def async_all_gather_case(rank, world, n):
    full = torch.zeros(world * n)
    full[rank * n:(rank + 1) * n] = data(rank, n)  # this rank's shard in its place, as ZeRO-3's buffers hold it
    expected = ds_comm.quantized_all_gather(data(rank, n), group_size=16)
    work = ds_comm.quantized_all_gather(full[rank * n:(rank + 1) * n], group_size=16, out=full, async_op=True)
    assert work.wait() is not False
    return torch.equal(full, expected), work.is_completed()


def test_an_async_quantized_all_gather_writes_out_at_its_wait_from_a_shard_inside_out():
    assert spawn(async_all_gather_case, world_size=2, args=(37,)) == [(True, True)] * 2


def reduce_scatter_case(rank, world, n, bits, op):
    ds_comm.configure(enabled=True, prof_all=True)
    groups = ds_comm.HierarchicalGroups()
    assert (groups.topology.num_nodes, groups.topology.ranks_per_node) == (2, 2)
    x = data(rank, n)
    ours = ds_comm.quantized_reduce_scatter(x, groups, op=op, group_size=8, bits=bits)
    plain = torch.empty(n // world)
    ds_comm.reduce_scatter_tensor(plain, x.clone(), op=op)
    # the bound: each rank's partition quantized in groups of 8 (error <= scale/2 = groupmax/(2 qmax)),
    # each node's sum requantized (its group max <= the sum of its ranks' maxima, plus their errors)
    part = slice(rank * (n // world), (rank + 1) * (n // world))
    maxima = [group_max(data(r, n)[part], 8) for r in range(world)]
    first = sum(maxima) / (2 * QMAX[bits])
    node_sums = [(maxima[2 * k] + maxima[2 * k + 1]) * (1 + 1 / QMAX[bits]) for k in range(2)]
    second = sum(node_sums) / (2 * QMAX[bits])
    exact = sum(data(r, n)[part].double() for r in range(world))
    divide = world if op == ds_comm.ReduceOp.AVG else 1
    bound = (first + second) * (1 + 2**-12) / divide + 1e-6 * exact.abs() / divide
    error = (ours.double() - plain.double()).abs()
    assert bool((error <= bound).all()), (error - bound).max().item()
    assert (ours.double() - exact / divide).abs().max() > 0  # it did quantize
    records = [(r.op, r.msg_bytes, r.count, r.off_node_peers, r.cross_node_bytes)
               for r in ds_comm.comms_logger.records()]
    return records


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_quantized_reduce_scatter_is_the_reduce_scatter_within_the_bound(bits, op):
    n = 4 * 20  # partitions of 20: groups of 8, the last short (padded to 24 on the wire)
    reduce_op = ds_comm.ReduceOp.SUM if op == "sum" else ds_comm.ReduceOp.AVG
    results = spawn(reduce_scatter_case, world_size=4, args=(n, bits, reduce_op), env=TWO_BY_TWO)
    intra = 2 * frame_bytes(2 * 24, 8, bits)  # to each local rank: its two partitions (one per node)
    inter = 2 * frame_bytes(24, 8, bits)  # to each node: its partition of this node's sum
    for records in results:
        assert ("quantized_reduce_scatter", intra, 1, 0, 0.0) in records  # stays in the node
        assert ("quantized_reduce_scatter", inter, 1, 1, inter / 2) in records  # half of it crosses
        assert ("reduce_scatter_tensor", n * 4, 1, 2, n * 4 * 2 / 4) in records
        crossing = sum(r[4] for r in records if r[0] == "quantized_reduce_scatter")
        plain = next(r[4] for r in records if r[0] == "reduce_scatter_tensor")
        assert crossing <= 0.3 * plain  # ZeRO++'s figure, here on a tiny tensor with its padding and scales


def test_node_topology_from_the_environment(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    topo = ds_comm.node_topology(world_size=4)
    assert (topo.num_nodes, topo.node_ranks(1), topo.peer_ranks(1), topo.off_node_peers(0, [0, 1, 2, 3])) == \
        (2, [2, 3], [1, 3], 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("LOCAL_SIZE", "4")
    assert ds_comm.node_topology(world_size=8).num_nodes == 2
    monkeypatch.delenv("LOCAL_SIZE")
    assert ds_comm.node_topology(world_size=8).num_nodes == 1
    with pytest.raises(ValueError, match=r"3 ranks per node .* must divide the world size 4"):
        ds_comm.node_topology(world_size=4, ranks_per_node=3)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE must be a positive integer, got 'two'"):
        ds_comm.node_topology(world_size=4)


def bad_arguments_case(rank, world):
    groups = ds_comm.HierarchicalGroups(ds_comm.NodeTopology(world, 1))
    errors = []
    for call in (lambda: ds_comm.quantized_reduce_scatter(torch.zeros(7), groups),
                 lambda: ds_comm.quantized_reduce_scatter(torch.zeros(8), groups, bits=2),
                 lambda: ds_comm.quantized_reduce_scatter(torch.zeros(8), groups, op=ds_comm.ReduceOp.MAX),
                 lambda: ds_comm.quantized_reduce_scatter(torch.zeros(8), None),
                 lambda: ds_comm.quantized_all_gather(torch.zeros(8, dtype=torch.int32)),
                 lambda: ds_comm.quantized_all_gather(torch.zeros(8), group_size=3, bits=4)):
        with pytest.raises(ValueError) as info:
            call()
        errors.append(str(info.value))
    return errors


def test_bad_arguments_are_named():
    errors = spawn(bad_arguments_case, world_size=2)[0]
    assert "tensor's 7 elements must divide into world_size (2) equal partitions" in errors[0]
    assert "bits must be 8 or 4, got 2" in errors[1]
    assert "op must be ReduceOp.SUM or ReduceOp.AVG" in errors[2]
    assert "groups must be a ds_comm.HierarchicalGroups, got NoneType" in errors[3]
    assert "shard must be a float32, float16 or bfloat16 tensor, got torch.int32" in errors[4]
    assert "group_size must be a positive integer, even for int4, got 3" in errors[5]


def layout_case(rank, world, n):
    groups = ds_comm.HierarchicalGroups()
    x = data(rank, n)
    ours = ds_comm.quantized_reduce_scatter(x, groups, op=ds_comm.ReduceOp.SUM, group_size=8, bits=8)
    plain = torch.empty(n // world)
    ds_comm.reduce_scatter_tensor(plain, x.clone())
    part = slice(rank * (n // world), (rank + 1) * (n // world))
    maxima = sum(group_max(data(r, n)[part], 8) for r in range(world))
    return bool(((ours.double() - plain.double()).abs() <= maxima * 2 / 127).all())


@pytest.mark.parametrize("ranks_per_node", ["4", "1"])
def test_one_node_and_one_rank_per_node(ranks_per_node):
    """One node: the intra-node all-to-all alone; one rank a node: the inter-node one alone."""
    assert all(spawn(layout_case, world_size=4, args=(40,), env={"LOCAL_WORLD_SIZE": ranks_per_node}))


@pytest.mark.parametrize("bits", [8, 4])
def test_without_ds_ops_the_torch_ops_give_the_same_bytes(bits, monkeypatch):
    """ds-comm alone quantizes in torch ops; ranks with and without ds-ops must agree byte for byte."""
    from ds_comm import quantized

    x = data(0, 1001) * 1e-37  # subnormal scales too
    x[::50] = 0.0
    x[500:520] = 0.0
    x[900] = float("inf")
    with_ops = quantized._quantize(x, 20, bits)
    stack = [torch.stack(t) for t in zip(with_ops, quantized._quantize(data(1, 1001), 20, bits), strict=True)]
    summed = quantized._dequantize_sum(*stack, 1001, 20, bits)
    requantized = quantized._requantize_sum(*stack, 1001, 20, bits, 4)
    monkeypatch.setattr(quantized, "_ds_ops", None)
    alone = quantized._quantize(x, 20, bits)
    assert torch.equal(alone[0], with_ops[0]) and torch.equal(alone[1].isnan(), with_ops[1].isnan())
    assert torch.equal(alone[1].nan_to_num(), with_ops[1].nan_to_num())
    assert torch.equal(quantized._dequantize_sum(*stack, 1001, 20, bits).nan_to_num(), summed.nan_to_num())
    again = quantized._requantize_sum(*stack, 1001, 20, bits, 4)
    assert torch.equal(again[0], requantized[0]) and torch.equal(again[1].nan_to_num(), requantized[1].nan_to_num())


def cuda_quantized_collectives(rank, world):
    torch.cuda.set_device(0)
    shard = data(rank, 4099).cuda()
    gathered = ds_comm.quantized_all_gather(shard, group_size=64)
    bound = group_max(shard.double().cpu(), 64) / QMAX[8] / 2 * (1 + 2**-15) + shard.double().cpu().abs() * 2**-23
    full = torch.zeros(4099, device="cuda")
    work = ds_comm.quantized_all_gather(full.clone(), group_size=64, out=full, async_op=True)
    work.wait()
    groups = ds_comm.HierarchicalGroups()
    reduced = ds_comm.quantized_reduce_scatter(shard[:4096], groups, op=ds_comm.ReduceOp.SUM, group_size=64)
    within = ((reduced.double().cpu() - shard[:4096].double().cpu()).abs()
              <= group_max(shard[:4096].double().cpu(), 64) / QMAX[4] / 2 * (1 + 2**-15) + 1e-6)
    return (gathered.is_cuda, bool(((gathered.double().cpu() - shard.double().cpu()).abs() <= bound).all()),
            bool(torch.equal(full, torch.zeros_like(full))), reduced.is_cuda, bool(within.all()))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_quantized_collectives_over_nccl():
    """qwZ's gather and qgZ's reduction with CUDA tensors over NCCL (one rank: the device path of the
    quantization, the frames and the exchanges), within the quantization's bound."""
    assert spawn(cuda_quantized_collectives, world_size=1, backend="nccl")[0] == (True, True, True, True, True)
