"""The health of a pretraining run at every validation: one pass of the recipe over fixed validation crops, one line.

:class:`HealthHandler` runs, at the epochs it is due, the recipe's views and forward on the same validation crops as
RankMe (without gradients, the network in eval mode, views drawn from a generator seeded alike every time), reads
the recipe's pretext signals beside their trivial answers (``Recipe.health`` / ``Recipe.health_signals``) and the
embedding signals every recipe shares (:func:`~components.training.health.embedding_signals`), and

- logs one line at INFO (``health: learning | masked_l1 0.127 (trivial 0.221): learning | ...``) with the crops and
  seconds it took;
- logs a WARNING naming every signal still at its baseline or collapsed, its value, its baseline and what to try, once
  the run is past ``warmup_epochs``;
- puts each signal (``health_<name>``) and its baseline (``health_<name>_trivial``), the verdict (``health``: 1
  learning, 0 at baseline, -1 collapsed) and RankMe (``val_rankme``) in the trainer's metrics of that epoch, which the
  bundle's TensorBoard (and MLflow) handlers attached after it record;
- appends the report to ``summary_file`` (JSON), which the demo and the benchmarks read; a resumed run keeps the
  reports written before its restored iteration.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from ignite.engine import Engine, Events

from ..errors import ConfigError
from ..files import atomic_write
from .seeding import epoch_seed
from ..networks.wrappers import unwrap
from .health import AT_BASELINE, COLLAPSED, HealthReport, embedding_signals, mean_of
from .rankme import RANKME_TAG, EmbeddingRankHandler, swin_embeddings

__all__ = ["HealthHandler", "health_crops", "recipe_health"]

logger = logging.getLogger(__name__)

#: the validation crops a report may embed, per training crop of the epochs between two reports: one pass of the
#: recipe and one of the encoder per crop, without gradients, cost about two thirds of a training step's per crop,
#: so this share keeps a report near a tenth of those epochs
AUTO_CROPS_SHARE = 0.15
#: the fewest and the most crops ``"auto"`` chooses (RankMe's bound is the crops: more than the embedding's 192-768
#: dimensions would only cost time)
AUTO_CROPS_RANGE = (8, 256)

_VERDICT_NUMBER = {COLLAPSED: -1.0, AT_BASELINE: 0.0}


def health_crops(requested: int | str, epoch_length: int, crops_per_iteration: int, interval: int) -> int:
    """The validation crops of a health report: ``requested`` when it is a number, else (``"auto"``) about a tenth of
    the cost of the ``interval`` epochs between two reports, :data:`AUTO_CROPS_SHARE` of their training crops, within
    :data:`AUTO_CROPS_RANGE`. A function of the run's settings alone, so runs of the same settings compare.

    Raises:
        ValueError: ``requested`` neither ``"auto"`` nor an integer of at least 2.

    Example:
        >>> health_crops("auto", epoch_length=24, crops_per_iteration=2, interval=10)
        72
    """
    if requested == "auto":
        wanted = int(AUTO_CROPS_SHARE * int(epoch_length) * int(crops_per_iteration) * int(interval))
        return min(max(wanted, AUTO_CROPS_RANGE[0]), AUTO_CROPS_RANGE[1])
    try:
        crops = int(requested)
        valid = not isinstance(requested, bool) and float(requested) == crops >= 2
    except (TypeError, ValueError):
        valid = False
    if not valid:
        raise ConfigError(f"training#rankme_crops must be 'auto' or an integer >= 2 (the crops of RankMe and of the "
                         f"health report), got {requested!r}.")  # fmt: skip
    return crops


def recipe_health(
    recipe: Any,
    network: torch.nn.Module,
    crops: Sequence[torch.Tensor],
    batch_size: int,
    seed: int,
    embed: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] = swin_embeddings,
    embed_network: torch.nn.Module | None = None,
) -> HealthReport:
    """The :class:`~components.training.health.HealthReport` of ``network`` on ``crops`` (each ``(C, *roi)``).

    Args:
        recipe: the run's recipe; its ``views`` / ``forward`` run on each batch and, when it has them, its
            ``health`` / ``health_signals`` give the pretext signals (without them only the embedding signals).
        network: the network the recipe's ``forward`` takes (wrappers are looked through).
        crops: the validation crops, batched ``batch_size`` at a time in this order.
        seed: the seed of the views' generator (the same views every time).
        embed: ``(network, image) -> (B, D)`` pooled embeddings (default: the ``swinViT``'s last stage).
        embed_network: the network ``embed`` gets (self-distillation embeds with the teacher); default ``network``.

    The network's training mode is restored afterwards; the recipe's state (a teacher's centre) is not touched: only
    ``views``, ``forward`` and ``health`` run, never ``loss``.
    """
    network = unwrap(network)
    embedder = unwrap(embed_network) if embed_network is not None else network
    device = next(network.parameters()).device
    has_health = callable(getattr(recipe, "health", None))
    generator = torch.Generator(device=device).manual_seed(epoch_seed(seed, 0, 0))
    view_kwargs = {}
    if has_health and "host_generator" in inspect.signature(recipe.views).parameters:
        view_kwargs["host_generator"] = torch.Generator().manual_seed(epoch_seed(seed, 0, 0)) if device.type != "cpu" else None
    modes = [(module, module.training) for module in (network, embedder)]
    batches, weights, embeddings = [], [], []
    try:
        network.eval()
        embedder.eval()
        with torch.no_grad():
            for start in range(0, len(crops), int(batch_size)):
                image = torch.stack(list(crops[start : start + int(batch_size)])).to(device)
                embeddings.append(embed(embedder, image).float().cpu())
                if has_health:
                    views = recipe.views(image, generator, **view_kwargs)
                    batches.append(recipe.health(recipe.forward(network, views), views))
                    weights.append(float(image.shape[0]))
    finally:
        for module, mode in modes:
            module.train(mode)
    signals = recipe.health_signals(mean_of(batches, weights), len(crops)) if has_health else []
    shared, extra = embedding_signals(torch.cat(embeddings))
    return HealthReport([*signals, *shared], crops=len(crops) if has_health else 0, embedded=len(crops), extra=extra)


class HealthHandler(EmbeddingRankHandler):
    """Ignite handler of a pretraining trainer: the run's health on fixed validation crops every ``interval`` epochs
    and at its last epoch (see the module docstring for what it logs and writes).

    The crops are :class:`~components.training.rankme.EmbeddingRankHandler`'s: ``crops`` of them, drawn the same way
    at every validation from the validation volumes; RankMe is computed on them too (``val_rankme``).

    Args:
        network: the network the recipe trains (``@network_def``). The recipe is the trainer's (``engine.recipe``,
            a :class:`~components.training.trainer.PretrainingTrainer`'s), read at each report; an engine without one
            gets the embedding signals alone.
        dataset: the validation dataset (as ``EmbeddingRankHandler``'s).
        crops: how many validation crops, at least 2, or ``"auto"``: about a tenth of the cost of the epochs between
            two reports (:func:`health_crops`, from the trainer's epoch length and ``batch_size``).
        batch_size: crops per forward.
        interval: epochs between two reports.
        seed: seed of the crops and of the views.
        warmup_epochs: from this epoch on, a report that is not ``learning`` is logged at WARNING.
        summary_file: the JSON file that collects every report of the run (None: none written).
        embed_network: the network whose encoder embeds the crops (default ``network``; self-distillation: the
            teacher).
        embed: ``(network, image) -> (B, D)``; default :func:`~components.training.rankme.swin_embeddings`.

    Raises:
        ValueError: as ``EmbeddingRankHandler``, and for a negative ``warmup_epochs``.

    Example (a pretraining bundle's train.json, rank 0 only)::

        {"_target_": "components.HealthHandler", "network": "@network_def", "dataset": "@validate#dataset", "crops": "@training#health_crops", "interval": "@training#val_interval",
         "warmup_epochs": "@training#health_warmup_epochs", "summary_file": "$@output_dir + '/health.json'"}
    """

    def __init__(
        self,
        network: torch.nn.Module,
        dataset: Sequence,
        crops: int | str = "auto",
        batch_size: int = 4,
        interval: int = 1,
        seed: int = 0,
        warmup_epochs: int = 1,
        summary_file: str | os.PathLike | None = None,
        embed_network: torch.nn.Module | None = None,
        embed: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] = swin_embeddings,
    ) -> None:
        embedder = embed_network if embed_network is not None else network
        super().__init__(embedder, dataset, health_crops(crops, 1, 1, 1), batch_size, interval, seed, embed)
        self.requested_crops = crops
        if int(warmup_epochs) < 0:
            raise ConfigError(f"warmup_epochs (training#health_warmup_epochs) must be >= 0, got {warmup_epochs!r}.")
        self.trained = network
        self.warmup_epochs = int(warmup_epochs)
        self.summary_file = Path(summary_file) if summary_file else None
        self.reports: list[dict[str, Any]] = []

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.STARTED, self._resume_reports)
        super().attach(engine)

    def _resume_reports(self, engine: Engine) -> None:
        """A resumed run keeps the reports its summary file holds up to the restored iteration; a fresh run (iteration
        0) starts a new list, whatever an earlier run left in the file."""
        start = engine.state.iteration
        if self.summary_file is None or not self.summary_file.is_file() or start == 0:
            self.reports = []
            return
        self.reports = [r for r in json.loads(self.summary_file.read_text())["reports"] if r["iteration"] <= start]

    def _forget(self, engine: Engine) -> None:
        """An epoch without a report must not log the last one's values again."""
        for name in [key for key in engine.state.metrics if key == RANKME_TAG or key.startswith("health")]:
            engine.state.metrics.pop(name)

    def __call__(self, engine: Engine) -> None:
        started = time.perf_counter()
        self.crops = health_crops(self.requested_crops, engine.state.epoch_length or 1, self.batch_size, self.interval)
        with torch.random.fork_rng(devices=[]):
            crops = list(self._drawn_crops())
        report = recipe_health(getattr(engine, "recipe", None), self.trained, crops, self.batch_size, self.seed, self.embed, self.network)
        seconds = time.perf_counter() - started
        raw = report.extra["rankme"]
        metrics = engine.state.metrics
        metrics[RANKME_TAG] = raw
        metrics["health"] = _VERDICT_NUMBER.get(report.verdict, 1.0)
        for signal in report.signals:
            metrics[f"health_{signal.name}"] = signal.value
            metrics[f"health_{signal.name}_trivial"] = signal.baseline
        epoch, iteration = engine.state.epoch, engine.state.iteration
        logger.info("%s (epoch %d, %d crops, %.1f s)", report.line(), epoch, len(crops), seconds)
        if report.verdict in (AT_BASELINE, COLLAPSED) and epoch >= self.warmup_epochs:
            logger.warning("%s (epoch %d, iteration %d; warned from training#health_warmup_epochs = %d on)",
                           report.warning(), epoch, iteration, self.warmup_epochs)  # fmt: skip
        self.reports.append({"epoch": epoch, "iteration": iteration, "seconds": round(seconds, 3), **report.as_dict()})
        if self.summary_file is not None:
            with atomic_write(self.summary_file, "w") as file:
                json.dump({"reports": self.reports}, file, indent=1)
