"""ds-launch against torchrun (the launcher a PyTorch user picks instead), in one run.

1. start-up: wall time of ``<launcher> --help`` (the launcher's own import cost);
2. time to first all_reduce: from starting the launcher to the moment both of 2 local ranks have
   finished their first gloo all_reduce (the cost a user waits for on every launch).

    python benchmarks/bench_launch.py [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

RANK = textwrap.dedent("""
    import os, sys, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()
    with open(os.path.join(sys.argv[1], f"done{dist.get_rank()}"), "w") as f:
        f.write(repr(time.time()))
    dist.barrier()  # leave together: tearing gloo down under a peer can abort it
    dist.destroy_process_group()
""")


def _command(name: str, module: str) -> list[str]:
    """The console script next to this interpreter, else ``python -m module``."""
    path = Path(sys.executable).parent / name
    return [str(path)] if path.exists() else [sys.executable, "-m", module]


COMMANDS = {"ds-launch": _command("ds-launch", "ds_launch"), "torchrun": _command("torchrun", "torch.distributed.run")}
LAUNCH_ARGS = {
    "ds-launch": lambda port: ["--num_procs", "2", "--master_port", str(port), "--no_local_rank"],
    "torchrun": lambda port: ["--nproc_per_node", "2", "--master_port", str(port)],
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_help(name: str) -> float:
    start = time.perf_counter()
    subprocess.run([*COMMANDS[name], "--help"], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def time_first_all_reduce(name: str, script: Path) -> float:
    with tempfile.TemporaryDirectory() as out:
        argv = [*COMMANDS[name], *LAUNCH_ARGS[name](_free_port()), str(script), out]
        start = time.time()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        done = [float(Path(out, f"done{r}").read_text()) for r in range(2)]
    return max(done) - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp, "rank.py")
        script.write_text(RANK)
        results = {}
        for metric, fn in (("help_s", time_help), ("first_all_reduce_s", lambda n: time_first_all_reduce(n, script))):
            for name in COMMANDS:
                results.setdefault(name, {})[metric] = []
            for _ in range(args.repeats):  # interleaved, so machine noise hits both sides alike
                for name in COMMANDS:
                    results[name][metric].append(fn(name))
    print(f"bench_launch: {args.repeats} repeats, median seconds (cpu count {os.cpu_count()})")
    print(f"{'metric':<22}{'ds-launch':>12}{'torchrun':>12}{'ratio':>10}")
    summary = {}
    for metric in ("help_s", "first_all_reduce_s"):
        ours = statistics.median(results["ds-launch"][metric])
        base = statistics.median(results["torchrun"][metric])
        summary[metric] = {"ds-launch": ours, "torchrun": base, "speedup": base / ours}
        print(f"{metric:<22}{ours:>12.3f}{base:>12.3f}{base / ours:>9.2f}x")
    print("(ratio = torchrun / ds-launch: above 1 means ds-launch is faster)")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"bench": "launch", "repeats": args.repeats, **summary}, indent=2))


if __name__ == "__main__":
    main()
