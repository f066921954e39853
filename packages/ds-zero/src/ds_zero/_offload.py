"""ZeRO-Offload's host side: the buffers on the host and the step that runs there.

With ``offload_optimizer.device: cpu`` (or ``nvme``) the optimizer steps on the host, whatever device
the model is on, as DeepSpeed's ZeRO-Offload does on a GPU: this rank's master copy (float32, or
bf16 with ``bf16.bf16_master_weights_and_grads``; for ``cpu``) and Adam's states live in host memory
(pinned where the model is on an accelerator). Per step:

1. as each bucket's reduction lands in this rank's gradient shard on the device, the shard is copied
   into the host gradient buffer (`_transfer.device_to_host`, on a side stream);
2. `HostOffload.finish_downloads` (in ``step()``) copies what no reduction copied yet and waits;
3. the CPU Adam (``ds_ops.adam_step`` on host tensors) steps the host master and writes the new 16-bit
   (or float32) values into a host parameter buffer (the master itself when their dtypes agree);
4. that buffer is copied into this rank's shard of the flat buffer on the device
   (`_transfer.host_to_device`), which the all-gather then spreads.

On a CPU model the same copies happen between separate tensors, so CI runs this path; `counts` says
how many bytes went each way.
"""

from __future__ import annotations

from typing import Any

import torch

from ._precision import fused_adam_step
from ._transfer import (
    TransferCounts,
    copy_stream,
    device_to_host,
    host_buffer,
    host_to_device,
    record_event,
    wait_copies,
)


class HostOffload:
    """The host buffers of ZeRO-Offload for one `ZeroOptimizer` (see the module docstring).

    ``numel``: elements of the host buffers (the whole layout at stage 0, this rank's partition above);
    ``places``: per bucket, (offset, length) of its stepped part in them (`host_places`); ``dtype``: the
    model's; ``master_dtype``: the master copy's, or None when there is none on the host (NVMe holds it);
    ``mirror``: the flat buffer on the device is the master copy (``bf16.bf16_master_weights_and_grads``)
    and the host's is read from it before each step. `bind` tells it the device tensors each bucket's
    copies go from and to."""

    def __init__(self, device: torch.device, numel: int, places: list[tuple[int, int]], *, dtype: torch.dtype,
                 master_dtype: torch.dtype | None, mirror: bool = False):
        self.device, self.places, self.mirror = device, places, mirror
        self.device_grads: list[torch.Tensor] = []
        self.device_params: list[torch.Tensor] = []
        self.counts = TransferCounts()
        self.master = host_buffer(numel, master_dtype, device) if master_dtype is not None else None
        self.grads = host_buffer(numel, dtype, device)
        # the new parameters in the model's dtype (the master itself when it is in that dtype)
        same = self.master is not None and master_dtype == dtype
        self.params = self.master if same else host_buffer(numel, dtype, device)
        self.writes_params = not same  # the step writes ``params`` besides the master (half_copy)
        self._stream = copy_stream(device)
        self._downloads: dict[int, Any] = {}  # bucket -> the event of its gradient copy (None on the CPU)
        self._uploaded: Any = None  # the event after the last parameter copies (they read ``params``)

    def bind(self, device_grads: list[torch.Tensor], device_params: list[torch.Tensor]) -> None:
        """Per bucket: the device tensor its reduction lands in (this rank's gradient shard), and the one its
        stepped parameters live in (this rank's shard of the flat buffer)."""
        self.device_grads, self.device_params = device_grads, device_params

    def views(self, ranges: list[tuple[int, int]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Views of the host gradients and of the host parameters at each of ``ranges`` (the stepped tensors')."""
        return [self.grads[at:at + n] for at, n in ranges], [self.params[at:at + n] for at, n in ranges]

    def download(self, bucket: int) -> None:
        """Bucket ``bucket``'s reduced gradient shard has landed (on the current stream): copy it to the host."""
        at, n = self.places[bucket]
        self._downloads[bucket] = device_to_host(self.device_grads[bucket], self.grads[at:at + n],
                                                 stream=self._stream, counts=self.counts)

    def finish_downloads(self) -> None:
        """Copy each bucket whose gradients no reduction copied (a bucket reduced in place, completed only
        now) and wait until every copy is on the host; the next step copies afresh."""
        for bucket in range(len(self.places)):
            if bucket not in self._downloads:
                self.download(bucket)
        wait_copies(list(self._downloads.values()))
        self._downloads.clear()

    def forget_downloads(self) -> None:
        """Drop the copies of a step that is not taken (close); waits for those in flight."""
        wait_copies(list(self._downloads.values()))
        self._downloads.clear()

    def adam_step(self, optimizer: torch.optim.Optimizer, recipe: Any, masters: list[torch.Tensor],
                  grads: list[torch.Tensor], copies: list[torch.Tensor] | None, grad_scale: float) -> None:
        """The CPU Adam over the host tensors, then the new parameters up to the device."""
        self.wait_uploaded()
        if self.mirror:
            self.download_params()
        fused_adam_step(optimizer, recipe, masters, grads, copies if self.writes_params else None, grad_scale)
        self.upload()

    def wait_uploaded(self) -> None:
        """Wait for the last step's parameter copies to the device (they read ``params``)."""
        wait_copies([self._uploaded])

    def download_params(self) -> None:
        """This rank's parameter shards from the device into ``params`` (where the flat buffer is the master
        copy: a float32 model on NVMe, bf16 master weights; the step updates ``params`` in place)."""
        events = []
        for (at, n), source in zip(self.places, self.device_params, strict=True):
            events.append(device_to_host(source, self.params[at:at + n], stream=self._stream, counts=self.counts))
        wait_copies(events)

    def upload(self) -> None:
        """``params`` into this rank's shards of the flat buffer on the device (non-blocking)."""
        for (at, n), target in zip(self.places, self.device_params, strict=True):
            host_to_device(self.params[at:at + n], target, counts=self.counts)
        self._uploaded = record_event(self.device)


def host_places(layout: Any, sharded: bool, shard_starts: list[int]) -> list[tuple[int, int]]:
    """Per bucket, where its stepped part lies in the host buffers (and the master copy): the whole
    bucket in the whole layout without ``sharded`` optimizer states (stage 0), this rank's shard in its
    partition with them."""
    if not sharded:
        return [(b.offset, b.padded) for b in layout.buckets]
    return [(at, b.shard) for b, at in zip(layout.buckets, shard_starts, strict=True)]


def nvme_step(optimizer: torch.optim.Optimizer, tensors: list[torch.Tensor], host: HostOffload, nvme: Any,
              recipe: Any, grad_scale: float) -> None:
    """ZeRO-Infinity's step: Adam over the partition with its states on NVMe, fed from the host buffers
    (the gradients copied down; the parameters written into ``params`` and copied up, or on NVMe too);
    the step count lives in the optimizer's state as torch keeps it (schedulers and state_dict see it)."""
    group = optimizer.param_groups[0]
    state = optimizer.state[tensors[0]]
    step = int(float(state.get("step", 0))) + 1
    for tensor in tensors:
        optimizer.state[tensor]["step"] = torch.tensor(float(step))
    on_disk = nvme.param_dtype is not None  # the parameters are read and written on NVMe
    if not on_disk and not nvme.master:
        host.download_params()  # float32: the partition is the master copy
    host.wait_uploaded()
    nvme.step(None if on_disk else host.params, host.grads, step, recipe.hyperparameters(group), grad_scale)
    if not on_disk:
        host.upload()
