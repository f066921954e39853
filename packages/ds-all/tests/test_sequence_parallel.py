"""Sequence parallelism (Ulysses) through ds_all.initialize: on 4 ranks, SP2 x DP2 (a tiny GPT whose attention is
ds-parallel's DistributedAttention, ZeRO stages 1, 2 and 3 over data x sequence ranks, fp32, gradient clipping that
clips) equals the same GPT trained on whole sequences in a plain torch loop on the same global batch, within 1e-6.
Each rank's loss is its share of its sequences' loss (its tokens' sum over all the sequences' tokens); the
engine sums the gradients over the sequence ranks and averages them over the data ranks, as DeepSpeed's does."""

import torch
import torch.nn.functional as F
from torch import nn

import ds_all
import ds_comm
import ds_parallel
from ds_comm.testing import spawn

V, D, HEADS, LAYERS, T = 64, 32, 4, 2, 16
MICRO, DP, SP, STEPS, LR, CLIP = 2, 2, 2, 4, 0.1, 0.05


def _local_attention(q, k, v):
    """Causal attention on [batch, seq, heads, head_dim] (the layout DistributedAttention hands over)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.fc, self.proj = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.attention = _local_attention  # the reference: the whole sequence on one rank

    def forward(self, x):
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = (m(h).view(b, t, HEADS, D // HEADS) for m in (self.q, self.k, self.v))
        x = x + self.o(self.attention(q, k, v).reshape(b, t, D))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)
        self.first_position, self.tokens = 0, None  # sequence parallel: where this rank's slice starts, all tokens

    def forward(self, ids, targets):
        x = self.wte(ids) + self.wpe(self.first_position + torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        losses = F.cross_entropy(self.head(self.ln_f(x)).reshape(-1, V), targets.reshape(-1), reduction="sum")
        return losses / (self.tokens or targets.numel())


def sequence_parallel(model, group, sp_rank):
    """The same GPT with Ulysses attention: the rank's slice of each sequence, all heads in, heads/P attended."""
    for block in model.blocks:
        block.attention = _ulysses(ds_parallel.DistributedAttention(_local_attention, group, scatter_idx=2,
                                                                    gather_idx=1))
    model.first_position, model.tokens = sp_rank * (T // SP), MICRO * T
    return model


def _ulysses(attention):
    return lambda q, k, v: attention(q, k, v, batch_dim_idx=0)  # [batch, seq/P, heads, head_dim]


def _batches():
    torch.manual_seed(1)
    ids = torch.randint(0, V, (STEPS, MICRO * DP, T + 1))
    return ids[..., :-1], ids[..., 1:]


def sp_dp_equals_whole_sequences(rank, world_size):
    inputs, targets = _batches()
    out = {}
    for stage in (1, 2, 3):
        config = {"train_batch_size": MICRO * DP, "train_micro_batch_size_per_gpu": MICRO,
                  "gradient_clipping": CLIP, "zero_optimization": {"stage": stage}}
        mpu = None
        if stage != 2:  # the config builds the groups (DeepSpeed's data_parallel_size x sequence_parallel_size)
            config.update(sequence_parallel_size=SP, data_parallel_size=DP)
        else:  # a script's own mpu
            mpu = ds_parallel.ModelParallelUnit(sequence_parallel_size=SP)
        torch.manual_seed(0)
        ref, model = GPT(), GPT()
        model.load_state_dict(ref.state_dict())
        engine, *_ = ds_all.initialize(model=model, config=config, mpu=mpu,
                                       optimizer=lambda params: torch.optim.SGD(params, lr=LR, momentum=0.9))
        group = engine.get_sequence_parallel_group()
        sp_rank, dp_rank = ds_comm.get_rank(group), engine.get_data_parallel_rank()
        sequence_parallel(model, group, sp_rank)
        assert (engine.sequence_parallel_size, engine.dp_world_size, engine.seq_dp_world_size) == (SP, DP, SP * DP)
        assert engine.zero.world_size == SP * DP  # ZeRO partitions over data x sequence
        assert ds_all.utils.groups.get_sequence_parallel_world_size() == SP
        reference = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
        norms = []
        for step in range(STEPS):
            rows = slice(dp_rank * MICRO, (dp_rank + 1) * MICRO)
            cols = slice(sp_rank * (T // SP), (sp_rank + 1) * (T // SP))
            loss = engine(inputs[step, rows, cols], targets[step, rows, cols])
            engine.backward(loss)
            engine.step()
            reference.zero_grad()
            ref(inputs[step], targets[step]).backward()
            norms.append((engine.get_global_grad_norm(),
                          float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP))))
            reference.step()
        full = dict(ref.named_parameters())
        with ds_all.zero.GatheredParameters(list(model.parameters()), enabled=stage == 3):  # stage 3: partitioned
            worst = max(float((p.detach() - full[n].detach()).abs().max()) for n, p in model.named_parameters())
        out[stage] = (norms, worst)
        engine.destroy()
    return out


def test_sp2_dp2_equals_whole_sequences_at_stages_1_2_and_3():
    results = spawn(sp_dp_equals_whole_sequences, world_size=4, timeout=240)
    for stage in (1, 2, 3):
        for norms, worst in [r[stage] for r in results]:
            assert worst < 1e-6, (stage, worst)
            for got, want in norms:
                assert got > CLIP  # clipped
                assert abs(got - want) <= 1e-6 * want, (stage, got, want)


def bad_sizes(rank, world_size):
    errors = []
    for extra in ({"sequence_parallel_size": 3}, {"sequence_parallel_size": 2, "data_parallel_size": 2}):
        try:
            ds_all.initialize(model=nn.Linear(4, 4), config={"train_micro_batch_size_per_gpu": 1, **extra},
                              optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
        except ValueError as e:
            errors.append(str(e))
    engine, *_ = ds_all.initialize(model=nn.Linear(4, 4), config={"train_micro_batch_size_per_gpu": 1},
                                   optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    try:
        engine.get_sequence_parallel_group()
    except RuntimeError as e:
        errors.append(str(e))
    engine.destroy()
    return errors


def test_bad_sequence_parallel_sizes_are_named():
    errors = spawn(bad_sizes, world_size=2)[0]
    assert len(errors) == 3
    assert "sequence_parallel_size 3" in errors[0] and "world size 2" in errors[0]
    assert "data_parallel_size 2 × sequence_parallel_size 2 must be the 1 data-parallel ranks" in errors[1]
    assert "no sequence parallelism" in errors[2]
