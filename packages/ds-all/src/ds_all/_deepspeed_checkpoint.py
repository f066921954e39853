"""``load_checkpoint`` of a checkpoint DeepSpeed wrote: the ZeRO part through ds-zero
(`ds_zero.load_deepspeed_checkpoint`, any world size and stage), the engine's part (counters, the
schedule, the client's entries) from DeepSpeed's model states, as DeepSpeed's own ``load_checkpoint``
restores them."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ds_zero import load_deepspeed_checkpoint

from ._train_state import TrainState

logger = logging.getLogger("ds_all")

LATEST_UNIVERSAL = "latest_universal"  # what DeepSpeed's ds_to_universal writes next to the tags


def load_deepspeed(zero: Any, path: Path, *, train_state: TrainState, lr_scheduler: Any, train_batch_size: int,
                   gradient_accumulation_steps: int, load_module_strict: bool, load_optimizer_states: bool,
                   load_lr_scheduler_states: bool, load_module_only: bool) -> tuple[str, dict[str, Any]]:
    """The checkpoint at ``path`` into ``zero``, the counters into ``train_state`` and the schedule into
    ``lr_scheduler`` (None: none); returns DeepSpeed's ``(path, client_state)``."""
    optimizer_too = load_optimizer_states and not load_module_only
    states = load_deepspeed_checkpoint(zero, path, load_optimizer=optimizer_too, strict=load_module_strict)
    if load_module_only:
        own = ["module"]
    else:
        own = ["module", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size", "data_sampler",
               "random_ltd"]
        steps = int(states.get("global_steps") or 0)
        train_state.global_steps = steps
        train_state.global_samples = int(states.get("global_samples", steps * train_batch_size))
        train_state.micro_steps = steps * gradient_accumulation_steps
        scheduler = states.get("lr_scheduler")
        if load_lr_scheduler_states and lr_scheduler is not None and scheduler is not None:
            lr_scheduler.load_state_dict(scheduler)
    # DeepSpeed hands back every other entry of its model states as the client's (ds_config, ds_version too)
    own += ["lr_scheduler"] if load_lr_scheduler_states else []
    own += ["optimizer"] if load_optimizer_states else []
    return str(path), {k: v for k, v in states.items() if k not in own}
