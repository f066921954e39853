"""DeepSpeed's ``deepspeed.ops`` is ds-ops; its submodules under DeepSpeed's names (``ds_all.ops.adam`` ...).

``__compatible_ops__`` (DeepSpeed's): op name -> whether this machine can build it, for every op ds has
(ds-ops' and those other packages register, with DeepSpeed's names ``fused_adam``/``fused_lamb`` for
the kernels of FusedAdam and FusedLamb). Probed on first access (a compiler check), then kept.
"""

from ds_ops import *  # noqa: F403  (the same public names)
from ds_ops import __all__  # noqa: F401

from . import adagrad, adam, lamb, lion, op_builder, sparse_attention  # noqa: F401


def _probe_compatible_ops() -> dict[str, bool]:
    from ds_ops.op_builder import FusedAdamBuilder, FusedLambBuilder
    from ds_ops.report import all_builders

    builders = {**all_builders(), FusedAdamBuilder.NAME: FusedAdamBuilder, FusedLambBuilder.NAME: FusedLambBuilder}
    return {name: builder().compatibility()[0] for name, builder in builders.items()}


def __getattr__(name: str):
    if name == "__compatible_ops__":
        globals()[name] = _probe_compatible_ops()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
