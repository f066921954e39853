"""``AioConfig``: the ``aio`` section of a DeepSpeed/ds config, key for key.

DeepSpeed's key for the per-request parallelism is ``thread_count``; the handle's argument is
``intra_op_parallelism``. Both are accepted (not together).
"""

from __future__ import annotations

from typing import Any

from ds_config import Section
from pydantic import Field, model_validator

SECTION = "aio"
ALIASES = {"thread_count": "intra_op_parallelism"}


class AioConfig(Section):
    """How ds-io's handles talk to storage (``"aio"`` in ds_config.json)."""

    section = SECTION

    block_size: int = Field(1048576, gt=0, description="I/O block size in bytes: each request is cut "
                                    "into pieces of this size.")
    queue_depth: int = Field(8, gt=0, description="I/O queue depth: pieces in flight per worker thread.")
    intra_op_parallelism: int = Field(1, gt=0, alias="thread_count", description="Worker threads that "
                                              "share each read/write (DeepSpeed's thread_count).")
    single_submit: bool = Field(False, description="Submit pieces to the device one at a time instead "
                                   "of as one batch.")
    overlap_events: bool = Field(True, description="Submit new pieces as soon as earlier ones "
                                    "complete, without waiting for the whole batch.")
    use_gds: bool = Field(False, description="Use NVIDIA GPUDirect Storage (gds_handle); an error "
                             "where it is not available.")

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
                "intra_op_parallelism": self.intra_op_parallelism}

    def to_ds_config(self) -> dict[str, Any]:
        """The section as it appears in ds_config.json."""
        return {SECTION: {**self.handle_kwargs(), "use_gds": self.use_gds}}
