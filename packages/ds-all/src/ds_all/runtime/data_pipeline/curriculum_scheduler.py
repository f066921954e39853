# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.runtime.data_pipeline.curriculum_scheduler`` is ds-data's `CurriculumScheduler`."""

from ds_data import CurriculumScheduler

__all__ = ["CurriculumScheduler"]
