"""The printed profile: summary, aggregated profile per depth, detailed per-module tree.

The layout follows DeepSpeed's flops profiler output line for line (the seeds' BERT-Large
example), so anything that reads DeepSpeed's profile reads ours.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._format import (
    duration_to_string,
    flops_to_string,
    macs_to_string,
    params_to_string,
    rate_to_string,
)
from .profile import ModuleProfile

TITLE = "-------------------------- ds Flops Profiler --------------------------"
AGGREGATED = "----------------------------- Aggregated Profile per GPU -----------------------------"
DETAILED = "------------------------------ Detailed Profile per GPU ------------------------------"
END = "------------------------------------------------------------------------------"

NOTATIONS = """Notations:
data parallel size (dp_size), model parallel size(mp_size),
number of parameters (params), number of multiply-accumulate operations(MACs),
number of floating-point operations (flops), floating-point operations per second (FLOPS),
fwd latency (forward propagation latency), bwd latency (backward propagation latency),
step (weights update latency), iter latency (sum of fwd, bwd and step latency)
"""

DETAILED_INTRO = """Each module profile is listed after its name in the following order:
params, percentage of total params, MACs, percentage of total MACs, fwd latency, percentage of total fwd latency, fwd FLOPS

Note: 1. A module can have torch.nn.module or torch.nn.functional to compute logits (e.g. CrossEntropyLoss). They are not counted as submodules, thus not to be printed out. However they make up the difference between a parent's MACs (or latency) and the sum of its submodules'.
2. Number of floating-point operations is a theoretical estimation, thus FLOPS computed using that could be larger than the maximum system throughput.
3. The fwd latency listed in the top module's profile is directly captured at the module forward function in PyTorch{engine_note}.
"""


@dataclass
class Summary:
    """The run-level numbers of the summary block; the engine supplies the optional ones.

    ``flops``, ``macs`` and ``duration`` are the profiler's totals: the root module's calls and any
    submodule called outside them. The tree's percentages are of these totals."""

    flops: int = 0
    macs: int = 0
    duration: float = 0.0
    world_size: int = 1
    dp_size: int = 1
    mp_size: int = 1
    batch_size: int | None = None
    fwd_latency: float = 0.0
    bwd_latency: float | None = None
    step_latency: float | None = None
    from_engine: bool = False


def _line(label: str, value) -> str:
    return f"{label:<70}  {value!s:<8}"


def format_summary(root: ModuleProfile, summary: Summary, profile_step: int, recompute_fwd_factor: float) -> list[str]:
    flops, macs, params = summary.flops, summary.macs, root.params
    mp = summary.mp_size
    bwd_factor = 2 + recompute_fwd_factor
    fwd = summary.fwd_latency
    out = ["", TITLE, f"Profile Summary at step {profile_step}:", NOTATIONS]
    out.append(_line("world size: ", summary.world_size))
    out.append(_line("data parallel size: ", summary.dp_size))
    out.append(_line("model parallel size: ", mp))
    if summary.batch_size is not None:
        out.append(_line("batch size per GPU: ", summary.batch_size))
    out.append(_line("params per GPU: ", params_to_string(params)))
    out.append(_line("trainable params per GPU: ", params_to_string(root.trainable_params)))
    out.append(_line("params of model = params per GPU * mp_size: ", params_to_string(params * mp)))
    out.append(_line("fwd MACs per GPU: ", macs_to_string(macs)))
    out.append(_line("fwd flops per GPU: ", flops_to_string(flops)))
    out.append(_line("fwd flops of model = fwd flops per GPU * mp_size: ", flops_to_string(flops * mp)))
    out.append(_line(f"bwd flops per GPU = {bwd_factor:g} * fwd flops per GPU (estimate): ",
                     flops_to_string(bwd_factor * flops)))
    out.append(_line("fwd latency: ", duration_to_string(fwd)))
    out.append(_line("fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ", rate_to_string(flops / fwd if fwd else 0)))
    iter_latency = None
    if summary.bwd_latency is not None:
        bwd = summary.bwd_latency
        out.append(_line("bwd latency: ", duration_to_string(bwd)))
        out.append(_line(f"bwd FLOPS per GPU = {bwd_factor:g} * fwd flops per GPU / bwd latency: ",
                         rate_to_string(bwd_factor * flops / bwd if bwd else 0)))
        out.append(_line(f"fwd+bwd FLOPS per GPU = {bwd_factor + 1:g} * fwd flops per GPU / (fwd+bwd latency): ",
                         rate_to_string((bwd_factor + 1) * flops / (fwd + bwd) if fwd + bwd else 0)))
        if summary.step_latency is not None:
            iter_latency = fwd + bwd + summary.step_latency
            out.append(_line("step latency: ", duration_to_string(summary.step_latency)))
            out.append(_line("iter latency: ", duration_to_string(iter_latency)))
            out.append(_line(f"FLOPS per GPU = {bwd_factor + 1:g} * fwd flops per GPU / iter latency: ",
                             rate_to_string((bwd_factor + 1) * flops / iter_latency if iter_latency else 0)))
    if summary.batch_size is not None and iter_latency:
        samples = summary.batch_size * summary.dp_size
        out.append(_line("samples/second: ", f"{samples / iter_latency:.2f}"))
    return out


def format_aggregated(root: ModuleProfile, module_depth: int, top_modules: int) -> list[str]:
    """Per depth, the top module classes by params, MACs and latency (summed over instances)."""
    per_depth: dict[int, dict[str, list]] = {}
    for node in root.walk():
        totals = per_depth.setdefault(node.depth, {}).setdefault(node.type_name, [0, 0, 0.0])
        totals[0] += node.macs
        totals[1] += node.params
        totals[2] += node.duration
    deepest = max(per_depth)
    last = deepest if module_depth == -1 else min(module_depth, deepest)
    out = ["", AGGREGATED,
           f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:"]
    for depth in range(last + 1):
        items = per_depth[depth].items()

        def top(index: int, fmt, items=items) -> dict:
            ranked = sorted(items, key=lambda kv: kv[1][index], reverse=True)[:top_modules]
            return {name: fmt(values[index]) for name, values in ranked}

        out.append(f"depth {depth}:")
        out.append(f"    params      - {top(1, params_to_string)}")
        out.append(f"    MACs        - {top(0, macs_to_string)}")
        out.append(f"    fwd latency - {top(2, duration_to_string)}")
    return out


def _percent(part: float, whole: float) -> str:
    return f"{part / whole:.2%}" if whole else "0.00%"


def _items(node: ModuleProfile, root: ModuleProfile, summary: Summary) -> str:
    items = [
        params_to_string(node.params), f"{_percent(node.params, root.params)} Params",
        macs_to_string(node.macs), f"{_percent(node.macs, summary.macs)} MACs",
        duration_to_string(node.duration), f"{_percent(node.duration, summary.duration)} latency",
        rate_to_string(node.flops_per_second),
    ]
    if node.extra_repr:
        items.append(node.extra_repr)
    return ", ".join(items)


def _indent(text: str, spaces: int) -> str:
    lines = text.split("\n")
    return "\n".join([lines[0]] + [" " * spaces + line for line in lines[1:]])


def format_tree(node: ModuleProfile, root: ModuleProfile, summary: Summary) -> str:
    """``Type(items)`` for a leaf, ``Type(\\n  items\\n  (child): ...\\n)`` otherwise, as ``print(model)``."""
    items = _items(node, root, summary)
    if not node.children:
        return f"{node.type_name}({items})"
    lines = [items] + [
        f"({child.name.rsplit('.', 1)[-1]}): {_indent(format_tree(child, root, summary), 2)}" for child in node.children
    ]
    return f"{node.type_name}(\n  " + "\n  ".join(lines) + "\n)"


def format_profile(root: ModuleProfile, summary: Summary, *, profile_step: int, module_depth: int,
                   top_modules: int, detailed: bool, recompute_fwd_factor: float) -> str:
    out = format_summary(root, summary, profile_step, recompute_fwd_factor)
    out += format_aggregated(root, module_depth, top_modules)
    if detailed:
        note = (", thus it's less than the fwd latency shown above which is captured in the engine"
                if summary.from_engine else "; it is the fwd latency shown above")
        out += ["", DETAILED, DETAILED_INTRO.format(engine_note=note), format_tree(root, root, summary)]
    out.append(END)
    return "\n".join(out) + "\n"
