"""What the machine offers a build: compiler, ninja, Python headers, pybind11, SIMD flags.

Nothing here imports torch: the op builder also runs inside ``pip install`` (DS_BUILD_OPS=1).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

SIMD_CHOICES = ("native", "avx512", "avx2", "scalar")
_SIMD_FLAGS = {
    "native": ["-march=native"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "scalar": [],
}


class OpBuildError(RuntimeError):
    """An op could not be built or loaded; the message holds the compiler's output and the fix."""


_COMPILER_NAMES = ("c++", "g++", "clang++")


def compiler() -> str | None:
    """The C++ compiler: $CXX (when set, it is the only choice), else c++, g++ or clang++ on PATH."""
    cxx = os.environ.get("CXX", "").strip()
    if cxx:
        return cxx if shutil.which(cxx.split()[0]) else None
    for name in _COMPILER_NAMES:
        if shutil.which(name):
            return name
    return None


def compiler_problem() -> str | None:
    """Why no C++ compiler can be used, or None. A $CXX that names nothing is the problem itself:
    it is not replaced by another compiler silently."""
    cxx = os.environ.get("CXX", "").strip()
    if cxx:
        if shutil.which(cxx.split()[0]):
            return None
        found = next((path for path in map(shutil.which, _COMPILER_NAMES) if path), None)
        alternative = f"; unset CXX to use {found}" if found else "; install one, e.g. apt-get install g++"
        return f"CXX={cxx!r} is not an executable on PATH (point CXX at a C++ compiler{alternative})"
    if compiler() is None:
        return "no C++ compiler (looked for $CXX, c++, g++, clang++): install one, e.g. apt-get install g++"
    return None


@functools.cache
def compiler_version(cxx: str) -> str:
    try:
        out = subprocess.run([*cxx.split(), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unusable ({e})"
    return out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout else "unknown"


def ninja() -> str | None:
    """ninja on PATH, else the one of the `ninja` Python package."""
    found = shutil.which("ninja")
    if found:
        return found
    try:
        import ninja as ninja_package
    except ImportError:
        return None
    candidate = Path(ninja_package.BIN_DIR) / "ninja"
    return str(candidate) if candidate.exists() else None


def python_include() -> Path:
    return Path(sysconfig.get_paths()["include"])


def pybind11_include() -> Path | None:
    try:
        import pybind11
    except ImportError:
        return None
    return Path(pybind11.get_include())


def pybind11_version() -> str:
    """The pybind11 whose headers a build compiles against ("none" without one): the op cache's key holds
    this, not the headers' path, so virtualenvs with the same pybind11 share their builds (each CI session
    has its own virtualenv: with the path in the key every session built every op again)."""
    try:
        import pybind11
    except ImportError:
        return "none"
    return pybind11.__version__


def native_target() -> str:
    """What ``-march=native`` resolves to: the CPU's model and feature flags under DS_BUILD_SIMD=native, else
    "" (a portable level's flags say it all). In the op cache's key, so a cache shared by machines of other
    CPU kinds (a home directory on NFS) never hands one a build with instructions it lacks."""
    if simd_choice() != "native":
        return ""
    model, flags = cpu()
    return f"{model}: {' '.join(sorted(flags))}"


def simd_choice() -> str:
    choice = os.environ.get("DS_BUILD_SIMD", "native").lower()
    if choice not in SIMD_CHOICES:
        raise OpBuildError(f"DS_BUILD_SIMD must be one of {', '.join(SIMD_CHOICES)}, got {choice!r}")
    return choice


def simd_flags() -> list[str]:
    """-march=native by default (a build for this machine); DS_BUILD_SIMD picks a portable level."""
    return list(_SIMD_FLAGS[simd_choice()])


@functools.cache
def simd_level(cxx: str, flags: tuple[str, ...]) -> str:
    """The vector width a build with these flags uses, read from the compiler's own macros."""
    try:
        out = subprocess.run([*cxx.split(), *flags, "-dM", "-E", "-x", "c++", os.devnull],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if "__AVX512F__" in out:
        return "AVX-512"
    if "__AVX2__" in out and "__FMA__" in out and "__F16C__" in out:
        return "AVX2"
    return "scalar"


# The CPU features each SIMD_CHOICES level compiles for (as /proc/cpuinfo names them): a build of a
# level runs only on a CPU that has them all.
LEVEL_FEATURES = {
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"),
    "avx2": ("avx2", "fma", "f16c"),
    "scalar": (),
}
# What a report names: the vector features the kernels can use, and those of bf16/AMX hardware.
REPORTED_FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
                     "avx512_fp16", "amx_tile", "amx_bf16")


@functools.cache
def cpu() -> tuple[str, frozenset[str]]:
    """(model name, feature flags) of this machine's CPU from /proc/cpuinfo; ("unknown", {}) elsewhere."""
    model, flags = "unknown", frozenset()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == "unknown":
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = frozenset(value.split())
    return model, flags


def cpu_summary() -> str:
    """The CPU's model and which of REPORTED_FEATURES it has, in one line (ds-report, test logs)."""
    model, flags = cpu()
    has = [f for f in REPORTED_FEATURES if f in flags]
    lacks = [f"no {f}" for f in ("avx2", "avx512f") if f not in flags]
    return f"{model} ({'; '.join(part for part in (' '.join(has), ', '.join(lacks)) if part)})"


def cpu_runs(level: str) -> bool:
    """Whether a build for ``level`` (one of SIMD_CHOICES but native) runs on this CPU."""
    return set(LEVEL_FEATURES[level]) <= cpu()[1]


def max_jobs() -> int | None:
    """MAX_JOBS (as torch's extension builder reads it): how many compilations may run at once."""
    value = os.environ.get("MAX_JOBS", "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise OpBuildError(f"MAX_JOBS must be a positive integer (compilations at once), got {value!r}")
    return int(value)


def cache_error(error: OSError) -> OpBuildError:
    """The error for an op cache that cannot be created or written, naming the variable to fix."""
    root = cache_root()
    where = f"DS_OPS_CACHE={os.environ['DS_OPS_CACHE']!r}" if os.environ.get("DS_OPS_CACHE") else f"the op cache {root}"
    detail = f"{error.strerror}: {error.filename}" if error.strerror and error.filename else str(error)
    return OpBuildError(f"{where} cannot be used as the op cache ({detail}); set DS_OPS_CACHE to a writable directory")


def cache_problem() -> str | None:
    """Why the op cache cannot be written, or None (a look without creating anything)."""
    root = cache_root()
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        reason = f"{probe} is not a directory"
    elif not os.access(probe, os.W_OK | os.X_OK):
        reason = f"{probe} is not writable"
    else:
        return None
    return f"{reason}; set DS_OPS_CACHE to a writable directory"


def cache_root() -> Path:
    """DS_OPS_CACHE, else $XDG_CACHE_HOME/ds_ops, else ~/.cache/ds_ops."""
    if os.environ.get("DS_OPS_CACHE"):
        return Path(os.environ["DS_OPS_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ds_ops"
