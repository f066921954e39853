"""The one way to build, test and run ds.  ``python3 -m nox --list`` shows every session.

* ``tests``: every package installed editable in one virtualenv, then each package's tests;
  ``tests-rest``: the same for the packages not in ``STANDALONE_IN_CI``, and those tests of theirs
  that need another ds package (``NEEDS_OTHER_PACKAGES``: they skip in the standalone session).
* ``standalone-<pkg>``: a fresh virtualenv with only that package (not editable, with its ``test``
  extra where it has one), its own tests.
* ``build``: a wheel of every package into ``.nox/wheelhouse``; ``lint``: ruff;
  ``bench``: every ``packages/*/benchmarks/bench_*.py``; ``demo``: the main job (a GPT from a JSON).
* ``wheels``: ``build``, then ds-all installed from the wheelhouse into a fresh virtualenv as a
  user would, ``python -m ds_all`` and an import of every part.

The README's test command is ``nox -t ci``: ``tests-rest``, the standalone sessions of
``STANDALONE_IN_CI``, ``lint``, ``demo`` and ``wheels`` (so that neither README command can break
unseen), then ``summary``: one line with each session's time and tests, the skips by reason and the CPU.
Every install goes through ``constraints.txt`` (torch among them: an unpinned torch pulls gigabytes of
CUDA wheels); ``PACKAGES`` comes from ``packages/*/pyproject.toml`` (``scripts/repo_packages.py``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import nox
from nox.command import CommandFailed

ROOT = Path(__file__).parent
sys.path.insert(0, str(ROOT / "scripts"))
import ci_summary  # noqa: E402  (scripts/: the run's closing line)
import repo_packages  # noqa: E402  (scripts/: the packages, from their pyproject.toml files)

TORCH = "torch==2.13.0"
# Every install below goes through it (`_install`), as do .ci/run's and the README's: versions change on purpose only.
CONSTRAINTS = ROOT / "constraints.txt"
TEST_DEPS = ["pytest", "pytest-timeout", "pytest-xdist", "numpy", TORCH]
# Every folder under packages/ (each its own project), lower layers first, so one pip command installs them
# together; a folder without a pyproject, named other than its project or missing from the layering test's
# LAYERS fails here, naming it, before any session runs.
PACKAGES = repo_packages.packages(ROOT)
# Packages whose issue asks for "installable and testable alone" in the test command.
STANDALONE_IN_CI = ["ds-config", "ds-launch", "ds-profiler", "ds-ops", "ds-comm", "ds-io", "ds-compress", "ds-zero",
                    "ds-pipe", "ds-data", "ds-moe", "ds-parallel", "ds-autotune"]
# Tests of those packages that need another ds package (ds-comm's native 1-bit path needs ds-ops, its hang
# test ds-launch): they skip in the standalone session, where the package is alone, so tests-rest, where
# every package is installed, runs them (paths under the package's tests/).
NEEDS_OTHER_PACKAGES = {"ds-comm": ["test_compressed.py",
                                    "test_exit.py::test_a_diagnosed_hang_ends_the_job_under_ds_launch"]}
# Packages whose tests run on a pytest worker per core (pytest-xdist, at most 2; DS_TEST_WORKERS overrides): the
# long suites, whose tests leave a core idle much of the time (one-process tests, compiler runs, process start-up).
# Measured on 2 cores with 2 workers: ds-all 731 -> 558 s, ds-ops 285 -> 190 s, ds-zero 361 -> 296 s. The two races
# and the hang the added load found are fixed (10b1c84: the demo's ranks timed bf16 each on its own; 1a7ba5c:
# stage 3's check groups made in different orders). ds-comm and ds-launch time hangs and launches: one process.
PARALLEL_TESTS = {"ds-all", "ds-ops", "ds-zero"}
WHEELHOUSE = ROOT / ".nox" / "wheelhouse"
# torch (and its dependencies) installed once per constraints file and reused by every session's virtualenv
# through a .pth file: a torch wheel unpacked into each of CI's 16 virtualenvs cost about 10 s each. What a
# session tests is its ds packages, installed into its own virtualenv as before; pip sees torch as present.
SHARED_TORCH = ROOT / ".nox" / "_shared-torch"
# The build backend of every package (hatchling; pybind11 and ninja for ds-ops' optional prebuilt ops), installed
# once per constraints file into a virtualenv of its own, which builds a wheel of every package once per nox run
# (LOCAL_WHEELS): the standalone sessions and the demo install those, instead of pip building each package again in
# an isolated build environment per install (about 75 such builds a run, each fetching hatchling from the index).
BUILD_DEPS = ["hatchling", "editables", "pybind11", "ninja"]
BUILD_ENV = ROOT / ".nox" / "_build-env"
LOCAL_WHEELS = ROOT / ".nox" / "_local-wheels" / str(os.getpid())
# What each session of this nox run measured (its time, its pytest results), read by the `summary` session.
RESULTS = ROOT / ".nox" / "_results" / str(os.getpid())
RUN_START = time.time()  # nox reads this file once, as the run starts

nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["tests"]


def _install(session: nox.Session, *args: str, constraints: Path = CONSTRAINTS, torch: bool = True) -> None:
    """``pip install`` through the constraints file, torch from the shared install, without byte-compiling
    what it installs, and with Python free to write the bytecode of what the session imports. pip compiles
    every file of every wheel (torch's thousands: 32 of the 45 s that installing the test dependencies took
    here, in each of CI's virtualenvs); a session imports a fraction of them, compiled once on first import.
    The environment may say PYTHONDONTWRITEBYTECODE (this one does), which would make every process compile
    what it imports again: empty is unset to Python. ``torch=False``: a session that needs no torch (ruff, build)."""
    session.env["PYTHONDONTWRITEBYTECODE"] = ""
    session.env["PIP_CONSTRAINT"] = str(constraints)  # pip's isolated build environments too (hatchling)
    if torch:
        _use_shared_torch(session, constraints)
    session.install("--no-compile", "-c", str(constraints), *args)


def _build_env(session: nox.Session) -> Path:
    """The python of a virtualenv with BUILD_DEPS (made now if this constraints file has none yet)."""
    key = hashlib.sha256(CONSTRAINTS.read_bytes()).hexdigest()[:16]
    target = BUILD_ENV / key
    python = target / "bin" / "python"
    if not (target / ".complete").exists():
        shutil.rmtree(target, ignore_errors=True)
        session.run("python", "-m", "venv", str(target), silent=True)
        session.run(str(python), "-m", "pip", "install", "--quiet", "--no-compile", "-c", str(CONSTRAINTS),
                    *BUILD_DEPS, external=True, silent=True)
        (target / ".complete").write_text("\n".join(BUILD_DEPS) + "\n")
    return python


def _local_wheels(session: nox.Session) -> dict[str, Path]:
    """{package: the wheel of this tree's package}, built once per nox run (by the first session that asks)
    without build isolation; given to pip by path, so nothing of an index can stand in for them."""
    if not (LOCAL_WHEELS / ".complete").exists():
        shutil.rmtree(LOCAL_WHEELS, ignore_errors=True)
        env = {"DS_BUILD_OPS": "0", "PIP_CONSTRAINT": str(CONSTRAINTS)}  # pure-Python wheels; ops build at first use
        session.run(str(_build_env(session)), "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(LOCAL_WHEELS), *(f"packages/{p}" for p in PACKAGES), external=True, env=env,
                    silent=True)
        (LOCAL_WHEELS / ".complete").write_text("")
    wheels = {}
    for package in PACKAGES:
        found = sorted(LOCAL_WHEELS.glob(f"{package.replace('-', '_')}-*.whl"))
        if len(found) != 1:
            session.error(f"{LOCAL_WHEELS}: expected one wheel of {package}, found {[w.name for w in found]}")
        wheels[package] = found[0]
    return wheels


def _use_shared_torch(session: nox.Session, constraints: Path) -> None:
    """Put the shared torch install (made now if this constraints file has none yet) on the session's path."""
    key = hashlib.sha256(constraints.read_bytes()).hexdigest()[:16]
    target = SHARED_TORCH / key
    if not (target / ".complete").exists():
        shutil.rmtree(target, ignore_errors=True)
        session.run("python", "-m", "pip", "install", "--quiet", "--no-compile", "-c", str(constraints), "--target",
                    str(target), TORCH, silent=True)
        (target / ".complete").write_text(TORCH + "\n")
    purelib = session.run("python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", silent=True)
    Path(purelib.strip(), "_ds_shared_torch.pth").write_text(f"{target}\n")


# The CPU features a kernel's bits may depend on (ds-ops builds with -march=native): logged before every pytest,
# so a result can be read with the CPU it came from (ds-ops' `ds-report` names them too).
_CPU_FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_fp16",
                 "amx_tile", "amx_bf16")


def _cpu_line() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "CPU: unknown (no /proc/cpuinfo)"
    model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "unknown")
    flags = next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), [])
    simd = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "below AVX2 (scalar kernels)"
    extras = [name for flag, name in (("avx512_bf16", "BF16"), ("avx512_fp16", "FP16"), ("amx_bf16", "AMX-BF16"))
              if flag in flags]
    simd += f" with {'/'.join(extras)}" if extras else ""
    return (f"CPU: {model}, {os.cpu_count()} cores, SIMD {simd}; features: "
            f"{' '.join(f for f in _CPU_FEATURES if f in flags)}; "
            f"lacks: {' '.join(f for f in ('avx2', 'avx512f', 'avx512_bf16', 'amx_bf16') if f not in flags) or '-'}")


def _disk_line() -> str:
    free = shutil.disk_usage(tempfile.gettempdir()).free / 2**30
    # each session's venv (torch included) and the ops it builds take a few GiB: a full disk shows up
    # as compiler and pickle errors deep in the tests, so it is named here first
    warn = "  <- low: builds and checkpoints in the tests below may fail for want of space" if free < 8 else ""
    return f"disk: {free:.1f} GiB free in {tempfile.gettempdir()}{warn}"


def _workers() -> int:
    """How many pytest workers a package in PARALLEL_TESTS gets: DS_TEST_WORKERS (0 or 1: one process), else
    one per core up to 2 (a test may start 4 ranks of its own, so more workers than cores only adds load)."""
    value = os.environ.get("DS_TEST_WORKERS", "")
    if value and not value.isdigit():
        raise ValueError(f"DS_TEST_WORKERS must be a whole number of pytest workers (0: none), got {value!r}")
    return int(value) if value else min(2, os.cpu_count() or 1)


def _pytest(session: nox.Session, package: str, *args: str) -> None:
    session.log(_cpu_line())
    session.log(_disk_line())
    workers = _workers() if package in PARALLEL_TESTS else 0
    # worksteal: a worker that runs out takes half of the other's queue, so a few long tests (ds-ops' kernel
    # matrix builds its ops at each SIMD level: ~90 s each) do not leave one worker idle at the end, as
    # `load`'s fixed chunks did (ds-ops: 614 s of tests in 435 s on 2 workers)
    spread = ["-n", str(workers), "--dist", "worksteal"] if workers > 1 else []
    # Only exit code 0 passes (nox's default, stated here on purpose): pytest's 5, "no tests ran",
    # fails the session like any other failure, since every package has tests.
    # --durations: the slowest tests in the log, to keep the whole run under its 30 minutes
    # -rs: every skip with its reason (a SIMD level or a system package this machine lacks is visible)
    # --junitxml: the counts and skip reasons of the run's summary line (the `summary` session)
    RESULTS.mkdir(parents=True, exist_ok=True)
    report = RESULTS / f"{session.name}.{package}.{len(list(RESULTS.glob(f'{session.name}.{package}.*')))}.xml"
    session.run("pytest", *args, *spread, "-rs", "-p", "no:cacheprovider", "--durations=8", f"--junitxml={report}",
                *session.posargs, success_codes=[0])


def _recorded(func):
    """The session, leaving its end and outcome for the `summary` session."""

    @functools.wraps(func)
    def session_func(session: nox.Session) -> None:
        ok = False
        try:
            func(session)
            ok = True
        finally:
            RESULTS.mkdir(parents=True, exist_ok=True)
            (RESULTS / f"{session.name}.json").write_text(json.dumps(
                {"session": session.name, "run_start": RUN_START, "end": time.time(), "ok": ok}))

    return session_func


# System packages the tests use, per package: installed with apt-get when missing and we are root, else the
# tests that need them skip and say why (never silently); under CI (the CI variable set and not "0"/"false") a
# package still missing fails the session with its name, so a green CI run never hides those tests as skips.
APT_NEEDS = {
    "ds-launch": {"sshd": "openssh-server", "ssh": "openssh-client", "pdsh": "pdsh"},  # real multi-node tests
    "ds-io": {"/usr/include/libaio.h": "libaio-dev"},  # Linux AIO; without it the op uses pread/pwrite
    "ds-all": {"sshd": "openssh-server", "ssh": "openssh-client"},  # the elastic launch over ssh to loopback
}


def _missing_system_packages(packages: list[str]) -> dict[str, str]:
    """{apt package: what was looked for} of APT_NEEDS that this machine lacks."""
    wanted = {}
    for package in packages:
        for probe, apt_name in APT_NEEDS.get(package, {}).items():
            present = Path(probe).exists() if probe.startswith("/") else (
                shutil.which(probe) or Path(f"/usr/sbin/{probe}").exists())
            if not present:
                wanted[apt_name] = probe
    return wanted


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _ensure_system_packages(session: nox.Session, packages: list[str]) -> None:
    wanted = _missing_system_packages(packages)
    if not wanted:
        return
    names = sorted(wanted)
    why = None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        why = "not installable here (needs root and apt-get)"
    else:
        env = {"DEBIAN_FRONTEND": "noninteractive"}
        try:
            session.run("apt-get", "update", "-q", external=True, env=env, silent=True)
            session.run("apt-get", "install", "-y", "-q", "--no-install-recommends", *names, external=True, env=env,
                        silent=True)
        except CommandFailed:
            why = "apt-get could not install them"
        still = _missing_system_packages(packages)
        if still and why is None:
            why = f"still missing after apt-get ({', '.join(f'{k}: no {v}' for k, v in sorted(still.items()))})"
    if why is None:
        return
    listed = ", ".join(f"{name} (for {wanted[name]})" for name in names)
    if _in_ci():
        session.error(f"system packages missing: {listed}; {why}. Under CI the tests that need them may not skip: "
                      "install them (apt-get install " + " ".join(names) + ") or run without CI set")
    session.warn(f"system packages missing: {listed}; {why}: the tests that need them skip")


def _extras(package: str) -> dict[str, list[str]]:
    import tomllib

    project = tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())["project"]
    return project.get("optional-dependencies", {})


def _test_extra(package: str) -> str:
    """``[test]`` when ``package`` declares that extra (what its tests need beyond TEST_DEPS)."""
    return "[test]" if "test" in _extras(package) else ""


def _our_dependencies(package: str) -> list[str]:
    """The packages of this repository that ``package`` depends on, recursively (lower layers first)."""
    return repo_packages.our_dependencies(ROOT, package, PACKAGES)


def _test_editable(session: nox.Session, packages: list[str], also: dict[str, list[str]] | None = None) -> None:
    """Every package editable in this virtualenv, then the tests of ``packages``, one pytest each, and
    those of ``also`` ({package: paths under its tests/}), one pytest per package."""
    _ensure_system_packages(session, packages)
    # every package's test extra too (transformers for ds-profiler's GPT-2/BERT, ds-all's monitors)
    # the build backend in this virtualenv, so that the 14 editable installs need no isolated build environment each
    _install(session, *BUILD_DEPS)
    _install(session, "--no-build-isolation", *TEST_DEPS,
             *(a for p in PACKAGES for a in ("-e", f"packages/{p}{_test_extra(p)}")))
    failed = []
    runs = [(package, [f"packages/{package}/tests"]) for package in packages]
    runs += [(package, [f"packages/{package}/tests/{path}" for path in paths]) for package, paths in (also or {}).items()]
    for package, paths in runs:
        try:
            _pytest(session, package, *paths)
        except CommandFailed:
            failed.append(package)
    if failed:
        session.error(f"tests failed in: {', '.join(failed)}")


@nox.session
@_recorded
def tests(session: nox.Session) -> None:
    """Every package editable in one virtualenv, then each package's tests (all of them)."""
    _test_editable(session, PACKAGES)


@nox.session(name="tests-rest", tags=["ci"])
@_recorded
def tests_rest(session: nox.Session) -> None:
    """As ``tests``, for the packages without a standalone session in CI (those run their tests there),
    and the tests of those that need another package and skip there (NEEDS_OTHER_PACKAGES; the files
    named run whole, so a few of their tests run twice)."""
    _test_editable(session, [p for p in PACKAGES if p not in STANDALONE_IN_CI],
                   {p: paths for p, paths in NEEDS_OTHER_PACKAGES.items() if p in STANDALONE_IN_CI})


def _standalone(package: str):
    def session_func(session: nox.Session) -> None:
        _ensure_system_packages(session, [package])
        # It and its ds dependencies as wheels built from their directories, as an index would serve them to a
        # user who runs `pip install <package>`; nothing else of the repository is installed.
        wheels = _local_wheels(session)
        _install(session, *TEST_DEPS, *(str(wheels[dep]) for dep in _our_dependencies(package)),
                 f"{wheels[package]}{_test_extra(package)}")
        # From the package folder, so pytest reads its pyproject; the sources live under src/,
        # which is not on sys.path, so the tests can only import the installed package.
        session.chdir(ROOT / "packages" / package)
        _pytest(session, package, "tests")

    session_func.__doc__ = f"Only {package} (and the ds packages it depends on), not editable, and its tests."
    return _recorded(session_func)


for _package in PACKAGES:
    if _package != "ds-all":
        globals()[f"standalone_{_package}"] = nox.session(
            name=f"standalone-{_package}", tags=["ci"] if _package in STANDALONE_IN_CI else []
        )(_standalone(_package))


@nox.session(tags=["ci"])
@_recorded
def lint(session: nox.Session) -> None:
    """ruff over the whole repository."""
    _install(session, "ruff", torch=False)
    session.run("ruff", "check", ".")


def _build_wheels(session: nox.Session) -> None:
    _install(session, "build", torch=False)
    if WHEELHOUSE.exists():
        shutil.rmtree(WHEELHOUSE)
    for package in PACKAGES:
        session.run("python", "-m", "build", "--wheel", "--outdir", str(WHEELHOUSE), f"packages/{package}",
                    silent=True)
    session.log(f"wheels: {', '.join(sorted(p.name for p in WHEELHOUSE.glob('*.whl')))}")


@nox.session
def build(session: nox.Session) -> None:
    """A wheel of every package into .nox/wheelhouse (then: pip install --find-links .nox/wheelhouse ds-all)."""
    _build_wheels(session)


# Run by `wheels` in the virtualenv that installed ds-all from the wheelhouse: every part imports
# from that virtualenv (not from the checkout) at the version of its wheel.
_CHECK_INSTALLED = """
import importlib, pathlib, sys, ds_all
wheels = {w.name.split("-")[0].replace("_", "-"): w.name.split("-")[1] for w in pathlib.Path(sys.argv[1]).glob("*.whl")}
assert set(ds_all.versions()) == set(wheels), (sorted(ds_all.versions()), sorted(wheels))
for name, version in ds_all.versions().items():
    module = importlib.import_module(name.replace("-", "_"))
    assert version == wheels[name], (name, version, wheels[name])
    assert pathlib.Path(module.__file__).is_relative_to(sys.prefix), (name, module.__file__, sys.prefix)
    print(f"{name:<12} {version:<8} imported from {pathlib.Path(module.__file__).parent}")
"""


@nox.session(tags=["ci"])
@_recorded
def wheels(session: nox.Session) -> None:
    """Build every wheel, install ds-all from the wheelhouse into this fresh virtualenv as a user
    would (README), run `python -m ds_all` and import every part from the installed wheels."""
    # the run's wheels (`_local_wheels`: hatchling, as `python -m build` runs it, built once for every session)
    if WHEELHOUSE.exists():
        shutil.rmtree(WHEELHOUSE)
    WHEELHOUSE.mkdir(parents=True)
    for wheel in _local_wheels(session).values():
        shutil.copy(wheel, WHEELHOUSE)
    session.log(f"wheels: {', '.join(sorted(p.name for p in WHEELHOUSE.glob('*.whl')))}")
    _install(session, TORCH, "--find-links", str(WHEELHOUSE), "ds-all")
    session.run("python", "-m", "ds_all")
    session.run("python", "-c", _CHECK_INSTALLED, str(WHEELHOUSE))


# DeepSpeed's own unit tests, unchanged (../shared/deepspeed-tests, or DS_DEEPSPEED_TESTS): their harness needs
# pytest < 8.4 (DistributedFixture uses a pytest private API) and pytest-forked, and runs with these variables.
DEEPSPEED_TEST_DEPS = ["pytest==8.3.5", "pytest-forked==1.7.5", "py==1.11.0", "tabulate==0.10.0", "hjson==3.1.0", "numpy",
                       TORCH]
DEEPSPEED_TEST_ENV = {"DS_ACCELERATOR": "cpu", "LOCAL_SIZE": "4", "OMP_NUM_THREADS": "1", "DS_UNITTEST_TIMEOUT": "300"}
DEEPSPEED_TEST_MARKERS = ("not nightly and not inference and not seq_inference and not inference_ops and not "
                          "inference_v2 and not inference_v2_ops and not stable_diffusion and not evaluation")


def _constraints_with(session: nox.Session, pins: list[str]) -> Path:
    """constraints.txt with ``pins`` (``name==version``) instead of its own lines for those names (DeepSpeed's
    harness needs pytest 8.3.5 where ours runs 9)."""
    from packaging.utils import canonicalize_name

    def name(line: str) -> str:
        return canonicalize_name(line.split("==")[0].strip())

    replaced = {name(pin) for pin in pins}
    kept = [line for line in CONSTRAINTS.read_text().splitlines()
            if not line.strip() or line.startswith("#") or name(line) not in replaced]
    path = Path(session.create_tmp()) / "constraints-deepspeed-tests.txt"
    path.write_text("\n".join([*kept, *pins]) + "\n")
    return path


@nox.session(name="deepspeed-tests")
def deepspeed_tests(session: nox.Session) -> None:
    """DeepSpeed's own unit tests (../shared/deepspeed-tests/tests), unchanged, against ds: ``import deepspeed``
    is ds_all through ds-launch's alias. Run from a copy (the autotuning tests write into the working
    directory); per-file counts printed beside DeepSpeed's. Not in CI (slow: about 40 minutes on 2 cores)."""
    source = Path(os.environ.get("DS_DEEPSPEED_TESTS", ROOT.parent / "shared" / "deepspeed-tests" / "tests"))
    if not (source / "conftest.py").exists():
        session.error(f"DeepSpeed's tests not found at {source} (set DS_DEEPSPEED_TESTS to their tests/ folder)")
    _install(session, *DEEPSPEED_TEST_DEPS, *(a for p in PACKAGES for a in ("-e", f"packages/{p}")),
             constraints=_constraints_with(session, [d for d in DEEPSPEED_TEST_DEPS if "==" in d]))
    work = Path(session.create_tmp()) / "deepspeed-tests"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(source, work)
    report = work / "results.xml"
    env = {**DEEPSPEED_TEST_ENV, "PYTHONPATH": str(ROOT / "packages" / "ds-launch" / "src" / "ds_launch" /
                                                   "_deepspeed_alias")}
    session.log(_cpu_line())
    with session.chdir(work):
        session.run("python", "-m", "pytest", "-p", "no:cacheprovider", "-m", DEEPSPEED_TEST_MARKERS, "-rfs",
                    f"--junitxml={report}", *session.posargs, env=env, success_codes=[0, 1])
    session.run("python", str(ROOT / "scripts" / "deepspeed_tests_report.py"), str(report))


@nox.session
def bench(session: nox.Session) -> None:
    """Every packages/*/benchmarks/bench_*.py: ours against the baseline, with ratios."""
    _install(session, TORCH, "numpy", *(a for p in PACKAGES for a in ("-e", f"packages/{p}")))
    scripts = sorted(ROOT.glob("packages/*/benchmarks/bench_*.py"))
    if not scripts:
        session.log("no benchmarks yet")
    for script in scripts:
        session.run("python", str(script), *session.posargs)


@nox.session(tags=["ci"])
@_recorded
def demo(session: nox.Session) -> None:
    """The main job: ds-launch starts 2 ranks that train a GPT (~34M parameters) from a DeepSpeed JSON
    through ds_all.initialize (ZeRO with CPU offload, WarmupCosineLR, TensorBoard and CSV logs, a flops
    profile, the comms logger's summary)."""
    # Every package, not editable, as `pip install ds-all[monitors]` would bring them (ds-all needs them
    # all; the JSON turns TensorBoard on).
    wheels = _local_wheels(session)
    _install(session, TORCH, *(str(wheels[p]) for p in PACKAGES if p != "ds-all"), f"{wheels['ds-all']}[monitors]")
    session.run("ds-launch", "--num_procs", "2", "packages/ds-all/examples/train_gpt.py", *session.posargs)


@nox.session(python=False, tags=["ci"])
def summary(session: nox.Session) -> None:
    """The run's closing line (last of the ``ci`` sessions): each session's time and pytest counts, the skips
    by reason, the CPU and its SIMD level (scripts/ci_summary.py)."""
    for line in ci_summary.summarize(RESULTS, _cpu_line()):
        session.log(line)
