"""DeepSpeed's ZeRO exception type (``deepspeed.runtime.zero.utils.ZeRORuntimeException``)."""

from __future__ import annotations


class ZeRORuntimeException(RuntimeError):
    """A ZeRO state or combination that cannot run: DeepSpeed's name for it, a ``RuntimeError`` in ds
    (DeepSpeed's derives from ``Exception``, so ``except ZeRORuntimeException`` code works the same)."""
