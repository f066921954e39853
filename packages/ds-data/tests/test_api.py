"""The public API of ds-data is small and pinned."""

import ds_data


def test_public_api_is_small():
    assert sorted(ds_data.__all__) == [
        "CurriculumLearningConfig", "CurriculumScheduler", "DataAnalyzer", "DataEfficiencyConfig", "DataSampler",
        "MMapIndexedDataset", "MMapIndexedDatasetBuilder", "ProgressiveLayerDrop", "ProgressiveLayerDropBlock",
        "ProgressiveLayerDropConfig", "RandomLTDConfig", "RandomLTDScheduler", "RandomLayerTokenDrop",
        "ScheduleConfig", "VariableBatchSizeLR", "__version__", "batch_by_seqlens", "convert_to_random_ltd",
        "dataloader_for_variable_batch_size", "get_dataloader_and_lr_scheduler_for_variable_batch_size",
        "get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed",
        "lr_scheduler_for_variable_batch_size", "scale_lr"]
    assert all(hasattr(ds_data, name) for name in ds_data.__all__)
