"""`AsyncIOBuilder`: the ``async_io`` op on ds-ops' op builder.

Linux AIO is used when libaio's header and library are found (checked by compiling a two-line
program, cached); otherwise the op is built on a pool of pread/pwrite threads and both
``compatibility()`` (hence ``ds-report``) and the log say so, with the command that fixes it.
``DS_IO_NO_LIBAIO=1`` builds without libaio on purpose.
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import tempfile
from pathlib import Path

from ds_ops.op_builder import OpBuilder, system

logger = logging.getLogger(__name__)

_PACKAGE_DIR = Path(__file__).resolve().parent  # .../ds_io
LIBAIO_FIX = "apt-get install libaio-dev (Debian/Ubuntu) or dnf install libaio-devel (Fedora/RHEL)"


def csrc_root() -> Path:
    """The C++ sources: shipped in the wheel as ds_io/_csrc, or the source tree's csrc/."""
    for candidate in (_PACKAGE_DIR / "_csrc", _PACKAGE_DIR.parents[1] / "csrc"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"the C++ sources of ds-io are missing (looked in {_PACKAGE_DIR / '_csrc'}); "
                            "reinstall ds-io")


@functools.cache
def _libaio_probe(cxx: str) -> str:
    """'' when a program including <libaio.h> links with -laio, else why not."""
    with tempfile.TemporaryDirectory(prefix="ds-io-probe-") as tmp:
        source = Path(tmp) / "probe.cpp"
        source.write_text("#include <libaio.h>\nint main() { io_context_t ctx = 0; return io_setup(1, &ctx) == -1; }\n")
        try:
            result = subprocess.run([*cxx.split(), str(source), "-o", str(Path(tmp) / "probe"), "-laio"],
                                    capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"cannot run the compiler to look for libaio ({e})"
    if result.returncode == 0:
        return ""
    if "libaio.h" in result.stderr:
        return "libaio headers (libaio.h) not found"
    return "libaio library (-laio) not found"


def libaio_status() -> str:
    """'' when the op will be built with libaio, else the reason it will not."""
    if os.environ.get("DS_IO_NO_LIBAIO") == "1":
        return "DS_IO_NO_LIBAIO=1"
    cxx = system.compiler()
    if cxx is None:
        return "no C++ compiler"
    return _libaio_probe(cxx)


class AsyncIOBuilder(OpBuilder):
    NAME = "async_io"
    DESCRIPTION = "ds-io asynchronous tensor file I/O (libaio or pread/pwrite worker pool, O_DIRECT)"

    def sources(self) -> list[Path]:
        root = csrc_root() / "aio"
        return [root / "aio_handle.cpp", root / "module.cpp"]

    def include_dirs(self) -> list[Path]:
        return [csrc_root() / "aio"]

    def defines(self) -> list[str]:
        return [] if libaio_status() else ["DS_IO_HAVE_LIBAIO"]

    def extra_cxx_flags(self) -> list[str]:
        return ["-pthread"]

    def extra_ldflags(self) -> list[str]:
        return ["-pthread", *([] if libaio_status() else ["-laio"])]

    def compatibility(self) -> tuple[bool, str]:
        ok, reason = super().compatibility()
        if not ok:
            return ok, reason
        missing = libaio_status()
        if missing:
            return True, (f"{missing}: built on a pread/pwrite thread pool instead of Linux AIO; "
                          f"for libaio: {LIBAIO_FIX}")
        return True, ""

    def load(self, verbose: bool = False):
        first = self.NAME not in OpBuilder._loaded
        module = super().load(verbose=verbose)
        if first and not module.have_libaio():
            logger.warning("async_io: %s; using a pread/pwrite thread pool instead of Linux AIO (for libaio: %s)",
                           libaio_status() or "built without libaio", LIBAIO_FIX)
        return module
