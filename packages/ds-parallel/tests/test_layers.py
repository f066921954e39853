"""The tensor-parallel layers on 2 ranks against nn.Linear / nn.Embedding / F.cross_entropy holding the gathered
weights: forward, the input's gradient and every parameter's gradient; initialisation from a seed equal to the
unsplit draw; the parameter marks; the RNG tracker; bad input named."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ds_comm.testing import spawn
from ds_parallel import (
    ColumnParallelLinear,
    CudaRNGStatesTracker,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
    vocab_parallel_cross_entropy,
)

close = torch.testing.assert_close


def gathered(t, dim):
    """The full tensor from every rank's slice along ``dim`` (plain torch.distributed)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.detach().contiguous())
    return torch.cat(parts, dim=dim)


def data(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def reference_weight(seed, shape, init):
    torch.manual_seed(seed)
    w = torch.empty(shape)
    init(w)
    return w


def check_column(rank, world):
    init = nn.init.normal_
    for gather_output in (True, False):
        torch.manual_seed(3)
        layer = ColumnParallelLinear(6, 8, gather_output=gather_output, init_method=init)
        full_w = reference_weight(3, (8, 6), init)
        close(gathered(layer.weight, 0), full_w, rtol=0, atol=0)  # the seed's unsplit draw, sliced
        close(layer.weight, full_w[rank * 4:(rank + 1) * 4])
        assert (layer.weight.tensor_model_parallel, layer.weight.partition_dim, layer.weight.partition_stride) == \
            (True, 0, 1)
        assert (layer.bias.tensor_model_parallel, layer.bias.partition_dim) == (True, 0)
        full_b = data(4, 8)
        with torch.no_grad():
            layer.bias.copy_(full_b[rank * 4:(rank + 1) * 4])
        ref = nn.Linear(6, 8)
        with torch.no_grad():
            ref.weight.copy_(full_w)
            ref.bias.copy_(full_b)
        x, xr = data(5, 2, 3, 6).requires_grad_(), data(5, 2, 3, 6).requires_grad_()
        g = data(6, 2, 3, 8)
        out, out_bias = layer(x)
        assert out_bias is None
        expected = ref(xr)
        cols = slice(rank * 4, (rank + 1) * 4)
        if gather_output:
            close(out, expected)
            out.backward(g)
        else:
            close(out, expected[..., cols])
            out.backward(g[..., cols])
        expected.backward(g)
        close(x.grad, xr.grad)
        close(layer.weight.grad, ref.weight.grad[cols])
        close(layer.bias.grad, ref.bias.grad[cols])

    # skip_bias_add returns the bias for the caller; no bias at all
    layer = ColumnParallelLinear(6, 8, gather_output=False, skip_bias_add=True)
    out, out_bias = layer(data(1, 2, 6))
    assert out_bias is layer.bias
    assert ColumnParallelLinear(6, 8, bias=False).bias is None

    # stride: the master weight is cut into stride pieces per rank, dealt round-robin (Megatron's strided split)
    torch.manual_seed(8)
    strided = ColumnParallelLinear(4, 8, stride=2, init_method=init, keep_master_weight_for_test=True)
    master = reference_weight(8, (8, 4), init)
    close(strided.master_weight, master)
    close(strided.weight, torch.cat([master[2 * rank:2 * rank + 2], master[4 + 2 * rank:4 + 2 * rank + 2]]))
    assert strided.weight.partition_stride == 2

    with pytest.raises(ValueError, match="output_size 7 is not divisible"):
        ColumnParallelLinear(6, 7)


def check_row(rank, world):
    init = nn.init.uniform_
    for input_is_parallel in (False, True):
        torch.manual_seed(11)
        layer = RowParallelLinear(8, 5, input_is_parallel=input_is_parallel, init_method=init)
        full_w = reference_weight(11, (5, 8), init)
        close(gathered(layer.weight, 1), full_w, rtol=0, atol=0)
        assert (layer.weight.tensor_model_parallel, layer.weight.partition_dim) == (True, 1)
        assert layer.bias.tensor_model_parallel is False  # replicated
        full_b = data(12, 5)
        with torch.no_grad():
            layer.bias.copy_(full_b)
        ref = nn.Linear(8, 5)
        with torch.no_grad():
            ref.weight.copy_(full_w)
            ref.bias.copy_(full_b)
        cols = slice(rank * 4, (rank + 1) * 4)
        xr = data(13, 3, 8).requires_grad_()
        x = (data(13, 3, 8)[:, cols] if input_is_parallel else data(13, 3, 8)).requires_grad_()
        g = data(14, 3, 5)
        out, out_bias = layer(x)
        expected = ref(xr)
        assert out_bias is None
        close(out, expected)
        out.backward(g)
        expected.backward(g)
        close(x.grad, xr.grad[:, cols] if input_is_parallel else xr.grad)
        close(layer.weight.grad, ref.weight.grad[:, cols])
        close(layer.bias.grad, ref.bias.grad)  # the same on every rank

    layer = RowParallelLinear(8, 5, input_is_parallel=True, skip_bias_add=True)
    out, out_bias = layer(data(1, 2, 4))
    assert out_bias is layer.bias
    with torch.no_grad():
        layer.bias.fill_(1.0)
    close(out, layer(data(1, 2, 4))[0])  # the bias was not added
    with pytest.raises(ValueError, match="this rank's 4 features, got 8"):
        layer(data(1, 2, 8))


def check_embedding(rank, world):
    init = nn.init.normal_
    torch.manual_seed(21)
    emb = VocabParallelEmbedding(10, 6, init_method=init)
    full = reference_weight(21, (10, 6), init)
    close(gathered(emb.weight, 0), full, rtol=0, atol=0)
    assert (emb.vocab_start_index, emb.vocab_end_index) == (5 * rank, 5 * rank + 5)
    assert (emb.weight.tensor_model_parallel, emb.weight.partition_dim) == (True, 0)
    ref = nn.Embedding(10, 6)
    with torch.no_grad():
        ref.weight.copy_(full)
    ids = torch.tensor([[0, 4, 5, 9], [9, 9, 2, 7]])  # ids of both halves, repeats
    g = data(22, 2, 4, 6)
    out, expected = emb(ids), ref(ids)
    close(out, expected)
    out.backward(g)
    expected.backward(g)
    close(emb.weight.grad, ref.weight.grad[5 * rank:5 * rank + 5])
    with pytest.raises(ValueError, match="vocabulary size 9 is not divisible"):
        VocabParallelEmbedding(9, 6)
    with pytest.raises(ValueError, match="integer token ids"):
        emb(ids.float())


def check_cross_entropy(rank, world):
    for scale, shift in ((1.0, 0.0), (30.0, 1e4)):  # large logits: no overflow (the max is subtracted)
        full = (data(31, 2, 3, 10) * scale + shift).requires_grad_()
        local = full.detach()[..., 5 * rank:5 * rank + 5].clone().requires_grad_()
        target = torch.tensor([[0, 4, 5], [9, 7, 2]])
        g = data(32, 2, 3)
        loss = vocab_parallel_cross_entropy(local, target)
        expected = F.cross_entropy(full.reshape(-1, 10), target.reshape(-1), reduction="none").reshape(2, 3)
        assert torch.isfinite(loss).all()
        close(loss, expected)
        loss.backward(g)
        expected.backward(g)
        close(local.grad, full.grad[..., 5 * rank:5 * rank + 5])
    # Megatron's label smoothing (alpha to the other ids) is torch's with alpha * V / (V - 1)
    full = data(34, 6, 10).requires_grad_()
    local = full.detach()[:, 5 * rank:5 * rank + 5].clone().requires_grad_()
    target, g = torch.tensor([0, 9, 5, 4, 3, 7]), data(35, 6)
    loss = vocab_parallel_cross_entropy(local, target, label_smoothing=0.1)
    expected = F.cross_entropy(full, target, reduction="none", label_smoothing=0.1 * 10 / 9)
    close(loss, expected)
    loss.backward(g)
    expected.backward(g)
    close(local.grad, full.grad[:, 5 * rank:5 * rank + 5])
    # retain_graph: a second backward gives the same gradient
    local = data(33, 4, 5).requires_grad_()
    loss = vocab_parallel_cross_entropy(local, torch.tensor([1, 6, 9, 0])).sum()
    loss.backward(retain_graph=True)
    first = local.grad.clone()
    loss.backward()
    close(local.grad, 2 * first)
    with pytest.raises(ValueError, match="target id 10 is outside the vocabulary"):
        vocab_parallel_cross_entropy(data(1, 2, 5), torch.tensor([3, 10]))
    with pytest.raises(ValueError, match="target's shape"):
        vocab_parallel_cross_entropy(data(1, 2, 5), torch.tensor([3, 1, 2]))


def check_rng_and_local_init(rank, world):
    model_parallel_cuda_manual_seed(123)
    before = torch.rand(3)
    with get_cuda_rng_tracker().fork():
        forked = torch.rand(3)
    after = torch.rand(3)
    # the default stream is seed 123 on every rank, untouched by the fork; the tracker's is 123 + 2718 + rank
    close(torch.cat([before, after]), torch.rand(6, generator=torch.Generator().manual_seed(123)))
    close(forked, torch.rand(3, generator=torch.Generator().manual_seed(123 + 2718 + rank)))
    both = gathered(forked.unsqueeze(0), 0)
    assert not torch.equal(both[0], both[1])
    # Megatron's local (GPU-path) init: each rank draws only its slice, in the tracker's stream
    model_parallel_cuda_manual_seed(7)
    layer = ColumnParallelLinear(4, 6, init_method=nn.init.normal_, master_weight_init=False)
    close(layer.weight, torch.randn(3, 4, generator=torch.Generator().manual_seed(7 + 2718 + rank)))
    assert layer.weight.tensor_model_parallel


def check_all(rank, world):
    for check in (check_column, check_row, check_embedding, check_cross_entropy, check_rng_and_local_init):
        check(rank, world)
    return True


def test_layers_two_ranks():
    assert spawn(check_all, world_size=2) == [True, True]


def test_one_rank_is_the_plain_layer():
    # no process group: the layers are nn.Linear / nn.Embedding / F.cross_entropy
    torch.manual_seed(0)
    col = ColumnParallelLinear(4, 6)
    row = RowParallelLinear(6, 3, input_is_parallel=True)
    emb = VocabParallelEmbedding(7, 4)
    x = data(1, 2, 4)
    close(col(x)[0], F.linear(x, col.weight, col.bias))
    close(row(x.repeat(1, 2)[:, :6])[0], F.linear(x.repeat(1, 2)[:, :6], row.weight, row.bias))
    ids = torch.tensor([0, 6, 3])
    close(emb(ids), emb.weight[ids])
    logits = data(2, 3, 7)
    close(vocab_parallel_cross_entropy(logits, ids), F.cross_entropy(logits, ids, reduction="none"))


def test_tracker_states():
    tracker = CudaRNGStatesTracker()
    tracker.add("a", 1)
    before = torch.get_rng_state()
    with tracker.fork("a"):
        first = torch.rand(2)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream is untouched
    with tracker.fork("a"):
        second = torch.rand(2)
    close(torch.cat([first, second]), torch.rand(4, generator=torch.Generator().manual_seed(1)))
    saved = tracker.get_states()
    with tracker.fork("a"):
        third = torch.rand(2)
    tracker.set_states(saved)
    with tracker.fork("a"):
        close(torch.rand(2), third)  # restoring the states repeats the draws (activation recompute)
    with pytest.raises(ValueError, match="seed 1 is already used"):
        tracker.add("b", 1)
    with pytest.raises(ValueError, match="'a' already exists"):
        tracker.add("a", 2)
    with pytest.raises(RuntimeError, match="no state named 'c'"), tracker.fork("c"):
        pass


def test_manual_seed_without_process_group():
    model_parallel_cuda_manual_seed(5)  # no process group: rank 0
    with get_cuda_rng_tracker().fork():
        close(torch.rand(2), torch.rand(2, generator=torch.Generator().manual_seed(5 + 2718)))
    model_parallel_cuda_manual_seed(5, rank=3)  # the rank given (ds-all passes its mpu's)
    with get_cuda_rng_tracker().fork():
        close(torch.rand(2), torch.rand(2, generator=torch.Generator().manual_seed(5 + 2718 + 3)))
    close(torch.rand(2), torch.rand(2, generator=torch.Generator().manual_seed(5)))
    with pytest.raises(ValueError, match="rank must be a non-negative int, got -1"):
        model_parallel_cuda_manual_seed(5, rank=-1)


def test_bad_sizes_named():
    with pytest.raises(ValueError, match="input_size must be a positive int, got 0"):
        ColumnParallelLinear(0, 4)
    with pytest.raises(ValueError, match="stride must be a positive int"):
        RowParallelLinear(4, 4, stride=0)
    with pytest.raises(ValueError, match="per-rank partition 6 is not divisible by stride 4"):
        ColumnParallelLinear(4, 6, stride=4)
    with pytest.raises(ValueError, match="target must be an int32/int64"):
        vocab_parallel_cross_entropy(data(1, 2, 5), torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\), got 1.0"):
        vocab_parallel_cross_entropy(data(1, 2, 5), torch.tensor([0, 1]), label_smoothing=1.0)
