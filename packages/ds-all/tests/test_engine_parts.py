"""The engine is the composition root (issue 44; ARCHITECTURE.md, "The engine's parts"): its parts are built from
explicit inputs and never see the engine. Checked from the code:

* no ds_all module other than the composition roots imports ``ds_all._engine`` (``TYPE_CHECKING`` imports
  included: a type-only import is how a part starts reading the engine's namespace);
* no function outside the roots takes the whole engine (a parameter named ``engine``), except the modules of
  `NOT_YET_PARTS`, a list that only shrinks.

Each checker is proven on a planted file before it is trusted with the real tree.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "ds_all"

# the engine's builders and DeepSpeed's paths of its classes: they may import it
ROOTS = {"__init__.py", "_engine.py", "_engine_api.py", "_engine_getters.py", "_initialize.py", "_pipe_engine.py",
         "runtime/engine.py", "runtime/pipe/engine.py"}
# modules whose functions still take the whole engine (to become parts, then leave this list); empty since
# _autotuning.py's AutotuningProfiler became a part: a module added here needs a reason beside it
NOT_YET_PARTS: set[str] = set()


def _engine_module(node: ast.AST, path: Path) -> bool:
    """Whether an import statement of ``path`` (under SRC) imports ``ds_all._engine``."""
    if isinstance(node, ast.Import):
        return any(alias.name == "ds_all._engine" for alias in node.names)
    if not isinstance(node, ast.ImportFrom):
        return False
    if node.level == 0:
        base = node.module or ""
    else:
        package = list(path.relative_to(SRC).parent.parts)
        package = package[:len(package) - (node.level - 1)] if node.level > 1 else package
        base = ".".join(["ds_all", *package, *([node.module] if node.module else [])])
    return base == "ds_all._engine" or (base == "ds_all" and any(a.name == "_engine" for a in node.names))


def engine_importers(root: Path = SRC) -> list[str]:
    """The modules under ``root`` (outside `ROOTS`) that import ``ds_all._engine``, with the line."""
    found = []
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        if name in ROOTS:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        found += [f"{name}:{node.lineno}" for node in ast.walk(tree) if _engine_module(node, path if root == SRC
                                                                                      else SRC / name)]
    return found


def engine_takers(root: Path = SRC) -> set[str]:
    """The modules under ``root`` (outside `ROOTS`) with a function taking a parameter named ``engine``."""
    found = set()
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        if name in ROOTS:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                if any(a.arg == "engine" for a in args):
                    found.add(name)
    return found


def test_the_checkers_catch_planted_imports_and_engine_parameters(tmp_path):
    (tmp_path / "runtime").mkdir()
    planted = {
        "_a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._engine import DeepSpeedEngine\n",
        "_b.py": "from . import _engine\n",
        "_c.py": "import ds_all._engine\n",
        "runtime/_d.py": "from .._engine import DeepSpeedEngine\n",
        "_e.py": "from ds_all._engine import DeepSpeedEngine\n",
        "_fine.py": "from ._engine_api import EngineAPI\nfrom . import _engine_getters\n",
        "_engine.py": "from ._engine import x\n",  # a root
        "_taker.py": "def configure(engine):\n    pass\n",
    }
    for name, text in planted.items():
        (tmp_path / name).write_text(text)
    assert engine_importers(tmp_path) == ["_a.py:3", "_b.py:1", "_c.py:1", "_e.py:1", "runtime/_d.py:1"]
    assert engine_takers(tmp_path) == {"_taker.py"}


def test_no_part_imports_the_engine():
    assert engine_importers() == []


def test_the_modules_taking_the_engine_are_only_those_not_yet_parts():
    takers = engine_takers()
    assert takers <= NOT_YET_PARTS, f"a module takes the whole engine: {sorted(takers - NOT_YET_PARTS)}"
    assert takers >= NOT_YET_PARTS, f"now parts, leave NOT_YET_PARTS: {sorted(NOT_YET_PARTS - takers)}"


def _raised_in(path: Path, exception: str) -> list[int]:
    """The lines of ``path`` that raise ``exception(...)`` themselves."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
            and isinstance(node.exc.func, ast.Name) and node.exc.func.id == exception]


def test_a_pipeline_refuses_features_from_what_the_parts_declare():
    from torch import nn

    import ds_moe
    from ds_all import DeepSpeedEngine
    from ds_all.config import Config

    # PipelineEngine refuses no feature by hand: every NotImplementedError of a feature comes from a part
    assert _raised_in(SRC / "_pipe_engine.py", "NotImplementedError") == []
    assert _raised_in(SRC / "_autocast.py", "NotImplementedError") != []  # the checker finds raises

    def refusal(config: dict, module: nn.Module) -> str | None:
        built = Config.model_validate({"train_micro_batch_size_per_gpu": 1, **config})
        for part in DeepSpeedEngine.FEATURE_PARTS:
            found = part.pipeline_refusal(built, module)
            if found is not None:
                return f"{type(found).__name__}: {found}"
        return None

    plain, moe = nn.Linear(4, 4), nn.Sequential(ds_moe.MoE(4, nn.Linear(4, 4), num_experts=2, ep_size=1))
    assert refusal({}, plain) is None
    assert refusal({"torch_autocast": {"enabled": True}}, plain).startswith(
        "NotImplementedError: torch_autocast with a PipelineModule is not implemented in ds-all")
    assert refusal({"progressive_layer_drop": {"enabled": True}}, plain).startswith(
        "NotImplementedError: progressive_layer_drop with a PipelineModule is not implemented in ds-all")
    assert refusal({}, moe).startswith("NotImplementedError: initialize: a PipelineModule with MoE layers")
