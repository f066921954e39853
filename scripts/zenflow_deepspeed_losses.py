"""Record DeepSpeed 0.19.8's per-step losses for ZenFlow on the fine-tuning example's configuration (issue 42).

DeepSpeedExamples' training/DeepSpeed-ZenFlow/finetuning trains a Hugging Face Llama with ``zf_config.json``:
bf16, ZeRO stage 2 with ``offload_optimizer`` to the CPU, AdamW (lr 2e-5, weight decay 0.01), clipping 1.0,
``zero_allow_untested_optimizer`` and ``"zenflow": {"topk_ratio": 0.1, "update_interval": 4,
"full_warm_up_rounds": 0, "overlap_step": true}``. This script runs that configuration on 2 ranks (gloo) with a
tiny random ``LlamaForCausalLM`` (the model, data and seed of packages/ds-all/tests/test_zenflow_example.py,
imported from there), ``train_batch_size`` 8, and prints each rank's loss per micro-step as JSON: the fixture
that test compares ds with. Like the example it passes ``training_data`` to ``initialize`` (so ZenFlow's
``select_strategy: auto`` re-selects columns once per epoch: every 8 micro-steps here) and trains 16 micro-steps
(4 ZenFlow update windows, two selections), on batches it builds itself.

It needs DeepSpeed and transformers, so it is not part of CI (no ``test_`` prefix: pytest does not collect it):

    /work/dsref/bin/pip install torch==2.13.0 deepspeed==0.19.8 transformers==5.23.0
    DS_ACCELERATOR=cpu /work/dsref/bin/python scripts/zenflow_deepspeed_losses.py [--overlap-step false] \
        [--zenflow '{"full_warm_up_rounds": 2, "select_strategy": "step", "select_interval": 8}']

DeepSpeed 0.19.8's ZenFlow scrambles every weight matrix at ``initialize``: it lays the matrices out transposed
(a column contiguous) but points each parameter at its slice as if it were not (``_update_model_bit16_weights``
views the slice in the parameter's shape), so the model trains ``W.t().contiguous().view(W.shape)`` instead of
``W`` (the first loss is not the model's), and the CPU optimizer's update lands on other elements than the
gradient it was computed from. By default this script corrects that one method (each matrix pointed at its
slice as the transposed view it is), so the losses are those of DeepSpeed's ZenFlow algorithm on the user's
model; ``--as-released`` records DeepSpeed unchanged.

Runtime: about a minute on 2 CPU cores (DeepSpeed JIT-builds its CPU Adam on first use: ninja and a C++ compiler).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

TEST = Path(__file__).resolve().parents[1] / "packages" / "ds-all" / "tests" / "test_zenflow_example.py"


def _workload():
    spec = importlib.util.spec_from_file_location("zenflow_workload", TEST)
    module = importlib.util.module_from_spec(spec)
    sys.modules["zenflow_workload"] = module
    spec.loader.exec_module(module)
    return module


def _correct_zenflow_layout() -> None:
    """Point each ZenFlow matrix at its slice of the flat buffer as the transposed view its layout holds."""
    from deepspeed.runtime.zenflow.zenflow_stage_1_and_2 import ZenFlowZeroOptimizer

    released = ZenFlowZeroOptimizer._update_model_bit16_weights

    def corrected(self, group_index):
        released(self, group_index)
        flat = self.bit16_groups_flat[group_index]
        for p, offset in zip(self.round_robin_bit16_groups[group_index], self.round_robin_bit16_offsets[group_index],
                             strict=True):
            if p.dim() == 2:
                p.data = flat.narrow(0, offset, p.numel()).view(p.shape[1], p.shape[0]).t()

    ZenFlowZeroOptimizer._update_model_bit16_weights = corrected

    released_select = ZenFlowZeroOptimizer.update_selected_channels

    def measured_on_own_columns(self, tensor, total_size, communication_data_type):
        # the released method walks the bucket counting 2-D parameters only, so each matrix after a 1-D one is
        # measured on a window shifted back by the 1-D gradients' length: hand it the bucket without them
        kept, at = [], 0
        for i, index_in_group, _ in self.ipg_buckets[communication_data_type].params:
            param = self.bit16_groups[i][index_in_group]
            if param.dim() != 1:
                kept.append(tensor.narrow(0, at, param.numel()))
            at += param.numel()
        released_select(self, torch.cat(kept), total_size, communication_data_type)

    ZenFlowZeroOptimizer.update_selected_channels = measured_on_own_columns


def _worker(rank: int, port: int, overrides: dict, out_dir: str, as_released: bool) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    torch.set_num_threads(1)
    import deepspeed

    work = _workload()
    if not as_released:
        _correct_zenflow_layout()
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    model = work.tiny_llama()
    config = work.example_config(**overrides)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                           training_data=work.TokenDataset())
    losses = []
    for step in range(work.STEPS):
        loss = engine(**work.batch(step, rank)).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(losses, f)
    process = getattr(engine.optimizer, "process", None)  # overlap_step's optimizer process outlives os._exit
    if process is not None:
        process.terminate()
        process.join()
    os._exit(0)  # skip DeepSpeed's teardown at exit


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--overlap-step", choices=("true", "false"), default="true")
    parser.add_argument("--zenflow", default="{}", help='more zenflow keys as JSON, e.g. \'{"full_warm_up_rounds": 2}\'')
    parser.add_argument("--config", default="{}", help="top-level keys added to the config as JSON (a scheduler)")
    parser.add_argument("--as-released", action="store_true", help="DeepSpeed unchanged (its weights scrambled)")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    overrides = {"overlap_step": args.overlap_step == "true", **json.loads(args.zenflow)}
    if json.loads(args.config):
        overrides["_config"] = json.loads(args.config)
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(port, overrides, out_dir, args.as_released), nprocs=2, start_method="spawn")
        losses = [json.loads(Path(out_dir, f"{rank}.json").read_text()) for rank in range(2)]
    import deepspeed
    import transformers

    print(json.dumps({"deepspeed": deepspeed.__version__, "torch": torch.__version__,
                      "transformers": transformers.__version__, "zenflow": overrides, "as_released": args.as_released, "losses": losses}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
