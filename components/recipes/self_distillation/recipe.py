"""Self-distillation (DINO) as a recipe of :class:`~components.training.trainer.PretrainingTrainer`.

The student is the trainer's network (DDP-wrapped under torchrun); the teacher lives here, is never wrapped, never
receives gradients and follows the student by an exponential moving average after every optimizer step (one
``torch._foreach_mul_`` / ``_foreach_add_`` pair over all parameters, as DINOv2). The teacher is a copy of the
*prepared* student (its attention kernel chosen, its checkpointing set) without stochastic depth. The
schedules (EMA momentum, teacher temperature, weight decay) are functions of the trainer's iteration, so a resumed
run continues them exactly; the teacher and the loss's centre are this module's state (``state_dict``), which
:class:`~components.ResumableCheckpointSaver` saves and :class:`~components.ResumeHandler` restores as ``recipe``.
"""

from __future__ import annotations

import copy
import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from ignite.engine import Engine, Events
from monai.engines.utils import IterationEvents
from monai.networks.layers import DropPath
from monai.utils import CommonKeys as Keys
from torch import nn

from ...networks.wrappers import unwrap
from ...training.health import Signal, collapse_signal, loss_signal
from .loss import SelfDistillationLoss
from .views import MultiCrop, MultiCropViews

__all__ = ["SelfDistillationRecipe", "cosine_schedule", "teacher_copy"]

#: the student-teacher KL (nats) at or below which the student has nothing left to learn from the teacher: with
#: uniform or one-prototype targets (DINO's two collapses, Caron et al. 2021, s5.3) it goes to 0
COLLAPSED_KL = 0.01
#: the prototypes in effective use over a batch at or below which one prototype takes every crop
COLLAPSED_PROTOTYPES = 1.0


def cosine_schedule(start: float, end: float, step: int, total: int) -> float:
    """Half-cosine from ``start`` (step 0) to ``end`` (step ``total``), constant at ``end`` after it."""
    progress = min(max(step, 0) / max(total, 1), 1.0)
    return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * progress))


def teacher_copy(student: nn.Module) -> nn.Module:
    """The teacher of ``student``: a frozen copy in eval mode whose stochastic-depth (``DropPath``) modules are
    replaced by identities, so it never drops a path, whatever mode it is later set to. Same state-dict keys.

    Example::

        >>> teacher = teacher_copy(SelfDistillationNetwork(feature_size=12, dropout_path_rate=0.1))
        >>> any(isinstance(m, DropPath) for m in teacher.modules()), teacher.training
        (False, False)
    """
    teacher = copy.deepcopy(unwrap(student))
    for name, module in list(teacher.named_modules()):
        if isinstance(module, DropPath):
            parent, _, attribute = name.rpartition(".")
            setattr(teacher.get_submodule(parent), attribute, nn.Identity())
    return teacher.requires_grad_(False).eval()


def _mismatched_modules(teacher: nn.Module, student: nn.Module) -> list[str]:
    """Modules of ``student`` whose counterpart in ``teacher`` has another class (``DropPath`` aside)."""
    copied = dict(teacher.named_modules())
    return [
        f"{name or 'the network'}: student {type(module).__name__}, teacher {type(copied.get(name)).__name__}"
        for name, module in student.named_modules()
        if not isinstance(module, DropPath) and type(copied.get(name)) is not type(module)
    ]


class _Outputs(NamedTuple):
    student_embeddings: torch.Tensor  # (V * B, D)
    student_logits: torch.Tensor  # (V * B, K)
    teacher_logits: torch.Tensor  # (G * B, K)


class SelfDistillationRecipe(nn.Module):
    """DINO-style self-distillation: views, forward, loss and the teacher's EMA, for the pretraining trainer.

    One step: :class:`MultiCrop` views of the batch (G global and L local crops per volume); the student (the
    trainer's network) encodes all crops in one forward, the teacher the global crops without gradients; the
    :class:`SelfDistillationLoss` (parts ``dino`` and, if on, ``koleo``); after the optimizer step the teacher
    moves towards the student with momentum ``m(t)`` (cosine from ``momentum[0]`` to ``momentum[1]`` over
    ``total_iterations``).

    Also attached to the trainer (:meth:`attach`): at the start of a fresh run the teacher takes the student's
    weights (after any pretrained weights were loaded; a resumed run keeps the restored teacher), and every run
    checks that the teacher's modules are of the student's classes; before every
    iteration the ``scheduled_weight_decay`` parameter groups (see
    :func:`~components.recipes.self_distillation.weight_decay_groups`) get the cosine weight decay from
    ``weight_decay[0]`` to ``weight_decay[1]``; during the first ``freeze_last_layer_epochs`` epochs the gradients
    of the student's prototype layer (``head.last_layer``) are dropped after backward, as DINO does.

    Args:
        student: the student network as it trains (e.g. :class:`SelfDistillationNetwork` after
            :func:`~components.prepare_network`, wrappers allowed), copied as the teacher by :func:`teacher_copy`.
            A bundle passes ``@train#network``, the prepared network, so the copy is made after the attention kernel was
            chosen whichever id the config resolves first; a teacher copied before (explicit attention under a
            fused student) fails the run's start with the modules that differ.
        loss_function: the :class:`SelfDistillationLoss` (its centre is part of this module's state).
        views: the :class:`MultiCrop` drawing the views.
        total_iterations: iterations of the whole run (the schedules' length), e.g. ``max_epochs * len(loader)``.
        momentum: (start, end) of the teacher's EMA momentum (DINO: 0.996 -> 1).
        teacher_temperature: the teacher's temperature after warm-up (DINO's paper and DINOv2's default config:
            0.07, warmed up from 0.04 over the first 30 epochs; DINO's ``main_dino.py`` default: 0.04, no warm-up).
        warmup_teacher_temperature: the temperature at the first iteration, raised linearly to ``teacher_temperature``
            over ``teacher_temperature_warmup_iterations``.
        weight_decay: (start, end) of the weight-decay schedule (DINO: 0.04 -> 0.4).
        freeze_last_layer_epochs: epochs during which the prototype layer is not trained.

    The trainer logs, averaged over ranks: ``loss``, ``loss_dino`` (``loss_koleo``), ``teacher_entropy`` (normalised
    to [0, 1]), ``kl`` (student-teacher, nats), ``teacher_temperature`` and ``momentum``.
    """

    def __init__(
        self,
        student: nn.Module,
        loss_function: SelfDistillationLoss,
        views: MultiCrop,
        total_iterations: int,
        momentum: tuple[float, float] = (0.996, 1.0),
        teacher_temperature: float = 0.04,
        warmup_teacher_temperature: float = 0.04,
        teacher_temperature_warmup_iterations: int = 0,
        weight_decay: tuple[float, float] = (0.04, 0.4),
        freeze_last_layer_epochs: int = 1,
    ) -> None:
        super().__init__()
        if int(total_iterations) < 1:
            raise ValueError(f"total_iterations must be >= 1, got {total_iterations}.")
        if not 0.0 <= float(momentum[0]) <= float(momentum[1]) <= 1.0:
            raise ValueError(f"momentum must be (start, end) with 0 <= start <= end <= 1, got {momentum!r}.")
        if not (float(teacher_temperature) > 0 and float(warmup_teacher_temperature) > 0):
            raise ValueError(
                f"teacher temperatures must be > 0, got {warmup_teacher_temperature} and {teacher_temperature}."
            )
        if not hasattr(unwrap(student), "head"):
            raise ValueError(f"the student ({type(unwrap(student)).__name__}) has no projection head 'head'.")
        self.teacher = teacher_copy(student)
        self.criterion = loss_function
        self.multi_crop = views
        self.total_iterations = int(total_iterations)
        self.momentum_range = (float(momentum[0]), float(momentum[1]))
        self.teacher_temperature = float(teacher_temperature)
        self.warmup_teacher_temperature = float(warmup_teacher_temperature)
        self.warmup_iterations = int(teacher_temperature_warmup_iterations)
        self.weight_decay_range = (float(weight_decay[0]), float(weight_decay[1]))
        self.freeze_last_layer_epochs = int(freeze_last_layer_epochs)
        self.step = 0  # 0-based index of the current iteration, set before each iteration

    # ------------------------------------------------------------------------------------------- schedules
    def momentum_at(self, step: int) -> float:
        return cosine_schedule(*self.momentum_range, step, self.total_iterations)

    def teacher_temperature_at(self, step: int) -> float:
        if step >= self.warmup_iterations:
            return self.teacher_temperature
        return self.warmup_teacher_temperature + (self.teacher_temperature - self.warmup_teacher_temperature) * (
            step / self.warmup_iterations
        )

    def weight_decay_at(self, step: int) -> float:
        return cosine_schedule(*self.weight_decay_range, step, self.total_iterations)

    # ----------------------------------------------------------------------------------------- the recipe
    def views(
        self, image: torch.Tensor, generator: torch.Generator, host_generator: torch.Generator | None = None
    ) -> MultiCropViews:
        """Multi-crop views; on an accelerator the crop boxes come from the trainer's CPU ``host_generator``."""
        return self.multi_crop(image, generator, host_generator)

    def forward(self, network: nn.Module, views: MultiCropViews) -> _Outputs:  # type: ignore[override]
        embeddings, logits = network([views.global_crops, views.local_crops])
        with torch.no_grad():
            _, teacher_logits = self.teacher(views.global_crops)
        return _Outputs(embeddings, logits, teacher_logits)

    def loss(self, outputs: _Outputs, views: MultiCropViews) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.criterion(
            outputs.student_logits,
            outputs.teacher_logits,
            self.teacher_temperature_at(self.step),
            num_global=self.multi_crop.num_global,
            student_embeddings=outputs.student_embeddings,
        )

    def monitor(self, outputs: _Outputs, views: MultiCropViews) -> dict[str, Any]:
        """The loss's statistics and schedules, and ``loss_dino_trivial``: ``ln K``, the cross-entropy to uniform
        targets."""
        return {
            **self.criterion.stats,
            "loss_dino_trivial": math.log(self.criterion.out_dim),
            "teacher_temperature": self.teacher_temperature_at(self.step),
            "momentum": self.momentum_at(self.step),
        }

    def outputs(self, outputs: _Outputs, views: MultiCropViews) -> dict[str, Any]:
        return {Keys.IMAGE: views.global_crops, Keys.PRED: outputs.student_embeddings.detach().float()}

    def health(self, outputs: _Outputs, views: MultiCropViews) -> dict[str, tuple[Any, Any]]:
        """This batch's signals beside their trivial answers, from the teacher's centred, sharpened targets of the
        global crops and the student's outputs of every crop (the centre is read, never updated)."""
        teacher = outputs.teacher_logits.float() - self.criterion.center
        log_targets = F.log_softmax(teacher / self.teacher_temperature_at(self.step), dim=-1)
        targets = log_targets.exp()
        prototypes = teacher.shape[-1]
        entropy = -(targets * log_targets).sum(dim=-1).mean()
        batch_mean = targets.mean(dim=0)
        in_use = torch.exp(-(batch_mean * torch.log(batch_mean.clamp_min(1e-12))).sum())
        crops = teacher.shape[0] // self.multi_crop.num_global
        log_probs = F.log_softmax(outputs.student_logits.float() / self.criterion.student_temperature, dim=-1).split(crops)
        pairs = [(q * (log_q - log_probs[v])).sum(dim=-1).mean()
                 for t, (q, log_q) in enumerate(zip(targets.split(crops), log_targets.split(crops)))
                 for v in range(len(log_probs)) if v != t]  # fmt: skip
        return {
            "teacher_entropy": (entropy, math.log(prototypes)),
            "student_teacher_kl": (torch.stack(pairs).mean(), 0.0),
            "prototypes_in_use": (in_use, 1.0),
        }

    def health_signals(self, means: dict[str, tuple[float, float]], crops: int) -> list[Signal]:
        """The signals from :meth:`health`'s means over the validation crops:

        - ``teacher_entropy`` (nats) against ``ln K``, its value for uniform targets;
        - ``student_teacher_kl`` (nats): collapsed at or below :data:`COLLAPSED_KL` (nothing left to learn);
        - ``prototypes_in_use``: ``exp`` of the entropy of the teacher's mean target over a batch, collapsed at or
          below :data:`COLLAPSED_PROTOTYPES` above 1 (one prototype takes every crop).
        """
        sharpen = ("the teacher's targets are near uniform (centring without enough sharpening; a longer run drifts "
                   "further): lower training#teacher_temperature, or raise training#center_momentum at small batches")  # fmt: skip
        one = "one prototype takes every crop: raise the teacher temperature or lower the learning rate"
        entropy, kl, in_use = means["teacher_entropy"], means["student_teacher_kl"], means["prototypes_in_use"]
        return [
            loss_signal("teacher_entropy", *entropy, sharpen),
            collapse_signal("student_teacher_kl", kl[0], COLLAPSED_KL, sharpen + "; or " + one, baseline=kl[1]),
            collapse_signal("prototypes_in_use", in_use[0], COLLAPSED_PROTOTYPES, one, baseline=in_use[1]),
        ]

    @torch.no_grad()
    def after_step(self, engine: Engine) -> None:
        """The teacher's EMA: ``teacher <- m teacher + (1 - m) student`` with this iteration's momentum, for all
        parameters at once (two multi-tensor kernels per device and dtype instead of two per parameter)."""
        m = self.momentum_at(self.step)
        teacher = list(self.teacher.parameters())
        student = [p.detach() for p in unwrap(engine.network).parameters()]
        torch._foreach_mul_(teacher, m)
        torch._foreach_add_(teacher, student, alpha=1.0 - m)

    # ------------------------------------------------------------------------------------------ handlers
    def attach(self, engine: Engine) -> None:
        """Registers the teacher's initialisation, the per-iteration schedules and the last-layer freeze."""
        self.to(engine.state.device)
        engine.add_event_handler(Events.STARTED, self._init_teacher)
        engine.add_event_handler(Events.ITERATION_STARTED, self._schedule)
        engine.add_event_handler(IterationEvents.BACKWARD_COMPLETED, self._freeze_last_layer)

    def _init_teacher(self, engine: Engine) -> None:
        student = unwrap(engine.network)
        mismatched = _mismatched_modules(self.teacher, student)
        if mismatched:
            raise ValueError(
                f"SelfDistillationRecipe: the teacher was copied from another network than the one training "
                f"({len(mismatched)} modules differ, e.g. {mismatched[0]}); give the recipe the prepared network "
                "(the bundle's @train#network, after components.prepare_network), not the bare network_def."
            )
        if engine.state.iteration == 0:  # a fresh run; a resumed one restored its teacher
            self.teacher.load_state_dict(student.state_dict())

    def _schedule(self, engine: Engine) -> None:
        self.step = engine.state.iteration - 1
        for group in engine.optimizer.param_groups:
            if group.get("scheduled_weight_decay"):
                group["weight_decay"] = self.weight_decay_at(self.step)

    def _freeze_last_layer(self, engine: Engine) -> None:
        if engine.state.epoch <= self.freeze_last_layer_epochs:
            for param in unwrap(engine.network).head.last_layer.parameters():
                param.grad = None
