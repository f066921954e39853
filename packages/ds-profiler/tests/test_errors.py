"""Bad input: errors that name the value, and nothing left attached when a model raises."""

from __future__ import annotations

import pytest
import torch
from _models import MLP, count, mlp_counts
from torch import nn

from ds_profiler import FlopsProfiler, get_model_profile


class Boom(nn.Module):
    """Raises from inside a nested submodule, after some ops have been counted."""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.mlp = MLP()
        self.inner = nn.Sequential(nn.Linear(8, 8), _Raise(error))

    def forward(self, x):
        return self.inner(self.mlp(x))


class _Raise(nn.Module):
    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error

    def forward(self, x):
        raise self.error


def assert_clean(model: nn.Module) -> None:
    assert torch._C._len_torch_function_stack() == 0
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks, type(module).__name__


def test_model_error_is_reraised_and_everything_undone():
    model = Boom(ValueError("bad batch"))
    model.train()
    with pytest.raises(ValueError, match="bad batch"):
        get_model_profile(model, input_shape=(2, 16), print_profile=False)
    assert_clean(model)
    assert all(m.training for m in model.modules())  # flags restored
    assert count(model.mlp, torch.randn(4, 16)) == mlp_counts(4)  # and profiling works again


def test_model_error_with_the_profiler_api():
    model = Boom(RuntimeError("kaput"))
    prof = FlopsProfiler(model)
    prof.start_profile()
    with pytest.raises(RuntimeError, match="kaput"):
        model(torch.randn(2, 16))
    assert torch._C._len_torch_function_stack() == 0  # the always-called hooks popped the mode
    assert prof.get_total_flops() == mlp_counts(2)[0] + 2 * 2 * 8 * 8 + 2 * 8  # what ran before the error
    prof.end_profile()
    assert_clean(model)


def test_keyboard_interrupt_is_undone_too():
    # KeyboardInterrupt is not an Exception: torch's always-called hooks do not run for it.
    model = Boom(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        get_model_profile(model, input_shape=(2, 16), print_profile=False, warm_up=0)
    assert_clean(model)


def test_empty_model():
    flops, macs, params = get_model_profile(nn.Sequential(), input_shape=(2, 3), as_string=False, print_profile=False)
    assert (flops, macs, params) == (0, 0, 0)
    text_model = nn.Sequential()
    prof = FlopsProfiler(text_model)
    prof.start_profile()
    text_model(torch.ones(2))
    text = prof.print_model_profile(output_file=None)
    prof.end_profile()
    assert "Sequential(0, 0.00% Params, 0 MACs, 0.00% MACs" in text


def test_model_without_parameters_still_counts():
    class Square(nn.Module):
        def forward(self, x):
            return x @ x

    assert get_model_profile(Square(), input_shape=(4, 4), as_string=False, print_profile=False) == (128, 64, 0)


def test_input_shape_that_does_not_fit_names_the_shape():
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied") as info:
        get_model_profile(MLP(), input_shape=(2, 7), print_profile=False)
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "input_shape=(2, 7)" in notes and "torch.float32" in notes


def test_an_output_error_gets_no_input_shape_note(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError) as info:  # the output file's parent is a file: not the model's fault
        get_model_profile(MLP(), input_shape=(2, 16), output_file=blocker / "p.txt")
    assert not getattr(info.value, "__notes__", [])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"input_shape": "2,16"}, "input_shape must be a non-empty tuple of positive integers, got '2,16'"),
    ({"input_shape": (2, 0)}, r"input_shape must be .* got \(2, 0\)"),
    ({"input_shape": ()}, r"got \(\)"),
    ({}, "needs the model's input: input_shape, args or kwargs"),
    ({"input_shape": (2, 16), "mode": "backward"}, "mode must be one of 'forward', 'generate', got 'backward'"),
    ({"input_shape": (2, 16), "mode": "generate"}, "mode='generate' needs a model with a generate"),
    ({"input_shape": (2, 16), "warm_up": -1}, "warm_up must be an integer >= 0, got -1"),
])
def test_bad_arguments_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        get_model_profile(MLP(), print_profile=False, **kwargs)


def test_bad_constructor_and_ignore_list():
    with pytest.raises(TypeError, match=r"needs a torch\.nn\.Module, got function"):
        FlopsProfiler(lambda x: x)
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module, got int"):
        get_model_profile(3, input_shape=(1,))
    with pytest.raises(ValueError, match="recompute_fwd_factor must be a number >= 0, got -1"):
        FlopsProfiler(MLP(), recompute_fwd_factor=-1)
    with pytest.raises(TypeError, match=r"ignore_list items must be torch\.nn\.Module classes or instances, got .Linear."):
        FlopsProfiler(MLP()).start_profile(ignore_list=["Linear"])


def test_reading_without_a_profile_says_what_to_do():
    prof = FlopsProfiler(MLP())
    with pytest.raises(RuntimeError, match=r"call start_profile\(\) and run the model's forward first"):
        prof.get_total_flops()
    prof.start_profile()
    prof.end_profile()
    with pytest.raises(RuntimeError, match="before end_profile"):
        prof.print_model_profile()


def test_a_mode_left_behind_by_the_model_does_not_strand_ours():
    from torch.overrides import BaseTorchFunctionMode

    class Leaky(nn.Module):
        def forward(self, x):
            BaseTorchFunctionMode().__enter__()  # never exited
            raise RuntimeError("leaky")

    model = nn.Sequential(nn.Linear(2, 2), Leaky())
    with pytest.raises(RuntimeError, match="leaky"):
        get_model_profile(model, input_shape=(1, 2), print_profile=False, warm_up=0)
    assert torch._C._len_torch_function_stack() == 0


def test_a_call_the_formula_cannot_read_is_reported_not_fatal(caplog, monkeypatch):
    from ds_profiler import _registry

    def broken(out, args, kwargs):
        raise IndexError("unexpected call form")

    monkeypatch.setitem(_registry.COUNTERS, torch.tanh, broken)
    with caplog.at_level("WARNING", logger="ds_profiler"):
        flops, _ = count(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), torch.randn(2, 4))
    assert flops == 2 * 2 * 4 * 4 + 2 * 4  # the linear still counted, tanh as 0
    assert "cannot count a call of torch.tanh (IndexError: unexpected call form)" in caplog.text
