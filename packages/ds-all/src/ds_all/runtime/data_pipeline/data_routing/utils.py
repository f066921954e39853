# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.runtime.data_pipeline.data_routing.utils``: its gather/scatter helpers are not built
(ds-data's `RandomLayerTokenDrop` gathers and scatters the kept tokens itself); importing them is an ImportError
naming them."""

from .. import not_built

__all__: list[str] = []

__getattr__ = not_built(__name__, ("bsh_decoder_gather", "bsh_decoder_scatter"),
                        "random-LTD's batch-sequence-hidden gather and scatter helpers")
