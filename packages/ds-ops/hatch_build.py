"""Build hook: ``DS_BUILD_OPS=1 pip install ds-ops`` (or ``DS_BUILD_<OP>=1`` for one op, e.g.
``DS_BUILD_CPU_ADAM=1``) compiles the ops into the wheel, under ds_ops/_prebuilt, so that a
machine without a compiler at run time is served. Without those variables the wheel is pure
Python and ops are built just in time on first use. The op builder is loaded from the source
tree by path: it never imports torch, so torch is not needed to build."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


def _load_op_builder(root: Path):
    package_dir = root / "src" / "ds_ops" / "op_builder"
    spec = importlib.util.spec_from_file_location("_ds_ops_build_op_builder", package_dir / "__init__.py",
                                                  submodule_search_locations=[str(package_dir)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def requested_ops(names, environ) -> list[str]:
    if environ.get("DS_BUILD_OPS") == "1":
        return [n for n in names if environ.get(f"DS_BUILD_{n.upper()}") != "0"]
    return [n for n in names if environ.get(f"DS_BUILD_{n.upper()}") == "1"]


class CustomBuildHook(BuildHookInterface):
    def initialize(self, version, build_data):
        if self.target_name != "wheel" or version == "editable":
            return
        op_builder = _load_op_builder(Path(self.root))
        wanted = requested_ops(list(op_builder.BUILDERS), os.environ)
        if not wanted:
            return
        out = self._prebuilt = Path(tempfile.mkdtemp(prefix="ds-ops-prebuilt-"))
        for name in wanted:
            builder = op_builder.BUILDERS[name]()
            ok, reason = builder.compatibility()
            if not ok:
                raise op_builder.OpBuildError(f"DS_BUILD_OPS: cannot build op {name}: {reason}")
            library = builder.build(out / name)
            build_data["force_include"][str(library)] = f"ds_ops/_prebuilt/{library.name}"
            self.app.display_info(f"ds-ops: built op {name} ahead ({builder.simd_level()})")
        build_data["pure_python"] = False
        build_data["infer_tag"] = True

    def finalize(self, version, build_data, artifact_path):
        # the libraries are in the wheel now: the build directory would stay in /tmp for good otherwise
        prebuilt = getattr(self, "_prebuilt", None)
        if prebuilt is not None:
            shutil.rmtree(prebuilt, ignore_errors=True)
