# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.utils.z3_leaf_module``: ZeRO-3 leaf modules (one fetch unit with everything
below them; a Mixture-of-Experts block), ds-zero's."""

from ds_zero import (
    apply_zero_leaf_module_config,
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)

__all__ = ["apply_zero_leaf_module_config", "get_z3_leaf_modules", "set_z3_leaf_module",
           "set_z3_leaf_modules", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix",
           "unset_z3_leaf_modules", "z3_leaf_module", "z3_leaf_parameter"]
