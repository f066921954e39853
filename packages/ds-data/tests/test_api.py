"""The public API of ds-data is small and pinned."""

import ds_data


def test_public_api_is_small():
    assert sorted(ds_data.__all__) == ["CurriculumLearningConfig", "CurriculumScheduler", "ProgressiveLayerDrop",
                                       "ProgressiveLayerDropBlock", "ProgressiveLayerDropConfig", "ScheduleConfig",
                                       "__version__"]
    assert all(hasattr(ds_data, name) for name in ds_data.__all__)
