"""Done-when: a tiny GPT at TP=2 (column/row-parallel attention and MLP, vocab-parallel embedding tied to the
head, vocab-parallel cross entropy) equals the unsplit model within 1e-6 fp32 over 10 SGD steps: the loss of
every step and every gathered weight. Both are built from the same seed; the unsplit one is plain torch."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

import ds_comm
from ds_comm.testing import spawn
from ds_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tensor_model_parallel_region,
    vocab_parallel_cross_entropy,
)

VOCAB, D, HEADS, LAYERS, SEQ, BATCH, STEPS, LR = 64, 32, 4, 2, 16, 2, 10, 0.5


def init(w):
    return nn.init.normal_(w, std=0.2)


# ---- the unsplit reference: plain torch, every weight drawn with ``init`` in creation order, biases zero ------
def linear(i, o):
    layer = skip_init(nn.Linear, i, o)
    init(layer.weight)
    nn.init.zeros_(layer.bias)
    return layer


def embedding(n, d):
    layer = skip_init(nn.Embedding, n, d)
    init(layer.weight)
    return layer


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = linear(D, D), linear(D, D), linear(D, D), linear(D, D)
        self.fc1, self.fc2 = linear(D, 4 * D), linear(4 * D, D)

    def forward(self, x):
        h = self.ln1(x)
        b, s, _ = h.shape
        q, k, v = (m(h).view(b, s, HEADS, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, D)
        x = x + self.o(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = embedding(VOCAB, D), embedding(SEQ, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D)

    def forward(self, ids, labels):
        x = self.wte(ids) + self.wpe(torch.arange(ids.size(1)))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied head
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


# ---- the same model at TP=2 -----------------------------------------------------------------------------------
class TPBlock(nn.Module):
    def __init__(self, tp):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        col = dict(gather_output=False, init_method=init)
        self.q, self.k, self.v = (ColumnParallelLinear(D, D, **col) for _ in range(3))
        self.o = RowParallelLinear(D, D, input_is_parallel=True, init_method=init)
        self.fc1 = ColumnParallelLinear(D, 4 * D, **col)
        self.fc2 = RowParallelLinear(4 * D, D, input_is_parallel=True, init_method=init)
        self.local_heads = HEADS // tp

    def forward(self, x):
        h = self.ln1(x)
        b, s, _ = h.shape
        q, k, v = (m(h)[0].view(b, s, self.local_heads, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.o(a)[0]
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))[0]))[0]


class TPGPT(nn.Module):
    def __init__(self, tp):
        super().__init__()
        self.wte, self.wpe = VocabParallelEmbedding(VOCAB, D, init_method=init), embedding(SEQ, D)
        self.blocks = nn.ModuleList(TPBlock(tp) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D)

    def forward(self, ids, labels):
        x = self.wte(ids) + self.wpe(torch.arange(ids.size(1)))
        for block in self.blocks:
            x = block(x)
        # Megatron's parallel_lm_logits: the head's input is copied into the region, logits stay vocab-parallel
        logits_parallel = F.linear(copy_to_tensor_model_parallel_region(self.ln_f(x)), self.wte.weight)
        return vocab_parallel_cross_entropy(logits_parallel, labels).mean()


def full_state(model):
    """Every parameter of the TP model gathered to its unsplit shape (plain torch.distributed, the marks say
    along which dimension)."""
    out = {}
    for name, p in model.named_parameters():
        if getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(p) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, p.detach().contiguous())
            out[name] = torch.cat(parts, dim=p.partition_dim)
        else:
            out[name] = p.detach().clone()
    return out


def train(rank, world_size):
    torch.manual_seed(0)
    reference = GPT()
    torch.manual_seed(0)
    model = TPGPT(world_size)
    ref_params = dict(reference.named_parameters())
    assert sorted(full_state(model)) == sorted(ref_params)
    for name, value in full_state(model).items():  # built from the same seed: the same weights, bit for bit
        assert torch.equal(value, ref_params[name]), name

    sgd, ref_sgd = torch.optim.SGD(model.parameters(), lr=LR), torch.optim.SGD(reference.parameters(), lr=LR)
    data = torch.Generator().manual_seed(1)  # the same batches on both ranks (one data-parallel replica)
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=data)
        inputs, labels = ids[:, :-1], ids[:, 1:]
        loss, ref_loss = model(inputs, labels), reference(inputs, labels)
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-6)
        losses.append(ref_loss.item())
        for opt, value in ((sgd, loss), (ref_sgd, ref_loss)):
            opt.zero_grad()
            value.backward()
            opt.step()
    final = full_state(model)
    moved = 0.0
    torch.manual_seed(0)
    initial = dict(GPT().named_parameters())
    for name, value in final.items():
        torch.testing.assert_close(value, ref_params[name], rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        moved = max(moved, (ref_params[name] - initial[name]).abs().max().item())
    assert moved > 1e-2, moved  # training changed the weights: the comparison is not of two initial models
    assert losses[-1] < losses[0], losses
    return ds_comm.get_world_size()


def test_tp2_gpt_equals_unsplit():
    assert spawn(train, world_size=2, timeout=240) == [2, 2]
