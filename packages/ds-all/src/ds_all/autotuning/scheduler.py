# generated from ds_all/_deepspeed_paths.py by `python -m ds_all._compat_gen`; do not edit
"""DeepSpeed's ``deepspeed.autotuning.scheduler``: ``ResourceManager(args, hosts, num_gpus_per_node,
results_dir, exps_dir, arg_mappings)``, ds-autotune's (the hosts and slots experiments use, the arg mappings
their commands apply)."""

from ds_autotune import ResourceManager

__all__ = ["ResourceManager"]
