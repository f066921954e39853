import numpy as np
import pytest
import torch

from ds_compress import (
    CompressionScheduler,
    fake_quantize,
    init_compression,
    quantize,
    redundancy_clean,
)
from ds_compress.quantization import ActivationQuantizer, pack, unpack


def _sym_reference(x: np.ndarray, bits: int, groups: int):
    """DeepSpeed's symmetric grid, in float64: scale = 2 max|x| / 2**bits, codes in [-2**(b-1), 2**(b-1)-1]."""
    g = x.reshape(groups, -1).astype(np.float64)
    scale = 2 * np.abs(g).max(axis=1, keepdims=True) / 2 ** bits
    codes = np.clip(np.round(g / scale), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    return codes, scale


@pytest.mark.parametrize("bits", [8, 4, 3])
@pytest.mark.parametrize("groups", [1, 4])
def test_symmetric_grid_and_scale(bits, groups):
    torch.manual_seed(bits)
    x = torch.randn(8, 16, dtype=torch.float64)
    q = quantize(x, bits, groups).numpy().reshape(groups, -1)
    codes, scale = _sym_reference(x.numpy(), bits, groups)
    k = q / scale
    np.testing.assert_allclose(k, np.round(k), atol=1e-9)  # every value is on the grid of its group
    k = np.round(k)
    assert k.min() >= -(2 ** (bits - 1)) and k.max() <= 2 ** (bits - 1) - 1
    np.testing.assert_allclose(k, codes, atol=1e-9)
    for row in range(groups):
        assert len(np.unique(np.round(k[row]))) <= 2 ** bits
    # the extreme value of each group hits the end of the grid
    assert np.all(np.abs(np.round(k)).max(axis=1) >= 2 ** (bits - 1) - 1)


@pytest.mark.parametrize("bits", [8, 4])
def test_asymmetric_grid_includes_zero_point(bits):
    torch.manual_seed(1)
    x = torch.rand(64, dtype=torch.float64) * 3 + 0.5  # all positive: asymmetric uses the whole grid
    q = quantize(x, bits, 1, "asymmetric").numpy()
    lo, hi = x.min().item(), x.max().item()
    scale = (hi - lo) / 2 ** bits
    zero_point = np.round(lo / scale) * scale
    k = (q - zero_point) / scale
    np.testing.assert_allclose(k, np.round(k), atol=1e-9)
    k = np.round(k)
    assert k.min() >= 0 and k.max() <= 2 ** bits - 1
    # half a step of rounding, plus one step where the top value is clamped to code 2**bits - 1
    assert np.abs(q - x.numpy()).max() <= 1.5 * scale
    sym_err = np.abs(quantize(x, bits).numpy() - x.numpy()).max()
    assert np.abs(q - x.numpy()).max() < sym_err  # and better than symmetric on a one-sided range


def test_ternary_and_binary_reference():
    torch.manual_seed(2)
    x = torch.randn(4, 10, dtype=torch.float64)
    g = x.numpy().reshape(2, -1)
    thr = 0.7 * np.abs(g).mean(axis=1, keepdims=True)
    keep = np.abs(g) > thr
    alpha = (np.abs(g) * keep).sum(axis=1, keepdims=True) / keep.sum(axis=1, keepdims=True)
    expected = alpha * np.sign(g) * keep
    np.testing.assert_allclose(quantize(x, 2, 2).numpy().reshape(2, -1), expected, atol=1e-12)
    expected = np.abs(g).mean(axis=1, keepdims=True) * np.sign(g)
    np.testing.assert_allclose(quantize(x, 1, 2).numpy().reshape(2, -1), expected, atol=1e-12)


def test_straight_through_gradient():
    x = torch.randn(5, 7, requires_grad=True)
    w = torch.randn(5, 7)
    (fake_quantize(x, 3) * w).sum().backward()
    torch.testing.assert_close(x.grad, w)


def test_stochastic_rounding_on_grid_and_unbiased():
    torch.manual_seed(3)
    x = torch.full((20000,), 0.3, dtype=torch.float64)
    x[0] = 1.0  # sets the scale: 2 / 16
    q = quantize(x, 4, rounding="stochastic")[1:]
    scale = 2 / 16
    assert set(np.round(q.numpy() / scale, 9).tolist()) <= {2.0, 3.0}  # floor or ceil of 2.4
    assert abs(q.mean().item() - 0.3) < 0.005  # nearest would give 0.25


@pytest.mark.parametrize("bits, kind", [(8, "symmetric"), (4, "symmetric"), (3, "asymmetric"), (2, "symmetric"),
                                        (1, "symmetric")])
def test_pack_roundtrip_and_size(bits, kind):
    torch.manual_seed(4)
    x = torch.randn(6, 9)
    store = pack(x, bits, 3, kind)
    torch.testing.assert_close(unpack(store, kind), quantize(x, bits, 3, kind))
    assert store["codes"].numel() == (54 if bits > 4 else 27)


def test_activation_quantizer_dynamic_per_token_and_static_momentum():
    x = torch.tensor([[[0.0, 1.0, 2.0, 4.0], [0.0, 0.1, 0.2, 0.4]]])
    dyn = ActivationQuantizer(4, "symmetric", "dynamic")
    out = dyn(x)
    torch.testing.assert_close(out[0, 0], quantize(x[0, 0], 4))  # each token its own range
    torch.testing.assert_close(out[0, 1], quantize(x[0, 1], 4))
    static = ActivationQuantizer(8, "asymmetric", "static", momentum=0.9)
    static(torch.tensor([0.0, 1.0]))
    static(torch.tensor([-1.0, 3.0]))
    torch.testing.assert_close(static.x_min_max, torch.tensor([-0.1, 0.9 + 0.3]))
    static.eval()
    y = static(torch.tensor([5.0, -5.0]))  # outside the range: clamped to it
    scale = (1.2 + 0.1) / 256
    zp = round(-0.1 / scale) * scale
    torch.testing.assert_close(y, torch.tensor([255 * scale + zp, zp]))


def test_bit_schedule_and_clean_packs(encoder, section):
    cfg = section("weight_quantization", {"quantize_weight_in_forward": True, "schedule_offset": 2},
                  {"g": {"params": {"start_bits": 8, "target_bits": 4, "quantization_period": 3},
                         "modules": ["intermediate", "output.dense"]}})
    init_compression(encoder, cfg)
    layer = encoder.layer[0].intermediate.dense
    sched = CompressionScheduler(encoder, cfg)
    seen = []
    for _ in range(16):
        seen.append((layer.weight_quantization_enabled, layer.weight_bits))
        sched.step()
    # off for 2 steps, then 8 bits for 3 steps, one bit less every 3 steps, down to 4
    assert seen[:2] == [(False, 8)] * 2
    assert [b for _, b in seen[2:]] == [8, 8, 8, 7, 7, 7, 6, 6, 6, 5, 5, 5, 4, 4]
    ids = torch.randint(0, 32, (3, 5))
    expected = encoder(ids)
    w = layer.weight.detach().clone()
    torch.testing.assert_close(layer.effective_weight()[0], quantize(w, 4))
    before = sum(t.numel() * t.element_size() for t in encoder.state_dict().values())
    redundancy_clean(encoder, cfg, pack=True)
    assert layer.weight is None and layer.weight_codes.dtype == torch.uint8
    after = sum(t.numel() * t.element_size() for t in encoder.state_dict().values())
    assert after < before
    torch.testing.assert_close(encoder(ids), expected)


def test_quantize_in_optimizer_step_mode(encoder, section):
    cfg = section("weight_quantization", {}, {"g": {"params": {"start_bits": 3, "target_bits": 3},
                                                    "modules": ["classifier"]}})
    init_compression(encoder, cfg)
    w = encoder.classifier.weight.detach()
    scale = 2 * w.abs().max() / 8
    k = w / scale
    torch.testing.assert_close(k, k.round())  # already quantized at init (offset 0)
    opt = torch.optim.SGD(encoder.parameters(), lr=0.1)
    encoder(torch.randint(0, 32, (2, 4))).sum().backward()
    opt.step()
    CompressionScheduler(encoder, cfg).step()
    w = encoder.classifier.weight.detach()
    k = w / (2 * w.abs().max() / 8)
    torch.testing.assert_close(k, k.round())


def test_fp16_mixed_quantize_ratio_grows(encoder, section):
    cfg = section("weight_quantization", {"quantize_weight_in_forward": True,
                                          "fp16_mixed_quantize": {"enabled": True, "quantize_change_ratio": 0.25}},
                  {"g": {"params": {"start_bits": 4, "target_bits": 4}, "modules": ["classifier"]}})
    init_compression(encoder, cfg)
    m = encoder.classifier
    sched = CompressionScheduler(encoder, cfg)
    w = m.weight.detach()
    torch.testing.assert_close(m.effective_weight()[0], 0.75 * w + 0.25 * quantize(w, 4))
    for _ in range(5):
        sched.step()
    assert m.mixed_ratio == 1.0
    torch.testing.assert_close(m.effective_weight()[0], quantize(w, 4))


def test_activation_quantization_on_linear_input(encoder, section):
    cfg = section("activation_quantization", {"range_calibration": "dynamic", "schedule_offset": 1},
                  {"a": {"params": {"bits": 4}, "modules": ["classifier"]}})
    init_compression(encoder, cfg)
    m = encoder.classifier
    x = torch.randn(3, 16)
    torch.testing.assert_close(m(x), torch.nn.functional.linear(x, m.weight, m.bias))  # not yet on
    CompressionScheduler(encoder, cfg).step()
    torch.testing.assert_close(m(x), torch.nn.functional.linear(quantize(x, 4, 3), m.weight, m.bias))


def test_embedding_weight_quantization(encoder, section):
    cfg = section("weight_quantization", {"quantize_weight_in_forward": True, "quantize_groups": 32},
                  {"g": {"params": {"start_bits": 4, "target_bits": 4}, "modules": ["embeddings"]}})
    init_compression(encoder, cfg)
    ids = torch.tensor([[1, 2, 3]])
    expected = quantize(encoder.embeddings.weight.detach(), 4, 32)[ids]
    torch.testing.assert_close(encoder.embeddings(ids), expected)
