"""How fast a pretrained Swin ViT encoder learns while a segmentation network is finetuned from it.

Two levers the finetuning bundles expose, both off by default (the published recipe has neither):

- :func:`encoder_param_groups`: layer-wise learning-rate decay. The decoder and heads learn at the bundle's
  learning rate; each encoder stage one step deeper from the bottleneck learns ``decay`` times slower, so a large
  finetuning rate adapts the decoder without overwriting the pretrained early stages.
- :class:`FreezeEncoder`: the encoder stays frozen for the first iterations, while the randomly initialised decoder
  learns to read it.

MONAI and ignite have neither: MONAI's ``generate_param_groups`` matches layers by hand-written filters with one
rate each, and ignite's ``create_lr_scheduler_with_warmup`` schedules all groups alike.
"""

from __future__ import annotations

import logging
import re

import torch
from ignite.engine import Engine
from monai.engines.utils import IterationEvents

from ..config.values import as_bool
from ..distributed import get_world_size

__all__ = ["FreezeEncoder", "encoder_param_groups", "lr_for_world_size"]

logger = logging.getLogger(__name__)

ENCODER_PREFIX = "swinViT."
_STAGE = re.compile(r"layers(\d+)")


def _name(name: str) -> str:
    """A parameter name without DDP's ``module.`` prefix."""
    return name[len("module.") :] if name.startswith("module.") else name


def _encoder_depths(names: list[str], prefix: str) -> dict[str, int]:
    """Depth of every encoder parameter counted from the bottleneck: the last stage ``layersN`` is 1, ``layers1`` is
    N, anything before the stages (the patch embedding) N + 1."""
    stages = {name: int(m.group(1)) for name in names if name.startswith(prefix) and (m := _STAGE.search(name[len(prefix) :]))}
    last = max(stages.values(), default=0)
    return {name: last - stages[name] + 1 if name in stages else last + 1 for name in names if name.startswith(prefix)}


def lr_for_world_size(lr: float, scale: bool | str = False) -> float:
    """The learning rate of a multi-GPU run: ``lr`` times the number of ranks with ``scale`` (the linear scaling rule,
    for a global batch that grows with the ranks), else ``lr``; ``scale`` as a command line gives it (``"false"``)."""
    return float(lr) * (get_world_size() if as_bool(scale, "scale_lr_with_world_size") else 1)


def encoder_param_groups(
    network: torch.nn.Module, learning_rate: float, decay: float = 1.0, prefix: str = ENCODER_PREFIX
) -> list[dict] | list[torch.nn.Parameter]:
    """Optimizer parameter groups with a learning rate decaying layer-wise into the pretrained encoder.

    The parameters under ``prefix`` (the SwinUNETR encoder, ``swinViT.``) get ``learning_rate * decay ** depth``,
    depth 1 for the last stage (``layers4``) up to 5 for the patch embedding; everything else (the convolutional
    encoder blocks, the decoder, the output head) gets ``learning_rate``. Groups carry ``lr`` only: the optimizer's
    other settings (weight decay, betas) apply to all, and a ``LambdaLR`` schedule such as MONAI's
    ``WarmupCosineSchedule`` keeps the ratios.

    Args:
        network: the network, or its DDP wrapper (names are read without ``module.``).
        learning_rate: the decoder's rate, >= 0.
        decay: the factor per stage, in (0, 1]. 1 returns ``network.parameters()`` as one group, exactly what an
            optimizer built without this function gets (and what its checkpoints hold).
        prefix: the encoder's parameter names start with it.

    Raises:
        ValueError: for a negative rate, a decay outside (0, 1], or a network without parameters under ``prefix``.

    Example::

        >>> net = SwinUNETR(in_channels=1, out_channels=2, feature_size=12)
        >>> groups = encoder_param_groups(net, 1e-3, decay=0.5)
        >>> sorted({g["lr"] for g in groups})
        [3.125e-05, 6.25e-05, 0.000125, 0.00025, 0.0005, 0.001]
    """
    if not learning_rate >= 0:
        raise ValueError(f"learning_rate must be >= 0, got {learning_rate}.")
    if not 0 < decay <= 1:
        raise ValueError(f"encoder_lr_decay must be in (0, 1] (1: no decay), got {decay}.")
    if decay == 1:
        return list(network.parameters())
    named = [(_name(name), param) for name, param in network.named_parameters() if param.requires_grad]
    depths = _encoder_depths([name for name, _ in named], prefix)
    if not depths:
        raise ValueError(f"encoder_lr_decay {decay}: no parameter of {type(network).__name__} starts with {prefix!r}.")
    groups: dict[int, list[torch.nn.Parameter]] = {}
    for name, param in named:
        groups.setdefault(depths.get(name, 0), []).append(param)
    logger.info("encoder_lr_decay %s: learning rates %s (decoder first, then the encoder from its last stage)", decay,
                [learning_rate * decay**depth for depth in sorted(groups)])  # fmt: skip
    return [{"params": groups[depth], "lr": learning_rate * decay**depth} for depth in sorted(groups)]


class FreezeEncoder:
    """Ignite handler: the encoder's parameters do not change during the first ``iterations`` training iterations.

    After each backward of those iterations it drops the gradients of the parameters under ``prefix`` (the
    optimizer skips a parameter without a gradient: no step, no weight decay, no moment update), so the randomly
    initialised decoder first learns to read the pretrained features. Works with any MONAI trainer that fires
    ``IterationEvents.BACKWARD_COMPLETED`` before its optimizer step (``SupervisedTrainer`` does), under DDP too (the
    gradients are already reduced), and after a resume (it reads the trainer's iteration).

    Args:
        network: the trained network (or its DDP wrapper).
        iterations: how many iterations the encoder stays frozen; 0 attaches nothing.
        prefix: the encoder's parameter names start with it.

    Raises:
        ValueError: for a negative count, or, when ``iterations`` > 0, a network without parameters under ``prefix``.
    """

    def __init__(self, network: torch.nn.Module, iterations: int = 0, prefix: str = ENCODER_PREFIX) -> None:
        if int(iterations) < 0:
            raise ValueError(f"freeze_encoder_iterations must be >= 0, got {iterations}.")
        self.iterations = int(iterations)
        self.network = network
        self.params = [param for name, param in network.named_parameters() if _name(name).startswith(prefix)]
        if self.iterations and not self.params:
            raise ValueError(f"freeze_encoder_iterations {iterations}: no parameter of {type(network).__name__} starts with {prefix!r}.")

    def attach(self, engine: Engine) -> None:
        """Registers on MONAI's ``BACKWARD_COMPLETED`` (every MONAI ``Workflow`` has ``IterationEvents``)."""
        if not self.iterations:
            return
        total = (engine.state.max_epochs or 0) * (engine.state.epoch_length or 0)
        if self.iterations >= total > 0 and not isinstance(self.network, torch.nn.parallel.DistributedDataParallel):
            for param in self.params:
                param.requires_grad_(False)
            logger.info("FreezeEncoder: %d encoder tensors frozen for the whole run (%d iterations; no gradients "
                        "through the encoder)", len(self.params), total)  # fmt: skip
            return
        engine.add_event_handler(IterationEvents.BACKWARD_COMPLETED, self)
        logger.info("FreezeEncoder: %d encoder tensors frozen for the first %d iterations", len(self.params), self.iterations)

    def __call__(self, engine: Engine) -> None:
        if engine.state.iteration <= self.iterations:
            for param in self.params:
                param.grad = None
