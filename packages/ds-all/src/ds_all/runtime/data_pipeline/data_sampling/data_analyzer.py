# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.runtime.data_pipeline.data_sampling.data_analyzer`` is ds-data's `DataAnalyzer`
(``DistributedDataAnalyzer``, ``Dist`` and ``test_compare_both_data_analyzers`` are not built: ImportErrors
naming them; run ``DataAnalyzer.run_map`` on each worker, then ``run_reduce`` once)."""

from ds_data import DataAnalyzer

from .. import not_built

__all__ = ["DataAnalyzer"]

__getattr__ = not_built(__name__, ("DistributedDataAnalyzer", "Dist",
                                   "test_compare_both_data_analyzers"),
                        "the data analyzer over torch.distributed")
