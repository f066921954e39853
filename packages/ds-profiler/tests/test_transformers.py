"""Full Hugging Face GPT-2 and BERT models, built from small config objects (no weights are
downloaded). Optional: skipped, with the reason, where ``transformers`` is not installed."""

from __future__ import annotations

import pytest
import torch
from _models import profile
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (optional test dependency: pip install transformers)")

B, S, H, HEADS, LAYERS, VOCAB = 2, 16, 32, 4, 2, 100


def torch_reference(model, **inputs) -> int:
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(**inputs)
    return counter.get_total_flops()


def check(model, expected_macs, expected_flops=None, **inputs):
    model.eval()
    prof = profile(model, **inputs)
    try:
        flops, macs = prof.get_total_flops(), prof.get_total_macs()
        assert macs == expected_macs
        if expected_flops is None:
            assert flops > 2 * macs  # plus biases, norms, softmax, activations
        else:
            assert flops == expected_flops
        assert 2 * macs == torch_reference(model, **inputs)
        text = prof.print_model_profile(output_file=None)
        return prof.get_profile(), text
    finally:
        prof.end_profile()


def test_gpt2():
    config = transformers.GPT2Config(n_layer=LAYERS, n_embd=H, n_head=HEADS, n_positions=32, vocab_size=VOCAB,
                                     attn_implementation="sdpa")
    model = transformers.GPT2LMHeadModel(config)
    bsh = B * S * H
    per_layer = 12 * B * S * H * H + 2 * B * S * S * H  # 2 * this = 24bsh^2 + 4bs^2h
    # Elementwise flops per layer, from the README's conventions applied to HF's GPT-2 code:
    # biases of c_attn (3h), attn c_proj (h), c_fc (4h), mlp c_proj (h) per token: 9bsh (Conv1D is
    # addmm with beta = alpha = 1: + 1 per output); ln_1, ln_2 with weight and bias: 2 * 7bsh;
    # gelu_new, 0.5*x*(1 + tanh(sqrt(2/pi)*(x + 0.044715*x^3))), 8 elementwise ops on the 4h
    # activations: 32bsh; the two residual adds: 2bsh. sdpa, causal: 7 per score (scale,
    # softmax 5, mask), b*heads*s^2 scores.
    per_layer_flops = 2 * per_layer + (9 + 14 + 32 + 2) * bsh + 7 * B * HEADS * S * S
    # + the position-embedding add (1), ln_f (7) and the lm_head (no bias).
    flops = LAYERS * per_layer_flops + 8 * bsh + 2 * bsh * VOCAB
    tree, text = check(model, LAYERS * per_layer + bsh * VOCAB, flops,
                       input_ids=torch.zeros(B, S, dtype=torch.long))
    assert (tree.find("transformer.h.0").flops, tree.find("transformer.h.0").macs) == (per_layer_flops, per_layer)
    assert tree.find("transformer.h.1.mlp.act").flops == 8 * 4 * bsh
    assert "GPT2Block(" in text


def test_bert():
    config = transformers.BertConfig(hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                     intermediate_size=4 * H, vocab_size=VOCAB, max_position_embeddings=64)
    model = transformers.BertModel(config)
    per_layer = 12 * B * S * H * H + 2 * B * S * S * H
    tree, _ = check(model, LAYERS * per_layer + B * H * H,  # + the pooler on the first token
                    input_ids=torch.zeros(B, S, dtype=torch.long), attention_mask=torch.ones(B, S, dtype=torch.long))
    assert tree.find("encoder.layer.1").macs == per_layer
