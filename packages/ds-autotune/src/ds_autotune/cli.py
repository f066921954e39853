"""``ds-autotune``: find the ZeRO stage and micro-batch size that train fastest, then (``run``) train.

    ds-autotune [tune|run] [--num_gpus N] [--num_nodes N] [launcher options] script.py --deepspeed_config cfg.json

Each experiment is a short run of the script through ``ds-launch`` (the launcher options given here are
passed on to it); the config's ``autotuning`` section configures the search. Standard library only.
"""

from __future__ import annotations

import argparse
import logging
import sys

from ._autotuner import Autotuner

# ds-launch options that take a value, passed on to it for every experiment
LAUNCHER_VALUE_OPTIONS = (("--hostfile", "-H"), ("--include", "-i"), ("--exclude", "-e"), ("--master_addr",),
                          ("--launcher",), ("--launcher_args",), ("--ssh_port",), ("--bind_core_list",))
LAUNCHER_FLAGS = (("--force_multi",), ("--bind_cores_to_rank",), ("--no_python",), ("--no_local_rank",),
                  ("--module", "-m"))


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise ValueError(f"{message} (see ds-autotune --help)")


def _positive(name: str):
    def parse(text: str) -> int:
        if not text.isdigit() or int(text) < 1:
            raise argparse.ArgumentTypeError(f"{name} must be a positive integer, got {text!r}")
        return int(text)
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ds-autotune", description="DeepSpeed's autotuner: experiments over ZeRO stage and "
                "micro-batch size, each a short run of the script through ds-launch.", allow_abbrev=False)
    p.add_argument("--num_gpus", "--num_accelerators", "--num_procs", dest="num_gpus", type=_positive("--num_gpus"),
                   default=None, help="ranks per node of each experiment (default: autotuning.num_gpus, else 1)")
    p.add_argument("--num_nodes", type=_positive("--num_nodes"), default=None, help="nodes of each experiment")
    p.add_argument("--memory_per_gpu", type=_positive("--memory_per_gpu"), default=None,
                   help="bytes one rank may use (default: the accelerator's, or on the CPU /proc/meminfo's "
                        "MemAvailable shared by the ranks)")
    p.add_argument("--exp_timeout", type=float, default=600.0, help="seconds one experiment may take (default 600)")
    p.add_argument("--seed", type=int, default=None, help="seed of the random and model-based tuners")
    p.add_argument("--master_port", type=int, default=None, help="ignored: every experiment gets a free port")
    for long, *short in LAUNCHER_VALUE_OPTIONS:
        p.add_argument(long, *short, dest=f"launch_{long[2:]}", default=None, help=argparse.SUPPRESS)
    for long, *short in LAUNCHER_FLAGS:
        p.add_argument(long, *short, dest=f"launch_{long[2:]}", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("user_script", help="the training script")
    p.add_argument("user_args", nargs=argparse.REMAINDER, help="its arguments (with --deepspeed_config cfg.json)")
    return p


def _launcher_args(args: argparse.Namespace) -> list[str]:
    out = []
    for long, *_ in LAUNCHER_VALUE_OPTIONS:
        value = getattr(args, f"launch_{long[2:]}")
        if value is not None:
            out.append(f"{long}={value}")
    out += [long for long, *_ in LAUNCHER_FLAGS if getattr(args, f"launch_{long[2:]}")]
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    mode = "tune"
    if argv and argv[0] in ("tune", "run"):
        mode = argv.pop(0)
    try:
        args = build_parser().parse_args(argv)
    except ValueError as e:
        print(f"ds-autotune: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="[ds-autotune %(asctime)s] %(message)s", datefmt="%H:%M:%S", stream=sys.stderr)
    try:
        tuner = Autotuner(args.user_script, args.user_args, num_gpus=args.num_gpus, num_nodes=args.num_nodes,
                          launcher_args=_launcher_args(args), memory_per_gpu=args.memory_per_gpu, seed=args.seed,
                          exp_timeout=args.exp_timeout)
    except (ValueError, OSError) as e:
        print(f"ds-autotune: error: {e}", file=sys.stderr)
        return 2
    best = tuner.tune()
    tuner.write_results()
    if mode == "run":
        return tuner.run_after_tuning()
    return 0 if best is not None else 1


if __name__ == "__main__":
    sys.exit(main())
