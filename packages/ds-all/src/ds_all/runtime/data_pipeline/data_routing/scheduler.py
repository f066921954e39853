# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.runtime.data_pipeline.data_routing.scheduler`` is ds-data's `RandomLTDScheduler`
(``BaseScheduler``, its base class in DeepSpeed, is not built: an ImportError naming it)."""

from ds_data import RandomLTDScheduler

from .. import not_built

__all__ = ["RandomLTDScheduler"]

__getattr__ = not_built(__name__, ("BaseScheduler",),
                        "the base class of DeepSpeed's random-LTD scheduler")
