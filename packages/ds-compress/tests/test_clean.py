"""redundancy_clean of quantized weights: float weights on the grid by default (DeepSpeed's
behaviour), packed integer codes with ``pack=True``."""

import io

import pytest
import torch
from torch import nn

from ds_compress import CompressionScheduler, init_compression, redundancy_clean

LAYERS = ("layer.0.intermediate.dense", "layer.1.attention.self.query", "classifier")


def _cfg(section, bits=4, groups=4, quantization_type="symmetric", modules=("intermediate", "query", "classifier")):
    return section("weight_quantization", {"quantize_weight_in_forward": True, "quantize_groups": groups,
                                           "quantization_type": quantization_type},
                   {"g": {"params": {"start_bits": bits, "target_bits": bits}, "modules": list(modules)}})


def _on_grid(weight, original, bits, groups, quantization_type):
    """Every group of ``weight`` is scale x (integers in the bit range) (+ zero point), the scale
    and zero point computed here from the original weights by the definition of the grid."""
    w = weight.detach().double().reshape(groups, -1)
    x = original.double().reshape(groups, -1)
    if quantization_type == "symmetric":
        scale = 2 * x.abs().amax(dim=1, keepdim=True) / 2 ** bits
        zero, lo, hi = 0.0, -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    else:
        scale = (x.amax(dim=1, keepdim=True) - x.amin(dim=1, keepdim=True)) / 2 ** bits
        zero, lo, hi = torch.round(x.amin(dim=1, keepdim=True) / scale) * scale, 0, 2 ** bits - 1
    k = (w - zero) / scale
    torch.testing.assert_close(k, k.round(), atol=1e-4, rtol=0)
    assert k.round().min() >= lo and k.round().max() <= hi
    assert (w - x).abs().max() > 0  # really quantized, not the original weights


@pytest.mark.parametrize("quantization_type", ["symmetric", "asymmetric"])
@pytest.mark.parametrize("bits", [8, 4])
def test_default_clean_keeps_float_weight_on_grid(encoder, section, bits, quantization_type):
    cfg = _cfg(section, bits, 4, quantization_type)
    originals = {n: encoder.get_submodule(n).weight.detach().clone() for n in LAYERS}
    init_compression(encoder, cfg)
    encoder.eval()
    ids = torch.randint(0, 32, (3, 5))
    expected = encoder(ids)
    redundancy_clean(encoder, cfg)
    for name in LAYERS:
        layer = encoder.get_submodule(name)
        assert isinstance(layer.weight, nn.Parameter) and layer.weight.dtype == torch.float32
        assert layer.weight.shape == originals[name].shape and not hasattr(layer, "weight_codes")
        _on_grid(layer.weight, originals[name], bits, 4, quantization_type)
        x = torch.randn(2, layer.in_features)
        torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias), atol=0, rtol=0)
    torch.testing.assert_close(encoder(ids), expected)
    weights = [encoder.get_submodule(n).weight.detach().clone() for n in LAYERS]
    CompressionScheduler(encoder, cfg).step()  # the schedule no longer touches cleaned weights
    for name, w in zip(LAYERS, weights, strict=True):
        assert torch.equal(encoder.get_submodule(name).weight, w)


@pytest.mark.parametrize("bits, code_bytes", [(8, 1.0), (4, 0.5)])
def test_pack_true_stores_codes(encoder, section, bits, code_bytes):
    cfg = _cfg(section, bits)
    init_compression(encoder, cfg)
    encoder.eval()
    ids = torch.randint(0, 32, (3, 5))
    expected = encoder(ids)
    before = sum(t.numel() * t.element_size() for t in encoder.state_dict().values())
    layer = encoder.layer[0].intermediate.dense
    numel = layer.weight.numel()
    redundancy_clean(encoder, cfg, pack=True)
    assert layer.weight is None and layer.weight_codes.dtype == torch.uint8
    assert layer.weight_codes.numel() == numel * code_bytes
    after = sum(t.numel() * t.element_size() for t in encoder.state_dict().values())
    assert after < before
    torch.testing.assert_close(encoder(ids), expected)


def test_pack_must_be_bool(encoder, section):
    init_compression(encoder, _cfg(section))
    with pytest.raises(ValueError, match="pack must be True or False, got 'yes'"):
        redundancy_clean(encoder, _cfg(section), pack="yes")


def _roundtrip(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def test_default_clean_state_dict_loads_into_the_plain_model(encoder, section, make_encoder):
    """What saving with Hugging Face / exporting needs: the cleaned state_dict has the plain model's
    keys and shapes, and the plain (never compressed) model loaded from it computes the same."""
    cfg = _cfg(section)
    init_compression(encoder, cfg)
    redundancy_clean(encoder, cfg)
    encoder.eval()
    ids = torch.randint(0, 32, (3, 5))
    torch.manual_seed(7)
    plain = make_encoder().eval()
    plain.load_state_dict(_roundtrip(encoder.state_dict()), strict=True)
    torch.testing.assert_close(plain(ids), encoder(ids), atol=0, rtol=0)


def test_packed_state_dict_round_trip(encoder, section, make_encoder):
    cfg = _cfg(section)
    init_compression(encoder, cfg)
    redundancy_clean(encoder, cfg, pack=True)
    encoder.eval()
    torch.manual_seed(7)
    other = init_compression(make_encoder(), cfg)
    redundancy_clean(other, cfg, pack=True)
    other.eval()
    ids = torch.randint(0, 32, (3, 5))
    assert not torch.equal(other(ids), encoder(ids))
    other.load_state_dict(_roundtrip(encoder.state_dict()), strict=True)
    torch.testing.assert_close(other(ids), encoder(ids), atol=0, rtol=0)


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.hidden = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.relu(self.hidden(self.embed(ids))))


def test_weight_tying_survives_default_clean(section):
    torch.manual_seed(0)
    model = TiedLM()
    original = model.embed.weight.detach().clone()
    cfg = _cfg(section, 4, 4, modules=("embed", "head", "hidden"))
    init_compression(model, cfg)
    model.eval()
    ids = torch.randint(0, 32, (2, 6))
    expected = model(ids)
    redundancy_clean(model, cfg)
    assert model.head.weight is model.embed.weight
    assert len(list(model.parameters())) == 3  # the shared weight counted once, hidden weight and bias
    _on_grid(model.embed.weight, original, 4, 4, "symmetric")  # quantized once, not twice
    torch.testing.assert_close(model(ids), expected)


def test_tied_weight_quantized_two_ways_is_an_error(section):
    torch.manual_seed(0)
    model = TiedLM()
    cfg = section("weight_quantization", {"quantize_weight_in_forward": True},
                  {"a": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["embed"]},
                   "b": {"params": {"start_bits": 4, "target_bits": 4}, "modules": ["head"]}})
    init_compression(model, cfg)
    with pytest.raises(ValueError, match="embed and head share one weight but quantize it differently"):
        redundancy_clean(model, cfg)
