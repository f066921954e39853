"""The printed profile: DeepSpeed's layout, parsed back to the same totals."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from _models import GPT, MLP, gpt_counts, profile

from ds_profiler._format import (
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
    rate_to_string,
    string_to_duration,
    string_to_number,
)

B, S = 2, 16

LINE = re.compile(
    r"^(?P<indent> *)(?:\((?P<key>[^)]+)\): )?(?P<type>\w+)\((?P<items>.*?)\)?$"
)
ITEMS = re.compile(
    r"^(?P<params>[\d.]+(?: [KMGT])?), (?P<pp>[\d.]+)% Params, (?P<macs>[\d.]+ [KMGT]?MACs), (?P<pm>[\d.]+)% MACs, "
    r"(?P<lat>[\d.]+ [mun]?s), (?P<pl>[\d.]+)% latency, (?P<rate>[\d.]+ [KMGT]?FLOPS)"
)


def parse_tree(text: str) -> dict[str, dict]:
    """Module name -> numbers, from the detailed profile (between its intro and the end rule)."""
    body = text.split("Detailed Profile per GPU")[1].split("\n\n")[-1]
    records, open_parents, pending = {}, [], None
    for line in body.splitlines():
        if line.startswith("---"):
            break
        stripped = line.strip()
        if stripped == ")":
            open_parents.pop()
            continue
        match = ITEMS.match(stripped)
        if match and pending is not None:  # the items line of a parent module
            records[pending] = match.groupdict()
            pending = None
            continue
        head = LINE.match(line)
        parent = open_parents[-1] if open_parents else None
        name = "" if parent is None else (f"{parent}.{head['key']}" if parent else head["key"])
        if line.endswith("("):
            open_parents.append(name)
            pending = name
        else:
            records[name] = ITEMS.match(head["items"]).groupdict()
    return records


def close(printed: str, exact: float) -> bool:
    """Equal to the printed precision: 2 decimals of the printed unit."""
    value = string_to_number(printed)
    unit = value / float(printed.split()[0]) if float(printed.split()[0]) else 1.0
    return abs(value - exact) <= 0.005 * unit + 1e-9


@pytest.fixture(scope="module")
def gpt_profile():
    torch.manual_seed(0)
    model = GPT().eval()
    prof = profile(model, torch.zeros(B, S, dtype=torch.long))
    text = prof.print_model_profile(profile_step=3, top_modules=2, output_file=None)
    tree = prof.get_profile()
    prof.end_profile()
    return model, text, tree


def test_layout_follows_deepspeed(gpt_profile):
    _, text, _ = gpt_profile
    for expected in ("-------------------------- ds Flops Profiler --------------------------",
                     "Profile Summary at step 3:", "Notations:", "world size:", "data parallel size:",
                     "model parallel size:", "params per GPU:", "fwd MACs per GPU:", "fwd flops per GPU:",
                     "fwd latency:", "fwd FLOPS per GPU = fwd flops per GPU / fwd latency:",
                     "Aggregated Profile per GPU", "Top 2 modules in terms of params, MACs or fwd latency",
                     "Detailed Profile per GPU", "GPT(\n  "):
        assert expected in text
    assert text.rstrip().endswith("-" * 78)


def test_tree_parses_back_to_the_same_numbers(gpt_profile):
    model, text, tree = gpt_profile
    parsed = parse_tree(text)
    assert list(parsed) == [name for name, _ in model.named_modules()]
    for record in tree.walk():
        row = parsed[record.name]
        assert close(row["params"], record.params), record.name
        assert close(row["macs"], record.macs), record.name
        assert abs(float(row["pm"]) - 100 * record.macs / tree.macs) <= 0.005
        assert abs(string_to_duration(row["lat"]) - record.duration) <= 0.005 * 1e-3 + 0.005 * record.duration
    root = parsed[""]
    flops, macs = gpt_counts(B, S)
    assert close(root["macs"], macs) and root["pm"] == "100.00"
    for record in tree.walk():  # a parent = its printed children + what it computes itself
        if record.children and record.calls:
            children = sum(string_to_number(parsed[c.name]["macs"]) for c in record.children)
            assert abs(children + record.self_macs - string_to_number(parsed[record.name]["macs"])) <= 10 * (
                len(record.children) + 1), record.name
    summary_flops = re.search(r"^fwd flops per GPU:\s+(.+?)\s*$", text, flags=re.M).group(1)
    assert close(summary_flops, flops)


def test_aggregated_profile_per_depth(gpt_profile):
    _, text, tree = gpt_profile
    block = text.split("Aggregated Profile per GPU")[1].split("Detailed Profile")[0]
    depths = re.findall(r"^depth (\d+):", block, flags=re.M)
    assert depths == [str(d) for d in range(max(r.depth for r in tree.walk()) + 1)]
    depth3 = block.split("depth 3:")[1]
    macs_line = re.search(r"MACs\s+- (\{.*\})", depth3).group(1)
    ranking = eval(macs_line)  # a dict literal of the top 2 classes
    mlps = sum(r.macs for r in tree.walk() if r.depth == 3 and r.type_name == "FeedForward")
    assert list(ranking) == ["FeedForward", "Attention"] and close(ranking["FeedForward"], mlps)


def test_module_depth_limits_the_aggregated_profile_and_detailed_can_be_off(capsys):
    prof = profile(MLP(), torch.randn(2, 16))
    text = prof.print_model_profile(module_depth=0, detailed=False)
    prof.end_profile()
    assert "depth 0:" in text and "depth 1:" not in text and "Detailed Profile" not in text
    assert capsys.readouterr().out == text


def test_output_file_gets_the_text_and_stdout_nothing(tmp_path, capsys):
    prof = profile(MLP(), torch.randn(2, 16))
    path = tmp_path / "sub" / "profile.txt"
    text = prof.print_model_profile(output_file=path)
    prof.end_profile()
    assert path.read_text() == text and "MLP(" in text
    assert capsys.readouterr().out == ""


def test_print_options_are_validated():
    prof = profile(MLP(), torch.randn(2, 16))
    with pytest.raises(ValueError, match=r"module_depth must be -1 .* got -2"):
        prof.print_model_profile(module_depth=-2)
    with pytest.raises(ValueError, match="top_modules must be an integer >= 1, got 0"):
        prof.print_model_profile(top_modules=0)
    prof.end_profile()


def test_engine_supplies_parallel_sizes_batch_and_timers():
    timers = {"fwd": 10.0, "bwd": 20.0, "step": 5.0}  # milliseconds, as DeepSpeed's timers
    engine = SimpleNamespace(
        world_size=4, dp_world_size=2, mp_world_size=2, train_micro_batch_size_per_gpu=lambda: 8,
        wall_clock_breakdown=lambda: True,
        timers=lambda name: SimpleNamespace(elapsed=lambda reset: timers[name]),
    )
    model = MLP()
    from ds_profiler import FlopsProfiler

    prof = FlopsProfiler(model, ds_engine=engine, recompute_fwd_factor=0.5)
    prof.start_profile()
    model(torch.randn(2, 16))
    text = prof.print_model_profile(output_file=None)
    flops, params = prof.get_total_flops(), prof.get_total_params()
    prof.end_profile()

    def value(label):
        return re.search(re.escape(label) + r"\s+(.+?)\s*$", text, flags=re.M).group(1)

    assert value("world size:") == "4" and value("data parallel size:") == "2" and value("model parallel size:") == "2"
    assert value("batch size per GPU:") == "8"
    assert value("params of model = params per GPU * mp_size:") == params_to_string(2 * params)
    assert value("fwd latency:") == "10 ms" and value("bwd latency:") == "20 ms" and value("step latency:") == "5 ms"
    assert value("bwd FLOPS per GPU = 2.5 * fwd flops per GPU / bwd latency:") == rate_to_string(2.5 * flops / 0.02)
    assert value("fwd+bwd FLOPS per GPU = 3.5 * fwd flops per GPU / (fwd+bwd latency):") == rate_to_string(3.5 * flops / 0.03)
    assert value("iter latency:") == "35 ms"
    assert value("samples/second:") == f"{8 * 2 / 0.035:.2f}"  # micro batch * data parallel size / iter latency


@pytest.mark.parametrize(("sizes", "dp"), [
    ({"dp_world_size": None, "seq_dp_world_size": 4}, "4"),  # DeepSpeed under Ulysses sequence parallelism
    ({"dp_world_size": None}, "4"),                           # no seq_dp_world_size: world // mp
    ({"dp_world_size": None, "seq_dp_world_size": None, "mp_world_size": None}, "8"),
])
def test_engine_dp_world_size_none(sizes, dp):
    """DeepSpeed's engine reports dp_world_size=None under sequence parallelism; int(None) crashed."""
    engine = SimpleNamespace(world_size=8, mp_world_size=2, train_micro_batch_size_per_gpu=lambda: 3,
                             wall_clock_breakdown=lambda: True,
                             timers=lambda name: SimpleNamespace(elapsed=lambda reset: 10.0))
    for name, value in sizes.items():
        setattr(engine, name, value)
    from ds_profiler import FlopsProfiler

    model = MLP()
    prof = FlopsProfiler(model, ds_engine=engine)
    prof.start_profile()
    model(torch.randn(2, 16))
    text = prof.print_model_profile(output_file=None)
    prof.end_profile()

    def value(label):
        return re.search(re.escape(label) + r"\s+(.+?)\s*$", text, flags=re.M).group(1)

    assert value("data parallel size:") == dp
    assert value("samples/second:") == f"{3 * int(dp) / 0.03:.2f}"


def test_engine_bad_size_names_it():
    from ds_profiler import FlopsProfiler

    engine = SimpleNamespace(world_size=8, mp_world_size=0, dp_world_size=None)
    prof = FlopsProfiler(MLP(), ds_engine=engine)
    prof.start_profile()
    prof.model(torch.randn(2, 16))
    with pytest.raises(ValueError, match=r"ds_engine\.mp_world_size must be a positive integer or None, got 0"):
        prof.print_model_profile(output_file=None)
    prof.end_profile()


@pytest.mark.parametrize(("number", "text"), [
    (0, "0 "), (999, "999 "), (1000, "1 K"), (1234567, "1.23 M"), (3.14159e12, "3.14 T"),
    (5e15, "5000 T"), (6279.86e9, "6.28 T"), (336.23e6, "336.23 M"),
])
def test_number_units(number, text):
    assert number_to_string(number) == text
    assert string_to_number(text) == pytest.approx(number, rel=5e-3)


def test_unit_helpers():
    assert macs_to_string(3139.93e9) == "3.14 TMACs" and macs_to_string(0) == "0 MACs"
    assert flops_to_string(1931264) == "1.93 M" and flops_to_string(12) == "12"
    assert rate_to_string(81.9e12) == "81.9 TFLOPS" and rate_to_string(0) == "0 FLOPS"
    assert params_to_string(30080) == "30.08 K" and params_to_string(2) == "2"
    assert [duration_to_string(t) for t in (0.07667, 3.409e-5, 1.5, 0, 2e-9)] == ["76.67 ms", "34.09 us", "1.5 s", "0 s", "2 ns"]


def test_as_string_totals():
    prof = profile(GPT().eval(), torch.zeros(B, S, dtype=torch.long))
    flops, macs = gpt_counts(B, S)
    assert prof.get_total_flops(as_string=True) == flops_to_string(flops) == "1.93 M"
    assert prof.get_total_macs(as_string=True) == macs_to_string(macs) == "917.5 KMACs"
    assert prof.get_total_params(as_string=True) == "30.08 K"
    assert prof.get_total_duration(as_string=True).endswith("s")
    prof.end_profile()
