"""ds-io: asynchronous tensor file I/O at the disk's speed (DeepNVMe-style ``aio_handle``), the
tensor swapper ZeRO-Infinity offloads through, and ``ds-nvme-tune``.

    import torch, ds_io
    h = ds_io.aio_handle(intra_op_parallelism=2)
    t = h.new_cpu_locked_tensor(1 << 20, torch.empty(0, dtype=torch.float32))
    h.async_pwrite(t, "/nvme/t.bin"); h.wait()          # -> 1
"""

__version__ = "0.1.0"

from .config import AioConfig
from .handle import AsyncIOHandle, aio_handle, gds_available, gds_handle
from .op_builder import AsyncIOBuilder
from .swapper import SwapRequest, TensorSwapper

__all__ = ["AioConfig", "AsyncIOBuilder", "AsyncIOHandle", "SwapRequest", "TensorSwapper", "__version__", "aio_handle", "gds_available", "gds_handle"]
