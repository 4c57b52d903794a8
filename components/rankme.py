"""A label-free signal of what a pretraining run learned: the effective rank of its encoder's embeddings (RankMe).

RankMe (Garrido et al., "RankMe: Assessing the downstream performance of pretrained self-supervised
representations by their rank", ICML 2023) is ``exp`` of the entropy of the normalised singular values of the
embedding matrix (N embeddings x D dimensions). It is near 1 when every input maps to the same embedding (a
collapsed encoder) and at most ``min(N, D)``; in that paper it ranks pretraining runs of one method roughly as their
downstream accuracy does, without any label.

MONAI and ignite have no such metric; :class:`EmbeddingRankHandler` computes it on a pretraining bundle's
validation crops at its validation interval and logs it next to the losses (log line and TensorBoard).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
from ignite.engine import Engine, Events
from monai.utils import CommonKeys as Keys

from .engine import reseed_data, unwrap

__all__ = ["EmbeddingRankHandler", "effective_rank", "swin_embeddings"]

logger = logging.getLogger(__name__)

RANKME_TAG = "val_rankme"
_EPS = 1e-7  # the paper's epsilon added to the normalised singular values


def effective_rank(embeddings: torch.Tensor, eps: float = _EPS) -> float:
    """RankMe of an ``(N, D)`` embedding matrix: ``exp(-sum p_k log p_k)`` with ``p_k = s_k / sum(s) + eps`` over its
    singular values ``s_k`` (computed in float64, no centring, as in the paper).

    Raises:
        ValueError: for a matrix that is not 2-D, has fewer than 2 rows, or holds a non-finite value.

    Example:
        >>> round(effective_rank(torch.ones(64, 16)), 3)  # every embedding the same: collapsed
        1.0
        >>> round(effective_rank(torch.eye(16)), 3)  # 16 orthogonal directions of equal weight
        16.0
    """
    if embeddings.ndim != 2 or embeddings.shape[0] < 2:
        raise ValueError(f"embeddings must be an (N, D) matrix with N >= 2, got shape {tuple(embeddings.shape)}.")
    matrix = embeddings.detach().to("cpu", torch.float64)
    if not torch.isfinite(matrix).all():
        raise ValueError("embeddings hold NaN or infinite values: the encoder's output is not finite.")
    singular = torch.linalg.svdvals(matrix)
    total = singular.sum()
    if total <= 0:  # all-zero embeddings: one degenerate direction
        return 1.0
    p = singular / total + eps
    return float(torch.exp(-(p * torch.log(p)).sum()))


def swin_embeddings(network: torch.nn.Module, image: torch.Tensor) -> torch.Tensor:
    """One embedding per crop from the ``swinViT`` encoder of ``network`` (SSLHead, SwinViTEmbedding, SwinUNETR,
    the self-distillation student; DDP / compile wrappers are looked through): the mean of its normalised last-stage
    tokens, ``(B, C, *spatial)`` -> ``(B, 16 * feature_size)``.

    Raises:
        AttributeError: for a network without a ``swinViT`` encoder.
    """
    encoder = getattr(unwrap(network), "swinViT", None)
    if encoder is None:
        raise AttributeError(f"{type(unwrap(network)).__name__} has no swinViT encoder to embed with.")
    return encoder(image.contiguous(), normalize=True)[-1].flatten(start_dim=2).mean(dim=2)


class EmbeddingRankHandler:
    """Ignite handler: RankMe of the encoder's embeddings of the validation crops, every ``interval`` epochs of the
    trainer and at its last epoch.

    It runs the encoder (never through the DDP wrapper, so no collective is involved) without gradients over
    ``data_loader``, reseeded with ``seed`` before each pass so that every evaluation embeds the same crops, logs
    ``val_rankme: 37.20 (96 crops x 192 dims; at most 96)`` and puts the value in ``trainer.state.metrics`` for that
    epoch, where the bundle's ``StatsHandler`` and ``TensorBoardStatsHandler`` (attached after this handler) log it
    with the epoch's other metrics. The value is at most ``min(crops, dims)``: give the loader enough crops. Meant for
    rank 0 only (the bundles disable it elsewhere); under ``multi_gpu_train.json`` it embeds rank 0's validation shard.
    With fewer than 2 crops it logs a WARNING and skips the evaluation (a rank of one crop says nothing).

    Args:
        network: the pretrained network (or its wrapper); ``embed`` gets it with a batch of crops.
        data_loader: batches with an ``"image"`` key (crops of the model's input size).
        interval: epochs between evaluations.
        seed: seed of the loader's random crops.
        embed: ``(network, image) -> (B, D)``; default :func:`swin_embeddings`.
        tag: the metric's name.

    Raises:
        ValueError: for an interval below 1.
    """

    def __init__(
        self,
        network: torch.nn.Module,
        data_loader: Iterable,
        interval: int = 1,
        seed: int = 0,
        embed: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] = swin_embeddings,
        tag: str = RANKME_TAG,
    ) -> None:
        if int(interval) < 1:
            raise ValueError(f"the RankMe interval must be at least one epoch, got {interval!r}.")
        self.network, self.data_loader, self.interval = network, data_loader, int(interval)
        self.seed, self.embed, self.tag = int(seed), embed, tag

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.EPOCH_STARTED, self._forget)
        engine.add_event_handler(Events.EPOCH_COMPLETED(event_filter=self._due), self)

    def _due(self, engine: Engine, epoch: int) -> bool:
        return epoch % self.interval == 0 or epoch == engine.state.max_epochs

    def _forget(self, engine: Engine) -> None:
        """An epoch without an evaluation must not log the last one's value again."""
        engine.state.metrics.pop(self.tag, None)

    def embeddings(self, device: torch.device) -> torch.Tensor:
        """The ``(N, D)`` embeddings of every crop of the (reseeded) loader, on the CPU in float32. The reseeding
        happens inside a forked CPU random state, so the training's random streams are the same with or without it."""
        network = unwrap(self.network)
        was_training = network.training
        network.eval()
        chunks = []
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                reseed_data(self.data_loader, self.seed)
                for batch in self.data_loader:
                    image = batch[Keys.IMAGE]
                    image = image.as_tensor() if hasattr(image, "as_tensor") else image
                    chunks.append(self.embed(network, image.to(device)).float().cpu())
        finally:
            network.train(was_training)
        if not chunks:
            raise ValueError("the RankMe data loader yielded no batch: the validation list is empty.")
        return torch.cat(chunks)

    def __call__(self, engine: Engine) -> None:
        device = next(unwrap(self.network).parameters()).device
        embeddings = self.embeddings(device)
        if embeddings.shape[0] < 2:
            logger.warning("%s skipped: the validation loader gave %d crop (a rank needs at least 2); list more "
                           "validation volumes or raise num_samples", self.tag, embeddings.shape[0])
            return
        value = effective_rank(embeddings)
        engine.state.metrics[self.tag] = value
        logger.info("%s: %.2f (%d crops x %d dims; at most %d)", self.tag, value, *embeddings.shape, min(embeddings.shape))
