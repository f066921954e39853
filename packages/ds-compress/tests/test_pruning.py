import copy
import math

import numpy as np
import pytest
import torch

from ds_compress import CompressionScheduler, init_compression, redundancy_clean


def _zero_fraction(t: torch.Tensor) -> float:
    return (t == 0).float().mean().item()


@pytest.mark.parametrize("ratio", [0.5, 0.3, 0.77])
def test_sparse_l1_keeps_largest_magnitudes(encoder, section, ratio):
    cfg = section("sparse_pruning", {}, {"sp": {"params": {"dense_ratio": ratio}, "modules": ["intermediate"]}})
    w = encoder.layer[0].intermediate.dense.weight.detach().clone()
    init_compression(encoder, cfg)
    eff = encoder.layer[0].intermediate.dense.effective_weight()[0]
    n = w.numel()
    pruned = (eff == 0).sum().item()
    assert abs(pruned - (1 - ratio) * n) <= 1
    threshold = np.sort(np.abs(w.numpy()).ravel())[::-1][math.ceil(ratio * n) - 1]
    expected = np.where(np.abs(w.numpy()) >= threshold, w.numpy(), 0.0)
    np.testing.assert_array_equal(eff.detach().numpy(), expected)


def test_sparse_topk_scores_learn_through_ste(encoder, section):
    cfg = section("sparse_pruning", {"method": "topk"}, {"sp": {"params": {"dense_ratio": 0.4},
                                                                 "modules": ["classifier"]}})
    init_compression(encoder, cfg)
    m = encoder.classifier
    assert abs(_zero_fraction(m.effective_weight()[0]) - 0.6) <= 1 / m.weight.numel()
    x = torch.randn(4, 16)
    out = m(x)
    g = torch.randn_like(out)
    out.backward(g)
    # d loss / d mask = d loss / d effective weight * weight, passed straight to the scores
    grad_eff = g.t() @ x
    torch.testing.assert_close(m.sparse_mask_scores.grad, grad_eff * m.weight.detach())
    mask = (m.effective_weight()[0] != 0).float()
    torch.testing.assert_close(m.weight.grad, grad_eff * mask)


def test_sparse_schedule_offset_and_end(encoder, section):
    cfg = section("sparse_pruning", {"method": "topk", "schedule_offset": 2, "schedule_offset_end": 3},
                  {"sp": {"params": {"dense_ratio": 0.5}, "modules": ["classifier"]}})
    init_compression(encoder, cfg)
    m, sched = encoder.classifier, CompressionScheduler(encoder, cfg)
    assert _zero_fraction(m.effective_weight()[0]) == 0  # warmup: not pruned yet
    sched.step()
    assert _zero_fraction(m.effective_weight()[0]) == 0
    sched.step()
    assert _zero_fraction(m.effective_weight()[0]) == 0.5
    with torch.no_grad():
        m.sparse_mask_scores.neg_()  # the scores move: before the end the mask follows them
    mask_learning = (m.effective_weight()[0] != 0)
    sched.step()  # step 3 = schedule_offset_end: the mask is frozen from now on
    with torch.no_grad():
        m.sparse_mask_scores.neg_()
    torch.testing.assert_close(m.effective_weight()[0] != 0, mask_learning)


@pytest.mark.parametrize("method", ["l1", "topk"])
def test_row_pruning_clean_shrinks_and_keeps_function(encoder, section, method):
    cfg = section("row_pruning", {"method": method},
                  {"rp": {"params": {"dense_ratio": 0.25}, "modules": ["intermediate.dense"],
                          "related_modules": [["layer.\\w+.output.dense"]]}})
    init_compression(encoder, cfg)
    inter = encoder.layer[1].intermediate.dense
    rows = (inter.effective_weight()[0].abs().sum(dim=1) == 0).sum().item()
    assert rows == 24  # 1 - 0.25 of 32 rows
    ids = torch.randint(0, 32, (3, 6))
    encoder.eval()
    expected = encoder(ids)
    redundancy_clean(encoder, cfg)
    for layer in encoder.layer:
        assert layer.intermediate.dense.weight.shape == (8, 16)
        assert layer.intermediate.dense.bias.shape == (8,)
        assert layer.output.dense.weight.shape == (16, 8)
        assert layer.output.dense.in_features == 8
        assert not hasattr(layer.intermediate.dense, "row_mask_scores")
    torch.testing.assert_close(encoder(ids), expected)


@pytest.mark.parametrize("method", ["topk", "l1"])
def test_head_pruning_clean_shrinks_qkv_and_keeps_function(encoder, section, method):
    cfg = section("head_pruning", {"method": method, "num_heads": 4},
                  {"hp": {"params": {"dense_ratio": 0.5}, "modules": ["attention.output.dense"],
                          "related_modules": [["self.query", "self.key", "self.value"]]}})
    init_compression(encoder, cfg)
    out = encoder.layer[0].attention.output.dense
    cols = (out.effective_weight()[0].abs().sum(dim=0) == 0).reshape(4, 4)
    assert cols.all(dim=1).sum().item() == 2 and (cols.all(dim=1) | ~cols.any(dim=1)).all()  # whole heads
    ids = torch.randint(0, 32, (2, 5))
    encoder.eval()
    expected = encoder(ids)
    redundancy_clean(encoder, cfg)
    for layer in encoder.layer:
        assert layer.attention.output.dense.weight.shape == (16, 8)
        for proj in ("query", "key", "value"):
            assert getattr(layer.attention.self, proj).weight.shape == (8, 16)
    torch.testing.assert_close(encoder(ids), expected)


@pytest.mark.parametrize("method", ["l1", "topk"])
def test_channel_pruning_clean_resizes_conv_and_batchnorm(convnet, section, method):
    cfg = section("channel_pruning", {"method": method},
                  {"cp": {"params": {"dense_ratio": 0.5}, "modules": ["conv1"],
                          "related_modules": [["conv2", "bn1"]]}})
    x = torch.randn(2, 3, 5, 5)
    convnet.train()
    convnet(x)  # non-trivial BatchNorm running statistics
    init_compression(convnet, cfg)
    w = convnet.conv1.effective_weight()[0]
    assert (w.abs().sum(dim=(1, 2, 3)) == 0).sum().item() == 4
    convnet.eval()
    expected = convnet(x)
    redundancy_clean(convnet, cfg)
    assert convnet.conv1.weight.shape == (4, 3, 3, 3) and convnet.conv1.out_channels == 4
    assert convnet.bn1.running_mean.shape == (4,) and convnet.bn1.num_features == 4
    assert convnet.conv2.weight.shape == (8, 4, 3, 3) and convnet.conv2.in_channels == 4
    torch.testing.assert_close(convnet(x), expected)


def test_structured_pruning_waits_for_offset(encoder, section):
    cfg = section("row_pruning", {"schedule_offset": 2},
                  {"rp": {"params": {"dense_ratio": 0.5}, "modules": ["classifier"]}})
    init_compression(encoder, cfg)
    m, sched = encoder.classifier, CompressionScheduler(encoder, cfg)
    sched.step()
    assert m.mask("row") is None
    sched.step()
    assert m.mask("row").sum().item() == 2  # ceil(0.5 * 3) rows kept


def test_sparse_clean_bakes_mask_and_excluded_modules(encoder, section):
    cfg = section("sparse_pruning", {"excluded_modules": ["layer.1"]},
                  {"sp": {"params": {"dense_ratio": 0.5}, "modules": ["intermediate.dense"]}})
    init_compression(encoder, cfg)
    assert type(encoder.layer[1].intermediate.dense) is torch.nn.Linear
    redundancy_clean(encoder, cfg)
    assert _zero_fraction(encoder.layer[0].intermediate.dense.weight) == 0.5
    assert encoder.layer[0].intermediate.dense.sparse_mask is None


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("groups", [1, 4])
def test_clean_exact_with_quantization_row_pruning_and_activations(section, groups, pack):
    """Row pruning + 4-bit weights (+ sparse, activation quantization) on the same layers: the
    quantization scale of the next layer ignores the columns clean removes, so clean is exact."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    cfg = {**section("weight_quantization", {"quantize_weight_in_forward": True, "quantize_groups": groups},
                     {"a": {"params": {"start_bits": 4, "target_bits": 4}}}),
           **section("row_pruning", {"method": "topk"},
                     {"r": {"params": {"dense_ratio": 0.5}, "modules": ["^0$"], "related_modules": [["^2$"]]}}),
           **section("sparse_pruning", {}, {"s": {"modules": ["2"]}}),
           **section("activation_quantization", {}, {"x": {}})}
    init_compression(m, cfg)
    x = torch.randn(5, 8)
    m(x).sum().backward()
    assert m[0].row_mask_scores.grad is not None
    copied = copy.deepcopy(m)
    m.eval()
    expected = m(x)
    redundancy_clean(m, cfg, pack=pack)
    assert m[0].out_features == 8 and m[2].in_features == 8
    if pack:
        assert m[2].weight is None and m[2].weight_codes.numel() == 16
    else:
        assert m[2].weight.shape == (4, 8) and not hasattr(m[2], "weight_codes")
    torch.testing.assert_close(m(x), expected)
    copied.eval()
    torch.testing.assert_close(copied(x), expected)  # a deep copy made before clean is unaffected


def test_channel_pruning_survives_deepcopy(convnet, section):
    cfg = section("channel_pruning", {}, {"cp": {"params": {"dense_ratio": 0.5}, "modules": ["conv1"],
                                                 "related_modules": [["conv2", "bn1"]]}})
    init_compression(convnet, cfg)
    twin = copy.deepcopy(convnet).eval()
    convnet.eval()
    x = torch.randn(1, 3, 4, 4)
    expected = twin(x)
    redundancy_clean(twin, cfg)
    torch.testing.assert_close(twin(x), expected)
    torch.testing.assert_close(convnet(x), expected)  # the original keeps its (hooked) BatchNorm
