"""``ds-report``: what this machine offers ds's native ops, like DeepSpeed's ``ds_report``.

Versions (Python, torch, every installed ds package), compiler, ninja, nvcc, the GPU, SIMD level,
the op cache, which kernel each optimizer runs on CUDA tensors, and a table of every op (ds-ops' and those other packages register under the ``ds_ops.builders``
entry point, e.g. ds-io's) with whether it can be built here, whether it is built, and why not.
``--build`` builds every compatible op that is not built yet, several at once (up to the number
of cores, or ``MAX_JOBS``), and exits 1 when any op is not built. A bad environment variable
(``DS_BUILD_SIMD``, ``MAX_JOBS``) is reported in one line with exit code 2.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata

from .op_builder import BUILDERS, OpBuilder, OpBuildError, cache_root, system

# The ds family, bottom layer first. Versions come from the installed distributions' metadata:
# nothing here imports a package (ds-ops must not import the layers above it).
DS_PACKAGES = ("ds-config", "ds-ops", "ds-profiler", "ds-launch", "ds-comm", "ds-io", "ds-compress", "ds-zero",
               "ds-pipe", "ds-data", "ds-moe", "ds-parallel", "ds-autotune", "ds-all")


def all_builders() -> dict[str, type[OpBuilder]]:
    """ds-ops' builders and those of installed packages (entry-point group ``ds_ops.builders``)."""
    found = dict(BUILDERS)
    for entry in metadata.entry_points(group="ds_ops.builders"):
        if entry.name in found:
            continue
        try:
            found[entry.name] = entry.load()
        except Exception as e:  # a broken plugin is reported, not fatal
            print(f"warning: cannot load op builder {entry.name} ({entry.value}): {e}", file=sys.stderr)
    return found


def ds_versions() -> tuple[list[tuple[str, str]], list[str]]:
    """(installed ds packages with their versions, the ds packages that are not installed)."""
    installed, missing = [], []
    for name in DS_PACKAGES:
        try:
            installed.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            missing.append(name)
    return installed, missing


# What each optimizer runs on CUDA tensors. ds-ops builds no CUDA kernel: torch's fused multi-tensor
# Adam is what torch.optim.AdamW(fused=True) runs, and the reference the GPU check measures against.
CUDA_KERNELS = (
    ("FusedAdam", "torch's fused multi-tensor Adam (torch._fused_adamw_ / _fused_adam_), float32 states"),
    ("adam_step", "torch's fused multi-tensor Adam; 16-bit gradients widened in float32 scratch"),
    ("FusedLamb", "torch ops on the device (trust ratio on the device, one read per step)"),
    ("CPUAdam", "host tensors only: the cpu_adam kernel (ZeRO-Offload's step on the host)"),
)


def nvcc() -> str:
    """nvcc's path and release (``nvcc --version``), from PATH or CUDA_HOME/CUDA_PATH; or why not."""
    found = shutil.which("nvcc")
    if found is None:
        for variable in ("CUDA_HOME", "CUDA_PATH"):
            home = os.environ.get(variable)
            if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
                found = os.path.join(home, "bin", "nvcc")
                break
    if found is None:
        return "not found (not on PATH, nor in CUDA_HOME/bin; ds-ops builds no CUDA op: not needed)"
    try:
        out = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"{found} — cannot run it: {e}"
    release = [line.strip() for line in out.splitlines() if "release" in line]
    return f"{found} — {release[-1] if release else (out.strip().splitlines() or ['no version printed'])[-1]}"


def gpu() -> str:
    """The CUDA device(s) torch sees, or why there are none."""
    import torch

    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build"
        return f"none (torch.cuda.is_available() is False; torch is {build})"
    count = torch.cuda.device_count()
    major, minor = torch.cuda.get_device_capability(0)
    return f"{torch.cuda.get_device_name(0)} (compute capability {major}.{minor}){f', {count} devices' if count > 1 else ''}"


def build_jobs() -> int:
    """How many compilations may run at once: MAX_JOBS, else the cores this process may use."""
    if system.max_jobs():
        return system.max_jobs()
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def build_all(builders: dict[str, OpBuilder]) -> dict[str, str]:
    """Load (building where needed) every op of ``builders``, up to ``build_jobs()`` compilations at
    once: ops in parallel, each op's ninja with the cores left to it. Returns name -> error."""
    jobs = build_jobs()
    todo = [name for name, builder in builders.items() if not builder.is_built()]
    workers = max(1, min(jobs, len(todo)))
    if todo:
        print(f"ds-report: building {len(todo)} op(s), {workers} at a time: {', '.join(sorted(todo))}",
              file=sys.stderr, flush=True)

    def load(name: str) -> str | None:
        builder = builders[name]
        builder.ninja_jobs = max(1, jobs // workers)
        try:
            builder.load()
        except Exception as e:
            return str(e).splitlines()[0]
        return None

    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = dict(zip(builders, pool.map(load, builders), strict=True))
    return {name: error for name, error in results.items() if error is not None}


def _report(build: bool) -> tuple[str, dict[str, str]]:
    import torch

    cxx = system.compiler()
    compiler_problem = system.compiler_problem()
    installed, missing = ds_versions()
    cache_problem = system.cache_problem()
    rows = [("python", f"{platform.python_version()} ({sys.executable})"),
            ("torch", f"{torch.__version__} (cuda: {torch.version.cuda or 'none'}, "
                      f"available: {torch.cuda.is_available()})"),
            *installed,
            *([("not installed", ", ".join(missing))] if missing else []),
            ("compiler", f"{cxx} — {system.compiler_version(cxx)}" if cxx else f"none: {compiler_problem}"),
            ("ninja", system.ninja() or "not found (pip install ninja)"),
            ("nvcc", nvcc()),
            ("GPU", gpu()),
            ("pybind11", str(system.pybind11_include() or "not found (pip install pybind11)")),
            ("CPU", system.cpu_summary()),
            ("SIMD", f"{system.simd_choice()} → {OpBuilder().simd_level() if cxx else 'unknown'}"),
            ("op cache", f"{cache_root()}" + (f" — cannot be used: {cache_problem}" if cache_problem else ""))]
    width = max(len(name) for name, _ in rows) + 1
    lines = ["ds-report: native ops of ds", "-" * 72]
    lines += [f"{name:<{width}}{value}" for name, value in rows]
    state = "available here" if torch.cuda.is_available() else "no GPU here"
    lines += ["-" * 72, f"on CUDA tensors ({state})", "-" * 72]
    lines += [f"{name:<14}{kernel}" for name, kernel in CUDA_KERNELS]
    lines += ["-" * 72, f"{'op':<14}{'compatible':<12}{'built':<8}note", "-" * 72]
    builders = {name: cls() for name, cls in sorted(all_builders().items())}
    compatibility = {name: builder.compatibility() for name, builder in builders.items()}
    failures = build_all({n: b for n, b in builders.items() if compatibility[n][0]}) if build else {}
    for name, builder in builders.items():
        ok, reason = compatibility[name]
        if name in failures:
            reason = f"build failed: {failures[name]}"
        built = "yes" if ok and builder.is_built() else "no"
        lines.append(f"{name:<14}{'yes' if ok else 'NO':<12}{built:<8}{reason or builder.DESCRIPTION}")
    if build:  # an op this machine cannot build is a failed build too
        failures.update({name: reason for name, (ok, reason) in compatibility.items() if not ok})
    return "\n".join(lines), failures


def report(build: bool = False) -> str:
    """The report as text (``build``: build every compatible op that is not built yet first)."""
    return _report(build)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ds-report", description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="store_true",
                        help="build every compatible op that is not built yet (in parallel); exit 1 if any fails")
    args = parser.parse_args(argv)
    try:  # the environment's knobs, checked before anything else: one line, exit 2
        system.simd_choice()
        system.max_jobs()
    except OpBuildError as e:
        print(f"ds-report: error: {e}", file=sys.stderr)
        return 2
    text, failures = _report(build=args.build)
    print(text)
    if failures:
        print(f"ds-report: {len(failures)} op(s) not built: {', '.join(sorted(failures))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
