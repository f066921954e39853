"""ZenFlow's pieces: DeepSpeed's partition of a group cut per parameter, the columns chosen in each part, and the
selected columns' AdamW, each against an independent reference (a hand count, a loop, torch.optim.AdamW)."""

from __future__ import annotations

import pytest
import torch

from ds_zero._zenflow_select import adamw_, column_count, pieces, select_columns, selected_count


def test_pieces_cut_deepspeeds_partitions_per_parameter():
    # the tiny Llama of ds-all's ZenFlow test: embedding, 2 layers of 4 x 64x64 + 3 x 8192 + 2 norms, norm, head
    layer = [4096] * 4 + [8192] * 3 + [64, 64]
    numels = [16384, *layer, *layer, 64, 16384]
    parts = pieces(numels, 2)
    # 115008 elements, padded to a multiple of 2 x 2: two partitions of 57504; the first ends 32 elements into
    # layer 1's q_proj (16384 + 41088 = 57472)
    assert parts[0] == [(0, 16384)] and parts[9] == [(0, 64)]
    assert parts[10] == [(0, 32), (32, 4064)]
    assert parts[-1] == [(0, 16384)]
    assert sum(n for p in parts for _, n in p) == sum(numels)
    assert pieces([10, 7], 4) == [[(0, 6), (6, 4)], [(0, 2), (2, 5)]]  # 17 -> 24: partitions of 6


@pytest.mark.parametrize(("offset", "numel", "rows", "expected"), [
    (0, 64, 8, (0, 8)), (32, 4064, 64, (1, 63)), (0, 32, 64, (0, 0)), (5, 20, 8, (1, 2)), (8, 8, 8, (1, 1))])
def test_column_count_takes_whole_columns(offset, numel, rows, expected):
    first, count = column_count(offset, numel, rows)
    assert (first, count) == expected
    whole = [c for c in range(0, (offset + numel) // rows + 1) if c * rows >= offset and (c + 1) * rows <= offset + numel]
    assert (whole[0] if whole else first, len(whole)) == expected


def test_selected_count_is_deepspeeds():
    assert [selected_count(n, 0.1) for n in (0, 1, 9, 10, 19, 63, 64)] == [0, 1, 1, 1, 1, 6, 6]


def test_select_columns_against_a_loop():
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(8, 20, generator=g).to(torch.bfloat16)
    parts = [(0, 44), (44, 116)]  # column 5 (elements 40-47) straddles the two parts: chosen by neither
    chosen = select_columns(grad, parts, 0.25)
    expected = []
    for first, count in (column_count(o, n, 8) for o, n in parts):
        sums = {c: grad[:, c].float().abs().sum().item() for c in range(first, first + count)}
        expected += sorted(sorted(sums, key=lambda c: -sums[c])[:selected_count(count, 0.25)])
    assert chosen.tolist() == expected and 5 not in expected
    assert chosen.dtype == torch.int64


def test_adamw_is_torchs_single_tensor_adamw_in_bf16():
    g = torch.Generator().manual_seed(1)
    param = (torch.randn(16, 6, generator=g) * 0.02).to(torch.bfloat16)
    reference = torch.nn.Parameter(param.clone())
    optimizer = torch.optim.AdamW([reference], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, foreach=False)
    exp_avg, exp_avg_sq, step = torch.zeros_like(param), torch.zeros_like(param), torch.zeros((), dtype=torch.float32)
    for _ in range(3):
        grad = torch.randn(16, 6, generator=g).to(torch.bfloat16)
        reference.grad = grad.clone()
        optimizer.step()
        adamw_(param, grad, exp_avg, exp_avg_sq, step, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
        assert torch.equal(param, reference.detach())
    assert torch.equal(exp_avg, optimizer.state[reference]["exp_avg"]) and float(step) == 3.0


class _TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.extra = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x, use_extra):
        h = self.body(x)
        return self.extra(h) if use_extra else h


def _plain_loop(rank, world_size):
    from ds_zero import ZeroOptimizer

    torch.manual_seed(0)
    model = _TwoHeads()
    zero = ZeroOptimizer(model, torch.optim.AdamW, optimizer_kwargs={"lr": 1e-2}, bf16={"enabled": True},
                         config={"stage": 2, "offload_optimizer": {"device": "cpu"},
                                 "zenflow": {"topk_ratio": 0.25, "update_interval": 2, "select_strategy": "step",
                                             "select_interval": 4, "overlap_step": True}})
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(6):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank)).to(torch.bfloat16)
        zero.backward(model(x, use_extra=(rank == 0 or step % 3 == 0)).float().square().mean())  # rank 1 skips extra
        zero.step()
        zero.zero_grad()
    zero.close()
    return {n: (p.detach().float(), before[n].float()) for n, p in model.named_parameters()}


def test_zenflow_in_a_plain_loop_keeps_ranks_equal_when_a_rank_skips_a_module():
    from ds_comm.testing import spawn

    first, second = spawn(_plain_loop, world_size=2, timeout=300)
    for name, (after, before) in first.items():
        assert torch.equal(after, second[name][0]), name  # one model on both ranks (rank 1 had no extra gradient)
        assert not torch.equal(after, before), name  # every parameter trained, the skipped module too
