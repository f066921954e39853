"""`OpBuilder`: compile an op's C++ sources with ninja on first use, cache the module, load it.

The cache directory of an op is keyed by a hash of its sources and headers, the flags, the
compiler's version and the Python version, so any change builds a fresh module and old entries
are never reused by mistake. A file lock makes concurrent loads safe: when several ranks load
the same op at once, one builds and the others wait, then load what it built. A build is only
trusted once its stamp (written last, atomically, with the module's SHA-256) matches the file:
a half-written or corrupt entry is rebuilt. Modules built ahead at ``pip install`` time
(``DS_BUILD_OPS=1``) live in ``ds_ops/_prebuilt`` and are used before anything is compiled.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

from . import system
from .system import OpBuildError

logger = logging.getLogger(__name__)

BUILDER_VERSION = "1"
EXT_SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]
_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # .../ds_ops
PREBUILT_DIR = _PACKAGE_DIR / "_prebuilt"


def csrc_root() -> Path:
    """The C++ sources: shipped in the wheel as ds_ops/_csrc, or the source tree's csrc/."""
    for candidate in (_PACKAGE_DIR / "_csrc", _PACKAGE_DIR.parents[1] / "csrc"):
        if candidate.is_dir():
            return candidate
    raise OpBuildError(f"the C++ sources of ds-ops are missing (looked in {_PACKAGE_DIR / '_csrc'}); "
                       "reinstall ds-ops")


class OpBuilder:
    """One native op. Subclasses name the op and list its sources; see `ds_ops.op_builder.ops`."""

    NAME = ""
    DESCRIPTION = ""
    _loaded: dict[str, ModuleType] = {}
    ninja_jobs: int | None = None  # ninja -j for this builder's builds (None: ninja's default)

    # ---- what a subclass describes ---------------------------------------------------------
    def sources(self) -> list[Path]:
        raise NotImplementedError(f"{type(self).__name__} must list its C++ sources")

    def include_dirs(self) -> list[Path]:
        return [csrc_root() / "common"]

    def defines(self) -> list[str]:
        return []

    def extra_cxx_flags(self) -> list[str]:
        return []

    def extra_ldflags(self) -> list[str]:
        return []

    def compatibility(self) -> tuple[bool, str]:
        """(True, "") when this machine can build the op, else (False, what is missing)."""
        if not sys.platform.startswith("linux"):
            return False, f"ds-ops builds on Linux only, this is {sys.platform}"
        problem = system.compiler_problem()
        if problem:
            return False, problem
        if system.ninja() is None:
            return False, "ninja not found: pip install ninja"
        if system.pybind11_include() is None:
            return False, "pybind11 not found: pip install pybind11"
        if not (system.python_include() / "Python.h").exists():
            return False, f"Python headers missing in {system.python_include()}: install python3-dev"
        return True, ""

    # ---- derived ----------------------------------------------------------------------------
    @property
    def module_name(self) -> str:
        return f"ds_ops_{self.NAME}"

    def cxx_flags(self) -> list[str]:
        defines = [f"-DDS_OP_MODULE={self.module_name}", *(f"-D{d}" for d in self.defines())]
        # -ffp-contract=off: a multiply and an add stay two roundings unless the source asks for a fused
        # one (B::fmadd), on every compiler (GCC's ISO mode already does so; clang's default contracts),
        # so a kernel's bits follow from its source and its SIMD level alone
        return ["-O3", "-std=c++17", "-ffp-contract=off", "-fPIC", "-fvisibility=hidden", "-fopenmp",
                *system.simd_flags(), *defines, *self.extra_cxx_flags()]

    def ldflags(self) -> list[str]:
        return ["-shared", "-fopenmp", *self.extra_ldflags()]

    def simd_level(self) -> str:
        cxx = system.compiler()
        return system.simd_level(cxx, tuple(self.cxx_flags())) if cxx else "unknown"

    def fingerprint(self) -> str:
        digest = hashlib.sha256()
        cxx = system.compiler() or "none"
        for part in (BUILDER_VERSION, self.NAME, sys.version, EXT_SUFFIX, cxx, system.compiler_version(cxx),
                     " ".join(self.cxx_flags()), " ".join(self.ldflags()), system.pybind11_version(),
                     system.native_target()):
            digest.update(part.encode() + b"\0")
        headers = sorted({h for d in self.include_dirs() for h in d.glob("*.h")})
        for path in [*self.sources(), *headers]:
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        return digest.hexdigest()

    def build_dir(self) -> Path:
        return system.cache_root() / f"{self.NAME}-{self.fingerprint()[:16]}"

    def library_path(self, directory: Path) -> Path:
        return directory / f"{self.module_name}{EXT_SUFFIX}"

    def prebuilt_path(self) -> Path:
        return PREBUILT_DIR / f"{self.module_name}{EXT_SUFFIX}"

    # ---- state ------------------------------------------------------------------------------
    def is_built(self) -> bool:
        """True when a usable module is cached (or was built ahead at install time)."""
        return self.prebuilt_path().exists() or _stamp_matches(self.build_dir(), self.library_path(self.build_dir()))

    # ---- building and loading -----------------------------------------------------------------
    def load(self, verbose: bool = False) -> ModuleType:
        """The op's module: already loaded, prebuilt, cached, or compiled now (once, under a lock)."""
        if self.NAME in OpBuilder._loaded:
            return OpBuilder._loaded[self.NAME]
        if self.prebuilt_path().exists():
            module = _import(self.module_name, self.prebuilt_path())
        else:
            module = self._load_cached_or_build(verbose)
        OpBuilder._loaded[self.NAME] = module
        return module

    def _load_cached_or_build(self, verbose: bool) -> ModuleType:
        ok, reason = self.compatibility()
        if not ok:
            raise OpBuildError(f"cannot build op {self.NAME}: {reason}")
        directory = self.build_dir()
        library = self.library_path(directory)
        lock = _FileLock(directory.parent / f"{directory.name}.lock")
        try:
            directory.parent.mkdir(parents=True, exist_ok=True)
            lock.__enter__()
        except OSError as e:
            raise system.cache_error(e) from e
        try:
            if _stamp_matches(directory, library):
                try:
                    return _import(self.module_name, library)
                except ImportError as e:
                    logger.warning("cached op %s at %s does not load (%s); rebuilding", self.NAME, directory, e)
            elif directory.exists():
                logger.info("cache entry %s of op %s is incomplete or corrupt; rebuilding", directory, self.NAME)
            self.build(directory, verbose=verbose)
            return _import(self.module_name, library)
        finally:
            lock.__exit__(None, None, None)

    def build(self, directory: Path, verbose: bool = False) -> Path:
        """Compile into ``directory`` (emptied first) and stamp the result; returns the module path."""
        if directory.exists():
            shutil.rmtree(directory)
        directory.mkdir(parents=True)
        cxx = system.compiler()
        includes = [*self.include_dirs(), system.python_include(), system.pybind11_include()]
        cflags = " ".join([*self.cxx_flags(), *(f"-I{_ninja_escape(str(d))}" for d in includes)])
        objects, lines = [], []
        for source in self.sources():
            obj = f"{source.stem}.o"
            objects.append(obj)
            lines.append(f"build {obj}: compile {_ninja_escape(str(source))}")
        library = self.library_path(directory)
        (directory / "build.ninja").write_text("\n".join([
            "ninja_required_version = 1.3",
            f"cxx = {cxx}",
            f"cflags = {cflags}",
            f"ldflags = {' '.join(self.ldflags())}",
            "rule compile",
            "  command = $cxx -MMD -MF $out.d $cflags -c $in -o $out",
            "  depfile = $out.d",
            "  deps = gcc",
            "rule link",
            "  command = $cxx $in $ldflags -o $out",
            *lines,
            f"build {library.name}: link {' '.join(objects)}",
            f"default {library.name}",
            "",
        ]))
        start = time.perf_counter()
        logger.info("building op %s in %s", self.NAME, directory)
        jobs = self.ninja_jobs or system.max_jobs()
        jobs = ["-j", str(jobs)] if jobs else []
        result = subprocess.run([system.ninja(), "-C", str(directory), *jobs, *(["-v"] if verbose else [])],
                                capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if result.returncode != 0:
            raise OpBuildError(_failure_message(self.NAME, directory, result.stdout + result.stderr))
        stamp = {"op": self.NAME, "sha256": _sha256(library), "seconds": round(seconds, 3),
                 "simd": self.simd_level(), "compiler": system.compiler_version(cxx)}
        _write_atomic(directory / "stamp.json", json.dumps(stamp, indent=1))
        logger.info("built op %s in %.1f s (%s)", self.NAME, seconds, stamp["simd"])
        return library


# ---- helpers ------------------------------------------------------------------------------------
class _FileLock:
    """An exclusive flock: one process builds an op, the others wait for it."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _stamp_matches(directory: Path, library: Path) -> bool:
    try:
        stamp = json.loads((directory / "stamp.json").read_text())
        return library.exists() and stamp.get("sha256") == _sha256(library)
    except (OSError, ValueError):
        return False


def _write_atomic(path: Path, text: str) -> None:
    # ds_config.write_atomic's guarantees (fsync, rename, directory fsync), written out here because
    # the wheel's build hook loads this module by path in an environment that has only hatchling.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ninja_escape(text: str) -> str:
    return text.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def _failure_message(name: str, directory: Path, output: str) -> str:
    tail = "\n".join(output.strip().splitlines()[-40:])
    if "Python.h" in output:
        fix = "install the Python development headers (e.g. apt-get install python3-dev)"
    elif "omp.h" in output or "-lgomp" in output or "fopenmp" in output:
        fix = "use a compiler with OpenMP support (g++ ships it; clang needs libomp-dev)"
    elif "pybind11" in output:
        fix = "pip install pybind11"
    else:
        fix = "check that a C++17 compiler is installed (e.g. apt-get install g++) and see the output above"
    return f"building op {name} failed (build directory {directory}):\n{tail}\nfix: {fix}"
