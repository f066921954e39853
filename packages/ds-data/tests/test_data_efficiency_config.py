"""The ``data_efficiency`` section: DeepSpeed's keys and defaults, its documented example, bad values named."""

from __future__ import annotations

import copy

import pytest

from ds_data import DataEfficiencyConfig
from ds_data.config import CurriculumMetricConfig

# DeepSpeed's config reference example of the section, key for key.
EXAMPLE = {
    "enabled": True, "seed": 1234,
    "data_routing": {"enabled": True, "random_ltd": {
        "enabled": True, "total_layer_num": 24, "random_ltd_layer_num": 22,
        "random_ltd_layer_id": list(range(1, 23)), "model_mask_name": "attention_mask", "model_type": "decoder",
        "hidden_state_order": "seq_batch_dim",
        "random_ltd_schedule": {"min_value": 128, "max_value": 2048, "schedule_type": "fixed_linear",
                                "schedule_config": {"require_steps": 200000, "seq_per_step": 16}}}},
    "data_sampling": {"enabled": True, "num_epochs": 1, "num_workers": 0, "curriculum_learning": {
        "enabled": True, "data_cluster_path": "/path/to/data_clusters", "curriculum_metrics": {
            "vocabularyrarity": {
                "index_to_sample_path": "/path/to/index_to_sample", "index_to_metric_path": "/path/to/index_to_metric",
                "difficulty_type": "percentile", "clustering_type": "schedule_based", "min_difficulty": 1,
                "max_difficulty": 100, "schedule_type": "fixed_root",
                "schedule_config": {"total_curriculum_step": 110000, "difficulty_step": 1, "root_degree": 2}}}}},
}


def test_defaults_are_deepspeeds():
    off = DataEfficiencyConfig()
    assert (off.enabled, off.seed) == (False, 1234)
    sampling = off.data_sampling
    assert (sampling.enabled, sampling.num_epochs, sampling.num_workers, sampling.pin_memory) == (False, 1000, 0, False)
    assert not sampling.curriculum_learning.enabled and sampling.curriculum_learning.curriculum_metrics == {}
    batching = sampling.dynamic_batching
    assert (batching.enabled, batching.lr_scaling_method, batching.min_batch_size, batching.max_batch_size,
            batching.sequence_picking_order, batching.verbose) == (False, "linear", 1, None, "dataloader", False)
    routing = off.data_routing
    assert not routing.enabled and not routing.random_ltd.enabled
    assert not routing.random_ltd.layer_token_lr_schedule.enabled
    assert DataEfficiencyConfig.from_ds_config({"train_batch_size": 4}) == off


def test_the_documented_example_loads():
    config = DataEfficiencyConfig.from_ds_config({"data_efficiency": EXAMPLE})
    ltd = config.data_routing.random_ltd
    assert ltd.random_ltd_layer_id == list(range(1, 23)) and ltd.hidden_state_order == "seq_batch_dim"
    assert ltd.random_ltd_schedule.schedule_config.seq_per_step == 16
    metric = config.data_sampling.curriculum_learning.curriculum_metrics["vocabularyrarity"]
    assert metric.difficulty_type == "percentile" and metric.schedule_config.root_degree == 2
    schedule = metric.schedule()
    assert (schedule.min_difficulty, schedule.max_difficulty, schedule.schedule_type) == (1, 100, "fixed_root")


def _with(path: str, value):
    data = copy.deepcopy(EXAMPLE)
    holder = data
    *parents, last = path.split(".")
    for part in parents:
        holder = holder[part]
    if value is KeyError:
        del holder[last]
    else:
        holder[last] = value
    return data


LTD = "data_routing.random_ltd"


@pytest.mark.parametrize("path,value,words", [
    (f"{LTD}.random_ltd_layer_id", [0, 24], r"random_ltd_layer_id \[24\] out of range: layers are 0 to "
                                            r"total_layer_num - 1 = 23"),
    (f"{LTD}.random_ltd_layer_id", [-1], "layer indices >= 0"),
    (f"{LTD}.random_ltd_layer_id", [1, 1], "repeated layers"),
    (f"{LTD}.random_ltd_layer_num", 21, r"random_ltd_layer_num 21 must equal the length of random_ltd_layer_id "
                                        r"\(22\)"),
    (f"{LTD}.random_ltd_schedule.min_value", 4096, "min_value 4096 is above max_value 2048"),
    (f"{LTD}.random_ltd_schedule.min_value", 0, "min_value must be a positive integer, got 0"),
    (f"{LTD}.random_ltd_schedule.schedule_type", "fixed_root", "schedule_type must be one of 'fixed_linear'"),
    (f"{LTD}.random_ltd_schedule.schedule_config.seq_per_step", 0, "seq_per_step must be a positive integer"),
    (f"{LTD}.hidden_state_order", "bsh", "hidden_state_order must be one of 'batch_seq_dim', 'seq_batch_dim'"),
    (f"{LTD}.model_type", "encoder-decoder", "model_type must be one of 'decoder', 'encoder'"),
    (f"{LTD}.random_ltd_schedule.schedule_config.require_steps", KeyError,
     r"random_ltd is enabled and needs random_ltd_schedule\.schedule_config\.require_steps"),
    (f"{LTD}.random_ltd_layer_idx", [1], "unknown key 'random_ltd_layer_idx'; did you mean 'random_ltd_layer_id'"),
    ("data_routing.random_ltd.random_ltd_schedule.schedule_config.seq_per_steps", 8,
     "did you mean 'seq_per_step'"),
    ("data_sampling.num_epoch", 1, "unknown key 'num_epoch'; did you mean 'num_epochs'"),
    ("data_sampling.num_workers", -1, "num_workers must be >= 0"),
    ("data_sampling.curriculum_learning.curriculum_metrics", {}, "curriculum_learning is enabled and needs "
                                                                 "curriculum_metrics"),
    ("data_sampling.curriculum_learning.data_cluster_path", KeyError, "needs data_cluster_path"),
    ("data_sampling.curriculum_learning.curriculum_metrics.vocabularyrarity.difficulty_type", "rank",
     "difficulty_type must be one of 'value', 'percentile'"),
    ("data_sampling.curriculum_learning.curriculum_metrics.vocabularyrarity.max_difficulty", 101,
     r"percentile' needs min_difficulty and max_difficulty in \[0, 100\], got 101"),
    ("data_sampling.curriculum_learning.curriculum_metrics.vocabularyrarity.index_to_sample_path", KeyError,
     "curriculum_metrics.vocabularyrarity needs index_to_sample_path"),
    ("data_sampling.curriculum_learning.curriculum_metrics.vocabularyrarity.schedule_config", {},
     r"vocabularyrarity: needs schedule_config\.total_curriculum_step"),
    ("data_sampling.dynamic_batching", {"enabled": True}, "dynamic_batching is enabled and needs max_tokens"),
    ("data_sampling.dynamic_batching", {"lr_scaling_method": "cube"}, "lr_scaling_method must be one of"),
    ("seeds", 1, "unknown key 'seeds'; did you mean 'seed'"),
])
def test_bad_values_are_named(path, value, words):
    with pytest.raises(ValueError, match=words):
        DataEfficiencyConfig.model_validate(_with(path, value))


def test_sections_that_are_off_may_leave_their_keys_out_but_their_values_are_checked():
    DataEfficiencyConfig.model_validate({"data_routing": {"random_ltd": {"enabled": False, "total_layer_num": 4}},
                                         "data_sampling": {"curriculum_learning": {"enabled": False}}})
    with pytest.raises(ValueError, match="min_value 9 is above max_value 3"):
        DataEfficiencyConfig.model_validate({"data_routing": {"random_ltd": {
            "random_ltd_schedule": {"min_value": 9, "max_value": 3}}}})
    value_metric = CurriculumMetricConfig(difficulty_type="value", clustering_type="schedule_based",
                                          index_to_sample_path="s", min_difficulty=8, max_difficulty=512,
                                          schedule_type="fixed_linear",
                                          schedule_config={"total_curriculum_step": 10, "difficulty_step": 8})
    with pytest.raises(ValueError, match="needs index_to_metric_path"):
        value_metric.check_complete("seqlen")
    CurriculumMetricConfig(difficulty_type="value", clustering_type="single_cluster", min_difficulty=8,
                           max_difficulty=512, schedule_type="custom").check_complete("seqlen")
