"""get_model_profile: DeepSpeed's one-call API."""

from __future__ import annotations

import re

import torch
from _models import GPT, MLP, gpt_counts, mlp_counts
from torch import nn

import ds_profiler
from ds_profiler import get_model_profile
from ds_profiler._format import flops_to_string, macs_to_string, params_to_string

MLP_PARAMS = 16 * 32 + 32 + 32 * 8 + 8


def test_public_api_is_small():
    assert sorted(ds_profiler.__all__) == ["FlopsProfiler", "FlopsProfilerConfig", "ModuleProfile",
                                           "__version__", "get_model_profile"]


def test_raw_and_string_results(capsys):
    flops, macs = mlp_counts(4)
    assert get_model_profile(MLP(), input_shape=(4, 16), as_string=False, print_profile=False) == (flops, macs, MLP_PARAMS)
    assert get_model_profile(MLP(), input_shape=(4, 16), print_profile=False) == (
        flops_to_string(flops), macs_to_string(macs), params_to_string(MLP_PARAMS))
    assert capsys.readouterr().out == ""
    get_model_profile(MLP(), input_shape=(4, 16))
    out = capsys.readouterr().out
    assert "Profile Summary at step 1:" in out and "MLP(" in out


def test_warm_up_runs_unprofiled_calls_first():
    calls = []

    class Counting(MLP):
        def forward(self, x):
            calls.append(x.shape)
            return super().forward(x)

    result = get_model_profile(Counting(), input_shape=(4, 16), warm_up=3, as_string=False, print_profile=False)
    assert len(calls) == 4 and result[0] == mlp_counts(4)[0]  # one call profiled


def test_args_and_kwargs_inputs():
    class Add(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4, bias=False)

        def forward(self, x, *, other):
            return self.lin(x) + other

    x, other = torch.randn(2, 4), torch.randn(2, 4)
    assert get_model_profile(Add(), args=[x], kwargs={"other": other}, as_string=False,
                             print_profile=False)[:2] == (2 * 2 * 4 * 4 + 8, 2 * 4 * 4)
    idx = torch.zeros(2, 16, dtype=torch.long)
    assert get_model_profile(GPT(), args=(idx,), as_string=False, print_profile=False)[:2] == gpt_counts(2, 16)


def test_input_shape_follows_the_model_dtype():
    model = MLP().double()
    flops, macs, _ = get_model_profile(model, input_shape=(2, 16), as_string=False, print_profile=False)
    assert (flops, macs) == mlp_counts(2)


def test_generate_mode_counts_every_forward_of_generate():
    class TinyLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.head = nn.Linear(8, 10, bias=False)

        def forward(self, idx):
            return self.head(self.emb(idx))

        def generate(self, idx, steps=3):
            for _ in range(steps):
                nxt = self(idx)[:, -1].argmax(-1, keepdim=True)
                idx = torch.cat([idx, nxt], dim=1)
            return idx

    idx = torch.zeros(1, 4, dtype=torch.long)
    flops, macs, _ = get_model_profile(TinyLM(), args=[idx], mode="generate", as_string=False, print_profile=False)
    tokens = 4 + 5 + 6  # the sequence grows by one token per step
    assert (flops, macs) == (2 * tokens * 8 * 10, tokens * 8 * 10)


class EncoderDecoder(nn.Module):
    """As Hugging Face's encoder-decoder models: generate() runs the encoder outside forward()."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(4, 4, bias=False)
        self.dec = nn.Linear(4, 4, bias=False)

    def forward(self, x, encoded=None):
        if encoded is None:
            encoded = self.enc(x)
        return self.dec(encoded)

    def generate(self, x, steps=2):
        encoded = self.enc(x)  # HF: self.get_encoder()(...), not through self(...)
        for _ in range(steps):
            out = self(x, encoded=encoded)
        return out


def test_generate_counts_a_submodule_called_outside_the_models_forward(tmp_path):
    one = 3 * 4 * 4  # MACs of one linear call on (3, 4)
    path = tmp_path / "p.txt"
    flops, macs, _ = get_model_profile(EncoderDecoder(), args=[torch.randn(3, 4)], mode="generate",
                                       as_string=False, output_file=path)
    assert (flops, macs) == (2 * 3 * one, 3 * one)  # the encoder once, the decoder twice
    text = path.read_text()  # the summary reports the same totals
    assert re.search(rf"fwd MACs per GPU: +{macs_to_string(3 * one)} *\n", text)
    assert re.search(rf"fwd flops per GPU: +{flops_to_string(6 * one)} *\n", text)
    # percentages of the total: the model's own calls are 2/3 of it, the encoder's 1/3
    assert f"{macs_to_string(2 * one)}, 66.67% MACs" in text
    assert f"(enc): Linear(16, 50.00% Params, {macs_to_string(one)}, 33.33% MACs" in text


def test_ignore_modules_and_output_file(tmp_path):
    path = tmp_path / "p.txt"
    flops, _, _ = get_model_profile(MLP(), input_shape=(4, 16), as_string=False, ignore_modules=[nn.ReLU],
                                    output_file=path)
    assert flops == mlp_counts(4)[0] - 4 * 32
    assert "ReLU(0, 0.00% Params, 0 MACs" in path.read_text()
