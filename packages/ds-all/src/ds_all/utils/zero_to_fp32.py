"""DeepSpeed's ``deepspeed.utils.zero_to_fp32``: the float32 weights of a ZeRO checkpoint (ds-zero's export,
any stage and world size), as a state dict or loaded into a model. The command line is ``ds-zero-to-fp32``."""

from ds_zero import get_fp32_state_dict_from_zero_checkpoint, load_state_dict_from_zero_checkpoint

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint"]
