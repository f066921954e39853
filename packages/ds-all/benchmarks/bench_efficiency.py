"""Training efficiency: time to a target loss with the seqlen curriculum, progressive layer dropping and random-LTD
against the plain run, all through ``ds_all.initialize`` in one process.

The workload is the yardstick GPT of ARCHITECTURE.md (pre-LN decoder, untied head, no dropout) SCALED DOWN
from its vocab 8192 / d_model 512 / 8 layers / seq 256 (34M parameters) to vocab 256, d_model 128, 6 layers,
4 heads, seq 128, micro-batch 8 (1.3M parameters), AdamW lr 2e-3, fp32, ZeRO stage 0, 1 rank (gloo) x 1 thread:
the four arms must each reach the target within about 4 minutes of wall time together on 2 cores shared with
other work, and the full yardstick needs minutes per arm for the first hundred steps. The data are walks on a
fixed random graph where every token has 4 equally likely successors (``_bench_efficiency_parts.MarkovWalks``),
so the best loss is ln 4 = 1.386; the target, 1.6 by default, is what the plain run reaches in ~150 steps.

Arms (same seed, same initial weights, the same batch at every step):

* ``plain``: the GPT;
* ``curriculum``: top-level ``curriculum_learning`` (seqlen, ``fixed_linear`` from 8 to 128 tokens over
  ``--schedule-steps``, ``difficulty_step`` 8, as DeepSpeed's GPT example with its lengths scaled); the engine
  passes ``curriculum_seqlen`` and the model truncates its batch to it;
* ``pld``: ``progressive_layer_drop`` with theta 0.5 and gamma 0.001 (DeepSpeed's BERT example; ``--pld-gamma``),
  every block wrapped in ``ds_data.ProgressiveLayerDropBlock``. With gamma 0.001 theta is still 0.93 after 150
  steps: PLD's schedule is made for runs of thousands of steps, and little is dropped here;
* ``random_ltd``: ``data_efficiency.data_routing.random_ltd`` on the middle blocks (all but the first and last,
  as DeepSpeed's GPT example), kept tokens ``fixed_linear`` from 32 to 128 over ``--schedule-steps``
  (``seq_per_step`` 8).

Fairness under CPU contention: the arms run in lockstep, one training step of each in turn (which arm goes first
rotates), each step timed with ``perf_counter``, so a slow phase of the machine hits every arm alike. Every
``--eval-every`` steps each arm's model is evaluated (not timed) on held-out walks at the full length, in eval
mode (no dropping, no truncation): an arm's steps-to-target is the first evaluated step whose held-out loss is at
or under the target (the training loss of a truncated or thinned model is not the full model's loss, and a
batch of 8 is noisy), its time-to-target the sum of its own step times up to that step (s/step: their mean); an
arm stops once it has reached the target. The ratio is plain's time over the arm's (goal: >= 1.3x for at least one arm). FLOPs: ds-profiler's
``get_model_profile`` counts the forward of one micro-batch for the plain model, at each curriculum length, and
for one block at each kept length; PLD's is the expectation over its keep probabilities. The table gives each
arm's mean forward FLOPs per step over its steps to the target and the share saved against plain.

    python benchmarks/bench_efficiency.py [--target 1.6] [--max-steps 400] [--json out.json]
    python benchmarks/bench_efficiency.py --seq 256 --d-model 256 --arms plain curriculum random_ltd
    python benchmarks/bench_efficiency.py --quick        # a ~30 s smoke: tiny model, loose target

The defaults are small enough for a few minutes; the savings turn into time only where the tokens' compute
dominates a step (not the optimizer, embedding and head), so the goal is met at ``--seq 256 --d-model 256``
(8 heads, ~6.5 min for three arms): random-LTD 1.43x, the curriculum 1.27x (the package README's table).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_efficiency_parts import GPT, LOSS_FLOOR, Block, ForwardFlops, MarkovWalks, Shape

import ds_all
import ds_comm
from ds_data import ProgressiveLayerDropBlock, convert_to_random_ltd

ARMS = ("plain", "curriculum", "pld", "random_ltd")
FULL = Shape(vocab=256, d_model=128, layers=6, heads=4, seq=128, micro_batch=8)
QUICK = Shape(vocab=64, d_model=64, layers=4, heads=2, seq=64, micro_batch=8)


def _config(arm: str, shape: Shape, args: argparse.Namespace) -> dict:
    config = {"train_micro_batch_size_per_gpu": shape.micro_batch, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0, "torch_adam": True}},
              "gradient_clipping": 1.0, "zero_optimization": {"stage": 0}, "steps_per_print": 10**9}
    if arm == "curriculum":
        config["curriculum_learning"] = {
            "enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8, "max_difficulty": shape.seq,
            "schedule_type": "fixed_linear",
            "schedule_config": {"total_curriculum_step": args.schedule_steps, "difficulty_step": 8}}
    elif arm == "pld":
        config["progressive_layer_drop"] = {"enabled": True, "theta": 0.5, "gamma": args.pld_gamma}
    elif arm == "random_ltd":
        middle = list(range(1, shape.layers - 1))
        config["data_efficiency"] = {"enabled": True, "data_routing": {"enabled": True, "random_ltd": {
            "enabled": True, "total_layer_num": shape.layers, "random_ltd_layer_num": len(middle),
            "random_ltd_layer_id": middle, "model_mask_name": None, "model_type": "decoder",
            "hidden_state_order": "batch_seq_dim",
            "random_ltd_schedule": {"min_value": shape.seq // 4, "max_value": shape.seq,
                                    "schedule_type": "fixed_linear",
                                    "schedule_config": {"require_steps": args.schedule_steps, "seq_per_step": 8}}}}}
    return config


def _engine(arm: str, shape: Shape, args: argparse.Namespace):
    torch.manual_seed(args.seed)
    model = GPT(shape)  # the same initial weights in every arm
    if arm == "pld":
        model.blocks = torch.nn.ModuleList(ProgressiveLayerDropBlock(block, i, shape.layers)
                                           for i, block in enumerate(model.blocks))
    elif arm == "random_ltd":
        convert_to_random_ltd(model, Block)
    engine, *_ = ds_all.initialize(model=model, config=_config(arm, shape, args))
    return engine


def _state(arm: str, engine) -> float | int | None:
    """What sets this arm's forward cost at its last step: the curriculum's length, PLD's theta, the kept tokens."""
    if arm == "curriculum":
        return engine.curriculum_scheduler_legacy.get_current_difficulty()
    if arm == "pld":
        return engine.progressive_layer_drop.get_theta()
    if arm == "random_ltd":
        return engine.random_ltd_scheduler.get_current_seq()
    return None


def _flops(arm: str, state, flops: ForwardFlops, shape: Shape) -> float:
    if arm == "curriculum":
        return flops.model(min(state, shape.seq))
    if arm == "pld":
        return flops.pld(state)
    if arm == "random_ltd":
        return flops.random_ltd(state, shape.layers - 2)
    return flops.model()


def _init_world() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    ds_comm.init_distributed(dist_backend="gloo", verbose=False)


def run(args: argparse.Namespace) -> dict:
    shape = QUICK if args.quick else FULL
    if args.seq is not None or args.d_model is not None:  # a larger, more compute-bound model
        shape = dataclasses.replace(shape, seq=args.seq or shape.seq, d_model=args.d_model or shape.d_model,
                                    heads=max(shape.heads, (args.d_model or shape.d_model) // 32))
    torch.set_num_threads(args.threads)
    _init_world()
    data = MarkovWalks(shape, seed=args.seed)
    held_out = data.held_out(args.eval_samples)
    engines = {arm: _engine(arm, shape, args) for arm in args.arms}
    flops = ForwardFlops(shape)
    record = {arm: {"times": [], "states": [], "eval": [], "reached": None} for arm in args.arms}
    running = list(args.arms)
    start = time.perf_counter()
    step = 0
    while running and step < args.max_steps:
        tokens = data.batch(step)
        order = running[step % len(running):] + running[:step % len(running)]
        for arm in order:
            engine, rec = engines[arm], record[arm]
            theta = _state(arm, engine) if arm == "pld" else None  # theta moves after the step, the others before
            begin = time.perf_counter()
            loss = engine(tokens)
            engine.backward(loss)
            engine.step()
            rec["times"].append(time.perf_counter() - begin)
            rec["states"].append(theta if arm == "pld" else _state(arm, engine))
        step += 1
        if step % args.eval_every == 0 or step == args.max_steps:
            evaluated = list(running)
            for arm in evaluated:
                module = engines[arm].module
                module.eval()
                with torch.no_grad():
                    value = module(held_out).item()
                module.train()
                record[arm]["eval"].append((step, value))
                if value <= args.target:
                    record[arm]["reached"] = step
                    running.remove(arm)
            logging.getLogger("bench_efficiency").info(
                "step %d (%.0f s): %s", step, time.perf_counter() - start,
                ", ".join(f"{arm} {record[arm]['eval'][-1][1]:.3f}" for arm in evaluated))
    rows = []
    for arm in args.arms:
        rec = record[arm]
        steps = rec["reached"]
        counted = steps if steps is not None else len(rec["times"])
        per_step = [_flops(arm, state, flops, shape) for state in rec["states"][:counted]]
        rows.append({"arm": arm, "reached": steps is not None, "steps_to_target": steps,
                     "time_to_target_s": sum(rec["times"][:steps]) if steps is not None else None,
                     "steps_run": len(rec["times"]), "time_run_s": sum(rec["times"]),
                     "mean_step_s": statistics.fmean(rec["times"][:counted]),
                     "last_eval_loss": rec["eval"][-1][1] if rec["eval"] else None,
                     "forward_flops_per_step": statistics.fmean(per_step),
                     "last_state": rec["states"][counted - 1] if counted else None})
    plain = next((r for r in rows if r["arm"] == "plain"), None)
    for row in rows:
        base_time = plain["time_to_target_s"] if plain else None
        row["speedup_vs_plain"] = base_time / row["time_to_target_s"] \
            if base_time is not None and row["time_to_target_s"] else None
        row["forward_flops_saved"] = 1.0 - row["forward_flops_per_step"] / flops.model()
    return {"shape": shape.__dict__, "target": args.target, "loss_floor": LOSS_FLOOR, "lr": args.lr,
            "schedule_steps": args.schedule_steps, "pld_gamma": args.pld_gamma, "threads": args.threads,
            "eval_every": args.eval_every, "wall_s": time.perf_counter() - start,
            "plain_forward_flops_per_step": flops.model(), "rows": rows}


def _print(result: dict) -> None:
    s = result["shape"]
    print(f"GPT vocab {s['vocab']}, d_model {s['d_model']}, {s['layers']} layers, seq {s['seq']}, micro-batch "
          f"{s['micro_batch']}, 1 rank x {result['threads']} thread(s); Markov walks (floor ln 4 = "
          f"{result['loss_floor']:.3f}); target held-out loss {result['target']}; wall {result['wall_s']:.0f} s")
    print(f"{'arm':<11} {'steps':>6} {'time s':>8} {'s/step':>7} {'plain/arm':>9} {'fwd GFLOP/step':>15} "
          f"{'saved':>6} {'goal >=1.3x':>11}")
    for r in result["rows"]:
        steps = str(r["steps_to_target"]) if r["reached"] else f">{r['steps_run']}"
        time_s = f"{r['time_to_target_s']:.1f}" if r["reached"] else f">{r['time_run_s']:.1f}"
        ratio = f"{r['speedup_vs_plain']:.2f}x" if r["speedup_vs_plain"] else "-"
        goal = "-" if r["arm"] == "plain" else ("met" if (r["speedup_vs_plain"] or 0) >= 1.3 else "missed")
        print(f"{r['arm']:<11} {steps:>6} {time_s:>8} {r['mean_step_s']:>7.3f} {ratio:>9} "
              f"{r['forward_flops_per_step'] / 1e9:>15.3f} {r['forward_flops_saved']:>6.1%} {goal:>11}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=float, default=None, help="held-out loss to reach (default 1.6; quick 2.0)")
    parser.add_argument("--max-steps", type=int, default=None, help="give up after this many steps (default 400)")
    parser.add_argument("--schedule-steps", type=int, default=None,
                        help="curriculum and random-LTD schedule length (default 100; quick 30)")
    parser.add_argument("--pld-gamma", type=float, default=0.001)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seq", type=int, help=f"sequence length (default {FULL.seq})")
    parser.add_argument("--d-model", type=int, help=f"model width (default {FULL.d_model}; heads of 32)")
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--eval-samples", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--quick", action="store_true", help="a ~30 s smoke: tiny model, target 2.0")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    if args.target is None:
        args.target = 2.0 if args.quick else 1.6
    if args.max_steps is None:
        args.max_steps = 150 if args.quick else 400
    if args.schedule_steps is None:
        args.schedule_steps = 30 if args.quick else 100
    if args.target <= LOSS_FLOOR:
        parser.error(f"--target must be above the loss floor ln 4 = {LOSS_FLOOR:.3f}, got {args.target}")
    if "plain" not in args.arms:
        parser.error("--arms must include plain (the baseline)")
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("bench_efficiency").setLevel(logging.INFO)
    result = run(args)
    _print(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    ds_comm.destroy_process_group()


if __name__ == "__main__":
    main()
