"""Self-distillation of the masked tokens beside masked image modelling: iBOT's masked-token term (Zhou et al., ICLR
2022). SMIT (Jiang et al., MICCAI 2022) adds to it a pooled image token distilled across two masked crops of a volume;
that term, and the two crops, are not implemented here.

The student sees the masked crop; an EMA teacher of its encoder and token head sees the whole crop. At every token the
student's mask hid, the teacher's centred, sharpened softmax over prototypes is the target of the student's
``log_softmax``: the cross-entropy, averaged over the masked tokens, is added to the reconstruction loss. The tokens are
those of the encoder's third stage (``swinViT(x)[3]``: one token per 16^3 voxels), so a mask block of 16^3 voxels (or
a multiple) hides whole tokens. The teacher (the student's ``swinViT`` and ``token_head``) follows the student by EMA
after every optimizer step, with DINO's cosine momentum schedule; its outputs are centred by an EMA of their mean over
the global batch (all ranks), as in DINO.

Defaults are iBOT's for patch tokens: student temperature 0.1, teacher temperature 0.07 warmed up from 0.04, centre
momentum 0.9, teacher momentum 0.996 to 1, weight 1 against the other loss.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from ignite.engine import Engine, Events
from torch import nn

from ...distributed import all_reduce_mean
from ...networks.wrappers import unwrap
from ..self_distillation.recipe import cosine_schedule

__all__ = ["TOKEN_STRIDE", "MaskedTokenDistillation", "stage_tokens"]

#: voxels per axis of one token of the encoder's third stage (patch 2, then three merges)
TOKEN_STRIDE = 16
_STAGE = 3  # swinViT(x)[3]: (B, 8f, *[s // 16])


def stage_tokens(encoder: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The normalised third-stage tokens of ``encoder`` (a ``swinViT``): ``(B, C, *spatial)`` -> ``(B, N, 8 f)``
    with ``N = prod(s // 16)``."""
    features = encoder(x.contiguous(), normalize=True)[_STAGE]
    return features.flatten(start_dim=2).transpose(1, 2)


class MaskedTokenDistillation(nn.Module):
    """The teacher, its centre and schedules, and the masked-token cross-entropy.

    Args:
        student: the prepared masked image network (the bundle's ``@train#network``), with a ``token_head``
            (``MaskedImageModel(distill_prototypes=K)``); its ``swinViT`` and ``token_head`` are copied as the teacher.
        total_iterations: the run's iterations (the momentum's cosine ends there).
        weight: the term's weight against the reconstruction loss.
        momentum: the teacher's EMA momentum at the first and last iteration.
        teacher_temperature, warmup_teacher_temperature, teacher_temperature_warmup_iterations: the teacher's
            temperature, linearly warmed up from ``warmup_teacher_temperature`` over that many iterations.
        student_temperature: the student's temperature.
        center_momentum: the centre's EMA momentum.

    Raises:
        ValueError: a student without ``token_head``, or a temperature or weight that is not positive.
    """

    def __init__(
        self,
        student: nn.Module,
        total_iterations: int,
        weight: float = 1.0,
        momentum: Sequence[float] = (0.996, 1.0),
        teacher_temperature: float = 0.07,
        warmup_teacher_temperature: float = 0.04,
        teacher_temperature_warmup_iterations: int = 0,
        student_temperature: float = 0.1,
        center_momentum: float = 0.9,
    ) -> None:
        super().__init__()
        network = unwrap(student)
        if getattr(network, "token_head", None) is None:
            raise ValueError("MaskedTokenDistillation needs a student with a token_head: build the MaskedImageModel "
                             "with distill_prototypes > 0 (masking#distill_prototypes).")  # fmt: skip
        if not (float(weight) > 0 and float(teacher_temperature) > 0 and float(warmup_teacher_temperature) > 0
                and float(student_temperature) > 0):  # fmt: skip
            raise ValueError("MaskedTokenDistillation: the weight and every temperature must be > 0.")
        self.teacher = nn.ModuleDict({"swinViT": copy.deepcopy(network.swinViT), "token_head": copy.deepcopy(network.token_head)})
        self.teacher.requires_grad_(False).eval()
        prototypes = network.token_head.last_layer.out_features
        self.register_buffer("center", torch.zeros(1, prototypes))
        self.total_iterations = int(total_iterations)
        self.weight = float(weight)
        self.momentum = (float(momentum[0]), float(momentum[1]))
        self.teacher_temperature = float(teacher_temperature)
        self.warmup_teacher_temperature = float(warmup_teacher_temperature)
        self.warmup_iterations = int(teacher_temperature_warmup_iterations)
        self.student_temperature = float(student_temperature)
        self.center_momentum = float(center_momentum)
        self.step = 0

    def momentum_at(self, step: int) -> float:
        return cosine_schedule(self.momentum[0], self.momentum[1], step, self.total_iterations)

    def teacher_temperature_at(self, step: int) -> float:
        if step >= self.warmup_iterations:
            return self.teacher_temperature
        share = step / max(self.warmup_iterations, 1)
        return self.warmup_teacher_temperature + (self.teacher_temperature - self.warmup_teacher_temperature) * share

    @torch.no_grad()
    def teacher_logits(self, image: torch.Tensor) -> torch.Tensor:
        """The teacher's logits of every third-stage token of the whole crops: ``(B, N, K)``."""
        self.teacher.eval()
        return self.teacher["token_head"](stage_tokens(self.teacher["swinViT"], image))

    def loss(
        self, student_logits: torch.Tensor, teacher_logits: torch.Tensor, token_mask: torch.Tensor, count: torch.Tensor
    ) -> torch.Tensor:
        """Cross-entropy from the teacher's targets to the student at the masked tokens, summed over them and divided
        by ``count`` (the masked tokens' count the caller makes global); the centre is updated here.

        Shapes: logits ``(B, N, K)``, ``token_mask`` ``(B, N)`` bool.
        """
        temperature = self.teacher_temperature_at(self.step)
        targets = F.softmax((teacher_logits.float() - self.center) / temperature, dim=-1)
        log_probs = F.log_softmax(student_logits.float() / self.student_temperature, dim=-1)
        cross_entropy = -(targets * log_probs).sum(dim=-1)
        self._update_center(teacher_logits)
        return (cross_entropy * token_mask).sum() / count

    @torch.no_grad()
    def _update_center(self, teacher_logits: torch.Tensor) -> None:
        batch_mean = all_reduce_mean(teacher_logits.float().reshape(-1, teacher_logits.shape[-1]).mean(dim=0, keepdim=True))
        self.center.mul_(self.center_momentum).add_(batch_mean.to(self.center), alpha=1.0 - self.center_momentum)

    @torch.no_grad()
    def update_teacher(self, student: nn.Module) -> None:
        """``teacher <- m teacher + (1 - m) student`` for the encoder and the token head, in two multi-tensor kernels."""
        network = unwrap(student)
        m = self.momentum_at(self.step)
        teacher = [*self.teacher["swinViT"].parameters(), *self.teacher["token_head"].parameters()]
        source = [p.detach() for p in (*network.swinViT.parameters(), *network.token_head.parameters())]
        torch._foreach_mul_(teacher, m)
        torch._foreach_add_(teacher, source, alpha=1.0 - m)

    def attach(self, engine: Engine) -> None:
        """The schedules follow the trainer's iteration; a fresh run's teacher starts as the student (a resumed run
        restored its own)."""
        self.to(engine.state.device)
        engine.add_event_handler(Events.STARTED, self._init_teacher)
        engine.add_event_handler(Events.ITERATION_STARTED, self._schedule)

    def _schedule(self, engine: Engine) -> None:
        self.step = engine.state.iteration - 1

    def _init_teacher(self, engine: Engine) -> None:
        if engine.state.iteration == 0:
            network = unwrap(engine.network)
            self.teacher["swinViT"].load_state_dict(network.swinViT.state_dict())
            self.teacher["token_head"].load_state_dict(network.token_head.state_dict())
