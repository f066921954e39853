"""FlopsProfilerConfig: DeepSpeed's flops_profiler section, key for key, typos refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ds_config import ConfigError as ValidationError

from ds_profiler import FlopsProfilerConfig

SHARED = Path("/work/shared/configs/profiling_and_monitoring.json")
# The section of that file, verbatim, so the test does not depend on the checkout's neighbours.
SECTION = ('{"enabled": true, "profile_step": 1, "module_depth": -1, "top_modules": 3, "detailed": true, '
           '"output_file": null}')


def test_defaults_are_deepspeeds():
    config = FlopsProfilerConfig()
    assert config.model_dump() == {"enabled": False, "recompute_fwd_factor": 0.0, "profile_step": 1,
                                   "module_depth": -1, "top_modules": 1, "detailed": True, "output_file": None}


def test_the_shared_config_section_loads():
    config = FlopsProfilerConfig.model_validate(json.loads(SECTION))
    assert (config.enabled, config.top_modules, config.module_depth, config.output_file) == (True, 3, -1, None)
    assert config.print_options() == {"profile_step": 1, "module_depth": -1, "top_modules": 3, "detailed": True,
                                      "output_file": None}
    if SHARED.exists():
        assert FlopsProfilerConfig.model_validate(json.loads(SHARED.read_text())["flops_profiler"]) == config


def test_unknown_key_suggests_the_right_one():
    with pytest.raises(ValidationError, match="unknown key 'modul_depth'; did you mean 'module_depth'"):
        FlopsProfilerConfig.model_validate({"modul_depth": 2})
    with pytest.raises(ValidationError, match="unknown key 'zzz' Allowed keys: enabled, recompute_fwd_factor"):
        FlopsProfilerConfig.model_validate({"zzz": 2})


def test_numbers_written_as_floats_are_integers():
    config = FlopsProfilerConfig.model_validate(json.loads('{"profile_step": 1e2, "top_modules": 3.0}'))
    assert (config.profile_step, config.top_modules) == (100, 3)
    assert isinstance(config.profile_step, int)


@pytest.mark.parametrize(("section", "message"), [
    ({"module_depth": -2}, "flops_profiler.module_depth must be -1 .every depth. or >= 0, got -2"),
    ({"top_modules": 0}, "flops_profiler.top_modules must be >= 1, got 0"),
    ({"profile_step": -1}, "flops_profiler.profile_step must be >= 0, got -1"),
    ({"recompute_fwd_factor": -0.5}, "flops_profiler.recompute_fwd_factor must be a number >= 0, got -0.5"),
    ({"top_modules": 2.5}, "must be an integer, got 2.5"),
    ({"top_modules": True}, "must be an integer, got True"),
    ({"enabled": "yes"}, "flops_profiler.enabled: must be true or false, got 'yes'"),
    ({"enabled": 2}, "flops_profiler.enabled: must be true or false, got 2"),
    ({"profile_step": "3"}, "flops_profiler.profile_step: must be an integer, got '3'"),
    ({"recompute_fwd_factor": True}, "flops_profiler.recompute_fwd_factor: must be a number, got True"),
    ({"recompute_fwd_factor": "0.5"}, "flops_profiler.recompute_fwd_factor: must be a number, got '0.5'"),
    ({"recompute_fwd_factor": None}, "flops_profiler.recompute_fwd_factor: must be a number, got None"),
    ({"recompute_fwd_factor": float("nan")}, "flops_profiler.recompute_fwd_factor must be a number >= 0, got nan"),
])
def test_bad_values_name_the_key_and_value(section, message):
    with pytest.raises(ValidationError, match=message):
        FlopsProfilerConfig.model_validate(section)


def test_recompute_fwd_factor_takes_integers_and_floats():
    assert FlopsProfilerConfig.model_validate(json.loads('{"recompute_fwd_factor": 1}')).recompute_fwd_factor == 1.0
    config = FlopsProfilerConfig.model_validate(json.loads('{"recompute_fwd_factor": 0.25}'))
    assert config.recompute_fwd_factor == 0.25 and isinstance(config.recompute_fwd_factor, float)


def test_fields_are_documented():
    assert all(field.description for field in FlopsProfilerConfig.model_fields.values())
