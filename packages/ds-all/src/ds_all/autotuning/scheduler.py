"""DeepSpeed's ``deepspeed.autotuning.scheduler``: ``ResourceManager(args, hosts, num_gpus_per_node,
results_dir, exps_dir, arg_mappings)``, ds-autotune's (the hosts and slots experiments use, the arg mappings
their commands apply)."""

from ds_autotune import ResourceManager

__all__ = ["ResourceManager"]
