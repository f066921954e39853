"""AutoTP when the group size does not divide a layer: DeepSpeed's shard-size rules (`get_shard_size_list`, by
hand-computed values), `LinearLayer` / `LinearAllreduce` holding uneven shards on 3 ranks against an nn.Linear
holding the whole weights (output, input gradient, parameter gradients, the gathered output and the gathered
state); AutoTP by rules (`apply_partition_config`); FPDT's token order. Bad input is named."""

import pytest
import torch
from torch import nn

from ds_comm.testing import spawn
from ds_parallel import (
    AutoTPConfig,
    LinearAllreduce,
    LinearLayer,
    TPLayerSpec,
    apply_partition_config,
    fpdt_token_order,
    get_shard_size,
    get_shard_size_list,
    replace_module_consolidated_state_dict,
)

close = torch.testing.assert_close


# ---- shard sizes --------------------------------------------------------------------------------------------

def test_near_even_split_first_ranks_get_one_more():
    assert get_shard_size_list(10, 3) == [4, 3, 3]
    assert get_shard_size_list(129, 4) == [33, 32, 32, 32]
    assert get_shard_size_list(128, 4) == [32, 32, 32, 32]
    assert get_shard_size_list(2, 4) == [1, 1, 0, 0]
    assert [get_shard_size(7, 3, r) for r in range(3)] == [3, 2, 2]


def test_grain_split_gives_the_remainder_to_the_last_rank():
    # 70 = 8 grains of 8 + 6: grains 3, 3, 2 -> 24, 24, 16 + 6
    assert get_shard_size_list(70, 3, grain_size=8) == [24, 24, 22]
    assert get_shard_size_list(5, 2, grain_size=8) == [3, 2]  # smaller than a grain: element by element


def test_attention_splits_by_whole_kv_heads_mlp_and_heads_do_not():
    # 6 kv heads of 16 over 4 ranks: 2, 2, 1, 1 heads
    assert get_shard_size_list(96, 4, "model.layers.0.self_attn.k_proj", num_kv_heads=6) == [32, 32, 16, 16]
    for name in ("model.layers.0.mlp.fc", "layers.0.up_proj", "lm_head"):
        assert get_shard_size_list(96, 4, name, num_kv_heads=6) == [24, 24, 24, 24]
    assert get_shard_size_list(100, 4, "q_proj", num_kv_heads=6) == [25, 25, 25, 25]  # 6 does not divide 100


@pytest.mark.parametrize("call", [lambda: get_shard_size_list(10, 0), lambda: get_shard_size(10, 3, 3),
                                  lambda: get_shard_size_list(10, 2, grain_size=0),
                                  lambda: get_shard_size_list(-1, 2), lambda: get_shard_size_list(8, 2, num_kv_heads=0)])
def test_bad_sizes_are_named(call):
    with pytest.raises(ValueError, match="must be an integer"):
        call()


# ---- uneven layers on 3 ranks -------------------------------------------------------------------------------

def _reference(seed, d_in, d_out):
    torch.manual_seed(seed)
    return nn.Linear(d_in, d_out)


def check_uneven_layers(rank, world):
    import copy

    d_in, d_out = 7, 10  # 10 -> [4, 3, 3], 7 -> [3, 2, 2]
    x = torch.randn(2, 5, d_in, generator=torch.Generator().manual_seed(1))
    g = torch.randn(2, 5, d_out, generator=torch.Generator().manual_seed(2))
    ref = _reference(0, d_in, d_out)
    xr = x.clone().requires_grad_()
    expected = ref(xr)
    expected.backward(g)
    rows = [(0, 4), (4, 7), (7, 10)][rank]
    cols = [(0, 3), (3, 5), (5, 7)][rank]

    for gather in (False, True):
        column = LinearLayer(copy.deepcopy(_reference(0, d_in, d_out)), None, gather_output=gather, name="fc")
        assert column.partition_sizes == (4, 3, 3) and column.weight.shape == (rows[1] - rows[0], d_in)
        assert column.out_features == d_out
        xc = x.clone().requires_grad_()
        out = column(xc)
        if gather:
            close(out, expected)
            out.backward(g)
        else:
            close(out, expected[..., rows[0]:rows[1]])
            out.backward(g[..., rows[0]:rows[1]])
        close(xc.grad, xr.grad)  # the input gradient all-reduced over the group
        close(column.weight.grad, ref.weight.grad[rows[0]:rows[1]])
        close(column.bias.grad, ref.bias.grad[rows[0]:rows[1]])
        state = column.gathered_state()
        close(state["weight"], ref.weight.detach(), rtol=0, atol=0)
        close(state["bias"], ref.bias.detach(), rtol=0, atol=0)

    row = LinearAllreduce(copy.deepcopy(_reference(0, d_in, d_out)), None, name="proj")
    assert row.partition_sizes == (3, 2, 2) and row.weight.shape == (d_out, cols[1] - cols[0]) and row.in_features == 7
    xs = x[..., cols[0]:cols[1]].clone().requires_grad_()
    out = row(xs)
    close(out, expected)
    out.backward(g)
    close(xs.grad, xr.grad[..., cols[0]:cols[1]])
    close(row.weight.grad, ref.weight.grad[:, cols[0]:cols[1]])
    close(row.bias.grad, ref.bias.grad)
    close(row.gathered_state()["weight"], ref.weight.detach(), rtol=0, atol=0)

    explicit = LinearLayer(copy.deepcopy(_reference(0, d_in, d_out)), None, partition_sizes=[2, 2, 6])
    close(explicit.weight, ref.weight.detach()[[(0, 2), (2, 4), (4, 10)][rank][0]:[(0, 2), (2, 4), (4, 10)][rank][1]])
    with pytest.raises(ValueError, match="partition_sizes must be 3 non-negative integers adding up to 10"):
        LinearLayer(copy.deepcopy(_reference(0, d_in, d_out)), None, partition_sizes=[5, 5])
    return True


def test_uneven_layers_match_the_whole_linear_on_3_ranks():
    assert spawn(check_uneven_layers, world_size=3) == [True] * 3


# ---- AutoTP by rules ----------------------------------------------------------------------------------------

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.ModuleDict({"up": nn.Linear(6, 10), "down": nn.Linear(10, 6)})])
        self.head = nn.Linear(6, 9)
        self.norm = nn.LayerNorm(6)

    def forward(self, x):
        b = self.blocks[0]
        return self.head(self.norm(b["down"](torch.relu(b["up"](x)))))


RULES = {"use_default_specs": False, "layer_specs": [
    {"patterns": [r".*\.up\.weight$"], "partition_type": "column"},
    {"patterns": [r".*\.down\.weight$"], "partition_type": "row"},
    {"patterns": [r"head\.weight$"], "partition_type": "column", "gather_output": True},
]}


def check_rules(rank, world):
    torch.manual_seed(0)
    whole = Net()
    torch.manual_seed(0)
    model = apply_partition_config(Net(), RULES, None)
    assert model.ds_autotp_parsed
    blocks = model.blocks[0]
    assert isinstance(blocks["up"], LinearLayer) and isinstance(blocks["down"], LinearAllreduce)
    assert isinstance(model.head, LinearLayer) and model.head.gather_output
    assert isinstance(model.norm, nn.LayerNorm)  # no 2-D weight: looked into, left
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(4))
    close(model(x), whole(x))  # 10 and 9 outputs split unevenly over 3 ranks when world is 3
    state = replace_module_consolidated_state_dict(model, rank0_only=False)
    for key, value in whole.state_dict().items():
        close(state[key], value, rtol=0, atol=0)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_partition_config_splits_by_rules_and_computes_the_whole_model(world):
    assert spawn(check_rules, world_size=world) == [True] * world


def test_partition_config_rules_and_refusals():
    config = AutoTPConfig.from_dict(RULES)
    assert config.find_matching_spec("blocks.0.up.weight").partition_type == "column"
    assert config.find_matching_spec("blocks.0.norm.weight") is None
    assert TPLayerSpec([r".*"], "skip", model_types=["llama"]).matches("a.weight", "LLaMA")
    assert not TPLayerSpec([r".*"], "skip", model_types=["llama"]).matches("a.weight", None)
    with pytest.raises(ValueError, match="partition_type must be one of column, row, skip, got 'diagonal'"):
        AutoTPConfig.from_dict({"layer_specs": [{"patterns": ["x"], "partition_type": "diagonal"}]})
    with pytest.raises(ValueError, match=r"unknown key.*patern"):
        AutoTPConfig.from_dict({"layer_specs": [{"patern": ["x"]}]})
    with pytest.raises(ValueError, match="gather_output applies to column-parallel rules"):
        TPLayerSpec(["x"], "row", gather_output=True)
    with pytest.raises(ValueError, match="not a regular expression"):
        TPLayerSpec(["("])
    with pytest.raises(ValueError, match=r"strict_mode.*no rule matches head\.weight"):
        apply_partition_config(Net(), {"strict_mode": True, "layer_specs": RULES["layer_specs"][:2]}, None)
    with pytest.raises(NotImplementedError, match="uses shape"):
        apply_partition_config(Net(), {"layer_specs": [{"patterns": [".*up.*"], "shape": [2, -1]}]}, None)
    emb = nn.Sequential(nn.Embedding(5, 4))
    with pytest.raises(NotImplementedError, match="0 is a Embedding"):
        apply_partition_config(emb, {"layer_specs": [{"patterns": [".*"]}]}, None)


# ---- FPDT's token order -------------------------------------------------------------------------------------

def test_fpdt_token_order_gives_each_rank_every_sp_size_th_chunk():
    # 16 tokens, 2 ranks, 2 chunks per rank: chunks of 4; rank 0 chunks 0 and 2, rank 1 chunks 1 and 3
    assert fpdt_token_order(16, 2, 2).tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]
    assert fpdt_token_order(6, 1, 3).tolist() == list(range(6))
    order = fpdt_token_order(48, 4, 3)
    assert sorted(order.tolist()) == list(range(48))
    with pytest.raises(ValueError, match="seq_len 10 must be divisible by sp_size 2 × num_chunks 3"):
        fpdt_token_order(10, 2, 3)
