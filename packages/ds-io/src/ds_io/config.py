"""``AioConfig``: the ``aio`` section of a DeepSpeed/ds config, key for key.

DeepSpeed's key for the per-request parallelism is ``thread_count``; the handle's argument is
``intra_op_parallelism``. Both are accepted (not together).
"""

from __future__ import annotations

import difflib
import math
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

SECTION = "aio"
ALIASES = {"thread_count": "intra_op_parallelism"}


def _positive_integer(value: Any) -> Any:
    """A positive integer, also written as a float with no fraction (``1e6`` in JSON); never a bool."""
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"must be a positive integer, got {value!r}")
    return value


def _boolean(value: Any) -> Any:
    """true/false, also the strings "true"/"false" that DeepSpeed's ds_nvme_tune prints."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, bool):
        raise ValueError(f"must be true or false, got {value!r}")
    return value


PositiveInt = Annotated[int, BeforeValidator(_positive_integer)]
Boolean = Annotated[bool, BeforeValidator(_boolean)]


class AioConfig(BaseModel):
    """How ds-io's handles talk to storage (``"aio"`` in ds_config.json)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, validate_default=True)

    block_size: PositiveInt = Field(1048576, description="I/O block size in bytes: each request is cut "
                                    "into pieces of this size.")
    queue_depth: PositiveInt = Field(8, description="I/O queue depth: pieces in flight per worker thread.")
    intra_op_parallelism: PositiveInt = Field(1, alias="thread_count", description="Worker threads that "
                                              "share each read/write (DeepSpeed's thread_count).")
    single_submit: Boolean = Field(False, description="Submit pieces to the device one at a time instead "
                                   "of as one batch.")
    overlap_events: Boolean = Field(True, description="Submit new pieces as soon as earlier ones "
                                    "complete, without waiting for the whole batch.")
    use_gds: Boolean = Field(False, description="Use NVIDIA GPUDirect Storage (gds_handle); an error "
                             "where it is not available.")

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise ValueError(f"{SECTION} must be a mapping of its keys, got {type(data).__name__}")
        allowed = [*cls.model_fields, *ALIASES]
        for key in data:
            if key not in allowed:
                close = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"{SECTION}: unknown key {key!r}{hint} Allowed keys: {', '.join(allowed)}")
        for alias, name in ALIASES.items():
            if alias in data and name in data:
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
