"""Per-file counts of a run of DeepSpeed's own unit tests on ds (the ``deepspeed-tests`` nox session), beside
DeepSpeed's counts on the same kind of CPU (../shared/deepspeed-tests/README.md's table).

    python scripts/deepspeed_tests_report.py results.xml
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict

# DeepSpeed's pass/fail/skip per file (../shared/deepspeed-tests/README.md): 0.19.8, or 0.19.6's source for the two
# files whose modules 0.19.8 removed. None: not counted there (the README gives a lower bound).
DEEPSPEED = {
    "unit/elasticity/test_elastic.py": (20, 0, 3),
    "unit/runtime/test_pld.py": (9, 0, 0),
    "unit/runtime/test_data_efficiency.py": (0, 0, 6),
    "unit/v1/moe/test_moe.py": (22, None, None),
    "unit/sequence_parallelism/test_ulysses.py": (1, None, None),
    "unit/model_parallelism/test_autotp_training.py": (29, 28, 2),
    "unit/autotuning/test_autotuning.py": (11, 0, 0),
}


def counts(path: str) -> dict[str, Counter]:
    per_file: dict[str, Counter] = defaultdict(Counter)
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        name = next((f"{'/'.join(module[:i])}.py" for i in range(len(module), 0, -1)
                     if f"{'/'.join(module[:i])}.py" in DEEPSPEED), "/".join(module))
        kinds = {child.tag for child in case}
        kind = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
        per_file[name][kind] += 1
    return per_file


def main(argv: list[str]) -> int:
    per_file = counts(argv[0])
    print(f"{'file':48} {'ds pass/fail/skip':>18} {'DeepSpeed pass/fail/skip':>25}")
    total = Counter()
    for name in sorted(set(per_file) | set(DEEPSPEED)):
        c = per_file.get(name, Counter())
        total.update(c)
        theirs = "/".join("?" if n is None else str(n) for n in DEEPSPEED.get(name, (None,) * 3))
        print(f"{name:48} {c['passed']:>6}/{c['failed']}/{c['skipped']:<9} {theirs:>25}")
    print(f"{'all':48} {total['passed']:>6}/{total['failed']}/{total['skipped']:<9} "
          f"{sum(p for p, _, _ in DEEPSPEED.values()):>9} pass on DeepSpeed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
