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
unseen); nox's summary gives each session's time. torch is pinned in every install (an unpinned
torch pulls gigabytes of CUDA wheels).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import nox
from nox.command import CommandFailed

ROOT = Path(__file__).parent
TORCH = "torch==2.13.0"
TEST_DEPS = ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "numpy", TORCH]
# Packages in dependency order (lower layers first): one pip command installs them together.
PACKAGES = ["ds-config", "ds-ops", "ds-profiler", "ds-launch", "ds-comm", "ds-io", "ds-compress", "ds-zero", "ds-pipe",
            "ds-data", "ds-moe", "ds-parallel", "ds-autotune", "ds-all"]
PACKAGES = [p for p in PACKAGES if (ROOT / "packages" / p / "pyproject.toml").exists()]
# Packages whose issue asks for "installable and testable alone" in the test command.
STANDALONE_IN_CI = ["ds-config", "ds-launch", "ds-profiler", "ds-ops", "ds-comm", "ds-io", "ds-compress", "ds-zero",
                    "ds-pipe", "ds-data", "ds-moe", "ds-parallel", "ds-autotune"]
# Tests of those packages that need another ds package (ds-comm's native 1-bit path needs ds-ops, its hang
# test ds-launch): they skip in the standalone session, where the package is alone, so tests-rest, where
# every package is installed, runs them (paths under the package's tests/).
NEEDS_OTHER_PACKAGES = {"ds-comm": ["test_compressed.py",
                                    "test_exit.py::test_a_diagnosed_hang_ends_the_job_under_ds_launch"]}
# Packages whose tests may run on several pytest workers (pytest-xdist) when DS_TEST_WORKERS says how many:
# the long suites, whose tests leave a core idle much of the time (one-process tests, compiler runs, process
# start-up). Measured on 2 cores with 2 workers: ds-all 731 -> 558 s, ds-ops 285 -> 190 s, ds-zero 361 -> 296 s.
# Off by default (CI too): the load it adds found two races (both fixed) in its first runs, and a run that
# fails on a third costs more than the minutes it saves. ds-comm and ds-launch time hangs and launches: never.
PARALLEL_TESTS = {"ds-all", "ds-ops", "ds-zero"}
WHEELHOUSE = ROOT / ".nox" / "wheelhouse"

nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["tests"]


def _install(session: nox.Session, *args: str) -> None:
    """``pip install`` without byte-compiling what it installs, and with Python free to write the
    bytecode of what the session imports. pip compiles every file of every wheel (torch's thousands:
    32 of the 45 s that installing the test dependencies took here, in each of CI's
    virtualenvs); a session imports a fraction of them, compiled once on first import. The
    environment may say PYTHONDONTWRITEBYTECODE (this one does), which would make every process
    compile what it imports again: empty is unset to Python."""
    session.env["PYTHONDONTWRITEBYTECODE"] = ""
    session.install("--no-compile", *args)


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
    return (f"CPU: {model}, {os.cpu_count()} cores; features: {' '.join(f for f in _CPU_FEATURES if f in flags)}; "
            f"lacks: {' '.join(f for f in ('avx2', 'avx512f', 'avx512_bf16', 'amx_bf16') if f not in flags) or '-'}")


def _disk_line() -> str:
    free = shutil.disk_usage(tempfile.gettempdir()).free / 2**30
    # each session's venv (torch included) and the ops it builds take a few GiB: a full disk shows up
    # as compiler and pickle errors deep in the tests, so it is named here first
    warn = "  <- low: builds and checkpoints in the tests below may fail for want of space" if free < 8 else ""
    return f"disk: {free:.1f} GiB free in {tempfile.gettempdir()}{warn}"


def _workers() -> int:
    """How many pytest workers a package in PARALLEL_TESTS gets: DS_TEST_WORKERS (unset, 0 or 1: one
    process; a test may start 4 ranks of its own, so more workers than cores only adds load)."""
    value = os.environ.get("DS_TEST_WORKERS", "")
    if value and not value.isdigit():
        raise ValueError(f"DS_TEST_WORKERS must be a whole number of pytest workers (0: none), got {value!r}")
    return int(value) if value else 0


def _pytest(session: nox.Session, package: str, *args: str) -> None:
    session.log(_cpu_line())
    session.log(_disk_line())
    workers = _workers() if package in PARALLEL_TESTS else 0
    spread = ["-n", str(workers)] if workers > 1 else []
    # Only exit code 0 passes (nox's default, stated here on purpose): pytest's 5, "no tests ran",
    # fails the session like any other failure, since every package has tests.
    # --durations: the slowest tests in the log, to keep the whole run under its 30 minutes
    # -rs: every skip with its reason (a SIMD level or a system package this machine lacks is visible)
    session.run("pytest", *args, *spread, "-rs", "-p", "no:cacheprovider", "--durations=8", *session.posargs,
                success_codes=[0])


# System packages the tests use, per package: installed with apt-get when missing and we are root,
# else the tests that need them skip and say why (never silently).
APT_NEEDS = {
    "ds-launch": {"sshd": "openssh-server", "ssh": "openssh-client", "pdsh": "pdsh"},  # real multi-node tests
    "ds-io": {"/usr/include/libaio.h": "libaio-dev"},  # Linux AIO; without it the op uses pread/pwrite
    "ds-all": {"sshd": "openssh-server", "ssh": "openssh-client"},  # the elastic launch over ssh to loopback
}


def _ensure_system_packages(session: nox.Session, packages: list[str]) -> None:
    wanted = {}
    for package in packages:
        for probe, apt_name in APT_NEEDS.get(package, {}).items():
            present = Path(probe).exists() if probe.startswith("/") else (
                shutil.which(probe) or Path(f"/usr/sbin/{probe}").exists())
            if not present:
                wanted[apt_name] = probe
    if not wanted:
        return
    names = sorted(wanted)
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        session.warn(f"{', '.join(names)} missing and not installable here (needs root and apt-get): tests that need them skip")
        return
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    try:
        session.run("apt-get", "update", "-q", external=True, env=env, silent=True)
        session.run("apt-get", "install", "-y", "-q", "--no-install-recommends", *names, external=True, env=env,
                    silent=True)
    except CommandFailed:
        session.warn(f"apt-get could not install {', '.join(names)}: tests that need them skip")


def _extras(package: str) -> dict[str, list[str]]:
    import tomllib

    project = tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())["project"]
    return project.get("optional-dependencies", {})


def _test_extra(package: str) -> str:
    """``[test]`` when ``package`` declares that extra (what its tests need beyond TEST_DEPS)."""
    return "[test]" if "test" in _extras(package) else ""


def _our_dependencies(package: str) -> list[str]:
    """The packages of this repository that ``package`` depends on, recursively (lower layers first)."""
    import tomllib

    found: list[str] = []

    def visit(name: str) -> None:
        project = tomllib.loads((ROOT / "packages" / name / "pyproject.toml").read_text())["project"]
        for requirement in project.get("dependencies", []):
            dep = requirement.split(">")[0].split("<")[0].split("=")[0].split("[")[0].strip()
            if dep in PACKAGES and dep not in found:
                visit(dep)
                found.append(dep)

    visit(package)
    return found


def _test_editable(session: nox.Session, packages: list[str], also: dict[str, list[str]] | None = None) -> None:
    """Every package editable in this virtualenv, then the tests of ``packages``, one pytest each, and
    those of ``also`` ({package: paths under its tests/}), one pytest per package."""
    _ensure_system_packages(session, packages)
    # every package's test extra too (transformers for ds-profiler's GPT-2/BERT, ds-all's monitors)
    _install(session, *TEST_DEPS, *(a for p in PACKAGES for a in ("-e", f"packages/{p}{_test_extra(p)}")))
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
def tests(session: nox.Session) -> None:
    """Every package editable in one virtualenv, then each package's tests (all of them)."""
    _test_editable(session, PACKAGES)


@nox.session(name="tests-rest", tags=["ci"])
def tests_rest(session: nox.Session) -> None:
    """As ``tests``, for the packages without a standalone session in CI (those run their tests there),
    and the tests of those that need another package and skip there (NEEDS_OTHER_PACKAGES; the files
    named run whole, so a few of their tests run twice)."""
    _test_editable(session, [p for p in PACKAGES if p not in STANDALONE_IN_CI],
                   {p: paths for p, paths in NEEDS_OTHER_PACKAGES.items() if p in STANDALONE_IN_CI})


def _standalone(package: str):
    def session_func(session: nox.Session) -> None:
        _ensure_system_packages(session, [package])
        # Its ds dependencies come from their directories, as an index would serve them to a user
        # who runs `pip install <package>`; nothing else of the repository is installed.
        _install(session, *TEST_DEPS, *(f"packages/{dep}" for dep in _our_dependencies(package)),
                 f"packages/{package}{_test_extra(package)}")
        # From the package folder, so pytest reads its pyproject; the sources live under src/,
        # which is not on sys.path, so the tests can only import the installed package.
        session.chdir(ROOT / "packages" / package)
        _pytest(session, package, "tests")

    session_func.__doc__ = f"Only {package} (and the ds packages it depends on), not editable, and its tests."
    return session_func


for _package in PACKAGES:
    if _package != "ds-all":
        globals()[f"standalone_{_package}"] = nox.session(
            name=f"standalone-{_package}", tags=["ci"] if _package in STANDALONE_IN_CI else []
        )(_standalone(_package))


@nox.session(tags=["ci"])
def lint(session: nox.Session) -> None:
    """ruff over the whole repository."""
    _install(session, "ruff>=0.6")
    session.run("ruff", "check", ".")


def _build_wheels(session: nox.Session) -> None:
    _install(session, "build>=1.0")
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
def wheels(session: nox.Session) -> None:
    """Build every wheel, install ds-all from the wheelhouse into this fresh virtualenv as a user
    would (README), run `python -m ds_all` and import every part from the installed wheels."""
    _build_wheels(session)
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


@nox.session(name="deepspeed-tests")
def deepspeed_tests(session: nox.Session) -> None:
    """DeepSpeed's own unit tests (../shared/deepspeed-tests/tests), unchanged, against ds: ``import deepspeed``
    is ds_all through ds-launch's alias. Run from a copy (the autotuning tests write into the working
    directory); per-file counts printed beside DeepSpeed's. Not in CI (slow: about 40 minutes on 2 cores)."""
    source = Path(os.environ.get("DS_DEEPSPEED_TESTS", ROOT.parent / "shared" / "deepspeed-tests" / "tests"))
    if not (source / "conftest.py").exists():
        session.error(f"DeepSpeed's tests not found at {source} (set DS_DEEPSPEED_TESTS to their tests/ folder)")
    _install(session, *DEEPSPEED_TEST_DEPS, *(a for p in PACKAGES for a in ("-e", f"packages/{p}")))
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
def demo(session: nox.Session) -> None:
    """The main job: ds-launch starts 2 ranks that train a GPT (~34M parameters) from a DeepSpeed JSON
    through ds_all.initialize (ZeRO with CPU offload, WarmupCosineLR, TensorBoard and CSV logs, a flops
    profile, the comms logger's summary)."""
    # Every package, not editable, as `pip install ds-all[monitors]` would bring them (ds-all needs them
    # all; the JSON turns TensorBoard on).
    _install(session, TORCH, *(f"packages/{p}" for p in PACKAGES if p != "ds-all"), "packages/ds-all[monitors]")
    session.run("ds-launch", "--num_procs", "2", "packages/ds-all/examples/train_gpt.py", *session.posargs)
