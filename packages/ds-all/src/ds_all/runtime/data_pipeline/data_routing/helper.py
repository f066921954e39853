# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.runtime.data_pipeline.data_routing.helper``: ds-data's `convert_to_random_ltd`.
``save_without_random_ltd`` and ``remove_random_ltd_state_dict`` are not built (ds-all saves a converted model's
own keys); importing them is an ImportError naming them."""

from ds_data import convert_to_random_ltd

from .. import not_built

__all__ = ["convert_to_random_ltd"]

__getattr__ = not_built(__name__, ("save_without_random_ltd", "remove_random_ltd_state_dict"),
                        "the state dict of a random-LTD model without its wrappers' names")
