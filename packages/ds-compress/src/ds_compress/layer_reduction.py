"""Layer reduction: keep ``keep_number_layer`` layers initialised from chosen teacher layers, and KD."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from .config import LayerReductionConfig


def _submodule(model: nn.Module, name: str, what: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise ValueError(f"layer_reduction.{what}: the {'teacher' if 'teacher' in what else 'model'} "
                         f"has no module named {name!r}") from None


def reduce_layers(student: nn.Module, teacher: nn.Module | None, config: LayerReductionConfig) -> nn.Module:
    """Initialise the student's layers from the teacher (DeepSpeed's ``student_initialization``).

    * ``module_name_prefix`` names a ``ModuleList``/``Sequential``.  Student layer ``i`` gets the
      weights of teacher layer ``teacher_layer[i]``.  A student that still has more than
      ``keep_number_layer`` layers is cut to its first ``keep_number_layer``.
    * Without a teacher the model is its own teacher: its layers ``teacher_layer`` are kept, in
      that order, and the others dropped.
    * ``other_module_name``: modules copied from the teacher by name (embeddings, pooler, head).
    """
    if config.module_name_prefix is not None:
        prefix = config.module_name_prefix
        layers = _submodule(student, prefix, "module_name_prefix")
        if not isinstance(layers, (nn.ModuleList, nn.Sequential)):
            raise ValueError(f"layer_reduction.module_name_prefix {prefix!r} must name a ModuleList or "
                             f"Sequential, got {type(layers).__name__}")
        source = _submodule(teacher, prefix, "module_name_prefix (teacher)") if teacher is not None else layers
        bad = [i for i in config.teacher_layer if i >= len(source)]
        if bad:
            raise ValueError(f"layer_reduction.teacher_layer {config.teacher_layer} has indices {bad} "
                             f"outside the {len(source)} layers of {prefix!r}")
        if teacher is None:
            kept = type(layers)(*[layers[i] for i in config.teacher_layer]) if isinstance(layers, nn.Sequential) \
                else nn.ModuleList([layers[i] for i in config.teacher_layer])
            student.set_submodule(prefix, kept)
        else:
            if len(layers) > config.keep_number_layer:
                kept_layers = [layers[i] for i in range(config.keep_number_layer)]
                layers = nn.Sequential(*kept_layers) if isinstance(layers, nn.Sequential) else nn.ModuleList(kept_layers)
                student.set_submodule(prefix, layers)
            if len(layers) != config.keep_number_layer:
                raise ValueError(f"layer_reduction.keep_number_layer={config.keep_number_layer} but the "
                                 f"student has only {len(layers)} layers under {prefix!r}")
            for i, t in enumerate(config.teacher_layer):
                layers[i].load_state_dict(copy.deepcopy(source[t].state_dict()))
    if teacher is not None:
        for name in config.other_module_name:
            target = _submodule(student, name, "other_module_name")
            target.load_state_dict(copy.deepcopy(_submodule(teacher, name, "other_module_name (teacher)").state_dict()))
    else:
        for name in config.other_module_name:
            _submodule(student, name, "other_module_name")
    return student


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                      temperature: float = 1.0) -> torch.Tensor:
    """Knowledge-distillation loss: ``T**2 * KL(softmax(teacher / T) || softmax(student / T))``.

    Averaged over the batch (all leading dimensions); the teacher gets no gradient.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    classes = student_logits.shape[-1]
    s = F.log_softmax(student_logits.reshape(-1, classes) / temperature, dim=-1)
    t = F.log_softmax(teacher_logits.detach().reshape(-1, classes) / temperature, dim=-1)
    return F.kl_div(s, t, reduction="batchmean", log_target=True) * temperature ** 2
