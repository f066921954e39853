#!/usr/bin/env bash
# The GPU check of issue 28, in one run of at most ~5 minutes on one GPU (the lent H100):
#   1. the wheels the GPU machine lacks (.whl/, made by scripts/fetch_gpu_wheels.sh) into a --target dir;
#   2. our packages from the working tree, no install and no build: packages/*/src on PYTHONPATH, beside a
#      dist-info per package (versions and entry points, which ds-report and ds_all.versions() read) and
#      the console scripts;
#   3. nvidia-smi, python, torch, nvcc versions; ds-report; the native ops built (while the tests run);
#   4. `pytest -m cuda` for every package, each from its own folder as CI runs it (--import-mode=importlib),
#      all packages at once, each under a time limit; results summarised from their junit XML;
#   5. packages/ds-all/benchmarks/bench_gpu.py (ours against plain PyTorch, interleaved, with ratios).
# Everything goes to $OUT (default ./gpu_check_out): gpu_check.log, gpu_check.json (versions, pytest
# summary, the benchmark's figures), gpu_check_junit.xml, bench_gpu.json. No phase stops the others.
#
#   bash scripts/fetch_gpu_wheels.sh      # here, where pip reaches PyPI; then on the GPU machine:
#   bash scripts/gpu_check.sh             # GPU_CHECK_PYTEST_S (100) and GPU_CHECK_BENCH_S (190) set the limits
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu_check_out}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
PY=${PYTHON:-python3}
PYTEST_S=${GPU_CHECK_PYTEST_S:-100}
BENCH_S=${GPU_CHECK_BENCH_S:-190}
START=$(date +%s)
WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)
SITE=$WORK/site
mkdir -p "$SITE/bin" "$WORK/junit" "$WORK/pytest"
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONDONTWRITEBYTECODE=1
phase() { echo; echo "== [+$(($(date +%s) - START)) s] $*"; }

main() {

phase "wheels (.whl -> $SITE)"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || echo "gpu_check: installing the wheels FAILED (pydantic is needed by every package but ds-launch)"
else
  echo "gpu_check: no .whl/ folder: run scripts/fetch_gpu_wheels.sh first and carry .whl"
fi

phase "our packages from the tree (PYTHONPATH, dist-info, console scripts)"
"$PY" - "$SITE" <<'EOF' || echo "gpu_check: writing the packages' metadata FAILED"
import pathlib, sys, tomllib

site = pathlib.Path(sys.argv[1])
for pyproject in sorted(pathlib.Path("packages").glob("*/pyproject.toml")):
    project = tomllib.loads(pyproject.read_text())["project"]
    name, version = project["name"], project["version"]
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    requires = "".join(f"Requires-Dist: {d}\n" for d in project.get("dependencies", []))
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{requires}")
    (info / "INSTALLER").write_text("gpu_check\n")
    (info / "RECORD").write_text("")
    groups = dict(project.get("entry-points", {}))
    if project.get("scripts"):
        groups["console_scripts"] = project["scripts"]
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()) + "\n" for group, entries in groups.items()))
    for script, target in project.get("scripts", {}).items():
        module, func = target.split(":")
        path = site / "bin" / script
        path.write_text(f"#!{sys.executable}\nimport sys\nfrom {module} import {func}\nsys.exit({func}())\n")
        path.chmod(0o755)
    print(f"{name} {version}")
EOF
SRC=$(for d in "$ROOT"/packages/*/src; do printf '%s:' "$d"; done)
export PYTHONPATH="$SITE:${SRC%:}${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"

phase "versions"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || echo "nvidia-smi failed"; } \
  | tee "$WORK/nvidia_smi.txt"
{ nvcc --version 2>&1 | tail -n 2 || echo "nvcc not found"; } | tee "$WORK/nvcc.txt"
timeout 60 "$PY" - <<'EOF' 2>&1 | tee "$WORK/versions.json" || echo "gpu_check: the version probe FAILED"
import json, platform, torch
out = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
       "cuda_available": torch.cuda.is_available(), "nccl": None, "gpu": None}
if torch.cuda.is_available():
    out["gpu"] = torch.cuda.get_device_name(0)
    out["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
for module in ("pydantic", "hjson", "pytest"):
    try:
        out[module] = __import__(module).__version__
    except Exception as error:
        out[module] = f"missing: {error}"
try:
    import ds_all
    out["ds"] = ds_all.versions()
except Exception as error:
    out["ds"] = f"import failed: {type(error).__name__}: {error}"
print(json.dumps(out))
EOF
timeout 60 ds-report 2>&1 || echo "gpu_check: ds-report FAILED"

phase "native ops built (background) + pytest -m cuda, every package at once, ${PYTEST_S} s each"
( timeout "$PYTEST_S" "$PY" - >"$WORK/ops_build.log" 2>&1 <<'EOF'
import concurrent.futures, time
from ds_ops.op_builder import BUILDERS

def build(name):
    start = time.time()
    try:
        BUILDERS[name]().load()
        return f"{name}: built in {time.time() - start:.1f} s"
    except Exception as error:
        return f"{name}: FAILED after {time.time() - start:.1f} s: {type(error).__name__}: {error}"

with concurrent.futures.ThreadPoolExecutor(len(BUILDERS)) as pool:
    for line in pool.map(build, BUILDERS):
        print(line, flush=True)
EOF
) &
OPS_PID=$!
PIDS=()
for dir in packages/*/; do
  pkg=$(basename "$dir")
  ( cd "$dir" && timeout -k 10 "$PYTEST_S" "$PY" -m pytest tests -m cuda -v -rfEs -p no:cacheprovider \
      --durations=5 --junitxml="$WORK/junit/$pkg.xml" >"$WORK/pytest/$pkg.log" 2>&1
    echo $? >"$WORK/pytest/$pkg.rc" ) &
  PIDS+=($!)
done
wait "${PIDS[@]}"
wait "$OPS_PID"
echo "-- native ops:"; cat "$WORK/ops_build.log"
for f in "$WORK"/pytest/*.log; do
  pkg=$(basename "$f" .log)
  echo "-- pytest $pkg (exit $(cat "$WORK/pytest/$pkg.rc" 2>/dev/null || echo '?'))"
  grep -v -E "^(platform|cachedir|rootdir|configfile|plugins|timeout)" "$f" | tail -n 80
done

phase "benchmark (budget ${BENCH_S} s)"
timeout -k 10 $((BENCH_S + 40)) "$PY" packages/ds-all/benchmarks/bench_gpu.py --budget "$BENCH_S" \
  --json "$OUT/bench_gpu.json" || echo "gpu_check: bench_gpu.py ended with exit $?"

phase "summary"
"$PY" - "$WORK" "$OUT" "$START" <<'EOF' || echo "gpu_check: the summary FAILED"
import json, pathlib, sys, time
import xml.etree.ElementTree as ET

work, out, start = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), float(sys.argv[3])

def read(path, default=None):
    try:
        return path.read_text().strip()
    except OSError:
        return default

pytest, merged = {}, ET.Element("testsuites")
for rc_file in sorted((work / "pytest").glob("*.rc")):
    pkg = rc_file.stem
    rc = int(read(rc_file, "-1") or -1)
    row = {"exit": rc, "meaning": {0: "passed", 1: "failures", 5: "no cuda tests", 124: "killed at the time limit"}
           .get(rc, "error")}
    try:
        root = ET.parse(work / "junit" / f"{pkg}.xml").getroot()
        suites = [root] if root.tag == "testsuite" else list(root)
        for key in ("tests", "failures", "errors", "skipped"):
            row[key] = sum(int(s.get(key, 0)) for s in suites)
        row["failed"] = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
                         if c.find("failure") is not None or c.find("error") is not None]
        for s in suites:
            s.set("name", pkg)
            merged.append(s)
    except (OSError, ET.ParseError) as error:
        row["junit"] = f"unreadable: {error}"
    pytest[pkg] = row
ET.ElementTree(merged).write(out / "gpu_check_junit.xml", encoding="utf-8", xml_declaration=True)
totals = {k: sum(r.get(k, 0) for r in pytest.values()) for k in ("tests", "failures", "errors", "skipped")}
try:
    versions = json.loads(read(work / "versions.json", "{}").splitlines()[-1])
except (ValueError, IndexError):
    versions = {"raw": read(work / "versions.json")}
versions["nvidia_smi"], versions["nvcc"] = read(work / "nvidia_smi.txt"), read(work / "nvcc.txt")
try:
    bench = json.loads((out / "bench_gpu.json").read_text())
except (OSError, ValueError) as error:
    bench = {"error": f"no benchmark figures: {error}"}
report = {"elapsed_s": round(time.time() - start), "versions": versions, "native_ops": read(work / "ops_build.log"),
          "pytest": {"totals": totals, "packages": pytest}, "bench": bench}
(out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
print(f"pytest -m cuda: {totals['tests']} tests, {totals['failures']} failures, {totals['errors']} errors, "
      f"{totals['skipped']} skipped")
for pkg, row in pytest.items():
    print(f"  {pkg:<12} exit {row['exit']} ({row['meaning']}): {row.get('tests', '?')} tests, "
          f"{row.get('failures', '?')} failed, {row.get('errors', '?')} errors, {row.get('skipped', '?')} skipped"
          + (f"; failed: {', '.join(row['failed'])}" if row.get("failed") else ""))
for key, line in bench.get("summary", {}).items():
    print(f"  {key}: {line}")
print(f"gpu_check: {report['elapsed_s']} s; figures in {out / 'gpu_check.json'}")
EOF
}

main 2>&1 | tee "$LOG"
rm -rf "$WORK"
