"""Random state per model-parallel rank (Megatron's ``tensor_parallel.random``).

Regions whose tensors are split across tensor-parallel ranks (dropout on a rank's attention heads,
the local slice of a weight initialised without a master copy) must draw *different* numbers on each
rank; everything else (dropout on replicated activations) must draw the *same* numbers. The tracker
keeps named generator states; ``with get_cuda_rng_tracker().fork():`` draws from the model-parallel
state and keeps its progress, restoring the default state afterwards.

``model_parallel_cuda_manual_seed(seed, group)`` seeds both as Megatron does: the default generator
with ``seed`` (the same on every tensor-parallel rank), the tracker's ``"model-parallel-rng"`` state
with ``seed + 2718 + rank in group``. The states are those of the CUDA generator of the current
device where CUDA is available, else the CPU generator, so the same code runs (and is tested) on CPU.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

import ds_comm

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_SEED_OFFSET = 2718  # Megatron's offset of the model-parallel seed


def _on_cuda() -> bool:
    return torch.cuda.is_available()


def _get_rng() -> torch.Tensor:
    return torch.cuda.get_rng_state() if _on_cuda() else torch.get_rng_state()


def _set_rng(state: torch.Tensor) -> None:
    if _on_cuda():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _manual_seed(seed: int) -> None:
    if _on_cuda():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class CudaRNGStatesTracker:
    """Named generator states: ``add(name, seed)`` creates one, ``fork(name)`` draws from it."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        """Forget every state and seed."""
        self.states_, self.seeds_ = {}, set()

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every state (for a checkpoint, or to recompute a region with the same draws)."""
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace every state with a copy of ``states`` (from `get_states`)."""
        self.states_ = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Create state ``name`` seeded with ``seed``; the default generator's state is left as it was."""
        if seed in self.seeds_:
            raise ValueError(f"CudaRNGStatesTracker.add: seed {seed} is already used by a state")
        if name in self.states_:
            raise ValueError(f"CudaRNGStatesTracker.add: a state named {name!r} already exists")
        self.seeds_.add(seed)
        outside = _get_rng()
        try:
            _manual_seed(seed)
            self.states_[name] = _get_rng()
        finally:
            _set_rng(outside)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME):
        """Draw from state ``name`` inside the block; it keeps its progress, the default state is restored."""
        if name not in self.states_:
            raise RuntimeError(f"CudaRNGStatesTracker.fork: no state named {name!r} (known: {sorted(self.states_)}); "
                               "call model_parallel_cuda_manual_seed(seed) or add(name, seed) first")
        outside = _get_rng()
        _set_rng(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_rng()
            _set_rng(outside)


_CUDA_RNG_STATE_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process's tracker (one per process, as Megatron's)."""
    return _CUDA_RNG_STATE_TRACKER


def model_parallel_cuda_manual_seed(seed: int, group=None, *, rank: int | None = None) -> None:
    """Seed the default generator with ``seed`` and the tracker's model-parallel state with
    ``seed + 2718 + rank``, ``rank`` this process's rank in ``group`` (the tensor-parallel group; None:
    the default group, rank 0 without a process group) unless given. The tracker is reset first."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"model_parallel_cuda_manual_seed: seed must be an int, got {seed!r}")
    if rank is None:
        rank = 0 if group is None and not dist.is_initialized() else ds_comm.get_rank(group)
    elif not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ValueError(f"model_parallel_cuda_manual_seed: rank must be a non-negative int, got {rank!r}")
    _CUDA_RNG_STATE_TRACKER.reset()
    _manual_seed(seed)
    _CUDA_RNG_STATE_TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + _SEED_OFFSET + rank)
