# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.runtime.data_pipeline.data_sampling.utils``: its helpers are not built (ds-data's
analyzer splits the work and writes its files itself); importing them is an ImportError naming them."""

from .. import not_built

__all__: list[str] = []

__getattr__ = not_built(__name__, ("find_fit_int_dtype", "split_index", "split_dataset",
                                   "create_mmap_dataset_builder", "close_mmap_dataset_builder"),
                        "the data analyzer's helpers")
