"""build_optimizer: DeepSpeed's optimizer section to an optimizer, checked class by class, argument by
argument, and one step against torch's optimizer of the same formula (or the closed form)."""

import json
import math
from pathlib import Path

import pytest
import torch

import ds_all
import ds_ops
import ds_zero
from ds_all import build_optimizer

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed_configs"


def _params(seed=0, n=37):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n)), torch.nn.Parameter(torch.randn(5, 3))]


def _grads(params, seed=1):
    torch.manual_seed(seed)
    for p in params:
        p.grad = torch.randn_like(p)


def _one_step(optimizer_or_none, params):
    _grads(params)
    optimizer_or_none.step()
    return [p.detach().clone() for p in params]


def _reference_step(cls, **kwargs):
    params = _params()
    return _one_step(cls(params, **kwargs), params)


def _assert_close(got, want):
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0)


HYPER = {"lr": 0.01, "betas": [0.8, 0.99], "eps": 1e-7, "weight_decay": 0.1}


@pytest.mark.parametrize(("section", "cls", "adam_w_mode", "reference"), [
    ({"type": "AdamW", "params": HYPER}, ds_ops.FusedAdam, True, torch.optim.AdamW),
    ({"type": "Adam", "params": HYPER}, ds_ops.FusedAdam, True, torch.optim.AdamW),  # DeepSpeed: Adam means AdamW
    ({"type": "adam", "params": {**HYPER, "adam_w_mode": False}}, ds_ops.FusedAdam, False, torch.optim.Adam),
    ({"type": "AdamW", "params": {**HYPER, "adam_w_mode": False}}, ds_ops.FusedAdam, True, torch.optim.AdamW),
])
def test_adam_types_build_fused_adam_with_deepspeeds_mode(section, cls, adam_w_mode, reference):
    params = _params()
    optimizer = build_optimizer(section, params)
    assert type(optimizer) is cls
    assert optimizer.adam_w_mode is adam_w_mode
    group = optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (0.01, (0.8, 0.99), 1e-7, 0.1)
    kwargs = {**HYPER, "betas": tuple(HYPER["betas"])}
    _assert_close(_one_step(optimizer, params), _reference_step(reference, **kwargs))


@pytest.mark.parametrize(("adam_type", "extra", "adamw_mode", "reference"), [
    ("Adam", {}, True, torch.optim.AdamW),
    ("Adam", {"adam_w_mode": False}, False, torch.optim.Adam),
    ("AdamW", {}, True, torch.optim.AdamW),
])
def test_offload_builds_cpu_adam(adam_type, extra, adamw_mode, reference):
    params = _params()
    optimizer = build_optimizer({"type": adam_type, "params": {**HYPER, **extra}}, params, offload=True)
    assert type(optimizer) is ds_ops.CPUAdam
    assert optimizer.adamw_mode is adamw_mode
    assert optimizer.param_groups[0]["weight_decay"] == 0.1
    _assert_close(_one_step(optimizer, params), _reference_step(reference, **{**HYPER, "betas": (0.8, 0.99)}))


@pytest.mark.parametrize(("adam_type", "extra", "cls"), [
    ("Adam", {}, torch.optim.AdamW),
    ("Adam", {"adam_w_mode": False}, torch.optim.Adam),
    ("AdamW", {"adam_w_mode": False}, torch.optim.AdamW),
])
@pytest.mark.parametrize("offload", [False, True])
def test_torch_adam_builds_torchs_and_consumes_the_keys(adam_type, extra, cls, offload):
    params = _params()
    section = {"type": adam_type, "params": {"lr": 0.02, "torch_adam": True, **extra}}
    optimizer = build_optimizer(section, params, offload=offload)
    assert type(optimizer) is cls
    assert optimizer.param_groups[0]["lr"] == 0.02
    assert "torch_adam" not in optimizer.defaults and "adam_w_mode" not in optimizer.defaults
    assert section["params"]["torch_adam"] is True  # the caller's dict is left as it was


def test_lamb_builds_fused_lamb_and_steps_by_the_closed_form():
    params = _params()
    section = {"type": "Lamb", "params": {"lr": 0.01, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.01,
                                          "max_coeff": 0.3, "min_coeff": 0.01}}
    optimizer = build_optimizer(section, params)
    assert type(optimizer) is ds_ops.FusedLamb
    group = optimizer.param_groups[0]
    assert (group["max_coeff"], group["min_coeff"], group["betas"]) == (0.3, 0.01, (0.8, 0.99))
    before = [p.detach().clone() for p in params]
    got = _one_step(optimizer, params)
    for p0, p, new in zip(before, params, got, strict=True):  # step 1: m^ = g, v^ = g^2
        g = p.grad
        update = g / (g.abs() + 1e-6) + 0.01 * p0
        ratio = min(max(float(p0.norm() / update.norm()), 0.01), 0.3)
        torch.testing.assert_close(new, p0 - 0.01 * ratio * update, atol=1e-6, rtol=0)


def test_lamb_offloaded_is_still_fused_lamb_as_in_deepspeed():
    assert type(build_optimizer({"type": "Lamb"}, _params(), offload=True)) is ds_ops.FusedLamb


@pytest.mark.parametrize("offload", [False, True])
def test_lion_builds_cpu_lion_and_steps_by_the_closed_form(offload):
    params = _params()
    optimizer = build_optimizer({"type": "Lion", "params": {"lr": 0.01, "betas": [0.9, 0.99],
                                                            "weight_decay": 0.5}}, params, offload=offload)
    assert type(optimizer) is ds_ops.CPULion
    assert optimizer.param_groups[0]["weight_decay"] == 0.5
    before = [p.detach().clone() for p in params]
    got = _one_step(optimizer, params)
    for p0, p, new in zip(before, params, got, strict=True):  # m starts at 0: c = (1 - b1) g
        c = (1 - 0.9) * p.grad
        torch.testing.assert_close(new, p0 * (1 - 0.01 * 0.5) - 0.01 * torch.sign(c), atol=1e-6, rtol=0)


@pytest.mark.parametrize(("offload", "cls"), [(False, torch.optim.Adagrad), (True, ds_ops.CPUAdagrad)])
def test_adagrad_is_torchs_unless_offloaded(offload, cls):
    params = _params()
    hyper = {"lr": 0.05, "eps": 1e-9, "weight_decay": 0.01}
    optimizer = build_optimizer({"type": "Adagrad", "params": hyper}, params, offload=offload)
    assert type(optimizer) is cls
    assert optimizer.param_groups[0]["eps"] == 1e-9
    _assert_close(_one_step(optimizer, params), _reference_step(torch.optim.Adagrad, **hyper))


@pytest.mark.parametrize("name", ["SGD", "RMSprop", "NAdam"])
def test_torch_optim_by_exact_name(name):
    params = _params()
    optimizer = build_optimizer({"type": name, "params": {"lr": 0.03, "weight_decay": 0.001}}, params)
    assert type(optimizer) is getattr(torch.optim, name)
    cls = getattr(torch.optim, name)
    _assert_close(_one_step(optimizer, params), _reference_step(cls, lr=0.03, weight_decay=0.001))


def test_no_optimizer_section_builds_nothing(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8}))
    assert build_optimizer({"train_batch_size": 8}, _params()) is None
    assert build_optimizer(path, _params()) is None
    assert build_optimizer(None, _params()) is None
    assert build_optimizer({"optimizer": None}, _params()) is None


def test_accepts_section_model_whole_config_and_path(tmp_path):
    section = {"type": "AdamW", "params": {"lr": 0.004}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "optimizer": section}))
    model = ds_all.Config.model_validate({"train_batch_size": 8, "optimizer": section}).optimizer
    for config in (section, {"optimizer": section}, path, str(path), model):
        optimizer = build_optimizer(config, _params())
        assert type(optimizer) is ds_ops.FusedAdam and optimizer.param_groups[0]["lr"] == 0.004


EXPECTED_FIXTURES = {"compression.json": ds_ops.FusedAdam, "pipeline_lr.json": ds_ops.FusedLamb,
                     "profiling_and_monitoring.json": ds_ops.FusedAdam, "sparse_attention.json": ds_ops.FusedAdam,
                     "zero1_fp16.json": ds_ops.FusedAdam, "zero2_offload.json": ds_ops.CPUAdam,
                     "zero3_nvme.json": ds_ops.CPUAdam, "zero3_offload.json": ds_ops.CPUAdam}


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.json")), ids=lambda p: p.name)
def test_shared_deepspeed_configs_build(path):
    whole = json.loads(path.read_text())
    offload = (whole.get("zero_optimization", {}).get("offload_optimizer") or {}).get("device") in ("cpu", "nvme")
    if path.name == "onebit_adam.json":  # built without a process group: it needs one only to step
        optimizer = build_optimizer(path, _params())
        assert type(optimizer) is ds_zero.OneBitAdam
        assert optimizer.freeze_step == whole["optimizer"]["params"]["freeze_step"]
        return
    optimizer = build_optimizer(path, _params(), offload=offload)
    if "optimizer" not in whole:
        assert optimizer is None
        return
    assert type(optimizer) is EXPECTED_FIXTURES[path.name]
    assert math.isclose(optimizer.param_groups[0]["lr"], whole["optimizer"]["params"]["lr"])


@pytest.mark.parametrize(("section", "offload", "message"), [
    ({"type": "Adam", "params": {"lrr": 0.1}}, False,
     r"optimizer.params.lrr: unknown parameter 'lrr' of FusedAdam; did you mean 'lr'\? Allowed: lr, bias_correction"),
    ({"type": "Adam", "params": {"weight_decai": 0.1}}, True,
     r"unknown parameter 'weight_decai' of CPUAdam; did you mean 'weight_decay'\?"),
    ({"type": "Lion", "params": {"eps": 1e-8}}, False,
     "unknown parameter 'eps' of CPULion Allowed: lr, betas, weight_decay, fp32_optimizer_states, state_dtype"),
    ({"type": "SGD", "params": {"momentun": 0.9}}, False, r"unknown parameter 'momentun' of SGD; did you mean 'momentum'\?"),
    ({"type": "Adam", "params": {"lr": "auto"}}, False,
     r"optimizer.params.lr: is 'auto', which an optimizer cannot resolve: resolve it first \(ds_all.Config.resolve\)"),
    ({"type": "OneBitAdam", "params": {"freeze_step": 0}}, False, "OneBitAdam: freeze_step must be an integer >= 1, got 0"),
    ({"type": "ZeroOneAdam", "params": {"var_freez_step": 5}}, False,
     r"unknown parameter 'var_freez_step' of ZeroOneAdam; did you mean 'var_freeze_step'\?"),
    ({"type": "OneBitAdam"}, True, "OneBitAdam steps on the model's own memory with ZeRO stage 0.*offload_optimizer"),
    ({"type": "onebitlamb", "params": {"factor_min": 5.0}}, False,
     r"OneBitLamb: need min_coeff <= max_coeff and factor_min <= factor_max, got \[0.01, 10.0\] and \[5.0, 4.0\]"),
    ({"type": "Lamb", "params": {"max_grad_norm": 1.0}}, False,
     "optimizer.params.max_grad_norm: is not an optimizer parameter.*'gradient_clipping'"),
    ({"type": "Adam", "params": {"adamw_mode": False}}, True, "optimizer.params.adamw_mode: .*'adam_w_mode'"),
    ({"type": "Adam", "params": {"torch_adam": "yes"}}, False, "optimizer.params.torch_adam: must be true or false"),
    ({"type": "Adamm"}, False, r"unknown optimizer type 'Adamm'; did you mean 'Adam'\?"),
    ({"optimiser": {"type": "Adam"}, "train_batch_size": 8}, False, "unknown section 'optimiser'; did you mean 'optimizer'"),
    ({"type": "Adam", "params": {"betas": [0.9, 1.5]}}, False, "betas"),
])
def test_bad_inputs_raise_value_error_naming_the_key(section, offload, message):
    with pytest.raises(ValueError, match=message):
        build_optimizer(section, _params(), offload=offload)


def test_exported_in_sorted_all():
    assert "build_optimizer" in ds_all.__all__
    assert ds_all.build_optimizer is build_optimizer


def test_the_readme_optimizer_example_prints_what_it_says(capsys):
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.findall(r"```python\n(.*?)```", readme.split("## Optimizers", 1)[1], re.S)[0]
    exec(compile(block, "README.md", "exec", dont_inherit=True), {})
    assert capsys.readouterr().out == "FusedAdam 0.0003\n"
