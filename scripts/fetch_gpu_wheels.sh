#!/usr/bin/env bash
# Downloads into .whl/ (git-ignored through .git/info/exclude) the wheels the GPU machine lacks, for its
# Python 3.12 on x86-64: pydantic and its parts, hjson (ds-config). The versions are those of the CPU pin's
# virtualenv, so the GPU check runs the same config models CI runs. Run it here (where pip reaches PyPI),
# then give `.whl` in the device tool's `carry`; scripts/gpu_check.sh installs them with --no-index.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=(
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  hjson==3.1.0
  typing-extensions==4.16.0   # pydantic 2.14 needs >= 4.16; the image's may be older
)
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
rm -f .whl/*.whl  # one version of each: two would stop the install there
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
ls -l .whl
