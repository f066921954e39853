"""What DeepSpeed's ``deepspeed.utils`` and ``deepspeed.runtime.utils`` give scripts that belongs to no part:
the ``"DeepSpeed"`` logger, `log_dist`, `set_random_seed`."""

from __future__ import annotations

import logging
import random
import sys

import torch

import ds_comm


def _deepspeed_logger() -> logging.Logger:
    """DeepSpeed's user-facing logger, as DeepSpeed makes it: named "DeepSpeed", INFO, to stdout,
    not propagated (scripts log through it and expect to see their INFO lines)."""
    log = logging.getLogger("DeepSpeed")
    if not log.handlers:
        handler = logging.StreamHandler(stream=sys.stdout)
        handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] "
                                               "%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


logger = _deepspeed_logger()


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` (prefixed ``[Rank r]``) on the ranks in ``ranks`` (``[-1]``: every rank); before
    the process group exists, on this process. DeepSpeed's ``log_dist``."""
    initialized = ds_comm.is_initialized()
    rank = ds_comm.get_rank() if initialized else -1
    ranks = list(ranks or [])
    if not initialized or (ranks and (ranks[0] == -1 or rank in ranks)):
        logger.log(level, "[Rank %d] %s", rank, message)


def set_random_seed(seed: int) -> None:
    """Seed Python's, NumPy's (when installed) and torch's generators (DeepSpeed's ``set_random_seed``)."""
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(seed)
    torch.manual_seed(seed)
