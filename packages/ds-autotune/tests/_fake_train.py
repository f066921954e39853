"""A stand-in training script for ds-autotune's tests (standard library only, so each run is fast).

Run by ds-launch on every rank with ``--deepspeed_config cfg.json``. It does what ds-all's engine does
in an autotuning experiment, with a known metric: the model-info run writes ``model_info_path``; an
experiment writes ``metric_path`` with ``throughput = mbs * 1000 / (mbs + 4) / (1 + 0.1 * stage)`` (so the
largest micro-batch at stage 0 is best); without ``autotuning.enabled`` it "trains" and writes
``$FAKE_TRAIN_DONE``. ``$FAKE_TRAIN_LOG`` gets one line per run (rank 0) naming what ran.
"""

import json
import os
import sys

NUM_PARAMS = 1_000_000
ACTIVATION = 1_000_000  # bytes per sample


def main() -> int:
    args = sys.argv[1:]
    path = args[args.index("--deepspeed_config") + 1]
    with open(path) as f:
        cfg = json.load(f)
    rank = int(os.environ["RANK"])
    at = cfg.get("autotuning", {})
    stage = cfg.get("zero_optimization", {}).get("stage", 0)
    mbs = cfg["train_micro_batch_size_per_gpu"]
    log = os.environ.get("FAKE_TRAIN_LOG")
    if log and rank == 0:
        with open(log, "a") as f:
            f.write(json.dumps({"enabled": at.get("enabled", False), "stage": stage, "mbs": mbs,
                                "profile": bool(at.get("model_info"))}) + "\n")
    if os.environ.get("FAKE_TRAIN_FAIL_MBS") == str(mbs):
        print("RuntimeError: out of memory (fake)", file=sys.stderr)
        return 1
    if at.get("enabled") and at.get("model_info", {}).get("profile"):
        if rank == 0:
            _write(at["model_info_path"], {"num_params": NUM_PARAMS, "trainable_num_params": NUM_PARAMS,
                                           "activation_mem_per_gpu": ACTIVATION, "rank": 0, "device_type": "cpu"})
        return 0
    if at.get("enabled"):
        throughput = mbs * 1000 / (mbs + 4) / (1 + 0.1 * stage)
        if rank == 0:
            _write(at["metric_path"], {"throughput": throughput, "latency": 1e6 * cfg["train_batch_size"] / throughput,
                                       "FLOPS_per_gpu": throughput * 1e6, "rank": 0})
        return 0
    done = os.environ.get("FAKE_TRAIN_DONE")
    if done and rank == 0:
        _write(done, {"stage": stage, "mbs": mbs, "gas": cfg["gradient_accumulation_steps"]})
    return 0


def _write(path: str, value: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    sys.exit(main())
