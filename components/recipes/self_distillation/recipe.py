"""Self-distillation (DINO) as a recipe of :class:`~components.engine.PretrainingTrainer`.

The student is the trainer's network (DDP-wrapped under torchrun); the teacher lives here, is never wrapped, never
receives gradients and follows the student by an exponential moving average after every optimizer step. The
schedules (EMA momentum, teacher temperature, weight decay) are functions of the trainer's iteration, so a resumed
run continues them exactly; the teacher and the loss's centre are this module's state (``state_dict``), which
:class:`~components.ResumableCheckpointSaver` saves and :class:`~components.ResumeHandler` restores as ``recipe``.
"""

from __future__ import annotations

import copy
import math
from typing import Any, NamedTuple

import torch
from ignite.engine import Engine, Events
from monai.engines.utils import IterationEvents
from monai.utils import CommonKeys as Keys
from torch import nn

from ...engine import unwrap
from .loss import SelfDistillationLoss
from .views import MultiCrop, MultiCropViews

__all__ = ["SelfDistillationRecipe", "cosine_schedule"]


def cosine_schedule(start: float, end: float, step: int, total: int) -> float:
    """Half-cosine from ``start`` (step 0) to ``end`` (step ``total``), constant at ``end`` after it."""
    progress = min(max(step, 0) / max(total, 1), 1.0)
    return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * progress))


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
    weights (after any pretrained weights were loaded; a resumed run keeps the restored teacher); before every
    iteration the ``scheduled_weight_decay`` parameter groups (see
    :func:`~components.recipes.self_distillation.weight_decay_groups`) get the cosine weight decay from
    ``weight_decay[0]`` to ``weight_decay[1]``; during the first ``freeze_last_layer_epochs`` epochs the gradients
    of the student's prototype layer (``head.last_layer``) are dropped after backward, as DINO does.

    Args:
        student: the student network (e.g. :class:`SelfDistillationNetwork`, wrappers allowed); copied as the teacher.
        loss_function: the :class:`SelfDistillationLoss` (its centre is part of this module's state).
        views: the :class:`MultiCrop` drawing the views.
        total_iterations: iterations of the whole run (the schedules' length), e.g. ``max_epochs * len(loader)``.
        momentum: (start, end) of the teacher's EMA momentum (DINO: 0.996 -> 1).
        teacher_temperature: the teacher's temperature after warm-up (DINO: 0.04 to 0.07).
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
        self.teacher = copy.deepcopy(unwrap(student)).requires_grad_(False).eval()
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
        return {
            **self.criterion.stats,
            "teacher_temperature": self.teacher_temperature_at(self.step),
            "momentum": self.momentum_at(self.step),
        }

    def outputs(self, outputs: _Outputs, views: MultiCropViews) -> dict[str, Any]:
        return {Keys.IMAGE: views.global_crops, Keys.PRED: outputs.student_embeddings.detach().float()}

    @torch.no_grad()
    def after_step(self, engine: Engine) -> None:
        """The teacher's EMA: ``teacher <- m teacher + (1 - m) student`` with this iteration's momentum."""
        m = self.momentum_at(self.step)
        for teacher, student in zip(self.teacher.parameters(), unwrap(engine.network).parameters()):
            teacher.mul_(m).add_(student.detach(), alpha=1.0 - m)

    # ------------------------------------------------------------------------------------------ handlers
    def attach(self, engine: Engine) -> None:
        """Registers the teacher's initialisation, the per-iteration schedules and the last-layer freeze."""
        self.to(engine.state.device)
        engine.add_event_handler(Events.STARTED, self._init_teacher)
        engine.add_event_handler(Events.ITERATION_STARTED, self._schedule)
        engine.add_event_handler(IterationEvents.BACKWARD_COMPLETED, self._freeze_last_layer)

    def _init_teacher(self, engine: Engine) -> None:
        if engine.state.iteration == 0:  # a fresh run; a resumed one restored its teacher
            self.teacher.load_state_dict(unwrap(engine.network).state_dict())

    def _schedule(self, engine: Engine) -> None:
        self.step = engine.state.iteration - 1
        for group in engine.optimizer.param_groups:
            if group.get("scheduled_weight_decay"):
                group["weight_decay"] = self.weight_decay_at(self.step)

    def _freeze_last_layer(self, engine: Engine) -> None:
        if engine.state.epoch <= self.freeze_last_layer_epochs:
            for param in unwrap(engine.network).head.last_layer.parameters():
                param.grad = None
