"""ds-ops' test session: the kernel matrix says which SIMD levels it covered (its skips say why not)."""

from __future__ import annotations

import sys


def pytest_terminal_summary(terminalreporter) -> None:
    matrix = next((m for name, m in sys.modules.items() if name.endswith("test_kernel_matrix")), None)
    if matrix is not None:
        terminalreporter.write_line(matrix.levels_line())
