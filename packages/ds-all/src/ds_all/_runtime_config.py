"""Sections of DeepSpeed 0.19's config that belong to no package yet: ``torch_autocast``,
``tensor_parallel``, ``compile``. Each key is DeepSpeed's; what ds-all does not build is accepted
while off and refused, naming the key, when on (`Config` checks ``refusal()``)."""

from __future__ import annotations

from typing import Any, Literal

from ds_config import Section
from pydantic import Field, field_validator

# DeepSpeed's DtypeEnum spellings (deepspeed.runtime.config), by torch dtype name
DTYPE_NAMES = {
    "float16": ("fp16", "float16", "half", "torch.float16"),
    "float32": ("fp32", "float32", "float", "torch.float32"),
    "bfloat16": ("bf16", "bfloat16", "torch.bfloat16"),
    "int8": ("int8", "torch.int8"),
}


def dtype_name(value: str | None, key: str) -> str | None:
    """The torch dtype name a DeepSpeed dtype spelling means ("bf16" -> "bfloat16"); None stays None."""
    if value is None:
        return None
    for name, spellings in DTYPE_NAMES.items():
        if value in spellings:
            return name
    allowed = ", ".join(repr(s) for spellings in DTYPE_NAMES.values() for s in spellings)
    raise ValueError(f"{key} must be one of {allowed}, got {value!r}")


class TorchAutocastConfig(Section):
    """``torch_autocast``: the engine's forward under ``torch.autocast`` (the parameters stay as they are)."""

    section = "torch_autocast"

    enabled: bool = Field(False, description="Run the model's forward under torch.autocast.")
    dtype: str | None = Field(None, description="The autocast dtype (\"bf16\", \"fp16\", ...; null: the "
                              "device's default, bfloat16 on a CPU, float16 on a GPU).")
    lower_precision_safe_modules: list[str] | None = Field(None, description="Classes (\"torch.nn.Linear\") whose "
                                                           "gradients DeepSpeed reduces in the autocast dtype.")

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, value: str | None) -> str | None:
        name = dtype_name(value, "torch_autocast.dtype")
        if name not in (None, "float16", "bfloat16"):
            raise ValueError(f"torch_autocast.dtype must be a 16-bit type (\"bf16\" or \"fp16\"), got {value!r}")
        return value


class TPConfig(Section):
    """``tensor_parallel.tp`` (DeepSpeed's TPConfig)."""

    tp_size: int = Field(1, ge=1, description="Ranks a tensor-parallel layer is split over.")
    tp_grain_size: int = Field(1, ge=1, description="Split granularity of AutoTP's partitions.")


class TensorParallelConfig(Section):
    """``tensor_parallel``: DeepSpeed's AutoTP training: ``autotp_size`` (or ``tp.tp_size``) above 1 makes
    `initialize` build the tensor-parallel groups and slice the model with ds-parallel's ``tp_model_init``.
    The keys that tune what ds-parallel does not build are refused when on (`refusal`)."""

    section = "tensor_parallel"

    autotp_size: int = Field(0, ge=0, description="AutoTP's tensor-parallel degree (0 or 1: off).")
    dtype: str | None = Field(None, description="The dtype AutoTP converts the model to.")
    tp_overlap_comm: bool = Field(False, description="Overlap AutoTP's all-reduce with computation.")
    vocab_parallel_lm_head: bool | None = Field(None, description="Split the LM head over the vocabulary.")
    vocab_parallel_ce_backend: Literal["torch", "liger"] = Field("torch", description="The vocabulary-parallel "
                                                                  "cross-entropy's implementation.")
    tensor_parallel: TPConfig = Field(default_factory=TPConfig, alias="tp", description="tp_size, tp_grain_size.")
    injection_policy_tuple: list[Any] | None = Field(None, description="AutoTP's injection policy.")
    partition_config: dict[str, Any] | None = Field(None, description="AutoTP's custom partition rules.")
    preset_model: str | None = Field(None, description="A model family with a preset partition.")
    keep_module_on_host: bool = Field(False, description="Keep the module on the host while partitioning.")
    replace_with_kernel_inject: bool = Field(False, alias="kernel_inject", description="Inject inference kernels.")

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, value: str | None) -> str | None:
        dtype_name(value, "tensor_parallel.dtype")
        return value

    @field_validator("partition_config")
    @classmethod
    def _partition_config(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:  # its rules checked now (ds-parallel's AutoTPConfig), applied by initialize
            import ds_parallel

            try:
                ds_parallel.AutoTPConfig.from_dict(value)
            except ValueError as err:
                raise ValueError(f"tensor_parallel.{err}") from None
        return value

    def refusal(self) -> str | None:
        """What the section asks for that is not built (None: nothing): AutoTP's options beyond slicing the
        attention and MLP linears over ``autotp_size`` ranks."""
        options = (("tp_overlap_comm", self.tp_overlap_comm, (False,)),
                   ("vocab_parallel_lm_head", self.vocab_parallel_lm_head, (None, False)),
                   ("vocab_parallel_ce_backend", self.vocab_parallel_ce_backend, ("torch",)),
                   ("tp.tp_grain_size", self.tensor_parallel.tp_grain_size, (1,)),
                   ("injection_policy_tuple", self.injection_policy_tuple, (None,)),
                   ("preset_model", self.preset_model, (None,)),
                   ("keep_module_on_host", self.keep_module_on_host, (False,)),
                   ("replace_with_kernel_inject", self.replace_with_kernel_inject, (False,)))
        for key, value, off in options:
            if value not in off:
                return f"tensor_parallel.{key} {value!r} (an AutoTP option beyond slicing the linears)"
        return None


class CompileConfig(Section):
    """``compile``: DeepSpeed's DeepCompile (not built: ``deepcompile: true`` is refused; the other keys
    only tune it)."""

    section = "compile"

    deepcompile: bool = Field(False, description="DeepCompile's graph passes for ZeRO.")
    autoep_non_moe: bool = Field(False, description="Compile the parents of AutoEP layers.")
    free_activation: bool = Field(False, description="Free activations early.")
    free_activation_threshold: int = Field(10 * 1024 * 1024, ge=0, description="Size above which activations are freed.")
    offload_activation: bool = Field(False, description="Offload activations.")
    offload_activation_pin_memory: bool = Field(True, description="Pinned activation buffers.")
    offload_opt_states: bool = Field(False, description="Offload the optimizer states.")
    double_buffer: bool = Field(True, description="Double-buffer the all-gathers.")
    symmetric_memory: bool = Field(False, description="Symmetric memory for the all-gathers.")
    debug_log: bool = Field(False, description="DeepCompile's debug log.")
    offload_parameters: bool = Field(False, description="Offload the parameters.")
    sync_before_reduce: bool = Field(False, description="Synchronize before reductions.")
    sync_after_reduce: bool = Field(False, description="Synchronize after reductions.")
    sync_before_allgather: bool = Field(False, description="Synchronize before all-gathers.")
    sync_after_allgather: bool = Field(False, description="Synchronize after all-gathers.")
    keep_int_input_tensors: bool = Field(True, description="Keep integer input tensors.")
    keep_all_input_tensors: bool = Field(False, description="Keep every input tensor.")
    passes: list[str] | None = Field(None, description="The passes to run.")

    def refusal(self) -> str | None:
        return "compile.deepcompile true: DeepCompile" if self.deepcompile else None
