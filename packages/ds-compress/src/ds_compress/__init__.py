"""ds-compress: compression training (quantization, pruning, layer reduction), DeepSpeed-compatible.

    model = init_compression(model, ds_config)          # or the "compression_training" dict
    scheduler = CompressionScheduler(model, ds_config)
    ...train, calling scheduler.step() after each optimizer.step()...
    model = redundancy_clean(model, ds_config)          # permanent (pack=True: packed codes), same function
"""

from .clean import redundancy_clean
from .compress import init_compression
from .config import CompressionConfig
from .layer_reduction import distillation_loss, reduce_layers
from .layers import Conv2dCompress, EmbeddingCompress, LinearCompress
from .quantization import fake_quantize, quantize
from .scheduler import CompressionScheduler

__version__ = "0.1.0"

__all__ = [
    "CompressionConfig",
    "CompressionScheduler",
    "Conv2dCompress",
    "EmbeddingCompress",
    "LinearCompress",
    "distillation_loss",
    "fake_quantize",
    "init_compression",
    "quantize",
    "reduce_layers",
    "redundancy_clean",
]
