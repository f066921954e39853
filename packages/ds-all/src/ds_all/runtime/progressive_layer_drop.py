# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.runtime.progressive_layer_drop`` (releases before 0.19) is ds-data's
`ProgressiveLayerDrop`."""

from ds_data import ProgressiveLayerDrop

__all__ = ["ProgressiveLayerDrop"]
