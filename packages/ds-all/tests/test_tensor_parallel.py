"""Tensor parallelism through ds_all.initialize: on 4 ranks, TP2 x DP2 (a tiny GPT built from ds-parallel's
Megatron-style layers, ZeRO stages 1, 2 and 3, fp32, gradient clipping that clips) equals the unsplit GPT trained in
a plain torch loop on the same global batch: the clipped norm every step (replicated parameters counted once)
and every weight slice after the steps, within 1e-6. Bad sizes are named."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ds_all
import ds_comm
import ds_parallel
from ds_comm.testing import RankFailed, spawn

V, D, HEADS, LAYERS, T = 64, 32, 4, 2, 16
MICRO, DP, TP, STEPS, LR, CLIP = 2, 2, 2, 4, 0.1, 0.05


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.fc, self.proj = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = (m(h).view(b, t, HEADS, D // HEADS).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, D)
        x = x + self.o(a)
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """The unsplit reference: plain torch."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)

    def forward(self, ids, targets):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.ln_f(x)).reshape(-1, V), targets.reshape(-1))


class TPBlock(nn.Module):
    """Megatron's split: q/k/v and fc column-parallel (heads and hidden units divided), o and proj
    row-parallel; the layer norms and the row-parallel biases replicated."""

    def __init__(self, group):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        col = dict(gather_output=False, group=group)
        self.q, self.k, self.v = (ds_parallel.ColumnParallelLinear(D, D, **col) for _ in range(3))
        self.o = ds_parallel.RowParallelLinear(D, D, input_is_parallel=True, group=group)
        self.fc = ds_parallel.ColumnParallelLinear(D, 4 * D, **col)
        self.proj = ds_parallel.RowParallelLinear(4 * D, D, input_is_parallel=True, group=group)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = (m(h)[0].view(b, t, HEADS // TP, D // HEADS).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, D // TP)
        x = x + self.o(a)[0]
        return x + self.proj(F.gelu(self.fc(self.ln2(x))[0]))[0]


class TPGPT(nn.Module):
    def __init__(self, group):
        super().__init__()
        self.group = group
        self.wte, self.wpe = ds_parallel.VocabParallelEmbedding(V, D, group=group), nn.Embedding(T, D)
        self.blocks = nn.ModuleList(TPBlock(group) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D)
        self.head = ds_parallel.ColumnParallelLinear(D, V, bias=False, gather_output=False, group=group)

    def forward(self, ids, targets):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))[0]  # this rank's slice of the vocabulary: no full logits anywhere
        return ds_parallel.vocab_parallel_cross_entropy(logits, targets, group=self.group).mean()


def _slice(full, param, rank):
    """This rank's slice of the reference's ``full`` tensor, as ``param`` holds it (its Megatron marks)."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim
    n = param.shape[dim]
    return full.narrow(dim, rank * n, n)


def _copy_slices(tp_model, ref, rank):
    full = dict(ref.named_parameters())
    with torch.no_grad():
        for name, p in tp_model.named_parameters():
            p.copy_(_slice(full[name], p, rank))


def _batches():
    torch.manual_seed(1)
    ids = torch.randint(0, V, (STEPS, MICRO * DP, T + 1))
    return ids[..., :-1], ids[..., 1:]


def tp_dp_equals_unsplit(rank, world_size):
    mpu = ds_parallel.ModelParallelUnit(tensor_parallel_size=TP)
    tp_rank, dp_rank = mpu.get_tensor_model_parallel_rank(), mpu.get_data_parallel_rank()
    inputs, targets = _batches()
    out = {}
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        ref = GPT()
        model = TPGPT(mpu.get_tensor_model_parallel_group())
        _copy_slices(model, ref, tp_rank)
        replicated = [n for n, p in model.named_parameters() if not getattr(p, "tensor_model_parallel", False)]
        assert "blocks.0.o.bias" in replicated and "blocks.0.ln1.weight" in replicated
        config = {"train_batch_size": MICRO * DP, "train_micro_batch_size_per_gpu": MICRO,
                  "gradient_clipping": CLIP, "zero_optimization": {"stage": stage},
                  "tensor_parallel": {"autotp_size": TP}}  # the same size as the mpu's: the model is sliced already
        engine, *_ = ds_all.initialize(model=model, config=config, mpu=mpu,
                                       optimizer=lambda params: torch.optim.SGD(params, lr=LR, momentum=0.9))
        assert (engine.dp_world_size, engine.mp_world_size, engine.zero.world_size) == (DP, TP, DP)
        assert engine.get_tensor_parallel_rank() == tp_rank
        reference = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
        norms, twice = [], []
        for step in range(STEPS):
            mine = slice(dp_rank * MICRO, (dp_rank + 1) * MICRO)
            loss = engine(inputs[step, mine], targets[step, mine])
            engine.backward(loss)
            engine.step()
            reference.zero_grad()
            ref(inputs[step], targets[step]).backward()
            ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP))
            # what counting the replicated parameters on both tensor-parallel ranks would give
            extra = sum(float(p.grad.square().sum()) for n, p in ref.named_parameters() if n in replicated)
            norms.append((engine.get_global_grad_norm(), ref_norm))
            twice.append(math.sqrt(ref_norm ** 2 + extra))
            reference.step()
        full = dict(ref.named_parameters())
        # stage 3: each slice is partitioned over the data-parallel ranks; gathered whole to compare
        with ds_all.zero.GatheredParameters(list(model.parameters()), enabled=stage == 3):
            worst = max(float((p.detach() - _slice(full[n], p, tp_rank).detach()).abs().max())
                        for n, p in model.named_parameters())
        out[stage] = (norms, twice, worst)
        engine.destroy()
    return out


def test_tp2_dp2_equals_the_unsplit_model_at_stages_1_2_and_3():
    results = spawn(tp_dp_equals_unsplit, world_size=4, timeout=240)
    for stage in (1, 2, 3):
        for norms, twice, worst in [r[stage] for r in results]:
            assert worst < 1e-6, (stage, worst)
            for (got, want), doubled in zip(norms, twice, strict=True):
                assert got > CLIP  # the clipping clipped: the trained weights depend on the norm
                assert abs(got - want) <= 1e-6 * want, (stage, got, want)
                assert abs(doubled - want) > 20e-6 * want  # replicated parameters counted twice would show


def bad_sizes(rank, world_size):
    base = {"train_micro_batch_size_per_gpu": 1}
    errors = []
    for extra, mpu_tp in (({"tensor_parallel": {"autotp_size": 3}}, None),
                          ({"tensor_parallel": {"autotp_size": 2, "tp": {"tp_size": 4}}}, None),
                          ({"tensor_parallel": {"autotp_size": 2}}, 1)):
        mpu = ds_parallel.ModelParallelUnit(tensor_parallel_size=mpu_tp) if mpu_tp else None
        try:
            ds_all.initialize(model=nn.Linear(4, 4), config={**base, **extra}, mpu=mpu,
                              optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
        except ValueError as e:
            errors.append(str(e))
    assert ds_comm.is_initialized()
    return errors


def test_bad_tensor_parallel_sizes_are_named():
    errors = spawn(bad_sizes, world_size=2)[0]
    assert len(errors) == 3
    assert "tensor_parallel.autotp_size 3" in errors[0] and "world size 2" in errors[0]
    assert "tensor_parallel.tp.tp_size (4) does not match tensor_parallel.autotp_size (2)" in errors[1]
    assert "tensor_parallel.autotp_size is 2 but the mpu passed (ModelParallelUnit) has 1" in errors[2]


def test_autotp_options_not_built_are_refused_by_name():
    with pytest.raises(ValueError, match=r"tensor_parallel\.tp_overlap_comm True"):
        ds_all.Config.load({"train_batch_size": 1, "tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": True}})
    config = ds_all.Config.load({"train_batch_size": 1, "tensor_parallel": {"autotp_size": 2}})
    assert config.tensor_parallel.autotp_size == 2  # accepted: initialize builds it


def test_tp_model_init_conflicting_with_the_config_is_named():
    with pytest.raises(RankFailed, match=r"tensor_parallel.autotp_size in the config \(4\) conflicts with "
                                         r"tp_model_init's tp_size \(2\)"):
        spawn(_initialize_after_tp_model_init, world_size=1)


def _initialize_after_tp_model_init(rank, world_size):
    model = nn.Linear(4, 4)
    assert ds_all.tp_model_init(model, tp_size=2, dtype=torch.float32) is model  # records, as DeepSpeed 0.19's
    ds_all.initialize(model=model, config={"train_batch_size": 1, "tensor_parallel": {"autotp_size": 4}},
                      optimizer=lambda params: torch.optim.SGD(params, lr=0.1))


class LlamaLikeAttention(nn.Module):
    """The names AutoTP recognises (q/k/v column, o row) and the head count it divides (``num_heads``)."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(D, D, bias=False) for _ in range(4))
        self.num_heads, self.head_dim = HEADS, D // HEADS

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
                   for m in (self.q_proj, self.k_proj, self.v_proj))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(a.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class LlamaLikeMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(D, 2 * D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLikeLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(D), nn.LayerNorm(D)
        self.self_attn, self.mlp = LlamaLikeAttention(), LlamaLikeMLP()

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaLike(nn.Module):
    """A Llama-shaped model for AutoTP (no transformers import on the ranks: CI time)."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(V, D)
        self.layers = nn.ModuleList(LlamaLikeLayer() for _ in range(LAYERS))
        self.norm, self.lm_head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)

    def forward(self, ids, targets):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.lm_head(self.norm(x)).reshape(-1, V), targets.reshape(-1))


def autotp_equals_unsplit(rank, world_size, save_dir):
    torch.manual_seed(0)
    ref = LlamaLike()
    model = LlamaLike()
    model.load_state_dict(ref.state_dict())
    ds_all.tp_model_init(model, tp_size=2, dtype=torch.float32)  # recorded: initialize builds the groups and slices
    config = {"train_batch_size": 2, "gradient_clipping": CLIP, "zero_optimization": {"stage": 1}}
    engine, *_ = ds_all.initialize(model=model, config=config,
                                   optimizer=lambda params: torch.optim.SGD(params, lr=LR))
    assert (engine.autotp_size(), engine.mp_world_size, engine.dp_world_size) == (2, 2, 1)
    assert model.layers[0].self_attn.num_heads == HEADS // 2  # sliced: half the heads on each rank
    reference = torch.optim.SGD(ref.parameters(), lr=LR)
    inputs, targets = _batches()
    losses = []
    for step in range(3):
        loss = engine(inputs[step, :2], targets[step, :2])
        engine.backward(loss)
        engine.step()
        reference.zero_grad()
        ref_loss = ref(inputs[step, :2], targets[step, :2])
        ref_loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        reference.step()
        losses.append((float(loss), float(ref_loss), engine.get_global_grad_norm(), float(norm)))
    engine.save_16bit_model(save_dir)  # the slices gathered: the unsplit model's weights
    worst = None
    if rank == 0:
        saved = torch.load(f"{save_dir}/pytorch_model.bin")
        assert set(saved) == set(ref.state_dict())
        worst = max(float((saved[k] - v).abs().max()) for k, v in ref.state_dict().items())
    engine.destroy()
    return losses, worst


def test_autotp_from_tp_model_init_trains_like_the_unsplit_model(tmp_path):
    """DeepSpeed 0.19's flow: ``tp_model_init`` records, ``initialize`` (no mpu, no tensor_parallel section) builds
    the tensor-parallel groups and slices; trained and saved whole, it equals the unsplit model."""
    results = spawn(autotp_equals_unsplit, world_size=2, args=(str(tmp_path),), timeout=240)
    for loss, ref_loss, norm, ref_norm in results[0][0]:
        assert abs(loss - ref_loss) <= 1e-5 and abs(norm - ref_norm) <= 1e-5 * ref_norm and norm > CLIP
    assert results[0][1] < 1e-5
