"""The allowed ranges of the aio settings, shared by the handle (and ``AioConfig``).

The C++ core holds the same numbers (``csrc/aio/aio_handle.h``) and refuses values outside them
as well; a test checks that the two agree.

* ``block_size`` 512 B .. 256 MiB: a request is cut into pieces of this size (DeepSpeed's tests and
  users pass 1024). With O_DIRECT a piece is rounded up to a 4096-byte multiple (a multiple of every
  device's logical block: 512 or 4096); buffered I/O uses the size as given. Linux splits any single request
  above the device's ``max_sectors_kb`` (a few MiB) and each worker may hold a bounce buffer of
  one piece, so pieces above 256 MiB buy nothing and cost memory.
* ``queue_depth`` 1 .. 65536: pieces in flight per worker. Each worker calls libaio's
  ``io_setup(queue_depth)``, which the kernel refuses beyond the system-wide
  ``/proc/sys/fs/aio-max-nr`` (65536 by default); where it is refused, the worker falls back to
  pread/pwrite and says so.
* ``intra_op_parallelism`` 1 .. 256: worker threads per handle. DeepSpeed's tuner sweeps up to
  8-16; every thread owns an AIO context and possibly a bounce buffer, and hundreds of threads
  gain nothing on any storage. A fixed bound (not a multiple of this machine's cores) keeps a
  config valid on every machine it is carried to.
"""

from __future__ import annotations

BLOCK_SIZE_MIN = 512
BLOCK_SIZE_MAX = 256 * 1024 * 1024
QUEUE_DEPTH_MIN = 1
QUEUE_DEPTH_MAX = 65536
INTRA_OP_PARALLELISM_MIN = 1
INTRA_OP_PARALLELISM_MAX = 256

RANGES: dict[str, tuple[int, int]] = {
    "block_size": (BLOCK_SIZE_MIN, BLOCK_SIZE_MAX),
    "queue_depth": (QUEUE_DEPTH_MIN, QUEUE_DEPTH_MAX),
    "intra_op_parallelism": (INTRA_OP_PARALLELISM_MIN, INTRA_OP_PARALLELISM_MAX),
}


def check_range(name: str, value, *, alias: str | None = None) -> int:
    """``value`` when it is an integer (not a bool) inside ``name``'s range, else ``ValueError``
    naming the setting (``alias`` is another name it goes by, e.g. ``thread_count``) and the range."""
    low, high = RANGES[name]
    label = f"{name} ({alias})" if alias else name
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{label} must be an integer in [{low}, {high}], got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{label} must be an integer in [{low}, {high}], got {value}")
    return value
