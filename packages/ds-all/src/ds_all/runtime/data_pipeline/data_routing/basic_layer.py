# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.runtime.data_pipeline.data_routing.basic_layer`` is ds-data's `RandomLayerTokenDrop`."""

from ds_data import RandomLayerTokenDrop

__all__ = ["RandomLayerTokenDrop"]
