"""``AioConfig``: the ``aio`` section of a DeepSpeed/ds config, key for key.

DeepSpeed's key for the per-request parallelism is ``thread_count``; the handle's argument is
``intra_op_parallelism``. Both are accepted (not together).
"""

from __future__ import annotations

from typing import Any

from ds_config import Section
from pydantic import Field, model_validator

from ._limits import (
    BLOCK_SIZE_MAX,
    BLOCK_SIZE_MIN,
    INTRA_OP_PARALLELISM_MAX,
    INTRA_OP_PARALLELISM_MIN,
    QUEUE_DEPTH_MAX,
    QUEUE_DEPTH_MIN,
)

SECTION = "aio"
ALIASES = {"thread_count": "intra_op_parallelism"}


class AioConfig(Section):
    """How ds-io's handles talk to storage (``"aio"`` in ds_config.json)."""

    section = SECTION

    block_size: int = Field(1048576, ge=BLOCK_SIZE_MIN, le=BLOCK_SIZE_MAX, description="I/O block size in "
                            "bytes: each request is cut into pieces of this size (4 KiB to 256 MiB).")
    queue_depth: int = Field(8, ge=QUEUE_DEPTH_MIN, le=QUEUE_DEPTH_MAX, description="I/O queue depth: pieces in "
                             "flight per worker thread (1 to 65536, the kernel's aio-max-nr default).")
    intra_op_parallelism: int = Field(1, ge=INTRA_OP_PARALLELISM_MIN, le=INTRA_OP_PARALLELISM_MAX,
                                      alias="thread_count", description="Worker threads that share each "
                                      "read/write (DeepSpeed's thread_count; 1 to 256).")
    single_submit: bool = Field(False, description="Submit pieces to the device one at a time instead "
                                   "of as one batch.")
    overlap_events: bool = Field(True, description="Submit new pieces as soon as earlier ones "
                                    "complete, without waiting for the whole batch.")
    use_gds: bool = Field(False, description="Use NVIDIA GPUDirect Storage (gds_handle); an error "
                             "where it is not available.")
    buffered_reads: bool = Field(False, description="ds extension: read through the page cache with "
                                 "kernel readahead instead of O_DIRECT (ds-nvme-tune says which is faster).")

    @model_validator(mode="before")
    @classmethod
    def _one_name_per_key(cls, data: Any) -> Any:
        for alias, name in ALIASES.items():
            if isinstance(data, dict) and alias in data and name in data:
                raise ValueError(f"{SECTION}: give {alias!r} or {name!r}, not both (they are the same setting)")
        return data

    def handle_kwargs(self) -> dict[str, Any]:
        """The arguments of ``AsyncIOHandle`` this section describes."""
        return {"block_size": self.block_size, "queue_depth": self.queue_depth,
                "single_submit": self.single_submit, "overlap_events": self.overlap_events,
                "intra_op_parallelism": self.intra_op_parallelism, "buffered_reads": self.buffered_reads}

    def to_ds_config(self) -> dict[str, Any]:
        """The section as it appears in ds_config.json."""
        return {SECTION: {**self.handle_kwargs(), "use_gds": self.use_gds}}  # buffered_reads included
