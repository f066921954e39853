"""The Section convention: strict values with JSON's one leniency, unknown keys named with their
dotted path and a suggestion, frozen models, sections picked out of whole DeepSpeed configs."""

from __future__ import annotations

import json
from typing import Literal

import pytest
from ds_config import DEEPSPEED_KEYS, ConfigError, Section, load_ds_config
from pydantic import Field, model_validator


class Offload(Section):
    device: Literal["none", "cpu", "nvme"] = Field("none", description="Where.")
    pin_memory: bool = Field(False, description="Pin.")
    buffer_count: int = Field(4, gt=0, description="Buffers.")
    ratio: float = Field(1.0, description="A float.")

    @model_validator(mode="after")
    def _nvme(self):
        if self.device == "nvme" and not self.pin_memory:
            raise ValueError("nvme needs pin_memory")
        return self


class Zero(Section):
    section = "zero_optimization"
    stage: int = Field(0, description="Stage.")
    bucket: int | Literal["auto"] = Field(500, description="Bucket.")
    offload_optimizer: Offload | None = Field(None, description="Offload.")
    groups: dict[str, Offload] = Field(default_factory=dict, description="Named.")
    layers: list[Offload] = Field(default_factory=list, description="Listed.")
    sizes: list[int] = Field(default_factory=list, description="Ints.")
    thread_count: int = Field(1, alias="threads", description="An aliased key.")


class Whole(Section):
    zero_optimization: Zero = Field(default_factory=Zero, description="Nested section.")


def _error(call, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        call(*args, **kwargs)
    assert isinstance(info.value, ValueError)
    return str(info.value)


@pytest.mark.parametrize(("data", "expected"), [
    ({"stage": True}, "zero_optimization.stage: must be an integer, got True"),
    ({"stage": "1"}, "zero_optimization.stage: must be an integer, got '1'"),
    ({"stage": 2.5}, "zero_optimization.stage: must be an integer, got 2.5"),
    ({"stage": float("inf")}, "zero_optimization.stage: must be an integer, got inf"),
    ({"bucket": "x"}, "zero_optimization.bucket: must be an integer or 'auto', got 'x'"),
    ({"offload_optimizer": {"pin_memory": 2}}, "zero_optimization.offload_optimizer.pin_memory: must be true or false, got 2"),
    ({"offload_optimizer": {"pin_memory": -1}}, "zero_optimization.offload_optimizer.pin_memory: must be true or false, got -1"),
    ({"offload_optimizer": {"pin_memory": 1.0}}, "zero_optimization.offload_optimizer.pin_memory: must be true or false, got 1.0"),
    ({"offload_optimizer": {"pin_memory": "yes"}}, "zero_optimization.offload_optimizer.pin_memory: must be true or false, got 'yes'"),
    ({"offload_optimizer": {"ratio": "0.5"}}, "zero_optimization.offload_optimizer.ratio: must be a number, got '0.5'"),
    ({"offload_optimizer": {"ratio": False}}, "zero_optimization.offload_optimizer.ratio: must be a number, got False"),
    ({"offload_optimizer": {"device": "gpu"}}, "zero_optimization.offload_optimizer.device: must be 'none', 'cpu' or 'nvme', got 'gpu'"),
    ({"offload_optimizer": {"buffer_count": 0}}, "zero_optimization.offload_optimizer.buffer_count: must be greater than 0, got 0"),
    ({"offload_optimizer": {"device": "nvme"}}, "zero_optimization.offload_optimizer: nvme needs pin_memory"),
    ({"offload_optimizer": [1]}, "zero_optimization.offload_optimizer: must be a mapping of its keys (a JSON object), got list"),
    ({"groups": {"g1": {"devcie": "cpu"}}}, "zero_optimization.groups.g1.devcie: unknown key 'devcie'; did you mean 'device'?"),
    ({"layers": [{}, {"device": "x"}]}, "zero_optimization.layers[1].device: must be 'none', 'cpu' or 'nvme', got 'x'"),
    ({"sizes": [1, 2.0, 2.5]}, "zero_optimization.sizes[2]: must be an integer, got 2.5"),
    ({"stag": 1}, "zero_optimization.stag: unknown key 'stag'; did you mean 'stage'? Allowed keys: stage, bucket"),
    ({"thread": 1}, "zero_optimization.thread: unknown key 'thread'; did you mean 'threads'?"),
])
def test_bad_values_are_named_with_their_dotted_path(data, expected):
    assert expected in _error(Zero, **data)
    assert expected in _error(Zero.model_validate, data)
    # nested inside a model with no section of its own, the path is the same and said once
    nested = _error(Whole.model_validate, {"zero_optimization": data})
    assert expected in nested and nested.count("zero_optimization.") == expected.count("zero_optimization.")


def test_every_problem_is_reported_one_per_line():
    lines = _error(Zero, stage="x", offload_optimizer={"device": "gpu", "pin_memory": 3}).splitlines()
    assert lines == ["zero_optimization.stage: must be an integer, got 'x'",
                     "zero_optimization.offload_optimizer.device: must be 'none', 'cpu' or 'nvme', got 'gpu'",
                     "zero_optimization.offload_optimizer.pin_memory: must be true or false, got 3"]


def test_json_leniency_integral_floats_boolean_strings_and_tuples():
    z = Zero(stage=5e8, sizes=(1, 2.0), offload_optimizer={"pin_memory": "TRUE", "ratio": 1},
             groups={"a": {"pin_memory": "false"}})
    assert z.stage == 500_000_000 and type(z.stage) is int
    assert z.sizes == [1, 2] and all(type(s) is int for s in z.sizes)
    assert z.offload_optimizer.pin_memory is True and z.offload_optimizer.ratio == 1.0
    assert z.groups["a"].pin_memory is False
    assert Zero(bucket="auto").bucket == "auto" and Zero(bucket=1e3).bucket == 1000

    class Switch(Section):
        on: bool | Literal["auto"] = Field(False, description="A boolean or 'auto'.")
        mode: Literal["true", "x"] | bool = Field(False, description="A literal that is the string.")

    assert Switch(on="true").on is True and Switch(on="auto").on == "auto"
    assert Switch(mode="true").mode == "true" and Switch(mode=True).mode is True


def test_integers_0_and_1_are_booleans_where_only_a_boolean_fits():
    # DeepSpeed reads "zero_allow_untested_optimizer": 1 as true (non-strict pydantic, get_scalar_param)
    z = Zero(offload_optimizer={"pin_memory": 1}, groups={"a": {"pin_memory": 0}})
    assert z.offload_optimizer.pin_memory is True and z.groups["a"].pin_memory is False
    assert Zero.model_validate({"layers": [{"pin_memory": 1}]}).layers[0].pin_memory is True
    # where an integer or a number also fits, 1 stays the integer
    assert Zero(stage=1).stage == 1 and type(Zero(stage=1).stage) is int
    assert Zero(offload_optimizer={"ratio": 1}).offload_optimizer.ratio == 1.0

    class Mixed(Section):
        flag: bool | int = Field(False, description="A boolean or a count.")
        on: bool | Literal["auto"] = Field(False, description="A boolean or 'auto'.")

    assert Mixed(flag=1).flag == 1 and type(Mixed(flag=1).flag) is int
    assert Mixed(on=1).on is True and Mixed(on=0).on is False


def test_alias_and_name_both_accepted_and_models_are_frozen():
    assert Zero(threads=3).thread_count == 3 == Zero(thread_count=3).thread_count
    z = Zero()
    with pytest.raises(ValueError):
        z.stage = 3
    assert z.stage == 0


def test_from_ds_config_picks_the_section_from_a_dict_or_a_file(tmp_path):
    whole = {"train_batch_size": 8, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert Zero.from_ds_config(whole).stage == 2
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(whole))
    assert Zero.from_ds_config(path).offload_optimizer.device == "cpu"
    assert Zero.from_ds_config(str(path)) == Zero.from_ds_config(whole)
    assert Zero.from_ds_config({"train_batch_size": 8}) == Zero()      # absent: the defaults
    assert Zero.from_ds_config({"zero_optimization": None}) == Zero()
    assert "zero_optimization.stage: must be an integer" in _error(Zero.from_ds_config, {"zero_optimization": {"stage": "2"}})


def test_a_misspelled_section_is_named_not_ignored():
    message = _error(Zero.from_ds_config, {"train_batch_size": 8, "zero_optimisation": {"stage": 3}})
    assert message == "unknown section 'zero_optimisation'; did you mean 'zero_optimization'?"
    # DeepSpeed's own keys are never taken for misspellings of another section
    assert all(Zero.from_ds_config({k: {}}) == Zero() for k in DEEPSPEED_KEYS if k != "zero_optimization")


def test_from_section_or_ds_config_tells_the_section_from_a_whole_config():
    assert Zero.from_section_or_ds_config({"stage": 1}).stage == 1
    assert Zero.from_section_or_ds_config({"fp16": {}, "zero_optimization": {"stage": 3}}).stage == 3
    assert Zero.from_section_or_ds_config(None) == Zero()
    z = Zero(stage=2)
    assert Zero.from_section_or_ds_config(z) is z
    assert "did you mean 'stage'" in _error(Zero.from_section_or_ds_config, {"stagee": 1})
    # a lone misspelled section is named as such, not as an unknown key inside the section
    assert _error(Zero.from_section_or_ds_config, {"zero_optimisation": {"stage": 3}}) == \
        "unknown section 'zero_optimisation'; did you mean 'zero_optimization'?"


def test_load_ds_config_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": 1,\n "b": }')
    with pytest.raises(ValueError, match=r"bad.json:2:\d+: not valid JSON"):
        load_ds_config(bad)
    with pytest.raises(ValueError, match=r"cannot read the config file .*missing\.json"):
        load_ds_config(tmp_path / "missing.json")
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ValueError, match="is a JSON object, got list"):
        load_ds_config(tmp_path / "list.json")
    with pytest.raises(ValueError, match="got int"):
        load_ds_config(3)


def test_a_nested_model_has_no_section_of_its_own():
    with pytest.raises(RuntimeError, match="not a top-level section"):
        Offload.from_ds_config({})


def test_load_ds_config_reads_hjson_as_deepspeed_does(tmp_path):
    pytest.importorskip("hjson")
    path = tmp_path / "ds_config.hjson"
    path.write_text('{\n  # comments, unquoted keys and trailing commas, as DeepSpeed reads with hjson\n'
                    '  train_batch_size: 8,\n  "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8,},\n}\n')
    assert load_ds_config(path) == {"train_batch_size": 8, "zero_optimization": {"stage": 2,
                                                                                "reduce_bucket_size": 5e8}}


def test_duplicate_keys_are_refused_as_deepspeed_refuses_them(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "fp16": {"enabled": true, "enabled": false}, "train_batch_size": 4}')
    with pytest.raises(ValueError, match="duplicate keys in a DeepSpeed config: 'enabled'"):
        load_ds_config(path)
    path.write_text('{"train_batch_size": 8, "train_batch_size": 4}')
    with pytest.raises(ValueError, match="duplicate keys in a DeepSpeed config: 'train_batch_size'"):
        load_ds_config(path)


def test_a_base64_config_string_is_read_as_deepspeed_reads_it(tmp_path, monkeypatch):
    import base64

    monkeypatch.chdir(tmp_path)
    encoded = base64.urlsafe_b64encode(b'{"train_batch_size": 8, "fp16": {"enabled": true}}').decode()
    assert load_ds_config(encoded) == {"train_batch_size": 8, "fp16": {"enabled": True}}
    # a path that does not exist is still named as a file (not base64 of an object)
    with pytest.raises(ValueError, match=r"cannot read the config file 'nope\.json'"):
        load_ds_config("nope.json")
    with pytest.raises(ValueError, match="cannot read the config file 'abcd'"):
        load_ds_config("abcd")  # valid base64, but not of a JSON object


def test_a_config_error_survives_pickling_with_its_problems():
    """A process pool sends a worker's exception to its parent pickled; DeepSpeed's test harness hangs on one
    that cannot be unpickled (ConfigError's __init__ takes the problems, not the message)."""
    import pickle

    error = ConfigError([("stage", "must be 0-3, got 7"), ("bucket", "must be > 0, got -1")], section="zero")
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is ConfigError and str(again) == str(error)
    assert (again.problems, again.section) == (error.problems, error.section)
