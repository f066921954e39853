"""AutoTP on 2 ranks: tp_model_init slices Hugging Face GPT-2 (fused Conv1D c_attn) and Llama (grouped-query
attention, biases) built from code; the sliced model gives the unsliced model's logits, trains equal to it
(a plain loop: SGD for GPT-2, Adam for Llama), and replace_module_consolidated_state_dict gives back the
unsliced model's state dict. The reference is the untouched Hugging Face model, run whole on every rank.
Refusals (a module AutoTP cannot slice, head counts tp_size does not divide) are checked in-process."""

import copy

import pytest
import torch
from torch import nn

import ds_comm
from ds_comm.testing import spawn
from ds_parallel import (
    LinearAllreduce,
    LinearLayer,
    replace_module_consolidated_state_dict,
    tp_model_init,
)

transformers = pytest.importorskip("transformers")

V, D, SEQ, BATCH, STEPS = 128, 64, 16, 2, 3
TOL = 1e-5


def gpt2(**overrides):
    kw = dict(vocab_size=V, n_positions=32, n_embd=D, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
              attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    kw.update(overrides)
    torch.manual_seed(0)  # the same full weights on every rank
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**kw))


def llama(**overrides):
    kw = dict(vocab_size=V, hidden_size=D, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32, attention_bias=True, mlp_bias=True,
              tie_word_embeddings=False, attn_implementation="sdpa")
    kw.update(overrides)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    with torch.no_grad():  # HF zero-initialises biases: make them count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.02)
    return model


def _max_diff(a, b):
    return (a - b).abs().max().item()


def _check_replicated_grads(model, group):
    """Replicated parameters see the same gradient on every tensor-parallel rank (the Megatron mappings
    all-reduce the activation gradients); average them over the group all the same, as a data-parallel
    reduction over these ranks would. Sliced gradients are left alone. Returns the largest cross-rank spread."""
    world, spread = ds_comm.get_world_size(group), 0.0
    for p in model.parameters():
        if getattr(p, "tensor_model_parallel", False) or p.grad is None:
            continue
        parts = [torch.empty_like(p.grad) for _ in range(world)]
        ds_comm.all_gather(parts, p.grad.contiguous(), group=group)
        spread = max(spread, max(_max_diff(parts[0], q) for q in parts[1:]))
        ds_comm.all_reduce(p.grad, group=group)
        p.grad /= world
    return spread


def _train_and_compare(ref, model, make_opt, group, rank):
    out = {}
    torch.manual_seed(1234)  # the same batches on every rank (tensor parallelism: one data stream)
    batches = [torch.randint(0, V, (BATCH, SEQ)) for _ in range(STEPS + 1)]
    probe = batches.pop()
    with torch.no_grad():
        out["logits0"] = _max_diff(model(probe).logits, ref(probe).logits)
    full = replace_module_consolidated_state_dict(model, rank0_only=False)
    want = ref.state_dict()
    out["keys0"] = list(full) == list(want)
    out["sd0"] = max(_max_diff(full[k], want[k]) for k in want)
    ref_opt, opt = make_opt(ref.parameters()), make_opt(model.parameters())
    out["loss"], out["spread"] = [], 0.0
    for ids in batches:
        ref_opt.zero_grad()
        ref_loss = ref(ids, labels=ids, use_cache=False).loss
        ref_loss.backward()
        ref_opt.step()
        opt.zero_grad()
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        out["spread"] = max(out["spread"], _check_replicated_grads(model, group))
        opt.step()
        out["loss"].append(abs(loss.item() - ref_loss.item()))
    with torch.no_grad():
        out["logits"] = _max_diff(model(probe).logits, ref(probe).logits)
    sd = replace_module_consolidated_state_dict(model)  # DeepSpeed's default: rank 0 only
    out["rank0_only"] = (sd is None) == (rank != 0)
    full = replace_module_consolidated_state_dict(model, rank0_only=False)
    want = ref.state_dict()
    out["keys"] = list(full) == list(want) and all(full[k].shape == want[k].shape for k in want)
    out["sd"] = max(_max_diff(full[k], want[k]) for k in want)
    return out


def run(rank, world_size):
    results = {}

    # ---- GPT-2: fused c_attn (Conv1D) sliced per head, default group, SGD ----
    ref = gpt2()
    init = copy.deepcopy(ref.state_dict())
    model = tp_model_init(copy.deepcopy(ref), tp_size=2, dtype=torch.float32)
    attn, mlp = model.transformer.h[0].attn, model.transformer.h[0].mlp
    c_attn = attn.c_attn
    results["gpt2_layout"] = (
        type(c_attn) is LinearLayer and type(attn.c_proj) is LinearAllreduce and type(mlp.c_fc) is LinearLayer
        and type(mlp.c_proj) is LinearAllreduce and type(model.lm_head) is nn.Linear
        and tuple(c_attn.weight.shape) == (3 * D // 2, D) and tuple(attn.c_proj.weight.shape) == (D, D // 2)
        and (attn.num_heads, attn.split_size) == (2, D // 2)
        and c_attn.weight.tensor_model_parallel and c_attn.weight.partition_stride == 3
        and c_attn.weight.partition_dim == 0 and attn.c_proj.weight.partition_dim == 1
        and not getattr(attn.c_proj.bias, "tensor_model_parallel", False)
        and not getattr(model.transformer.wte.weight, "tensor_model_parallel", False)
        and model.lm_head.weight is model.transformer.wte.weight and model.ds_autotp_parsed)
    # rank r's c_attn rows are its heads of q, k and v (HF Conv1D: columns of the [in, 3 D] weight)
    half = D // 2
    cols = [part * D + rank * half + i for part in range(3) for i in range(half)]
    results["gpt2_heads"] = _max_diff(c_attn.weight, ref.transformer.h[0].attn.c_attn.weight[:, cols].t())
    out = _train_and_compare(ref, model, lambda ps: torch.optim.SGD(ps, lr=0.5), None, rank)
    out["trained"] = max(_max_diff(init[k], v) for k, v in ref.state_dict().items())
    results["gpt2"] = out

    # ---- Llama: GQA (4 heads, 2 kv heads), biases, an explicit tp_group, Adam ----
    group = ds_comm.new_group([0, 1])
    ref = llama()
    init = copy.deepcopy(ref.state_dict())
    model = tp_model_init(copy.deepcopy(ref), 2, torch.float32, tp_group=group)
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    results["llama_layout"] = (
        all(type(getattr(attn, n)) is LinearLayer for n in ("q_proj", "k_proj", "v_proj"))
        and type(attn.o_proj) is LinearAllreduce
        and all(type(getattr(mlp, n)) is LinearLayer for n in ("gate_proj", "up_proj"))
        and type(mlp.down_proj) is LinearAllreduce
        and type(model.lm_head) is LinearLayer and model.lm_head.gather_output  # the HF plan's colwise_gather_output
        and tuple(model.lm_head.weight.shape) == (V // 2, D) and type(model.model.embed_tokens) is nn.Embedding
        and tuple(attn.k_proj.weight.shape) == (D // 4, D)  # 2 kv heads of 16: one per rank
        and attn.q_proj.bias.tensor_model_parallel and attn.q_proj.bias.partition_dim == 0
        and not getattr(attn.o_proj.bias, "tensor_model_parallel", False)
        and attn.num_key_value_groups == 2)
    out = _train_and_compare(ref, model, lambda ps: torch.optim.Adam(ps, lr=1e-3), group, rank)
    out["trained"] = max(_max_diff(init[k], v) for k, v in ref.state_dict().items())
    results["llama"] = out

    # ---- a tied Llama head stays replicated (and tied); logits still equal ----
    ref = llama(tie_word_embeddings=True)
    model = tp_model_init(copy.deepcopy(ref), 2, torch.float32, tp_group=group)
    ids = torch.randint(0, V, (BATCH, SEQ))
    with torch.no_grad():
        results["tied"] = (type(model.lm_head) is nn.Linear and model.lm_head.weight is model.model.embed_tokens.weight,
                           _max_diff(model(ids).logits, ref(ids).logits))

    # ---- LinearLayer(gather_output=True) alone: the full output and the full input gradient ----
    torch.manual_seed(5)
    full, x = nn.Linear(8, 6), torch.randn(3, 8)
    layer = LinearLayer(copy.deepcopy(full), group, gather_output=True)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    y_ref, y = full(xs[0]), layer(xs[1])
    (y_ref * torch.arange(6.0)).sum().backward()
    (y * torch.arange(6.0)).sum().backward()
    results["gather_output"] = (tuple(layer.weight.shape) == (3, 8), _max_diff(y, y_ref),
                                _max_diff(xs[0].grad, xs[1].grad))
    return results


def test_autotp_gpt2_llama_equal_unsliced():
    for rank, res in enumerate(spawn(run, world_size=2, timeout=180)):
        assert res["gpt2_layout"], rank
        assert res["gpt2_heads"] == 0.0
        assert res["llama_layout"], rank
        assert res["tied"][0] and res["tied"][1] <= TOL, res["tied"]
        shape_ok, out_diff, grad_diff = res["gather_output"]
        assert shape_ok and out_diff <= 1e-6 and grad_diff <= 1e-6, res["gather_output"]
        for model in ("gpt2", "llama"):
            out = res[model]
            assert out["keys0"] and out["keys"], (model, rank)
            assert out["logits0"] <= TOL and out["sd0"] == 0.0, (model, rank, out)
            assert max(out["loss"]) <= TOL, (model, rank, out)
            assert out["spread"] <= 1e-6, (model, rank, out)
            assert out["logits"] <= TOL and out["sd"] <= TOL, (model, rank, out)
            assert out["trained"] > 1e-3, (model, rank, out)  # training moved the weights: the check has teeth
            assert out["rank0_only"], (model, rank)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Module()
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self.attn, n, nn.Linear(8, 8))
        self.attn.head_dim = 4
        self.fc = nn.Linear(8, 8)  # no recognised pattern


class _Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Block(), _Block()])


def _untouched(model):
    return not any(isinstance(m, (LinearLayer, LinearAllreduce)) for m in model.modules())


def test_refuses_module_it_cannot_slice_by_name():
    model = _Odd()
    with pytest.raises(NotImplementedError, match=r"'layers\.0\.fc' \(Linear\)"):
        tp_model_init(model, 2, torch.float32)
    assert _untouched(model)  # refused before any change
    cross = gpt2(add_cross_attention=True)
    with pytest.raises(NotImplementedError, match=r"'transformer\.h\.0\.crossattention'.*cross-attention"):
        tp_model_init(cross, 2, torch.float32)
    assert _untouched(cross)
    with pytest.raises(NotImplementedError, match=r"Sequential: it has no nn\.ModuleList"):
        tp_model_init(nn.Sequential(nn.Linear(4, 4)), 2, torch.float32)
    qk_norm = llama()
    qk_norm.model.layers[0].self_attn.q_norm = nn.LayerNorm(16)  # Qwen3-style: a gradient partial per rank
    with pytest.raises(NotImplementedError, match=r"'model\.layers\.0\.self_attn\.q_norm' \(LayerNorm\)"):
        tp_model_init(qk_norm, 2, torch.float32)


def test_refuses_tp_size_not_dividing_heads_by_name():
    with pytest.raises(ValueError, match=r"'transformer\.h\.0\.attn' has num_heads = 3, not divisible by tp_size 2"):
        tp_model_init(gpt2(n_embd=48, n_head=3), 2, torch.float32)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn' has num_key_value_heads .* = 1, not "
                                         r"divisible by tp_size 2"):
        tp_model_init(llama(num_key_value_heads=1), 2, torch.float32)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.up_proj' has out_features = 90, not divisible "
                                         r"by tp_size 4"):
        tp_model_init(llama(intermediate_size=90, num_key_value_heads=4), 4, torch.float32)


def test_bad_arguments_and_single_rank():
    model = gpt2()
    with pytest.raises(ValueError, match="tp_size must be an int >= 1, got 0"):
        tp_model_init(model, 0, torch.float32)
    with pytest.raises(ValueError, match=r"dtype must be a floating torch\.dtype.*torch\.int8"):
        tp_model_init(model, 1, torch.int8)
    with pytest.raises(RuntimeError, match=r"tp_size=2\) needs the default process group initialised"):
        tp_model_init(model, 2, torch.float32)  # no process group in this process
    assert _untouched(model)
    ref = copy.deepcopy(model.state_dict())
    assert tp_model_init(model, 1, torch.bfloat16) is model  # tp_size 1: only the cast
    assert _untouched(model) and model.ds_autotp_parsed
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    sd = replace_module_consolidated_state_dict(model)
    assert all(torch.equal(sd[k], v.to(torch.bfloat16)) for k, v in ref.items())
    with pytest.raises(RuntimeError, match="already sliced with tp_size 1, cannot slice it again with tp_size 2"):
        tp_model_init(model, 2, torch.bfloat16)
