"""The ops of ds-ops. Other packages define theirs on the same base (ds-io: async_io) and make
them known to ``ds-report`` through the ``ds_ops.builders`` entry-point group."""

from __future__ import annotations

from pathlib import Path

from .builder import OpBuilder, csrc_root


class _CpuOptimizerBuilder(OpBuilder):
    KERNEL = ""

    def sources(self) -> list[Path]:
        return [csrc_root() / "optim" / self.KERNEL, csrc_root() / "optim" / "module.cpp"]

    def include_dirs(self) -> list[Path]:
        return [csrc_root() / "common", csrc_root() / "optim"]

    def defines(self) -> list[str]:
        return [f"DS_OP_{self.NAME.upper()}"]


class CPUAdamBuilder(_CpuOptimizerBuilder):
    NAME = "cpu_adam"
    DESCRIPTION = "Adam/AdamW on CPU tensors: CPUAdam, FusedAdam's CPU path"
    KERNEL = "adam.cpp"


class CPUAdagradBuilder(_CpuOptimizerBuilder):
    NAME = "cpu_adagrad"
    DESCRIPTION = "Adagrad on CPU tensors: CPUAdagrad"
    KERNEL = "adagrad.cpp"


class CPULionBuilder(_CpuOptimizerBuilder):
    NAME = "cpu_lion"
    DESCRIPTION = "Lion on CPU tensors: CPULion"
    KERNEL = "lion.cpp"


class CPULambBuilder(_CpuOptimizerBuilder):
    NAME = "cpu_lamb"
    DESCRIPTION = "LAMB on CPU tensors: FusedLamb's CPU path"
    KERNEL = "lamb.cpp"


class SparseAttentionBuilder(OpBuilder):
    NAME = "sparse_attn"
    DESCRIPTION = "block-sparse attention on CPU (SDD, softmax, DSD; forward and backward): SparseSelfAttention"

    def sources(self) -> list[Path]:
        return [csrc_root() / "sparse_attention" / name for name in ("attention.cpp", "module.cpp")]

    def include_dirs(self) -> list[Path]:
        return [csrc_root() / "common", csrc_root() / "sparse_attention"]


class OneBitBuilder(OpBuilder):
    NAME = "onebit"
    DESCRIPTION = "1-bit compression with error feedback on CPU float32 buffers: ds_comm.compressed_allreduce"

    def sources(self) -> list[Path]:
        return [csrc_root() / "onebit" / name for name in ("onebit.cpp", "module.cpp")]

    def include_dirs(self) -> list[Path]:
        return [csrc_root() / "common", csrc_root() / "onebit"]

    def extra_cxx_flags(self) -> list[str]:
        # every float32 operation rounded on its own, as in the torch reference (no fused multiply-add)
        return ["-ffp-contract=off"]


class QuantizeBuilder(OpBuilder):
    NAME = "quantize"
    DESCRIPTION = "block quantization (int8/int4, a scale per group) on CPU buffers: ZeRO++'s qwZ and qgZ"

    def sources(self) -> list[Path]:
        return [csrc_root() / "quantize" / name for name in ("quantize.cpp", "module.cpp")]

    def include_dirs(self) -> list[Path]:
        return [csrc_root() / "common", csrc_root() / "quantize"]

    def extra_cxx_flags(self) -> list[str]:
        # every float32 operation rounded on its own, as in the torch reference (no fused multiply-add)
        return ["-ffp-contract=off"]


class FusedAdamBuilder(CPUAdamBuilder):
    """DeepSpeed's ``FusedAdamBuilder`` (its name ``fused_adam``). ds's `FusedAdam` runs the ``cpu_adam``
    kernel on CPU tensors and torch's fused kernel on a device, so this builder is the ``cpu_adam`` op
    under DeepSpeed's name: it builds, caches and loads that same module."""

    NAME = "fused_adam"
    DESCRIPTION = "DeepSpeed's name for the kernel of FusedAdam: the cpu_adam module"

    def load(self, verbose: bool = False):
        return CPUAdamBuilder().load(verbose)

    def is_built(self) -> bool:
        return CPUAdamBuilder().is_built()


class FusedLambBuilder(CPULambBuilder):
    """DeepSpeed's ``FusedLambBuilder`` (``fused_lamb``): the ``cpu_lamb`` op that ds's `FusedLamb` runs on
    CPU tensors, under DeepSpeed's name."""

    NAME = "fused_lamb"
    DESCRIPTION = "DeepSpeed's name for the kernel of FusedLamb: the cpu_lamb module"

    def load(self, verbose: bool = False):
        return CPULambBuilder().load(verbose)

    def is_built(self) -> bool:
        return CPULambBuilder().is_built()


# The ops ds-report lists and `DS_BUILD_OPS=1` builds (DeepSpeed's names above are the same modules).
BUILDERS: dict[str, type[OpBuilder]] = {
    b.NAME: b for b in (CPUAdamBuilder, CPUAdagradBuilder, CPULionBuilder, CPULambBuilder, SparseAttentionBuilder,
                        OneBitBuilder, QuantizeBuilder)
}
