"""Checkpoints of tensor-parallel models load at another tensor-parallel size: each slice is saved as its part
of the whole parameter (weights and Adam's states), so a TP=2 checkpoint loads at TP=1 × DP=2 and a TP=1
checkpoint (of the unsplit model, plain torch layers) loads at TP=2, and training goes on as if uninterrupted:
equal, within 1e-6 in fp32, to the unsplit model trained in a plain torch loop for all the steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_comm.testing import spawn

IN, D, HIDDEN, OUT, ROWS, SEQ, LR, SEED = 8, 16, 32, 4, 4, 4, 1e-2, 7
BEFORE, AFTER = 2, 2  # steps before the save, steps after the load
CLIP = 0.5


class ParallelMLP(nn.Module):
    def __init__(self, group):
        super().__init__()
        from ds_parallel import ColumnParallelLinear, RowParallelLinear
        self.ln = nn.LayerNorm(D)
        self.fc = ColumnParallelLinear(D, HIDDEN, gather_output=False, group=group)
        self.proj = RowParallelLinear(HIDDEN, D, input_is_parallel=True, group=group)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.ln(x))[0]))[0]


class ParallelHead(nn.Module):
    def __init__(self, group):
        super().__init__()
        from ds_parallel import ColumnParallelLinear
        self.fc = ColumnParallelLinear(D, OUT, gather_output=True, group=group)

    def forward(self, x):
        return self.fc(x)[0]


class TPModel(nn.Module):
    """The model with ds-parallel's layers: a replicated linear, an MLP (column then row), a column head."""

    def __init__(self, group):
        super().__init__()
        self.lin0, self.mlp, self.head = nn.Linear(IN, D), ParallelMLP(group), ParallelHead(group)

    def forward(self, x):
        return self.head(self.mlp(self.lin0(x)))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc, self.proj = nn.LayerNorm(D), nn.Linear(D, HIDDEN), nn.Linear(HIDDEN, D)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.ln(x))))


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, OUT)

    def forward(self, x):
        return self.fc(x)


class PlainModel(nn.Module):
    """The unsplit model in plain torch layers (the same parameter names)."""

    def __init__(self):
        super().__init__()
        self.lin0, self.mlp, self.head = nn.Linear(IN, D), MLP(), Head()

    def forward(self, x):
        return self.head(self.mlp(self.lin0(x)))


def plain_model(seed: int) -> PlainModel:
    """The unsplit model initialised as `TPModel` is after ``torch.manual_seed(seed)``: the first linear by
    torch's default, the parallel layers' whole weights by xavier_normal_ in their order, biases 0."""
    model = PlainModel()
    torch.manual_seed(seed)
    with torch.no_grad():
        model.lin0.reset_parameters()
        for linear in (model.mlp.fc, model.mlp.proj, model.head.fc):
            linear.weight.copy_(nn.init.xavier_normal_(torch.empty_like(linear.weight)))
            linear.bias.zero_()
    return model


def batch(step: int):
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(ROWS, SEQ, IN, generator=g), torch.randn(ROWS, SEQ, OUT, generator=g)


def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = plain_model(SEED)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(BEFORE + AFTER):
        x, y = batch(step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def _engine(tp: int, seed: int, plain: bool):
    import ds_all
    import ds_parallel
    mpu = ds_parallel.ModelParallelUnit(tensor_parallel_size=tp)
    if plain:
        model = plain_model(seed)
    else:
        torch.manual_seed(seed)
        model = TPModel(mpu.get_tensor_model_parallel_group())
    dp = mpu.get_data_parallel_world_size()
    config = {"train_micro_batch_size_per_gpu": ROWS // dp, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": LR}}, "zero_optimization": {"stage": 1},
              "gradient_clipping": CLIP, "steps_per_print": 1000}
    engine, *_ = ds_all.initialize(model=model, config=config, mpu=mpu)
    return engine, mpu


def _steps(engine, mpu, steps) -> list[float]:
    dp, share = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    losses = []
    for step in steps:
        x, y = batch(step)
        rows = slice(share * ROWS // dp, (share + 1) * ROWS // dp)  # this replica's share of the batch
        loss = F.mse_loss(engine(x[rows]), y[rows])
        engine.backward(loss)
        engine.step()
        whole = loss.detach().clone()
        torch.distributed.all_reduce(whole)  # the replicas' shares (each on every tensor-parallel rank)
        losses.append(whole.item() / torch.distributed.get_world_size())
    return losses


def resume(rank, world, directory, save_tp, load_tp):
    """Train BEFORE steps at ``save_tp`` (TP=1: the plain unsplit model), save, load at ``load_tp`` into a
    model of other initial weights, train AFTER steps; this rank's slices and the losses."""
    engine, mpu = _engine(save_tp, SEED, plain=save_tp == 1)
    losses = _steps(engine, mpu, range(BEFORE))
    engine.save_checkpoint(directory, tag="t")
    engine.destroy()
    engine, mpu = _engine(load_tp, SEED + 1, plain=load_tp == 1 and save_tp != 1)
    path, _ = engine.load_checkpoint(directory)
    assert path is not None and engine.global_steps == BEFORE
    losses += _steps(engine, mpu, range(BEFORE, BEFORE + AFTER))
    params = {name: (p.detach().clone(), p.partition_dim if getattr(p, "tensor_model_parallel", False) else None)
              for name, p in engine.module.named_parameters()}
    engine.destroy()
    return losses, mpu.get_tensor_model_parallel_rank(), params


def both_ways(rank, world, root):
    return {(save, load): resume(rank, world, f"{root}/{save}to{load}", save, load) for save, load in ((2, 1), (1, 2))}


def _whole(results, case) -> dict[str, torch.Tensor]:
    """The whole parameters: slices concatenated along partition_dim at TP=2; at TP=1 × DP=2 rank 0's
    (both replicas hold the same)."""
    ranks = sorted((r[case] for r in results), key=lambda r: r[1])
    sliced = len({tp_rank for _, tp_rank, _ in ranks}) > 1
    out = {}
    for name, (tensor, dim) in ranks[0][2].items():
        other, _ = ranks[1][2][name]
        if sliced and dim is not None:
            out[name] = torch.cat([tensor, other], dim=dim)
        else:
            torch.testing.assert_close(other, tensor, rtol=0, atol=0)  # replicated: the same on both ranks
            out[name] = tensor
    return out


@pytest.mark.parametrize("case", [(2, 1), (1, 2)], ids=["tp2-to-tp1", "tp1-to-tp2"])
def test_a_checkpoint_loads_at_another_tensor_parallel_size(case, results_both_ways):
    want_losses, want = reference()
    results = results_both_ways
    for losses, _, _ in (r[case] for r in results):
        assert losses == pytest.approx(want_losses, rel=1e-6, abs=1e-6)
    got = _whole(results, case)
    assert set(got) == set(want)
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, want[name], rtol=1e-6, atol=1e-6, msg=lambda m, n=name: f"{case} {n}: {m}")


@pytest.fixture(scope="module")
def results_both_ways(tmp_path_factory):
    return spawn(both_ways, world_size=2, args=(str(tmp_path_factory.mktemp("tp_ckpt")),), timeout=240)


# --------------------------------------------- GPT-2's fused c_attn: a strided slice (partition_stride 3)
class Conv1D(nn.Module):
    """Hugging Face's GPT-2 ``Conv1D`` (weight [in, out]; AutoTP knows it by name and shape): no transformers
    import on the ranks."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight, self.bias = nn.Parameter(torch.randn(nx, nf) * 0.2), nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        return x @ self.weight + self.bias


class GPT2Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_heads, self.split_size, self.head_dim = 4, D, D // 4
        self.c_attn, self.c_proj = Conv1D(3 * D, D), Conv1D(D, D)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (h.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
                   for h in self.c_attn(x).split(self.split_size, dim=2))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        return self.c_proj(a.reshape(b, t, self.num_heads * self.head_dim))


class GPT2MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc, self.c_proj = Conv1D(HIDDEN, D), Conv1D(D, HIDDEN)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(D), GPT2Attention(), nn.LayerNorm(D), GPT2MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Like(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin0, self.h, self.head = nn.Linear(IN, D), nn.ModuleList(GPT2Block() for _ in range(2)), nn.Linear(D, OUT)

    def forward(self, x):
        x = self.lin0(x)
        for block in self.h:
            x = block(x)
        return self.head(x)


def _gpt2_engine(seed: int):
    import ds_all
    torch.manual_seed(seed)
    model = GPT2Like()
    ds_all.tp_model_init(model, tp_size=2, dtype=torch.float32)
    config = {"train_micro_batch_size_per_gpu": ROWS, "optimizer": {"type": "Adam", "params": {"lr": LR}},
              "zero_optimization": {"stage": 1}, "gradient_clipping": CLIP, "steps_per_print": 1000}
    engine, *_ = ds_all.initialize(model=model, config=config)
    return engine


def _gpt2_steps(engine, steps) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(step)
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def gpt2_resumes(rank, world, directory):
    """Uninterrupted, then saved after BEFORE steps and loaded into a model of other initial weights."""
    engine = _gpt2_engine(SEED)
    assert engine.module.h[0].attn.c_attn.weight.partition_stride == 3  # q, k and v: this rank's heads of each
    losses = _gpt2_steps(engine, range(BEFORE + AFTER))
    want = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    engine = _gpt2_engine(SEED)
    resumed = _gpt2_steps(engine, range(BEFORE))
    engine.save_checkpoint(directory, tag="t")
    # the checkpoint holds the whole c_attn, each rank's q, k and v heads in their places ([out, in] layout)
    whole = engine.module.h[0].attn.c_attn.gathered_state()["weight"].t()
    exported = None
    if rank == 0:
        from ds_zero import get_fp32_state_dict_from_zero_checkpoint
        exported = get_fp32_state_dict_from_zero_checkpoint(directory)["h.0.attn.c_attn.weight"]
    engine.destroy()
    engine = _gpt2_engine(SEED + 1)
    path, _ = engine.load_checkpoint(directory)
    assert path is not None and engine.global_steps == BEFORE
    resumed += _gpt2_steps(engine, range(BEFORE, BEFORE + AFTER))
    worst = max(float((p.detach() - want[n]).abs().max()) for n, p in engine.module.named_parameters())
    engine.destroy()
    return losses, resumed, worst, whole, exported


def test_a_gpt2_autotp_checkpoint_with_strided_c_attn_resumes_as_if_uninterrupted(tmp_path):
    results = spawn(gpt2_resumes, world_size=2, args=(str(tmp_path),), timeout=240)
    for losses, resumed, worst, _, _ in results:
        assert resumed == losses and worst == 0.0
    _, _, _, whole, exported = results[0]
    assert whole.shape == (3 * D, D) and torch.equal(exported, whole)
