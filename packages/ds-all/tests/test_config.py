"""ds_all.Config: every shared DeepSpeed config loads as one strict model built from the packages'
section models; the batch triad is derived as DeepSpeed derives it (checked against the
arithmetic); "auto" is resolved only from what the caller gives; typos and unimplemented features
are named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ds_config import ConfigError

from ds_all import Config, WarmupLR, build_scheduler
from ds_zero import ZeroConfig

CONFIGS = sorted((Path(__file__).parent / "fixtures" / "deepspeed_configs").glob("*.json"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_shared_config_loads_and_resolves_on_2_ranks(path):
    whole = json.loads(path.read_text())
    config = Config.load(path)
    assert config.zero_optimization == ZeroConfig.from_ds_config(whole)
    train, micro, gas = config.resolve(dp_world_size=2).batch_triad(2)
    assert train == micro * gas * 2
    for key, value in (("train_batch_size", train), ("train_micro_batch_size_per_gpu", micro),
                       ("gradient_accumulation_steps", gas)):
        if key in whole:
            assert whole[key] == value  # given values are kept, only the missing one is derived
    if "optimizer" in whole:
        assert config.optimizer.type == whole["optimizer"]["type"]
        assert config.optimizer.params == whole["optimizer"]["params"]


# (train_batch_size, micro, gas, data-parallel ranks) -> (train, micro, gas) or the error's words
TRIADS = [
    ((32, 4, None, 2), (32, 4, 4)),
    ((32, None, 2, 2), (32, 8, 2)),
    ((None, 4, 3, 2), (24, 4, 3)),
    ((32, None, None, 4), (32, 8, 1)),
    ((None, 4, None, 3), (12, 4, 1)),
    ((24, 4, 3, 2), (24, 4, 3)),
    ((24, 4, 3, 1), "train_batch_size 24 != train_micro_batch_size_per_gpu 4 × gradient_accumulation_steps 3 × 1 "
                    "data-parallel ranks = 12"),
    ((30, 4, None, 2), "train_batch_size 30 is not divisible by train_micro_batch_size_per_gpu 4 × 2 data-parallel "
                       "ranks = 8"),
    ((30, None, 4, 2), "train_batch_size 30 is not divisible by gradient_accumulation_steps 4 × 2 data-parallel "
                       "ranks = 8"),
    ((None, None, 4, 2), "give train_batch_size or train_micro_batch_size_per_gpu"),
]


@pytest.mark.parametrize(("given", "expected"), TRIADS)
def test_the_batch_triad_is_derived_or_the_arithmetic_is_shown(given, expected):
    train, micro, gas, ranks = given
    config = Config.load({k: v for k, v in (("train_batch_size", train), ("train_micro_batch_size_per_gpu", micro),
                                            ("gradient_accumulation_steps", gas)) if v is not None})
    if isinstance(expected, tuple):
        assert config.batch_triad(ranks) == expected
        assert expected[0] == expected[1] * expected[2] * ranks
    else:
        with pytest.raises(ValueError, match=expected.replace("×", ".")):
            config.batch_triad(ranks)


def test_a_triad_that_fits_no_world_size_is_refused_when_loaded():
    with pytest.raises(ValueError, match=r"train_batch_size 30 is not train_micro_batch_size_per_gpu 4 × "
                                         r"gradient_accumulation_steps 2 × a whole number of data-parallel ranks"):
        Config.load({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})


def test_auto_is_resolved_only_from_what_the_caller_gives():
    raw = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": 0.01}},
           "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}, "pipeline": {"stages": "auto"}}
    config = Config.load(raw)
    with pytest.raises(ValueError, match='train_micro_batch_size_per_gpu is "auto": resolve it first'):
        config.batch_triad(2)
    with pytest.raises(ConfigError) as error:
        config.resolve(dp_world_size=2, train_micro_batch_size_per_gpu=4)
    assert str(error.value).splitlines() == ['optimizer.params.lr: is "auto" and nothing resolved it',
                                             'zero_optimization.reduce_bucket_size: is "auto" and nothing resolved it']
    resolved = config.resolve(dp_world_size=2, train_micro_batch_size_per_gpu=4, optimizer__params__lr=3e-4,
                              zero_optimization__reduce_bucket_size=250_000)
    assert resolved.batch_triad(2) == (16, 4, 2) and resolved.train_batch_size == 16
    assert resolved.optimizer.params == {"lr": 3e-4, "weight_decay": 0.01}
    assert resolved.zero_optimization.reduce_bucket_size == 250_000
    assert resolved.pipeline.stages == "auto"  # a setting of its own (stages from the module), not a placeholder
    with pytest.raises(ValueError, match=r'gradient_accumulation_steps is not "auto" in this config \(it is 2\)'):
        config.resolve(dp_world_size=2, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=8)


@pytest.mark.parametrize(("raw", "message"), [
    ({"zero_optimisation": {"stage": 2}}, "unknown key 'zero_optimisation'; did you mean 'zero_optimization'?"),
    ({"train_batch_sise": 8}, "unknown key 'train_batch_sise'; did you mean 'train_batch_size'?"),
    ({"zero_optimization": {"stagee": 2}}, "zero_optimization.stagee: unknown key 'stagee'; did you mean 'stage'?"),
    ({"tensorboard": {"enabled": True, "outputpath": "x"}}, "tensorboard.outputpath: unknown key 'outputpath'; "
                                                            "did you mean 'output_path'?"),
    ({"optimizer": {"type": "Adamm", "params": {}}}, "optimizer.type: unknown optimizer type 'Adamm'; did you mean "
                                                     "'Adam'?"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled and bf16.enabled are both true"),
    ({"amp": {"enabled": True, "opt_level": "O1"}}, "amp is a DeepSpeed feature ds-all 0.1.0 does not implement"),
    ({"gradient_clipping": -1}, "gradient_clipping: must be greater than or equal to 0"),
    ({"steps_per_print": "10"}, "steps_per_print: must be an integer, got '10'"),
    ({"checkpoint": {"tag_validation": "Sometimes"}}, "checkpoint.tag_validation must be Ignore, Warn or Fail, got "
                                                      "'Sometimes'"),
    ({"communication_data_type": "int8"}, "communication_data_type: must be 'fp32', 'fp16' or 'bf16'"),
    ({"scheduler": {"type": "WarmupLr"}}, "scheduler.type: unknown schedule 'WarmupLr'; did you mean 'WarmupLR'?"),
])
def test_bad_configs_are_named(raw, message):
    with pytest.raises(ValueError) as error:
        Config.load(raw)
    assert message in str(error.value), str(error.value)


def test_disabled_unimplemented_features_and_case_insensitive_names_load():
    config = Config.load({"train_batch_size": 8, "amp": {"enabled": False}, "optimizer": {"type": "adamw"},
                          "checkpoint": {"tag_validation": "fail"}, "memory_breakdown": False,
                          "steps_per_print": 5e1})
    assert config.optimizer.type == "adamw" and config.checkpoint.tag_validation == "Fail"
    assert config.steps_per_print == 50


def test_a_config_file_that_is_not_json_names_its_line(tmp_path):
    bad = tmp_path / "ds_config.json"
    bad.write_text('{"train_batch_size": 8,\n "fp16": {"enabled": true]}')
    with pytest.raises(ValueError, match=r"ds_config.json:2:\d+: not valid JSON or HJSON"):
        Config.load(bad)
    bad.write_text('{"train_batch_size": 8,\n "fp16": {enabled: true}}')  # HJSON, as DeepSpeed reads it
    assert Config.load(bad).fp16.enabled is True


def test_the_scheduler_section_keeps_auto_until_resolved_then_builds():
    import torch

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    config = Config.load({"train_batch_size": 8,
                          "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto", "warmup_num_steps": 4}}})
    with pytest.raises(ConfigError, match=r"scheduler\.params\.warmup_max_lr: is 'auto', which a schedule cannot resolve"):
        build_scheduler(config.scheduler, optimizer)
    with pytest.raises(ConfigError, match=r'scheduler\.params\.warmup_max_lr: is "auto" and nothing resolved it'):
        config.resolve(dp_world_size=2)
    resolved = config.resolve(dp_world_size=2, scheduler__params__warmup_max_lr=0.05)
    schedule = build_scheduler(resolved.scheduler, optimizer)
    assert isinstance(schedule, WarmupLR) and resolved.scheduler.params == {"warmup_max_lr": 0.05, "warmup_num_steps": 4}


def test_the_readme_config_example_prints_what_it_says(capsys):
    import re

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.findall(r"```python\n(.*?)```", readme.split("## Config", 1)[1], re.S)[0]
    exec(compile(block, "README.md", "exec", dont_inherit=True), {})
    assert capsys.readouterr().out == "(32, 4, 4) 2\n"


def test_integers_0_and_1_are_booleans_as_deepspeed_reads_them():
    # DeepSpeed's ZeRO tests write "zero_allow_untested_optimizer": 1
    cfg = Config.load({"train_batch_size": 2, "zero_allow_untested_optimizer": 1,
                       "fp16": {"enabled": 0}, "bf16": {"enabled": 1},
                       "zero_optimization": {"stage": 1, "contiguous_gradients": 0}})
    assert cfg.zero_allow_untested_optimizer is True
    assert cfg.fp16.enabled is False and cfg.bf16.enabled is True
    assert cfg.zero_optimization.contiguous_gradients is False and cfg.zero_optimization.stage == 1
    with pytest.raises(ConfigError, match="zero_allow_untested_optimizer: must be true or false, got 2"):
        Config.load({"train_batch_size": 2, "zero_allow_untested_optimizer": 2})
