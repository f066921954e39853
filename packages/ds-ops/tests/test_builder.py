"""The op builder for real: cold builds into empty caches, reuse, corrupt entries, concurrent
ranks, compiler errors, SIMD levels, ahead-of-time builds into a wheel, ds-report."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from ds_ops.op_builder import CPUAdamBuilder, OpBuilder, OpBuildError, system

PACKAGE_ROOT = Path(__file__).resolve().parents[1]

LOAD = textwrap.dedent("""
    import logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
    from ds_ops.op_builder import CPUAdamBuilder
    module = CPUAdamBuilder().load()
    print("LOADED", module.simd_level(), module.__file__)
""")


def _python(code: str, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, **env})
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A cache into which one process built the op cold (the tests below copy it instead of building again:
    each build is 10-30 s of CI), and that process's output."""
    cache = tmp_path_factory.mktemp("built") / "cache"
    return cache, _python(LOAD, {"DS_OPS_CACHE": str(cache)})


def test_cold_build_then_warm_reuse(built):
    cache, first = built
    assert "building op cpu_adam" in first.stdout and "LOADED" in first.stdout
    (entry,) = [d for d in cache.iterdir() if d.is_dir()]
    assert entry.name.startswith("cpu_adam-")
    stamp = json.loads((entry / "stamp.json").read_text())
    assert stamp["op"] == "cpu_adam" and stamp["simd"] in ("AVX-512", "AVX2", "scalar")
    second = _python(LOAD, {"DS_OPS_CACHE": str(cache)})
    assert "building" not in second.stdout and "LOADED" in second.stdout


@pytest.mark.parametrize("damage", ["truncate the module", "remove the stamp"])
def test_a_corrupt_or_unfinished_entry_is_rebuilt(built, cache, damage):
    shutil.copytree(built[0], cache)
    (entry,) = [d for d in cache.iterdir() if d.is_dir()]
    if damage == "truncate the module":
        (library,) = entry.glob("ds_ops_cpu_adam*.so")
        library.write_bytes(library.read_bytes()[:1000])
    else:
        (entry / "stamp.json").unlink()
    again = _python(LOAD, {"DS_OPS_CACHE": str(cache)})
    assert "incomplete or corrupt; rebuilding" in again.stdout
    assert "LOADED" in again.stdout


def test_concurrent_ranks_build_once(cache):
    """Three processes load the op at once into an empty cache: one builds, the others wait."""
    env = {**os.environ, "DS_OPS_CACHE": str(cache)}
    ranks = [subprocess.Popen([sys.executable, "-c", LOAD], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=env) for _ in range(3)]
    outputs = [rank.communicate(timeout=300)[0] for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), outputs
    assert sum(out.count("building op cpu_adam") for out in outputs) == 1, outputs
    assert all("LOADED" in out for out in outputs)


class _BrokenBuilder(OpBuilder):
    NAME = "broken_test_op"

    def __init__(self, source: Path):
        self.source = source

    def sources(self):
        return [self.source]


def test_a_failed_build_shows_the_compiler_message_and_the_fix(tmp_path):
    source = tmp_path / "broken.cpp"
    source.write_text("int main( { this is not C++ }\n")
    with pytest.raises(OpBuildError) as info:
        _BrokenBuilder(source).build(tmp_path / "out")
    message = str(info.value)
    assert "building op broken_test_op failed" in message
    assert "broken.cpp" in message and "error" in message  # the compiler's own words
    assert "fix:" in message


def test_the_fingerprint_follows_the_sources(tmp_path):
    source = tmp_path / "op.cpp"
    source.write_text("int f() { return 1; }\n")
    before = _BrokenBuilder(source).fingerprint()
    source.write_text("int f() { return 2; }\n")
    assert _BrokenBuilder(source).fingerprint() != before


def test_virtualenvs_with_one_pybind11_share_a_build_and_other_cpus_do_not(monkeypatch, tmp_path):
    """The key holds pybind11's version, not its headers' path (one per virtualenv), and under
    DS_BUILD_SIMD=native the CPU -march=native compiled for."""
    source = tmp_path / "op.cpp"
    source.write_text("int f() { return 1; }\n")
    monkeypatch.delenv("DS_BUILD_SIMD", raising=False)
    before = _BrokenBuilder(source).fingerprint()
    monkeypatch.setattr(system, "pybind11_include", lambda: tmp_path / "another-venv" / "include")
    assert _BrokenBuilder(source).fingerprint() == before
    monkeypatch.setattr(system, "pybind11_version", lambda: "0.0.1")
    assert _BrokenBuilder(source).fingerprint() != before
    monkeypatch.undo()
    monkeypatch.delenv("DS_BUILD_SIMD", raising=False)
    model, flags = system.cpu()
    other = flags ^ {"avx512f"}  # the same model name with or without AVX-512 (a VM's CPU flags)
    monkeypatch.setattr(system, "cpu", lambda: (model, other))
    assert _BrokenBuilder(source).fingerprint() != before
    monkeypatch.setenv("DS_BUILD_SIMD", "avx2")  # a portable level's build runs on either
    portable = _BrokenBuilder(source).fingerprint()
    monkeypatch.setattr(system, "cpu", lambda: (model, flags))
    assert _BrokenBuilder(source).fingerprint() == portable


def test_a_cxx_that_names_nothing_is_named_as_the_problem(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setenv("DS_OPS_CACHE", str(tmp_path))
    monkeypatch.setattr(OpBuilder, "_loaded", {})
    builder = CPUAdamBuilder()
    monkeypatch.setattr(type(builder), "prebuilt_path", lambda self: tmp_path / "none.so")
    ok, reason = builder.compatibility()
    assert not ok and "CXX='/nonexistent/c++' is not an executable on PATH" in reason
    assert "unset CXX to use" in reason  # c++ is on this machine's PATH: say so, do not claim there is none
    with pytest.raises(OpBuildError, match=r"cannot build op cpu_adam: CXX='/nonexistent/c\+\+'"):
        builder.load()


def test_without_any_compiler_the_reason_is_given(monkeypatch, tmp_path):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    ok, reason = CPUAdamBuilder().compatibility()
    assert not ok and "no C++ compiler" in reason and "g++" in reason


def test_an_unusable_cache_names_the_variable(monkeypatch, tmp_path):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("DS_OPS_CACHE", str(tmp_path / "a-file" / "cache"))
    monkeypatch.setattr(OpBuilder, "_loaded", {})
    builder = CPUAdamBuilder()
    monkeypatch.setattr(type(builder), "prebuilt_path", lambda self: tmp_path / "none.so")
    with pytest.raises(OpBuildError, match=r"DS_OPS_CACHE='.*a-file/cache' cannot be used as the op cache "
                                           r"\(Not a directory: .*\); set DS_OPS_CACHE to a writable directory"):
        builder.load()


def test_unknown_simd_level_is_refused(monkeypatch):
    monkeypatch.setenv("DS_BUILD_SIMD", "avx1024")
    with pytest.raises(OpBuildError, match="DS_BUILD_SIMD must be one of native, avx512, avx2, scalar, got 'avx1024'"):
        CPUAdamBuilder().cxx_flags()


SIMD_CHECK = textwrap.dedent("""
    import torch, ds_ops
    from ds_ops.op_builder import CPUAdamBuilder
    print("SIMD", CPUAdamBuilder().load().simd_level())
    g = torch.Generator().manual_seed(0)
    a = torch.randn(1000, generator=g).requires_grad_(); b = a.detach().clone().requires_grad_()
    ours, ref = ds_ops.CPUAdam([a], lr=1e-2, weight_decay=0.01), torch.optim.AdamW([b], lr=1e-2, weight_decay=0.01)
    for _ in range(10):
        grad = torch.randn(1000, generator=g)
        a.grad, b.grad = grad.clone(), grad.clone()
        ours.step(); ref.step()
    torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-5)
    n = 1 << 18   # bf16 states: stochastic rounding must stay unbiased on this backend too
    p = torch.zeros(n, requires_grad=True); p.grad = torch.full((n,), 1.0 / 3.0)
    opt = ds_ops.CPUAdam([p], lr=0.0, betas=(0.0, 0.999), state_dtype=torch.bfloat16); opt.step()
    assert abs(opt.state[p]["exp_avg"].float().mean().item() - 1.0 / 3.0) < 5e-5
    # adam_step's scaled variant and its inf check on this backend, against torch's AdamW
    q, m, v = torch.randn(1000, generator=g), torch.zeros(1000), torch.zeros(1000)
    r = q.clone().requires_grad_()
    grad = torch.randn(1000, generator=g)
    assert ds_ops.adam_step(q, grad * 1024, m, v, 1, 1e-2, weight_decay=0.01, grad_scale=1024.0) is False
    r.grad = grad.clone()
    torch.optim.AdamW([r], lr=1e-2, weight_decay=0.01).step()
    torch.testing.assert_close(q, r.detach(), rtol=1e-5, atol=1e-5)
    before, bad = q.clone(), grad * 1024
    bad[997] = float("inf")  # in the scalar tail of every backend
    assert ds_ops.adam_step(q, bad, m, v, 2, 1e-2, grad_scale=1024.0) is True and torch.equal(q, before)
    assert ds_ops.has_inf_or_nan(bad.bfloat16()) and not ds_ops.has_inf_or_nan(grad.bfloat16())
    print("OK")
""")


@pytest.mark.parametrize("level, expected", [("avx2", "AVX2"), ("scalar", "scalar")])
def test_portable_simd_levels_build_and_compute_the_same(level, expected):
    """The AVX-512 path runs everywhere else in these tests; the AVX2 and scalar ones run here. In the
    session's op cache: the kernel matrix builds the same portable ops there (each build is ~10 s of a
    2-core CI run; the cold builds of the cache's own mechanics are tested above, in caches of their own)."""
    result = _python(SIMD_CHECK, {"DS_BUILD_SIMD": level})
    assert f"SIMD {expected}" in result.stdout and "OK" in result.stdout


# The files of the kernels' tests, run again against each other vector build this CPU runs.
KERNEL_TESTS = ["test_positions.py", "test_adam_step.py", "test_optimizers.py", "test_onebit.py"]


@pytest.mark.parametrize("level", ["avx2", "avx512"])
def test_the_kernel_tests_pass_on_every_vector_path_this_cpu_runs(level):
    """Every other test runs the native build (-march=native: AVX-512 on an AVX-512 CPU). A kernel's
    AVX-512 and AVX2 paths differ in their arithmetic (AVX-512 uses rsqrt14/rcp14 estimates), and CI
    runs on one CPU kind at a time: an AVX-512 CPU also runs the AVX2 build's kernel tests, so a
    defect of either path shows wherever CI has AVX-512 (one went unseen where CI had AVX2 only)."""
    model = system.cpu()[0]
    if not system.cpu_runs(level):
        missing = sorted(set(system.LEVEL_FEATURES[level]) - system.cpu()[1])
        pytest.skip(f"{model} lacks {' '.join(missing)}: it cannot run the {level} build")
    expected, native = {"avx2": "AVX2", "avx512": "AVX-512"}[level], OpBuilder().simd_level()
    if native == expected:
        pytest.skip(f"the native build on {model} is {native}: the other tests ran this path")
    env = {"DS_BUILD_SIMD": level}  # the session's op cache, where the kernel matrix builds this level too
    loaded = _python("from ds_ops.op_builder import CPUAdamBuilder; print(CPUAdamBuilder().load().simd_level())", env)
    assert loaded.stdout.split() == [expected], loaded.stdout  # not a prebuilt op
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                             *(str(PACKAGE_ROOT / "tests" / name) for name in KERNEL_TESTS)],
                            capture_output=True, text=True, timeout=900, cwd=PACKAGE_ROOT, env={**os.environ, **env})
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout.splitlines()[-1], result.stdout[-2000:]


def test_ds_build_ops_puts_a_prebuilt_op_in_the_wheel_that_needs_no_compiler(tmp_path):
    wheels = tmp_path / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels),
                            str(PACKAGE_ROOT)], capture_output=True, text=True, timeout=600,
                           env={**os.environ, "DS_BUILD_CPU_ADAM": "1"})
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = wheels.glob("ds_ops-*.whl")
    assert not wheel.name.endswith("-none-any.whl"), "a wheel with a compiled op is platform-specific"
    unpacked = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        archive.extractall(unpacked)
    assert any(n.startswith("ds_ops/_prebuilt/ds_ops_cpu_adam") for n in names)
    assert "ds_ops/_csrc/optim/adam.cpp" in names  # sources ship for the just-in-time builds
    code = textwrap.dedent(f"""
        import torch, ds_ops
        assert ds_ops.__file__.startswith({str(unpacked)!r}), ds_ops.__file__
        from ds_ops.op_builder import CPUAdamBuilder
        assert CPUAdamBuilder().is_built() and not CPUAdamBuilder().compatibility()[0]
        p = torch.zeros(10, requires_grad=True); p.grad = torch.ones(10)
        ds_ops.CPUAdam([p], lr=0.1).step()
        assert torch.allclose(p.detach(), torch.full((10,), -0.1))
        print("PREBUILT OK")
    """)
    result = _python(code, {"PYTHONPATH": str(unpacked), "CXX": "/nonexistent/c++", "PATH": "/nonexistent",
                            "DS_OPS_CACHE": str(tmp_path / "empty-cache")})
    assert "PREBUILT OK" in result.stdout


def test_ds_report_lists_every_op():
    out = subprocess.run([sys.executable, "-m", "ds_ops.report"], capture_output=True, text=True, timeout=300,
                         check=True).stdout
    for line in ("python", "torch", "compiler", "ninja", "SIMD", "op cache"):
        assert any(row.startswith(line) for row in out.splitlines()), line
    # the CPU as /proc/cpuinfo names it, with its vector features (what a kernel's bits may depend on)
    info = Path("/proc/cpuinfo").read_text().splitlines()
    model = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    flags = next(line.split(":", 1)[1].split() for line in info if line.startswith("flags"))
    (row,) = [r for r in out.splitlines() if r.startswith("CPU ")]
    assert row.split(None, 1)[1].startswith(f"{model} (") and ("avx2" in flags) == (" avx2 " in row.replace("(", " "))
    assert ("avx512f" in flags) == ("no avx512f" not in row), row
    for op in ("cpu_adam", "cpu_adagrad", "cpu_lion", "cpu_lamb", "sparse_attn", "onebit"):
        (row,) = [r for r in out.splitlines() if r.startswith(op + " ")]
        assert row.split()[1] == "yes", row


# ---- ds-report's rough edges, through the command line -----------------------------------------------

def _ds_report(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ds_ops.report", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("variable, value, message", [
    ("DS_BUILD_SIMD", "avx9", "DS_BUILD_SIMD must be one of native, avx512, avx2, scalar, got 'avx9'"),
    ("MAX_JOBS", "many", "MAX_JOBS must be a positive integer (compilations at once), got 'many'"),
])
def test_ds_report_refuses_a_bad_variable_in_one_line(variable, value, message):
    result = _ds_report(env={variable: value})
    assert result.returncode == 2
    assert result.stderr.strip() == f"ds-report: error: {message}"
    assert result.stdout == ""


def test_ds_report_names_a_cxx_that_points_nowhere():
    result = _ds_report(env={"CXX": "/nonexistent/c++"})
    assert result.returncode == 0, result.stderr
    (row,) = [r for r in result.stdout.splitlines() if r.startswith("compiler")]
    assert "CXX='/nonexistent/c++' is not an executable on PATH" in row and "no C++ compiler" not in result.stdout
    built = _ds_report("--build", env={"CXX": "/nonexistent/c++"})
    assert built.returncode == 1  # nothing could be built: the command says so
    assert "op(s) not built: " in built.stderr and "cpu_adam" in built.stderr


def test_ds_report_build_fails_with_an_unusable_cache_and_names_the_variable(tmp_path):
    (tmp_path / "a-file").write_text("")
    cache = tmp_path / "a-file" / "cache"
    result = _ds_report("--build", env={"DS_OPS_CACHE": str(cache)})
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    (row,) = [r for r in result.stdout.splitlines() if r.startswith("op cache")]
    assert "cannot be used" in row and "set DS_OPS_CACHE to a writable directory" in row
    (op,) = [r for r in result.stdout.splitlines() if r.startswith("cpu_adam ")]
    assert f"build failed: DS_OPS_CACHE='{cache}' cannot be used as the op cache" in op


FAKE_CXX = textwrap.dedent("""\
    #!/bin/sh
    # A compiler that only meets its neighbours: each compile step says which op it belongs to (the
    # op's build directory), waits up to 5 s for a compile step of another op, records whether one
    # came, and fails (so nothing is cached and nothing links).
    case " $* " in *" --version "*) echo "fake-c++ 1.0"; exit 0;; esac
    case " $* " in *" -c "*) ;; *) exit 1;; esac
    op=$(basename "$PWD"); mine="$LOG/running.$op.$$"
    touch "$mine"
    others() { ls "$LOG" | grep '^running\\.' | grep -v "^running\\.$op\\." | wc -l; }
    i=0
    while [ "$(others)" -eq 0 ] && [ $i -lt 100 ]; do sleep 0.05; i=$((i + 1)); done
    [ "$(others)" -gt 0 ] && touch "$LOG/overlap.$op"
    rm -f "$mine"
    echo "fake-c++: not a real compiler" >&2
    exit 1
""")


def test_ds_report_build_compiles_ops_in_parallel_and_fails_when_builds_fail(tmp_path):
    """Two ops compile at once (MAX_JOBS=2: two ops, ninja -j1 each); every build fails here, so
    the command exits 1 and says which ops are not built."""
    log = tmp_path / "log"
    log.mkdir()
    fake = tmp_path / "fake-c++"
    fake.write_text(FAKE_CXX)
    fake.chmod(0o755)
    result = _ds_report("--build", env={"CXX": str(fake), "LOG": str(log), "MAX_JOBS": "2",
                                         "DS_OPS_CACHE": str(tmp_path / "cache")}, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "2 at a time" in result.stderr
    overlapping = sorted(p.name for p in log.glob("overlap.*"))
    assert len(overlapping) >= 2, (overlapping, result.stdout)  # builds of different ops ran at the same time
    failed = [r for r in result.stdout.splitlines() if "build failed: building op" in r]
    assert len(failed) >= 6, result.stdout  # ds-ops' six ops (and ds-io's when installed)


def test_ds_report_lists_every_installed_ds_package_without_importing_them():
    code = textwrap.dedent("""
        import sys
        from ds_ops import report
        report.main([])
        # ds_config: ds-ops' own dependency; ds_io: its op builder is a registered ds_ops.builders plug-in
        loaded = sorted({m.split(".")[0] for m in sys.modules if m.startswith("ds_")} - {"ds_ops", "ds_io", "ds_config"})
        print("IMPORTED", loaded)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         check=True).stdout
    assert "IMPORTED []" in out
    from importlib import metadata
    for name in ("ds-ops", "ds-profiler", "ds-compress", "ds-launch", "ds-comm", "ds-io", "ds-data", "ds-moe", "ds-parallel", "ds-autotune", "ds-all",
                 "ds-config"):
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            assert any(r.startswith("not installed") and name in r for r in out.splitlines()), name
            continue
        assert any(r.split() == [name, version] for r in out.splitlines()), (name, out)
