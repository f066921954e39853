# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset``: ds-data's
`MMapIndexedDataset` and `MMapIndexedDatasetBuilder` (Megatron's ``.bin``/``.idx`` layout). The older
``IndexedDataset`` formats and the module's helpers are not built: importing them is an ImportError naming them."""

from ds_data import MMapIndexedDataset, MMapIndexedDatasetBuilder

from .. import not_built

__all__ = ["MMapIndexedDataset", "MMapIndexedDatasetBuilder"]

__getattr__ = not_built(__name__, ("IndexedDataset", "IndexedCachedDataset",
                                   "IndexedDatasetBuilder", "make_builder", "make_dataset",
                                   "dataset_exists", "get_available_dataset_impl",
                                   "infer_dataset_impl", "read_longs", "write_longs", "dtypes",
                                   "valid_dtypes", "code", "index_file_path", "data_file_path",
                                   "create_doc_idx", "exscan_from_cumsum_",
                                   "get_pointers_with_total"),
                        "the indexed dataset's older formats and helpers")
