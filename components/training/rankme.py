"""A label-free signal of what a pretraining run learned: the effective rank of its encoder's embeddings (RankMe).

RankMe (Garrido et al., "RankMe: Assessing the downstream performance of pretrained self-supervised
representations by their rank", ICML 2023) is ``exp`` of the entropy of the normalised singular values of the
embedding matrix (N embeddings x D dimensions). It is near 1 when every input maps to the same embedding (a
collapsed encoder) and at most ``min(N, D)``; in that paper it ranks pretraining runs of one method roughly as their
downstream accuracy does, without any label.

Because the bound depends on N, two values compare only when they embed the same number of inputs: a run validating
7 crops cannot read above 7, one validating 29 can. :class:`EmbeddingRankHandler` therefore embeds a fixed number of
crops (``training#rankme_crops`` in the pretraining bundles, 256 by default), drawn the same way at every validation
from the validation volumes, whatever the length of the validation list.

MONAI and ignite have no such metric; the handler logs it next to the losses (log line and TensorBoard).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from ignite.engine import Engine, Events
from monai.data.utils import set_rnd
from monai.utils import CommonKeys as Keys

from ..errors import ConfigError
from ..networks.wrappers import unwrap

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


def _visit_seed(seed: int, visit: int) -> int:
    """The seed of the ``visit``-th draw of crops: a function of the run's seed and the draw's index alone."""
    return int(np.random.SeedSequence((seed, visit)).generate_state(1)[0])


def draw_crops(dataset: Sequence, crops: int, seed: int) -> Iterator[torch.Tensor]:
    """``crops`` crops of ``dataset``, one ``(C, *roi_size)`` tensor at a time: the volumes visited in order and cycled
    over, each visit running the dataset's own (random) transforms reseeded from ``(seed, visit)``, so the same
    crops every time, whatever the length of the list. The caller forks the random state if it must stay untouched.

    Raises:
        ValueError: an empty dataset.
    """
    volumes = len(dataset)
    if volumes == 0:
        raise ConfigError("the RankMe dataset is empty: the validation list has no volume.")
    transform = getattr(dataset, "transform", dataset)
    drawn, visit = 0, 0
    while True:
        visit_seed = _visit_seed(seed, visit)
        set_rnd(transform, visit_seed)
        torch.manual_seed(visit_seed)
        item = dataset[visit % volumes]
        for sample in item if isinstance(item, list) else [item]:
            image = sample[Keys.IMAGE]
            yield image.as_tensor() if hasattr(image, "as_tensor") else torch.as_tensor(image)
            drawn += 1
            if drawn == crops:
                return
        visit += 1


class EmbeddingRankHandler:
    """Ignite handler: RankMe of the encoder's embeddings of ``crops`` validation crops, every ``interval`` epochs of
    the trainer and at its last epoch.

    The crops: the validation volumes are visited in order and cycled over until ``crops`` crops are drawn; each visit
    runs the dataset's own transforms (so the validation's crop size, ``roi_size``, and its random crops and
    augmentations), reseeded from ``(seed, visit)``, and gives that transform's crops (``training#num_samples`` per
    volume in the bundles). So every evaluation embeds the same crops, their number never depends on the length of the
    validation list, and the crop drawn at a given visit of a given volume is the same in a longer list. The reseeding
    happens inside a forked CPU random state: the training's random streams are the same with or without it. The
    dataset's transforms keep the last visit's random state; the bundles' evaluators reseed them at their own start.

    Why 256 by default: RankMe is at most ``min(N, D)``, ``D = 16 * feature_size`` dimensions (768 at feature size 48,
    192 at 12). N must be the same in the runs compared, and far above the values they reach (3 to 21 in this
    collection's low-data benchmarks, which embed 128 crops), so that the bound does not flatten the differences; 256
    is twice the benchmarks' count and costs one pass without gradients per 4 crops at the SSL bundle's batch (64
    passes), little next to an epoch. The bound is then 256 at feature size 48 and 192 at 12: a value near it means
    the crops, not the encoder, limit the rank; raise N (at the cost of more passes) before comparing such runs.

    It runs the encoder (never through the DDP wrapper, so no collective is involved) without gradients, logs
    ``val_rankme: 37.20 (256 crops x 768 dims; at most 256)`` and puts the value in ``trainer.state.metrics`` for that
    epoch, where the bundle's ``StatsHandler`` and ``TensorBoardStatsHandler`` (attached after this handler) log it
    with the epoch's other metrics. Meant for rank 0 only (the bundles disable it elsewhere); under
    ``multi_gpu_train.json`` it draws from rank 0's validation shard.

    Args:
        network: the pretrained network (or its wrapper); ``embed`` gets it with a batch of crops.
        dataset: the validation dataset: item ``i`` is a dict with an ``"image"`` crop ``(C, *roi_size)``, or a list
            of such dicts (a multi-crop transform such as ``RandSpatialCropSamplesd``).
        crops: N, the number of crops embedded; at least 2.
        batch_size: crops per pass of the encoder.
        interval: epochs between evaluations.
        seed: seed of the crops' random transforms.
        embed: ``(network, image) -> (B, D)``; default :func:`swin_embeddings`.
        tag: the metric's name.

    Raises:
        ValueError: one line naming ``crops`` below 2, ``batch_size`` or ``interval`` below 1; at an evaluation, an
            empty validation list.

    Example (a pretraining bundle's train.json)::

        {"_target_": "components.EmbeddingRankHandler", "network": "@network_def", "dataset": "@validate#dataset",
         "crops": "@training#rankme_crops", "batch_size": "$@batch_size * @training#num_samples",
         "interval": "@training#val_interval", "seed": "@training#seed"}
    """

    def __init__(
        self,
        network: torch.nn.Module,
        dataset: Sequence,
        crops: int = 256,
        batch_size: int = 4,
        interval: int = 1,
        seed: int = 0,
        embed: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] = swin_embeddings,
        tag: str = RANKME_TAG,
    ) -> None:
        if int(crops) < 2:
            raise ConfigError(f"RankMe needs at least 2 crops (training#rankme_crops), got {crops!r}: a rank of one "
                              "embedding says nothing.")  # fmt: skip
        if int(batch_size) < 1:
            raise ConfigError(f"the RankMe batch size must be at least one crop, got {batch_size!r}.")
        if int(interval) < 1:
            raise ConfigError(f"the RankMe interval must be at least one epoch, got {interval!r}.")
        self.network, self.dataset, self.crops = network, dataset, int(crops)
        self.batch_size, self.interval = int(batch_size), int(interval)
        self.seed, self.embed, self.tag = int(seed), embed, tag

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.EPOCH_STARTED, self._forget)
        engine.add_event_handler(Events.EPOCH_COMPLETED(event_filter=self._due), self)

    def _due(self, engine: Engine, epoch: int) -> bool:
        return epoch % self.interval == 0 or epoch == engine.state.max_epochs

    def _forget(self, engine: Engine) -> None:
        """An epoch without an evaluation must not log the last one's value again."""
        engine.state.metrics.pop(self.tag, None)

    def _drawn_crops(self) -> Iterator[torch.Tensor]:
        """The ``crops`` crops, one ``(C, *roi_size)`` tensor at a time, cycling over the volumes (see the class)."""
        return draw_crops(self.dataset, self.crops, self.seed)

    def embeddings(self, device: torch.device) -> torch.Tensor:
        """The ``(crops, D)`` embeddings, on the CPU in float32."""
        network = unwrap(self.network)
        was_training = network.training
        network.eval()
        chunks, batch = [], []
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                for crop in self._drawn_crops():
                    batch.append(crop)
                    if len(batch) == self.batch_size:
                        chunks.append(self.embed(network, torch.stack(batch).to(device)).float().cpu())
                        batch = []
                if batch:
                    chunks.append(self.embed(network, torch.stack(batch).to(device)).float().cpu())
        finally:
            network.train(was_training)
        return torch.cat(chunks)

    def __call__(self, engine: Engine) -> None:
        device = next(unwrap(self.network).parameters()).device
        embeddings = self.embeddings(device)
        value = effective_rank(embeddings)
        engine.state.metrics[self.tag] = value
        logger.info("%s: %.2f (%d crops x %d dims; at most %d)", self.tag, value, *embeddings.shape, min(embeddings.shape))
