"""The public API of ds-data is small and pinned."""

import ds_data


def test_public_api_is_small():
    assert sorted(ds_data.__all__) == [
        "CurriculumLearningConfig", "CurriculumScheduler", "DataAnalyzer", "DataEfficiencyConfig", "DataSampler",
        "MMapIndexedDataset", "MMapIndexedDatasetBuilder", "ProgressiveLayerDrop", "ProgressiveLayerDropBlock",
        "ProgressiveLayerDropConfig", "RandomLTDConfig", "RandomLTDScheduler", "RandomLayerTokenDrop",
        "ScheduleConfig", "__version__", "convert_to_random_ltd"]
    assert all(hasattr(ds_data, name) for name in ds_data.__all__)
