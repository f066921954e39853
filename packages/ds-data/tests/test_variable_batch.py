"""Variable batch size and learning rate against references written here: a brute-force packing (every run
length tried, the longest valid kept, as DeepSpeed's loop), token sums and sizes checked micro-batch by
micro-batch, the lr formulas per method, the scheduler's rates against the wrapped scheduler stepped alone
times the scale, ranks' shares against the batches, and DeepSpeed 0.19.8's own outputs (recorded)."""

from __future__ import annotations

import math
import random
import types

import numpy as np
import pytest
import torch

from ds_data import (
    VariableBatchSizeLR,
    batch_by_seqlens,
    dataloader_for_variable_batch_size,
    get_dataloader_and_lr_scheduler_for_variable_batch_size,
    get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed,
    lr_scheduler_for_variable_batch_size,
    scale_lr,
)
from ds_data.config import DataEfficiencyConfig

SEQLENS = [5, 3, 9, 2, 7, 4, 8, 1, 6, 3, 10, 2, 5, 4, 7, 3, 12, 6, 1, 8]


def reference_batches(seqlens, max_tokens, ids=None, min_bs=1, max_bs=None, order="dataloader", k_batch=1,
                      same=False, seed=0):
    """Brute force: at each start, every run length (a multiple of k) is tried and the longest whose
    interleaved micro-batches are all valid is kept; a start with none drops its sample if samples remain."""
    metrics = [(seqlens[i], i) for i in (range(len(seqlens)) if ids is None else ids)]
    if order == "random":
        random.Random(seed).shuffle(metrics)
    elif order == "seqlen":
        metrics = sorted(metrics)
    metrics = [m for m in metrics if m[0] <= max_tokens]
    k = k_batch if same else 1

    def valid(mb):
        return len(mb) >= min_bs and (max_bs is None or len(mb) <= max_bs) and sum(x for x, _ in mb) <= max_tokens

    mbs, start = [], 0
    while start < len(metrics):
        ends = [end for end in range(start + k, len(metrics) + 1, k)
                if all(valid(metrics[start:end][b::k]) for b in range(k))]
        if not ends:
            if start + k * min_bs > len(metrics):
                break
            start += 1
            continue
        mbs += [metrics[start:max(ends)][b::k] for b in range(k)]
        start = max(ends)
    mbs = mbs[:len(mbs) - len(mbs) % k_batch]
    return [[i for _, i in mb] for mb in mbs]


def check_batches(out, seqlens, max_tokens, k_batch, min_bs=1, max_bs=None, same=False):
    microbatch_ids, batch_sizes, batch_max = out
    assert len(microbatch_ids) % k_batch == 0 and len(batch_sizes) == len(microbatch_ids) // k_batch
    seen = [i for _, mb in microbatch_ids for i in mb]
    assert len(seen) == len(set(seen))
    for j, (batch_id, mb) in enumerate(microbatch_ids):
        assert batch_id == j // k_batch
        assert sum(seqlens[i] for i in mb) <= max_tokens
        assert min_bs <= len(mb) <= (max_bs or len(mb))
    for b in range(len(batch_sizes)):
        group = [mb for _, mb in microbatch_ids[b * k_batch:(b + 1) * k_batch]]
        assert batch_sizes[b] == sum(len(mb) for mb in group)
        assert batch_max[b] == max(seqlens[i] for mb in group for i in mb)
        if same:
            assert len({len(mb) for mb in group}) == 1


# DeepSpeed 0.19.8 (DS_ACCELERATOR=cpu, /work/dsref), batch_by_seqlens(SEQLENS + [11], max_tokens=11,
# max_batch_size=3, effective_batch_size=2, seed=7, ...): DeepSpeed's loop never packs the last sample it
# walks (range(..., len(metrics), ...)), so the sentinel 11, walked last in both orders, makes its output
# that of SEQLENS without that bug. "random" was run on SEQLENS itself (its last walked sample is trimmed).
DEEPSPEED = {
    ("dataloader", False): ([(0, [0, 1]), (0, [2, 3]), (1, [4, 5]), (1, [6, 7]), (2, [8, 9]), (2, [10]),
                             (3, [11, 12, 13]), (3, [14, 15]), (4, [17, 18]), (4, [19])],
                            [4, 4, 3, 5, 3], [9, 8, 10, 7, 8]),
    ("dataloader", True): ([(0, [0]), (0, [1]), (1, [2]), (1, [3]), (2, [4]), (2, [5]), (3, [6]), (3, [7]),
                            (4, [8]), (4, [9]), (5, [10]), (5, [11]), (6, [12]), (6, [13]), (7, [14]), (7, [15]),
                            (8, [17]), (8, [18])], [2, 2, 2, 2, 2, 2, 2, 2, 2], [5, 9, 7, 8, 6, 10, 5, 7, 6]),
    ("seqlen", False): ([(0, [7, 18, 3]), (0, [11, 1, 9]), (1, [15, 5, 13]), (1, [0, 12]), (2, [8]), (2, [17]),
                         (3, [4]), (3, [14]), (4, [6]), (4, [19]), (5, [2]), (5, [10])],
                        [6, 5, 2, 2, 2, 2], [3, 5, 6, 7, 8, 10]),
    ("seqlen", True): ([(0, [7, 3, 1]), (0, [18, 11, 9]), (1, [15, 13]), (1, [5, 0]), (2, [12]), (2, [8]),
                        (3, [17]), (3, [4]), (4, [14]), (4, [6]), (5, [19]), (5, [2])],
                       [6, 4, 2, 2, 2, 2], [3, 5, 6, 7, 8, 9]),
    ("random", False): ([(0, [17, 15, 11]), (0, [18, 7, 6]), (1, [19, 3]), (1, [14]), (2, [0, 9]), (2, [5, 8]),
                         (3, [13]), (3, [2]), (4, [1, 12]), (4, [4])], [6, 3, 4, 2, 3], [8, 8, 6, 9, 7]),
}


@pytest.mark.parametrize("key", sorted(DEEPSPEED))
def test_equals_deepspeed_outputs(key):
    order, same = key
    out = batch_by_seqlens(SEQLENS, max_tokens=11, max_batch_size=3, sequence_picking_order=order,
                           effective_batch_size=2, required_microbatches_of_same_size=same, seed=7)
    assert out == DEEPSPEED[key]


@pytest.mark.parametrize("order", ["dataloader", "seqlen", "random"])
@pytest.mark.parametrize("same", [False, True])
@pytest.mark.parametrize("min_bs,max_bs,k_batch", [(1, None, 1), (1, 4, 4), (2, 5, 3), (3, None, 2)])
def test_packing_against_brute_force(order, same, min_bs, max_bs, k_batch):
    rng = np.random.default_rng(3)
    seqlens = rng.integers(1, 40, size=150).tolist()
    ids = sorted(rng.choice(150, size=120, replace=False).tolist())
    out = batch_by_seqlens(seqlens, 64, sequence_ids_per_mb=ids, min_batch_size=min_bs, max_batch_size=max_bs,
                           sequence_picking_order=order, effective_batch_size=k_batch,
                           required_microbatches_of_same_size=same, seed=11)
    check_batches(out, seqlens, 64, k_batch, min_bs, max_bs, same)
    assert [mb for _, mb in out[0]] == reference_batches(seqlens, 64, ids, min_bs, max_bs, order, k_batch, same, 11)
    assert {i for _, mb in out[0] for i in mb} <= set(ids)


def test_long_samples_left_out_and_numpy_input():
    seqlens = np.array([[3], [50], [4], [2], [60], [5]])  # the analyzer's N x 1 metric
    ids, sizes, longest = batch_by_seqlens(seqlens, max_tokens=10)
    assert ids == [(0, [0, 2, 3]), (1, [5])] and sizes == [3, 1] and longest == [4, 5]


def test_deterministic_per_seed():
    seqlens = np.random.default_rng(0).integers(1, 30, size=200).tolist()
    run = [batch_by_seqlens(seqlens, 50, sequence_picking_order="random", effective_batch_size=4, seed=s)
           for s in (5, 5, 6)]
    assert run[0] == run[1] and run[0] != run[2]
    assert batch_by_seqlens(seqlens, 50, sequence_picking_order="random", effective_batch_size=4) == \
        batch_by_seqlens(seqlens, 50, sequence_picking_order="random", effective_batch_size=4, seed=0)


@pytest.mark.parametrize("method", ["linear", "sqrt", "none", None, "NONE"])
def test_scale_lr_formulas(method):
    for base, size, lr in ((8, 4, 0.1), (8, 16, 0.1), (3, 7, 2e-4), (5, 0, 1.0)):
        expected = {"linear": lr * size / base, "sqrt": lr * math.sqrt(size / base)}.get(method, lr)
        assert scale_lr(base, size, lr, method) == pytest.approx(expected, rel=1e-15)
    assert scale_lr(4, 8) == 2.0  # base_lr 1, linear: the defaults


def _optimizer(lrs=(0.1, 0.03)):
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in lrs]
    return torch.optim.SGD([{"params": [p], "lr": lr} for p, lr in zip(params, lrs, strict=True)])


SCHEDULERS = {
    "exponential": lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.7),
    "lambda_warmup": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / 4)),
    "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
@pytest.mark.parametrize("method", ["linear", "sqrt", "none"])
def test_scheduler_scales_the_wrapped_rates(name, method):
    plain_opt = _optimizer()
    plain = SCHEDULERS[name](plain_opt)
    expected_unscaled = [[g["lr"] for g in plain_opt.param_groups]]
    for _ in range(9):
        plain_opt.step()
        plain.step()
        expected_unscaled.append([g["lr"] for g in plain_opt.param_groups])
    sizes = [6, 2, 9, 4]
    opt = _optimizer()
    sched = lr_scheduler_for_variable_batch_size(4, sizes, None, SCHEDULERS[name](opt), method)
    for t in range(10):
        if t:
            opt.step()
            sched.step()
        scale = scale_lr(4, sizes[t % 4], 1.0, method)
        assert [g["lr"] for g in opt.param_groups] == pytest.approx([lr * scale for lr in expected_unscaled[t]])
        assert sched.get_lr() == [g["lr"] for g in opt.param_groups]
        assert sched.get_last_lr() == pytest.approx(expected_unscaled[t])  # DeepSpeed's: unscaled
        assert sched.current_batch_size() == sizes[t % 4]
    sched.step(0)  # the start of an epoch: first rates, first batch
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([lr * scale_lr(4, 6, 1.0, method)
                                                                  for lr in expected_unscaled[0]])


def test_scheduler_equals_deepspeed_outputs():
    """DeepSpeed 0.19.8: ExponentialLR(gamma 0.5) under SGD lr 0.1, base 4, batch sizes [2, 4, 8], linear;
    an optimizer alone (constant rate) with sqrt."""
    opt = _optimizer((0.1,))
    sched = lr_scheduler_for_variable_batch_size(4, [2, 4, 8], None,
                                                 torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5))
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(5):
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == pytest.approx([0.05, 0.05, 0.05, 0.00625, 0.00625, 0.00625], rel=1e-15)
    assert sched.get_last_lr() == pytest.approx([0.003125])
    sched.step(0)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    opt = _optimizer((0.1,))
    sched = lr_scheduler_for_variable_batch_size(4, [2, 4, 8], None, opt, "sqrt")
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(4):
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == pytest.approx([0.07071067811865477, 0.1, 0.14142135623730953, 0.07071067811865477, 0.1],
                                rel=1e-15)


def test_scheduler_over_an_optimizer_wrapper_and_resume():
    opt = _optimizer()
    wrapper = types.SimpleNamespace(optimizer=opt, zero_grad=opt.zero_grad, step=opt.step)  # like the engine's
    sched = lr_scheduler_for_variable_batch_size(2, [1, 3], None, wrapper, "linear")
    assert isinstance(sched, VariableBatchSizeLR) and isinstance(sched, torch.optim.lr_scheduler.LRScheduler)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.05, 0.015])
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.15, 0.045])

    opt_a = _optimizer()
    a = lr_scheduler_for_variable_batch_size(4, [6, 2, 9], None, SCHEDULERS["exponential"](opt_a))
    for _ in range(4):
        a.step()
    state, opt_state = a.state_dict(), opt_a.state_dict()
    opt_b = _optimizer((1.0, 1.0))
    b = lr_scheduler_for_variable_batch_size(4, [1], None, SCHEDULERS["exponential"](opt_b))
    opt_b.load_state_dict(opt_state)
    b.load_state_dict(state)
    for _ in range(4):
        a.step()
        b.step()
        assert b.get_lr() == a.get_lr() and b.last_epoch == a.last_epoch


def _engine_split(seqlens, dp, mbs, gas, **kwargs):
    dataset = [torch.full((n,), i) for i, n in enumerate(seqlens)]
    effective = mbs * gas * dp
    loaders = []
    for rank in range(dp):
        loader, sched, io_kwargs = get_dataloader_and_lr_scheduler_for_variable_batch_size(
            dataset, seqlens, max_tokens=40, effective_batch_size=effective, dataloader_batch_size=mbs,
            dataloader_rank=rank, dataloader_num_replicas=dp, lr_scheduler_or_optimizer=_optimizer((0.1,)),
            sequence_picking_order="random", seed=3, **kwargs)
        loaders.append((loader, sched, io_kwargs))
    return loaders, batch_by_seqlens(seqlens, 40, effective_batch_size=effective, sequence_picking_order="random",
                                     seed=3, **kwargs)


@pytest.mark.parametrize("dp,mbs,gas", [(1, 1, 1), (2, 2, 2), (3, 1, 2), (2, 1, 4)])
def test_ranks_split_each_batch_disjoint_and_covering(dp, mbs, gas):
    seqlens = np.random.default_rng(1).integers(1, 20, size=240).tolist()
    loaders, (microbatch_ids, batch_sizes, _) = _engine_split(seqlens, dp, mbs, gas)
    iters = [iter(loader) for loader, _, _ in loaders]
    assert all(len(loader) == len(batch_sizes) * gas for loader, _, _ in loaders)
    for step, size in enumerate(batch_sizes):
        shares = []
        for it in iters:
            shares.append([int(t[0]) for _ in range(gas) for t in next(it)])  # gas items of mbs micro-batches
        everyone = [i for share in shares for i in share]
        assert len(everyone) == len(set(everyone)) == size
        expected = {i for batch_id, mb in microbatch_ids if batch_id == step for i in mb}
        assert set(everyone) == expected
        for _, sched, _ in loaders:  # every rank's rate is scaled for the batch it is on
            assert sched.current_batch_size() == size
            assert sched.get_lr() == pytest.approx([scale_lr(mbs * gas * dp, size, 0.1)])
            sched.step()
    assert all(next(it, None) is None for it in iters)
    _, _, io_kwargs = loaders[0]
    assert io_kwargs["batch_size"] == mbs and io_kwargs["data_sampler"].num_replicas == dp


def test_padding_to_the_batch_longest():
    seqlens = [3, 5, 2, 7, 4, 1, 6, 2]
    dataset = [torch.ones(n) for n in seqlens]
    ids, _, longest = batch_by_seqlens(seqlens, 9, effective_batch_size=2, required_microbatches_of_same_size=True)
    loader, _ = dataloader_for_variable_batch_size(
        dataset, ids, longest, dataloader_batch_size=2, dataloader_num_workers=0,
        dataloader_collate_fn=torch.stack, required_microbatches_of_same_seqlen=True,
        sample_padding_fn=lambda s, n: torch.nn.functional.pad(s, (0, n - len(s))))
    batches = list(loader)
    assert [tuple(b.shape) for b in batches] == [(sum(len(mb) for _, mb in ids[2 * j:2 * j + 2]), longest[j])
                                                  for j in range(len(longest))]
    assert [int(b.sum()) for b in batches] == [sum(seqlens[i] for _, mb in ids[2 * j:2 * j + 2] for i in mb)
                                               for j in range(len(longest))]


class _Engine:
    """What the DeepSpeed-style entry point reads from an engine."""

    def __init__(self, config, train_batch_size=4, micro=2, scheduler=None):
        self.config = types.SimpleNamespace(data_efficiency=config)
        self._train, self._micro = train_batch_size, micro
        self.optimizer = _optimizer((0.1,))
        self.lr_scheduler = scheduler
        self.data_parallel_group, self.world_size, self.global_rank = None, 1, 0

    def train_batch_size(self):
        return self._train

    def train_micro_batch_size_per_gpu(self):
        return self._micro


class PipelineEngine(_Engine):
    pass


def _config(tmp_path, **batching):
    return DataEfficiencyConfig.model_validate({"enabled": True, "seed": 9, "data_sampling": {"dynamic_batching": {
        "enabled": True, "max_tokens": 12, "metrics_path": str(tmp_path), "sequence_picking_order": "random",
        "lr_scaling_method": "sqrt", "max_batch_size": 4, **batching}}})


def test_deepspeed_entry_point_runs_the_analyzer(tmp_path):
    seqlens = np.random.default_rng(2).integers(1, 10, size=60).tolist()
    dataset = [torch.ones(n) for n in seqlens]

    def batch_seqlens_fn(batch):
        return torch.tensor([len(s) for s in batch], dtype=torch.int64)

    engine = _Engine(_config(tmp_path))
    loader, sched, _ = get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
        dataset, engine, dataloader_collate_fn=list, batch_seqlens_fn=batch_seqlens_fn)
    assert (tmp_path / "seqlen" / "seqlen_sample_to_metric.bin").exists()
    ids, sizes, _ = batch_by_seqlens(seqlens, 12, max_batch_size=4, sequence_picking_order="random",
                                     effective_batch_size=4, seed=9)
    assert sched.batch_sizes == sizes and sched.lr_scaling_method == "sqrt" and sched.base_batch_size == 4
    got = [[len(s) for s in item] for item in loader]
    assert got == [[seqlens[i] for _, mb in ids[j:j + 2] for i in mb] for j in range(0, len(ids), 2)]
    again = get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(dataset, _Engine(_config(tmp_path)))
    assert again[1].batch_sizes == sizes  # read back from the metric files

    pipe = PipelineEngine(_config(tmp_path))
    _, pipe_sched, _ = get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
        dataset, pipe, dataset_seqlens=seqlens, sample_padding_fn=lambda s, n: s)
    assert pipe_sched.batch_sizes == batch_by_seqlens(seqlens, 12, max_batch_size=4, sequence_picking_order="random",
                                                      effective_batch_size=4, seed=9,
                                                      required_microbatches_of_same_size=True)[1]


def test_bad_input_named(tmp_path):
    with pytest.raises(ValueError, match="max_tokens"):
        batch_by_seqlens(SEQLENS, 0)
    with pytest.raises(ValueError, match="min_batch_size"):
        batch_by_seqlens(SEQLENS, 10, min_batch_size=0)
    with pytest.raises(ValueError, match="max_batch_size"):
        batch_by_seqlens(SEQLENS, 10, min_batch_size=3, max_batch_size=2)
    with pytest.raises(ValueError, match=r"sequence_picking_order.*'longest'"):
        batch_by_seqlens(SEQLENS, 10, sequence_picking_order="longest")
    with pytest.raises(ValueError, match="effective_batch_size"):
        batch_by_seqlens(SEQLENS, 10, effective_batch_size=0)
    with pytest.raises(ValueError, match=r"sequence_ids_per_mb \[20\]"):
        batch_by_seqlens(SEQLENS, 10, sequence_ids_per_mb=[1, 20])
    with pytest.raises(ValueError, match="seqlens must be integers >= 0"):
        batch_by_seqlens([3, -1], 10)
    with pytest.raises(ValueError, match=r"only 1 micro-batches.*effective_batch_size 4"):
        batch_by_seqlens([1, 2, 3], 10, effective_batch_size=4)
    with pytest.raises(ValueError, match=r"lr_scaling_method.*'cubic'"):
        scale_lr(4, 8, 0.1, "cubic")
    with pytest.raises(ValueError, match="base_batch_size must be > 0, got 0"):
        scale_lr(0, 8, 0.1)
    with pytest.raises(ValueError, match="dataloader_rank must be below dataloader_num_replicas 2, got 2"):
        dataloader_for_variable_batch_size([], [(0, [0]), (0, [1])], [1], dataloader_rank=2, dataloader_num_replicas=2)
    with pytest.raises(ValueError, match="3 micro-batches do not split evenly over dataloader_num_replicas 2"):
        dataloader_for_variable_batch_size([], [(0, [0]), (0, [1]), (1, [2])], [1, 1], dataloader_num_replicas=2)
    with pytest.raises(ValueError, match="sample_padding_fn"):
        dataloader_for_variable_batch_size([], [(0, [0])], [1], required_microbatches_of_same_seqlen=True)
    with pytest.raises(ValueError, match=r"effective_batch_size 6 must be a multiple of .* = 4"):
        get_dataloader_and_lr_scheduler_for_variable_batch_size([], SEQLENS, 10, 6, dataloader_batch_size=2,
                                                                dataloader_num_replicas=2)
    with pytest.raises(ValueError, match=r"lr_scheduler_or_optimizer.*NoneType"):
        lr_scheduler_for_variable_batch_size(4, [4], None, None)
    with pytest.raises(ValueError, match="batch_sizes must be a non-empty"):
        lr_scheduler_for_variable_batch_size(4, [], None, _optimizer())
    off = DataEfficiencyConfig.model_validate({"data_sampling": {"dynamic_batching": {"max_tokens": 8}}})
    with pytest.raises(ValueError, match=r"dynamic_batching\.enabled is false"):
        get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed([], _Engine(off))
    with pytest.raises(ValueError, match="give dataset_seqlens or batch_seqlens_fn"):
        get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed([1], _Engine(_config(tmp_path / "none")))
