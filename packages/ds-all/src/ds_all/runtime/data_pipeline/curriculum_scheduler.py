"""DeepSpeed's ``deepspeed.runtime.data_pipeline.curriculum_scheduler`` is ds-data's `CurriculumScheduler`."""

from ds_data import CurriculumScheduler

__all__ = ["CurriculumScheduler"]
