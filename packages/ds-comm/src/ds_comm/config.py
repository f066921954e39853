"""`CommsLoggerConfig`: the ``comms_logger`` section of a DeepSpeed config."""

from __future__ import annotations

from ds_config import Section
from pydantic import Field, field_validator

from ._ops import OPS


class CommsLoggerConfig(Section):
    """DeepSpeed's ``comms_logger`` keys with their defaults, plus ``hang_timeout``."""

    section = "comms_logger"

    enabled: bool = Field(False, description="Record every communication op (count, latency, bandwidth).")
    verbose: bool = Field(False, description="Print each op as it happens.")
    prof_all: bool = Field(True, description="Record all ops; when false only those named in prof_ops.")
    debug: bool = Field(False, description="Add the calling function's name to each record, and number the "
                                           "collectives of every group (the basis of hang diagnosis).")
    prof_ops: list[str] = Field(default_factory=list, description="Ops to record when prof_all is false, "
                                                                   "e.g. [\"all_reduce\", \"all_gather_into_tensor\"].")
    hang_timeout: float | None = Field(None, description="Seconds after which a collective that has not completed "
                                                         "is diagnosed (each rank's sequence numbers and last ops) "
                                                         "and raised as CollectiveHang instead of hanging. Needs "
                                                         "debug. Off by default.")

    @field_validator("hang_timeout")
    @classmethod
    def _positive(cls, value):
        if value is not None and not value > 0:
            raise ValueError(f"comms_logger.hang_timeout must be a positive number of seconds or null, got {value}")
        return value

    @field_validator("prof_ops")
    @classmethod
    def _known_ops(cls, value):
        unknown = [op for op in value if op not in OPS]
        if unknown:
            raise ValueError(f"comms_logger.prof_ops: unknown op(s) {unknown}; known: {', '.join(sorted(OPS))}")
        return value
