"""DeepSpeed's vocab_sequence_parallel_cross_entropy on 2 ranks against F.cross_entropy on the whole sequence."""

import pytest
import torch
import torch.nn.functional as F

import ds_comm
from ds_comm.testing import spawn
from ds_parallel import vocab_sequence_parallel_cross_entropy

TOL = 1e-6
SEQ, BATCH, VOCAB, IGNORE = 16, 3, 32, -100


def _full_problem():
    """The whole sequence, [seq, batch, vocab] (DeepSpeed's layout), some targets ignored, and a weight per token
    (so the gradient of each token differs)."""
    torch.manual_seed(0)
    logits = torch.randn(SEQ, BATCH, VOCAB) * 2
    target = torch.randint(0, VOCAB, (SEQ, BATCH))
    target[torch.rand(SEQ, BATCH) < 0.2] = IGNORE
    weight = torch.rand(SEQ, BATCH)
    return logits, target, weight


def _reference(logits, target, weight, reduction="none"):
    """F.cross_entropy on the full sequence: the loss and the gradient of its logits."""
    logits = logits.clone().requires_grad_()
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=IGNORE,
                           reduction=reduction)
    if reduction == "none":
        loss = loss.view(SEQ, BATCH)
        (loss * weight).sum().backward()
    else:
        loss.backward()
    return loss.detach(), logits.grad


def _diff(a, b):
    return (a - b).abs().max().item()


def _check_against_full_sequence(rank, world):
    logits, target, weight = _full_problem()
    rows = slice(rank * SEQ // world, (rank + 1) * SEQ // world)
    sp = ds_comm.new_group(ranks=list(range(world)))
    diffs = {}

    # DeepSpeed's default (Megatron-DeepSpeed's call): the sequence split, the losses all-gathered
    ref_loss, ref_grad = _reference(logits, target, weight)
    local = logits[rows].clone().requires_grad_()
    ds_comm.configure(enabled=True)
    ds_comm.comms_logger.reset()
    loss = vocab_sequence_parallel_cross_entropy(local, target[rows], sp)
    (loss * weight).sum().backward()
    ops = {r.op for r in ds_comm.comms_logger.records()}
    ds_comm.configure(enabled=False)
    assert loss.shape == (SEQ, BATCH) and loss.dtype == torch.float32
    diffs["gathered loss"] = _diff(loss, ref_loss)
    diffs["gathered grad"] = _diff(local.grad, ref_grad[rows])

    # no gather: the local losses, and the sum / mean over the sequence-parallel group
    local = logits[rows].clone().requires_grad_()
    loss = vocab_sequence_parallel_cross_entropy(local, target[rows], sp, gather_sequence_loss=False)
    (loss * weight[rows]).sum().backward()
    assert loss.shape == (SEQ // world, BATCH)
    diffs["local loss"] = _diff(loss, ref_loss[rows])
    diffs["local grad"] = _diff(local.grad, ref_grad[rows])
    for reduction in ("sum", "mean"):
        ref_value, ref_red_grad = _reference(logits, target, weight, reduction)
        local = logits[rows].clone().requires_grad_()
        value = vocab_sequence_parallel_cross_entropy(local, target[rows], sp, reduction=reduction,
                                                      gather_sequence_loss=False)
        value.backward()
        diffs[f"{reduction} value"] = _diff(value, ref_value) / max(1.0, ref_value.abs().item())
        diffs[f"{reduction} grad"] = _diff(local.grad, ref_red_grad[rows])

    # the vocabulary split over a tensor-parallel group too (here the same 2 ranks, the whole sequence on each):
    # equal shards, then uneven ones given by their bounds
    for start, end in (((0, 16), (16, 32)), ((0, 12), (12, 32))):
        lo, hi = start if rank == 0 else end
        shard = logits[:, :, lo:hi].clone().requires_grad_()
        bounds = {} if hi - lo == VOCAB // world else {"vocab_start_index": lo, "vocab_end_index": hi}
        loss = vocab_sequence_parallel_cross_entropy(shard, target, None, tp_group=sp, gather_sequence_loss=False,
                                                     **bounds)
        (loss * weight).sum().backward()
        diffs[f"tp {hi - lo} loss"] = _diff(loss, ref_loss)
        diffs[f"tp {hi - lo} grad"] = _diff(shard.grad, ref_grad[:, :, lo:hi])
    return diffs, sorted(ops)


def test_sequence_split_equals_cross_entropy_of_the_whole_sequence():
    for diffs, ops in spawn(_check_against_full_sequence, world_size=2):
        assert max(diffs.values()) < TOL, diffs
        assert "all_gather_into_tensor" in ops, ops  # the comms logger sees the gather


def _check_bad_input_across_ranks(rank, world):
    group = ds_comm.new_group(ranks=list(range(world)))
    messages = []
    seq = 4 if rank == 0 else 5  # the ranks hold different sequence lengths: no gather is possible
    try:
        vocab_sequence_parallel_cross_entropy(torch.randn(seq, 2, 8), torch.zeros(seq, 2, dtype=torch.long), group)
    except ValueError as error:
        messages.append(str(error))
    vocab = 8 if rank == 0 else 6  # uneven vocabulary shards without bounds
    try:
        vocab_sequence_parallel_cross_entropy(torch.randn(4, 2, vocab), torch.zeros(4, 2, dtype=torch.long), None,
                                              tp_group=group, gather_sequence_loss=False)
    except ValueError as error:
        messages.append(str(error))
    bounds = (0, 8) if rank == 0 else (9, 17)  # a gap at id 8
    try:
        vocab_sequence_parallel_cross_entropy(torch.randn(4, 2, 8), torch.zeros(4, 2, dtype=torch.long), None,
                                              tp_group=group, vocab_start_index=bounds[0],
                                              vocab_end_index=bounds[1], gather_sequence_loss=False)
    except ValueError as error:
        messages.append(str(error))
    return messages


def test_bad_input_across_the_groups_is_named_on_every_rank():
    for messages in spawn(_check_bad_input_across_ranks, world_size=2):
        assert len(messages) == 3, messages
        assert "sp_group" in messages[0] and "[(4, 2), (5, 2)]" in messages[0]
        assert "tp_group" in messages[1] and "[8, 6]" in messages[1]
        assert "tp_group" in messages[2] and "[(0, 8), (9, 17)]" in messages[2]


@pytest.mark.parametrize("kwargs, words", [
    ({"target": torch.zeros(4, 3, dtype=torch.long)}, ["(4, 3)", "(4, 2, 8)"]),
    ({"target": torch.zeros(4, 2)}, ["integer", "torch.float32"]),
    ({"target": torch.full((4, 2), 8)}, ["target id 8", "[0, 8)"]),
    ({"reduction": "max", "gather_sequence_loss": False}, ["reduction", "'max'"]),
    ({"reduction": "mean"}, ["gather_sequence_loss", "'mean'"]),
    ({"sp_group": None}, ["sp_group=None"]),
    ({"backend": "triton"}, ["backend", "'triton'"]),
    ({"vocab_start_index": 0, "gather_sequence_loss": False}, ["vocab_start_index", "vocab_end_index"]),
    ({"vocab_start_index": 2, "vocab_end_index": 10, "gather_sequence_loss": False}, ["[0, 8)", "[2, 10)"]),
])
def test_bad_input_is_named(kwargs, words):
    args = {"vocab_parallel_logits": torch.randn(4, 2, 8), "target": torch.zeros(4, 2, dtype=torch.long),
            "sp_group": object(), **kwargs}
    if not args.get("gather_sequence_loss", True):
        args["sp_group"] = None
    with pytest.raises(ValueError) as error:
        vocab_sequence_parallel_cross_entropy(**args)
    assert all(word in str(error.value) for word in words), str(error.value)
