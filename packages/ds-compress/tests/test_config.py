import json
import logging
from pathlib import Path

import pytest
import torch
from ds_config import ConfigError as ValidationError

from ds_compress import CompressionConfig, init_compression

FIXTURE = Path(__file__).parent / "fixtures" / "compression.json"


def test_reference_config_loads_and_applies(encoder):
    cfg = CompressionConfig.load(str(FIXTURE))
    wq = cfg.weight_quantization
    assert wq.shared_parameters.quantize_weight_in_forward is True
    assert wq.different_groups["wq2"].params.start_bits == 4
    assert cfg.sparse_pruning.shared_parameters.schedule_offset == 30
    assert cfg.row_pruning.shared_parameters.enabled is False  # absent technique: defaults
    # The whole ds config (dict) is accepted too, and the same section comes out.
    assert CompressionConfig.load(json.loads(FIXTURE.read_text())) == cfg
    init_compression(encoder, cfg)
    assert encoder.layer[0].attention.output.dense.weight_bits == 4
    assert encoder.layer[1].attention.self.query.weight_bits == 8
    assert encoder.layer[0].intermediate.dense.weight_bits == 8
    assert type(encoder.layer[0].output.dense) is torch.nn.Linear  # "output.dense" is not named


def test_defaults_match_reference():
    cfg = CompressionConfig()
    wq = cfg.weight_quantization.shared_parameters
    assert (wq.enabled, wq.schedule_offset, wq.quantize_groups, wq.quantization_type, wq.rounding,
            wq.quantize_weight_in_forward, wq.fp16_mixed_quantize.quantize_change_ratio) == (
        False, 0, 1, "symmetric", "nearest", False, 0.001)
    aq = cfg.activation_quantization.shared_parameters
    assert (aq.quantization_type, aq.range_calibration) == ("symmetric", "static")
    sp = cfg.sparse_pruning.shared_parameters
    assert (sp.method, sp.block_pattern, sp.dense_ratio, sp.schedule_offset_stride) == ("l1", "4x1", 0.1, 1)
    assert cfg.head_pruning.shared_parameters.method == "topk"
    assert cfg.row_pruning.shared_parameters.method == cfg.channel_pruning.shared_parameters.method == "l1"


@pytest.mark.parametrize("data, words", [
    ({"weight_quantization": {"shared_parameters": {"enabeld": True}}}, ["enabeld", "did you mean 'enabled'"]),
    ({"sparse_pruning": {"shared_parameters": {"enabled": True},
                         "different_groups": {"a": {"params": {"dense_ratio": 0.0}}}}}, ["dense_ratio", "(0, 1]"]),
    ({"row_pruning": {"shared_parameters": {"enabled": True},
                      "different_groups": {"a": {"params": {"dense_ratio": 1.5}}}}}, ["dense_ratio", "1.5"]),
    ({"weight_quantization": {"different_groups": {"a": {"params": {"start_bits": 4, "target_bits": 8}}}}},
     ["target_bits", "start_bits"]),
    ({"activation_quantization": {"different_groups": {"a": {"params": {"bits": 2}}}}}, ["bits", "got 2"]),
    ({"head_pruning": {"shared_parameters": {"enabled": True},
                       "different_groups": {"a": {"modules": ["x"]}}}}, ["num_heads"]),
    ({"row_pruning": {"shared_parameters": {"enabled": True}}}, ["row_pruning", "different_groups is empty"]),
    ({"weight_quantization": {"shared_parameters": {"schedule_offset": True}}}, ["schedule_offset"]),
    ({"sparse_pruning": {"shared_parameters": {"method": "snip_momentum"}}}, ["schedule_offset_end"]),
    ({"sparse_pruning": {"shared_parameters": {"block_pattern": "4by1"}}}, ["block_pattern", "4by1"]),
    ({"layer_reduction": {"enabled": True, "module_name_prefix": "layer", "keep_number_layer": 2,
                          "teacher_layer": [0]}}, ["teacher_layer", "keep_number_layer=2"]),
])
def test_bad_values_name_the_key(data, words):
    with pytest.raises(ValidationError) as info:
        CompressionConfig.load(data)
    for word in words:
        assert word in str(info.value)


def test_misspelled_section_is_named_as_a_section(tmp_path):
    for whole in ({"compresion_training": {}}, {"train_batch_size": 8, "compression_trainig": {}}):
        with pytest.raises(ValueError, match=r"^unknown section 'compres\w+'; did you mean 'compression_training'"):
            CompressionConfig.load(whole)
        path = tmp_path / "ds_config.json"
        path.write_text(json.dumps(whole))
        with pytest.raises(ValueError, match="did you mean 'compression_training'"):
            CompressionConfig.load(path)


@pytest.mark.parametrize("group", [{"modules": ["attention.(self"]},
                                   {"modules": ["dense"], "related_modules": [["out[put"]]}])
def test_bad_regex_names_the_key_and_the_pattern(group):
    with pytest.raises(ValueError, match=r"compression_training\.row_pruning\.different_groups\.rp1\.\w+: "
                                         r"'.*' is not a valid regular expression \("):
        CompressionConfig.load({"row_pruning": {"different_groups": {"rp1": group}}})


def test_deepspeed_test_config_quantizes_from_12_to_8_bits(encoder):
    # DeepSpeed's unit test config anneals 12 -> 8 bits; bits above the final 8 are for training only.
    cfg = CompressionConfig.load({"weight_quantization": {
        "shared_parameters": {"enabled": True, "quantize_weight_in_forward": True},
        "different_groups": {"wq1": {"params": {"start_bits": 12, "target_bits": 8, "quantization_period": 2},
                                     "modules": ["attention.self"]}}}})
    init_compression(encoder, cfg)
    assert encoder.layer[0].attention.self.query.weight_bits == 12
    with pytest.raises(ValueError, match="target_bits must be between 1 and 8, got 12"):
        CompressionConfig.load({"weight_quantization": {"different_groups": {"a": {
            "params": {"start_bits": 12, "target_bits": 12}}}}})
    with pytest.raises(ValueError, match="start_bits must be between 1 and 16, got 17"):
        CompressionConfig.load({"weight_quantization": {"different_groups": {"a": {"params": {"start_bits": 17}}}}})


def test_float_integers_accepted():
    cfg = CompressionConfig.load({"weight_quantization": {"shared_parameters": {"schedule_offset": 5e1}}})
    assert cfg.weight_quantization.shared_parameters.schedule_offset == 50
    with pytest.raises(ValidationError, match=r"2\.5"):
        CompressionConfig.load({"weight_quantization": {"shared_parameters": {"schedule_offset": 2.5}}})


def test_a_pattern_matching_nothing_is_skipped_with_a_warning_naming_key_and_pattern(encoder, section, caplog):
    # DeepSpeed skips it silently (a shared config names the modules of several models); we skip and say so
    cfg = section("sparse_pruning", {}, {"sp1": {"modules": ["attention.selff"]}, "sp2": {"modules": ["self.query"]}})
    before = {name: type(m) for name, m in encoder.named_modules()}
    with caplog.at_level(logging.WARNING, logger="ds_compress"):
        model = init_compression(encoder, cfg)
    (record,) = [r for r in caplog.records if "matches no" in r.getMessage()]
    assert "sparse_pruning.different_groups.sp1.modules: pattern 'attention.selff' matches no" in record.getMessage()
    changed = {name for name, m in model.named_modules() if name in before and type(m) is not before[name]}
    assert changed and all("self.query" in name for name in changed)  # sp2's modules, and only those


def test_module_in_two_groups_is_an_error(encoder, section):
    cfg = section("sparse_pruning", {}, {"a": {"modules": ["query"]}, "b": {"modules": ["self.query"]}})
    with pytest.raises(ValueError, match="already compressed by group 'a'"):
        init_compression(encoder, cfg)


def test_related_modules_must_pair(encoder, section):
    cfg = section("row_pruning", {}, {"rp": {"modules": ["intermediate.dense"],
                                             "related_modules": [["classifier"]]}})
    with pytest.raises(ValueError, match="related_modules: pattern 'classifier' matches 1"):
        init_compression(encoder, cfg)


def test_refused_features_say_why(encoder, section):
    with pytest.raises(ValueError, match="quantizer_kernel"):
        init_compression(encoder, section("weight_quantization", {"quantizer_kernel": True}, {"a": {}}))
    with pytest.raises(ValueError, match="snip_momentum"):
        init_compression(encoder, section("sparse_pruning", {"method": "snip_momentum", "schedule_offset_end": 9}, {}))


def test_default_modules_are_linear_and_conv(convnet, section):
    init_compression(convnet, section("weight_quantization", {}, {"all": {"params": {"start_bits": 8}}}))
    assert all(m.weight_quantization is not None for m in (convnet.conv1, convnet.conv2, convnet.fc))
    assert not hasattr(convnet.bn1, "weight_quantization")
    x = torch.randn(2, 3, 6, 6)
    assert convnet(x).shape == (2, 3)


@pytest.mark.parametrize("technique, shared, group, key, pattern", [
    ("sparse_pruning", {}, {"modules": ["layer.(0"]}, "sparse_pruning.different_groups.g.modules", "layer.(0"),
    ("sparse_pruning", {"excluded_modules": ["*query"]}, {"modules": ["query"]},
     "sparse_pruning.shared_parameters.excluded_modules", "*query"),
    ("row_pruning", {}, {"modules": ["intermediate.dense"], "related_modules": [["output[.dense"]]},
     "row_pruning.different_groups.g.related_modules", "output[.dense"),
])
def test_bad_regex_names_key_and_pattern(encoder, section, technique, shared, group, key, pattern):
    """A pattern that is no regular expression: a ValueError naming the key and the pattern, not a bare re.error."""
    with pytest.raises(ValueError) as info:
        init_compression(encoder, section(technique, shared, {"g": group}))
    message = str(info.value)
    assert f"compression_training.{key}" in message
    assert repr(pattern) in message and "not a valid regular expression" in message
