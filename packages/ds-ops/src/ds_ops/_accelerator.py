"""The accelerator seam: DeepSpeed's ``get_accelerator()`` object, for the CPU and for CUDA.

One class, `Accelerator`, for both device types: device names and indices, random state, streams
and events, memory statistics, pinned host memory, the communication backend, the dtypes the
device computes in. On the CPU, streams and events are no-ops, "pinned" memory is plain memory and
the memory statistics are this process's resident set (as DeepSpeed's CPU accelerator reports
them), so code written against the seam runs unchanged in CPU CI. On CUDA each method is the
``torch.cuda`` call of the same name.

``get_accelerator()`` picks CUDA when ``torch.cuda.is_available()`` and the CPU otherwise;
``DS_ACCELERATOR=cpu`` or ``=cuda`` (DeepSpeed's variable) decides instead, and
``set_accelerator()`` replaces the choice for the process.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

ACCELERATORS = ("cpu", "cuda")
SUPPORTED_ACCELERATOR_LIST = list(ACCELERATORS)  # DeepSpeed's name for the accelerators this build supports


def _rss() -> int:
    """This process's resident set in bytes (/proc/self/statm; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Accelerator:
    """DeepSpeed's accelerator interface (``deepspeed.accelerator.get_accelerator()``) for one
    device type, ``"cpu"`` or ``"cuda"``."""

    def __init__(self, name: str):
        if name not in ACCELERATORS:
            raise ValueError(f"accelerator must be one of {', '.join(ACCELERATORS)}, got {name!r}")
        if name == "cuda" and not torch.cuda.is_available():
            raise ValueError("accelerator 'cuda' needs a CUDA build of torch and a visible GPU; "
                             "torch.cuda.is_available() is False here")
        self._name = name
        self._cuda = name == "cuda"
        self._peak_rss = _rss()

    def __repr__(self) -> str:
        return f"Accelerator({self._name!r})"

    # ---- what the device is ------------------------------------------------------------------
    def is_synchronized_device(self) -> bool:
        """True when work is done when the call returns (the CPU): no streams to wait for."""
        return not self._cuda

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        return self.is_synchronized_device()

    def device_name(self, device_index: int | None = None) -> str:
        """``"cpu"``, or ``"cuda"`` / ``"cuda:<index>"`` (as DeepSpeed's)."""
        if not self._cuda or device_index is None:
            return self._name
        return f"cuda:{device_index}"

    def device(self, device_index: int | None = None):
        """The ``torch.device``: ``cpu``, or the CUDA device ``device_index`` (default: the current)."""
        if not self._cuda:
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device() if device_index is None else device_index)

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        """The current CUDA device; on the CPU this process's ``LOCAL_RANK`` (0 without one)."""
        return torch.cuda.current_device() if self._cuda else int(os.environ.get("LOCAL_RANK", 0))

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device_count(self) -> int:
        """GPUs visible; on the CPU ``LOCAL_SIZE`` when the launcher set it, else 1."""
        return torch.cuda.device_count() if self._cuda else max(1, int(os.environ.get("LOCAL_SIZE", 1)))

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._cuda else True

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        """The torch.distributed backend for this device's tensors: NCCL for CUDA, gloo for the CPU."""
        return "nccl" if self._cuda else "gloo"

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    # ---- dtypes --------------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        """CUDA: always; the CPU: where oneDNN has float16 kernels (as DeepSpeed's CPU accelerator)."""
        if self._cuda:
            return True
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except (AttributeError, RuntimeError):
            return False

    def is_fp64_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32]
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        return dtypes

    def is_triton_supported(self) -> bool:
        return self._cuda and torch.cuda.get_device_capability()[0] >= 8

    # ---- random state -------------------------------------------------------------------------
    def random(self):
        return torch.random

    def manual_seed(self, seed: int):
        return torch.cuda.manual_seed(seed) if self._cuda else torch.manual_seed(seed)

    def manual_seed_all(self, seed: int):
        return torch.cuda.manual_seed_all(seed) if self._cuda else torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if self._cuda:
            return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)
        else:
            torch.set_rng_state(new_state)

    def default_generator(self, device_index: int):
        return torch.cuda.default_generators[device_index] if self._cuda else torch.default_generator

    # ---- streams, events, graphs (no-ops on the CPU) --------------------------------------------
    @property
    def Stream(self):
        return torch.cuda.Stream if self._cuda else None

    @property
    def Event(self):
        return torch.cuda.Event if self._cuda else None

    def stream(self, stream):
        """A context that makes ``stream`` current (CUDA); nothing on the CPU."""
        return torch.cuda.stream(stream) if self._cuda else contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None):
        return torch.cuda.current_stream(device_index) if self._cuda else None

    def default_stream(self, device_index: int | None = None):
        return torch.cuda.default_stream(device_index) if self._cuda else None

    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain: Any = None) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback):
        return torch.cuda._lazy_call(callback) if self._cuda else callback()

    def is_current_stream_capturing(self) -> bool:
        return self._cuda and torch.cuda.is_current_stream_capturing()

    def create_graph(self):
        return torch.cuda.CUDAGraph() if self._cuda else None

    def capture_to_graph(self, graph, pool=None, stream=None):
        return torch.cuda.graph(graph, pool, stream) if self._cuda else contextlib.nullcontext()

    def replay_graph(self, graph) -> None:
        if self._cuda:
            graph.replay()

    # ---- memory -------------------------------------------------------------------------------
    def _host(self) -> int:
        """The CPU's figure for every memory statistic: the resident set, its peak tracked here."""
        rss = _rss()
        self._peak_rss = max(self._peak_rss, rss)
        return rss

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else self._host()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.max_memory_allocated(device_index)
        self._host()
        return self._peak_rss

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._cuda else self._host()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.max_memory_reserved(device_index)
        return self.max_memory_allocated()

    # DeepSpeed's older names of the reserved figures
    memory_cached = memory_reserved
    max_memory_cached = max_memory_reserved

    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        self.reset_peak_memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)
        else:
            self._peak_rss = _rss()

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        if self._cuda:
            return torch.cuda.memory_stats(device_index)
        return {"allocated_bytes.all.current": self._host(), "allocated_bytes.all.peak": self._peak_rss}

    def total_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.mem_get_info(device_index)[0]
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    # ---- host memory ----------------------------------------------------------------------------
    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """``tensor`` in page-locked host memory (CUDA: copies fast and asynchronously); the tensor
        itself on the CPU, where there is nothing to pin for."""
        return tensor.pin_memory() if self._cuda else tensor

    def pinned_empty(self, size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A new, uninitialised host tensor allocated page-locked (CUDA; no pageable copy first, as
        ``pin_memory(torch.empty(...))`` would make); a plain one on the CPU. Not DeepSpeed's API."""
        return torch.empty(size, dtype=dtype, pin_memory=self._cuda)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self._cuda else False

    # ---- tensor types (DeepSpeed's properties) --------------------------------------------------
    def _tensor_type(self, dtype: torch.dtype):
        return torch.tensor([], dtype=dtype, device=self._name).type()

    @property
    def BFloat16Tensor(self):
        return self._tensor_type(torch.bfloat16)

    @property
    def FloatTensor(self):
        return self._tensor_type(torch.float32)

    @property
    def HalfTensor(self):
        return self._tensor_type(torch.float16)

    @property
    def DoubleTensor(self):
        return self._tensor_type(torch.float64)

    @property
    def LongTensor(self):
        return self._tensor_type(torch.int64)

    @property
    def IntTensor(self):
        return self._tensor_type(torch.int32)

    @property
    def ByteTensor(self):
        return self._tensor_type(torch.uint8)

    # ---- environment ------------------------------------------------------------------------------
    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"]

    def set_visible_devices_envs(self, current_env: dict, local_accelerator_ids: list[int]) -> None:
        for name in self.visible_devices_envs():
            current_env[name] = ",".join(map(str, local_accelerator_ids))

    def export_envs(self) -> list[str]:
        return ["NCCL"] if self._cuda else []


_current: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """The process's accelerator: ``DS_ACCELERATOR`` (``cpu`` or ``cuda``) when set, else CUDA when
    ``torch.cuda.is_available()``, else the CPU; made once, then the same object."""
    global _current
    if _current is None:
        name = os.environ.get("DS_ACCELERATOR", "").strip().lower()
        if name and name not in ACCELERATORS:
            raise ValueError(f"DS_ACCELERATOR must be one of {', '.join(ACCELERATORS)} (ds builds no other), "
                             f"got {os.environ['DS_ACCELERATOR']!r}")
        _current = Accelerator(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    return _current


def is_current_accelerator_supported() -> bool:
    """DeepSpeed's check: is the process's accelerator one that ds supports (`SUPPORTED_ACCELERATOR_LIST`)."""
    return get_accelerator().device_name() in SUPPORTED_ACCELERATOR_LIST


def set_accelerator(accelerator: Accelerator) -> None:
    """Make ``accelerator`` the one `get_accelerator` returns (DeepSpeed's ``set_accelerator``)."""
    global _current
    if not isinstance(accelerator, Accelerator):
        raise ValueError(f"set_accelerator takes a ds_ops.Accelerator, got {type(accelerator).__name__}")
    _current = accelerator
