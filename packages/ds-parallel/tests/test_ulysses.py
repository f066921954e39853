"""Ulysses (DistributedAttention) on 2 ranks against single-rank attention on the whole sequence."""

import math

import pytest
import torch
import torch.nn.functional as F

import ds_comm
from ds_comm.testing import spawn
from ds_parallel import DistributedAttention, seq_all_to_all

TOL = 1e-6


def _attention(q, k, v, causal=False):
    """Plain softmax attention on [batch, seq, heads, head_dim]; k/v may have fewer heads (GQA)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, h, s, d]
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = q.shape[2]
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def _rotary(t, cos, sin):
    half = cos.shape[-1] // 2
    head = t[..., :cos.shape[-1]]
    rotated = torch.cat((-head[..., half:], head[..., :half]), dim=-1)
    return torch.cat((head * cos + rotated * sin, t[..., cos.shape[-1]:]), dim=-1)


def _max_diff(a, b):
    return (a - b).abs().max().item()


def _one_case(rank, world, *, causal, layout, q_heads=4, kv_heads=4, rotary=False):
    """Max |difference| (output, dq, dk, dv) between this rank's slice of the SP result and of the
    single-rank attention of the whole sequence."""
    torch.manual_seed(0)
    b, s, d = 2, 16, 8
    q = torch.randn(b, s, q_heads, d)
    k, v = torch.randn(b, s, kv_heads, d), torch.randn(b, s, kv_heads, d)
    grad = torch.randn(b, s, q_heads, d)
    cos = sin = None
    if rotary:  # DeepSpeed's form: [seq, 1, 1, rot_dim], permuted (1, 0, 2, 3) before use
        angle = torch.arange(s).float()[:, None] * torch.rand(d // 2)
        cos = torch.cat((angle.cos(), angle.cos()), -1)[:, None, None, :]
        sin = torch.cat((angle.sin(), angle.sin()), -1)[:, None, None, :]

    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    rq, rk = ref_in[0], ref_in[1]
    if rotary:
        rq, rk = (_rotary(t, cos.permute(1, 0, 2, 3), sin.permute(1, 0, 2, 3)) for t in (rq, rk))
    ref = _attention(rq, rk, ref_in[2], causal)
    ref.backward(grad)

    chunk = s // world
    mine = slice(rank * chunk, (rank + 1) * chunk)
    seq_first = layout in ("seq_first", "literal_seq_first")

    def local(t):  # this rank's slice of the sequence, in the layout under test
        t = t[:, mine]
        return t.transpose(0, 1).contiguous() if seq_first else t.contiguous()

    def local_attention(q_, k_, v_):
        if seq_first:
            return _attention(q_.transpose(0, 1), k_.transpose(0, 1), v_.transpose(0, 1), causal).transpose(0, 1)
        return _attention(q_, k_, v_, causal)

    ins = [local(t).requires_grad_() for t in (q, k, v)]
    if layout == "batch_first":
        out = DistributedAttention(local_attention, None)(*ins, 0, (cos, sin) if rotary else None)
    elif layout == "seq_first":
        out = DistributedAttention(local_attention, None)(*ins, batch_dim_idx=1)
    elif layout == "literal_batch_first":  # no batch_dim_idx: split dim 2, concatenate dim 1
        out = DistributedAttention(local_attention, None, scatter_idx=2, gather_idx=1)(*ins)
    else:  # literal_seq_first: DeepSpeed's defaults (scatter 2, gather 0) on [seq, batch, heads, dim]
        out = DistributedAttention(local_attention, None)(*ins)
    out.backward(local(grad))
    back = (lambda t: t.transpose(0, 1)) if seq_first else (lambda t: t)
    return [_max_diff(back(out), ref[:, mine])] + [_max_diff(back(t.grad), r.grad[:, mine])
                                                 for t, r in zip(ins, ref_in, strict=True)]


CASES = [dict(causal=c, layout=lay) for c in (False, True)
         for lay in ("batch_first", "seq_first", "literal_batch_first", "literal_seq_first")]
CASES += [dict(causal=True, layout="batch_first", q_heads=4, kv_heads=2),
          dict(causal=True, layout="batch_first", rotary=True)]


def _errors(rank, world):
    """(what, exception type, message) of each bad input."""
    found = []
    x = torch.randn(1, 4, 4, 2)

    def attempt(what, fn):
        try:
            fn()
        except (ValueError, NotImplementedError) as e:
            found.append((what, type(e).__name__, str(e)))
        else:
            found.append((what, None, ""))

    attn = DistributedAttention(_attention, None)
    three = torch.randn(1, 4, 3, 2)
    attempt("heads", lambda: attn(three, three, three, 0))
    attempt("kv_heads", lambda: attn(x, three, three, 0))
    attempt("batch_dim_idx", lambda: attn(x, x, x, 2))
    attempt("3d_with_batch_dim", lambda: attn(x[0], x[0], x[0], 0))
    attempt("same_idx", lambda: DistributedAttention(_attention, None, scatter_idx=1, gather_idx=1))
    attempt("sp_stream", lambda: DistributedAttention(_attention, None, sp_stream=object()))
    attempt("not_callable", lambda: DistributedAttention("attention", None))
    attempt("num_kv_heads", lambda: DistributedAttention(_attention, None, num_kv_heads=3)(x, x, x, 0))
    attempt("seq_split", lambda: seq_all_to_all(torch.randn(3, 4), 0, 1))
    return found


def _attention_checks(rank, world):
    diffs = [_one_case(rank, world, **case) for case in CASES]
    # the exchanges go through ds_comm: 4 all-to-alls forward (q, k, v, output) and 4 backward
    ds_comm.configure(enabled=True)
    ds_comm.comms_logger.reset()
    _one_case(rank, world, causal=False, layout="batch_first")
    counts = {r.op: r.count for r in ds_comm.comms_logger.records()}
    ds_comm.configure(enabled=False)
    return {"diffs": diffs, "counts": counts, "errors": _errors(rank, world)}


@pytest.fixture(scope="module")
def attention_results():
    return spawn(_attention_checks, world_size=2)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[
    "-".join(f"{k}={v}" for k, v in c.items()) for c in CASES])
def test_sp2_attention_equals_single_rank(attention_results, index):
    for rank, result in enumerate(attention_results):
        out, dq, dk, dv = result["diffs"][index]
        assert max(out, dq, dk, dv) < TOL, (rank, CASES[index], out, dq, dk, dv)


def test_all_to_alls_go_through_ds_comm(attention_results):
    for result in attention_results:
        assert result["counts"].get("all_to_all_single") == 8, result["counts"]


def test_bad_input_is_named(attention_results):
    errors = {what: (kind, msg) for what, kind, msg in attention_results[0]["errors"]}
    assert errors["heads"][0] == "ValueError" and "query heads (3" in errors["heads"][1] \
        and "group size (2)" in errors["heads"][1]
    assert errors["kv_heads"][0] == "ValueError" and "key heads (3" in errors["kv_heads"][1]
    assert errors["batch_dim_idx"][0] == "ValueError" and "got 2" in errors["batch_dim_idx"][1]
    assert errors["3d_with_batch_dim"][0] == "ValueError" and "3-D" in errors["3d_with_batch_dim"][1]
    assert errors["same_idx"][0] == "ValueError" and "1 for both" in errors["same_idx"][1]
    assert errors["sp_stream"][0] == "NotImplementedError" and "sp_stream" in errors["sp_stream"][1]
    assert errors["not_callable"][0] == "ValueError" and "str" in errors["not_callable"][1]
    assert errors["num_kv_heads"][0] == "ValueError" and "num_kv_heads (3)" in errors["num_kv_heads"][1]
    assert errors["seq_split"][0] == "ValueError" and "size 3" in errors["seq_split"][1]


# ---- a tiny GPT trained with its sequence split over 2 ranks ------------------------------------------
VOCAB, D, HEADS, LAYERS, SEQ, BATCH, STEPS = 64, 32, 4, 2, 16, 2, 10


class _Block(torch.nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(D), torch.nn.LayerNorm(D)
        self.qkv, self.proj = torch.nn.Linear(D, 3 * D), torch.nn.Linear(D, D)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(D, 4 * D), torch.nn.GELU(), torch.nn.Linear(4 * D, D))
        self.attention = attention

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, HEADS, D // HEADS).unbind(2)
        x = x + self.proj(self.attention(q, k, v).reshape(b, s, D))
        return x + self.mlp(self.ln2(x))


class _GPT(torch.nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(VOCAB, D), torch.nn.Embedding(SEQ, D)
        self.blocks = torch.nn.ModuleList(_Block(attention) for _ in range(LAYERS))
        self.ln, self.head = torch.nn.LayerNorm(D), torch.nn.Linear(D, VOCAB)

    def forward(self, tokens, first_position=0):
        positions = torch.arange(first_position, first_position + tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def _causal(q, k, v):
    return _attention(q, k, v, causal=True)


def _train(model, batches, step_loss):
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    losses = []
    for tokens, targets in batches:
        loss = step_loss(model, tokens, targets)
        opt.step()
        opt.zero_grad()
        losses.append(loss)
    return losses


def _gpt_trains_equal(rank, world):
    torch.manual_seed(0)
    tokens = [torch.randint(VOCAB, (BATCH, SEQ)) for _ in range(STEPS)]
    batches = [(t, (t * 7 + 3) % VOCAB) for t in tokens]  # a learnable map, so the loss falls
    torch.manual_seed(1)
    reference = _GPT(_causal)
    sp_attention = DistributedAttention(_causal, None)
    split = _GPT(lambda q, k, v: sp_attention(q, k, v, batch_dim_idx=0))
    split.load_state_dict(reference.state_dict())

    def whole(model, tokens, targets):
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        return loss.item()

    chunk = SEQ // world

    def sequence_parallel(model, tokens, targets):
        mine = slice(rank * chunk, (rank + 1) * chunk)
        loss = F.cross_entropy(model(tokens[:, mine], rank * chunk).flatten(0, 1), targets[:, mine].flatten())
        loss.backward()
        # as ZeRO does over data x sequence: average the gradients over the group (the slices hold
        # equal token counts, so the mean of the slices' mean losses is the whole sequence's)
        for p in model.parameters():
            ds_comm.all_reduce(p.grad)
            p.grad /= world
        total = loss.detach().clone()
        ds_comm.all_reduce(total)
        return total.item() / world

    ref_losses = _train(reference, batches, whole)
    sp_losses = _train(split, batches, sequence_parallel)
    weights = max(_max_diff(a, b) for a, b in zip(reference.parameters(), split.parameters(), strict=True))
    return {"loss": max(abs(a - b) for a, b in zip(ref_losses, sp_losses, strict=True)), "weights": weights,
            "losses": ref_losses}


def test_gpt_with_ulysses_trains_equal_to_single_rank():
    results = spawn(_gpt_trains_equal, world_size=2)
    for result in results:
        assert result["loss"] < TOL and result["weights"] < TOL, result
        assert result["losses"][-1] < result["losses"][0]  # it did train
