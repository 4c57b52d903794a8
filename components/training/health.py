"""Is the encoder learning? Each pretext signal beside the value its trivial answer reaches on the same crops.

A pretraining loss means nothing on its own: a masked-voxel L1 of 0.22 is learning on one corpus and the "predict the
crop's mean" answer on another. Every signal here is therefore a :class:`Signal`: its value, the value a trivial
solution reaches on the same validation crops (its baseline), and the verdict that follows:

- ``learning``: the value is beyond its baseline by the signal's margin, in the direction that is better;
- ``at baseline``: it is not (it equals the trivial answer, or is worse);
- ``collapsed``: a collapse signal (the embeddings' spread, the mean's share of their norm, the spread of a
  reconstruction across crops, the prototypes in use) crossed its line: every input gets the same output.

A recipe gives its pretext signals (``Recipe.health(outputs, views)``, see :mod:`components.training.recipe`); the
signals every recipe shares, of the encoder's pooled embeddings, are :func:`embedding_signals`. A
:class:`HealthReport` reads them together: a run is collapsed when any collapse signal says so, at baseline when any
pretext signal is, learning otherwise. :class:`~components.training.health_handler.HealthHandler` logs the report at
every validation of a pretraining bundle, and ``python -m components health`` prints it for any saved encoder.

Where the lines are, and why:

- a pretext signal learns when it is better than its baseline by :data:`RELATIVE_MARGIN` of the baseline (losses), or
  by two standard errors of a chance accuracy over the crops scored (accuracies, :func:`accuracy_margin`): closer
  than that, the trivial answer explains the value;
- the pooled embeddings, L2-normalised, have a per-dimension standard deviation times ``sqrt(D)`` near 1 when they
  spread over the sphere and near 0 when they collapse (lightly's ``std_of_l2_normalized``, scaled so the line
  does not depend on ``D``); below :data:`COLLAPSED_STD` they have collapsed;
- the mean embedding's share of the squared norm is 1 when every embedding is the same; a centred RankMe (the rank of
  what is left after removing the mean) is read only while that residual is at least :data:`MIN_RESIDUAL_SHARE` of
  the norm: below it the centred rank measures a vanishing remainder (a masked image encoder whose mean held
  0.9999956 of the norm had a centred RankMe of 51.5 while every crop got the same reconstruction), and the
  embeddings have collapsed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .rankme import effective_rank

__all__ = ["HealthReport", "Signal", "embedding_signals"]

LEARNING = "learning"
AT_BASELINE = "at baseline"
COLLAPSED = "collapsed"
NOT_COLLAPSED = "not collapsed"

#: a loss learns when it is below its trivial answer's value by this share of that value.
RELATIVE_MARGIN = 0.05
#: the scaled per-dimension std of normalised embeddings below which they have collapsed (1: spread on the sphere).
COLLAPSED_STD = 0.05
#: the share of the embeddings' squared norm outside their mean below which a centred RankMe is not read: the square
#: of :data:`COLLAPSED_STD`, since the per-dimension variances of normalised embeddings add up to about that share,
#: so the centred rank is withheld exactly when the embeddings have collapsed.
MIN_RESIDUAL_SHARE = COLLAPSED_STD**2


@dataclass(frozen=True)
class Signal:
    """One health signal of a run, beside its trivial answer.

    Attributes:
        name: e.g. ``masked_l1``, ``rotation_accuracy``, ``embedding_std``.
        value: the signal on the validation crops.
        baseline: what the trivial answer (or a collapsed encoder) reaches on the same crops.
        better: ``"lower"`` or ``"higher"``: the direction in which the value is better than the baseline.
        margin: how far beyond the baseline, in that direction, the value must be to count as learning (pretext
            signals), or how far beyond it is still collapse (collapse signals).
        kind: ``"pretext"`` (learning / at baseline) or ``"collapse"`` (collapsed / not collapsed).
        advice: what to try when the signal is at its baseline or collapsed.
        note: how to read the value (e.g. why a centred rank is not read), or empty.
    """

    name: str
    value: float
    baseline: float
    better: str
    margin: float
    kind: str = "pretext"
    advice: str = ""
    note: str = ""

    def __post_init__(self) -> None:
        if self.better not in ("lower", "higher"):
            raise ValueError(f"Signal {self.name}: better must be 'lower' or 'higher', got {self.better!r}.")
        if self.kind not in ("pretext", "collapse"):
            raise ValueError(f"Signal {self.name}: kind must be 'pretext' or 'collapse', got {self.kind!r}.")

    @property
    def beyond_baseline(self) -> bool:
        """The value is better than the baseline by more than the margin."""
        gain = self.baseline - self.value if self.better == "lower" else self.value - self.baseline
        return math.isfinite(self.value) and gain > self.margin

    @property
    def verdict(self) -> str:
        if self.kind == "collapse":
            return NOT_COLLAPSED if self.beyond_baseline else COLLAPSED
        return LEARNING if self.beyond_baseline else AT_BASELINE

    def text(self) -> str:
        """``masked_l1 0.127 (trivial: 0.221): learning`` or ``embedding_std 0.31 (collapsed: 0): not collapsed``."""
        return f"{self.name} {_number(self.value)} ({'trivial' if self.kind == 'pretext' else 'collapsed'}: " \
               f"{_number(self.baseline)}): {self.verdict}"  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "verdict": self.verdict}


def _number(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else str(value)


@dataclass
class HealthReport:
    """The signals of one validation, read together.

    Attributes:
        signals: the recipe's pretext signals and the embedding signals.
        crops: how many validation crops the pretext signals were computed on.
        embedded: how many crops the embedding signals were computed on (0: none).
        extra: figures shown beside the verdicts (RankMe raw and centred, the mean's share), not judged.
    """

    signals: list[Signal]
    crops: int = 0
    embedded: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        """``collapsed`` if any collapse signal says so, ``at baseline`` if any pretext signal is, ``learning`` when
        every pretext signal learns, ``not collapsed`` when there is none (an encoder without its pretext heads)."""
        verdicts = {signal.verdict for signal in self.signals}
        if COLLAPSED in verdicts:
            return COLLAPSED
        if AT_BASELINE in verdicts:
            return AT_BASELINE
        return LEARNING if LEARNING in verdicts else NOT_COLLAPSED

    def failing(self) -> list[Signal]:
        """The signals at their baseline or collapsed."""
        return [signal for signal in self.signals if signal.verdict in (AT_BASELINE, COLLAPSED)]

    def line(self) -> str:
        """The one-line report: ``health: learning | masked_l1 0.127 (trivial 0.221): learning | ...``."""
        extra = [f"{name} {_number(value)}" for name, value in self.extra.items()]
        return " | ".join([f"health: {self.verdict}", *(s.text() for s in self.signals), *extra])

    def warning(self) -> str:
        """What a user should read when the run is not learning: every failing signal with its value and baseline,
        then what to try (each piece of advice once); empty when the run is learning."""
        failing = self.failing()
        if not failing:
            return ""
        named = ", ".join(f"{s.name} {s.verdict} ({_number(s.value)} against {_number(s.baseline)})" for s in failing)
        advice = list(dict.fromkeys(s.advice for s in failing if s.advice))
        return f"the encoder is {self.verdict}: {named}" + (". Try: " + "; ".join(advice) if advice else "")

    def as_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "crops": self.crops,
            "embedded": self.embedded,
            "signals": {signal.name: signal.as_dict() for signal in self.signals},
            "extra": {name: value if math.isfinite(value) else None for name, value in self.extra.items()},
        }


def accuracy_margin(chance: float, count: int) -> float:
    """Two standard errors of an accuracy at ``chance`` over ``count`` independent trials: an accuracy closer to
    chance than this is what guessing gives."""
    return 2.0 * math.sqrt(chance * (1.0 - chance) / max(int(count), 1))


def loss_signal(name: str, value: float, baseline: float, advice: str = "", margin: float = RELATIVE_MARGIN) -> Signal:
    """A loss (lower is better) that learns once it is ``margin`` (a share of the baseline) below its trivial value."""
    return Signal(name, float(value), float(baseline), "lower", margin * abs(float(baseline)), "pretext", advice)


def accuracy_signal(name: str, value: float, chance: float, count: int, advice: str = "") -> Signal:
    """An accuracy over ``count`` trials that learns once it is :func:`accuracy_margin` above ``chance``."""
    return Signal(name, float(value), float(chance), "higher", accuracy_margin(chance, count), "pretext", advice)


def collapse_signal(
    name: str, value: float, line: float, advice: str = "", note: str = "", baseline: float = 0.0
) -> Signal:
    """A signal at ``baseline`` (0 by default) when every input gets the same output: collapsed while it is not more
    than ``line`` above it."""
    return Signal(name, float(value), float(baseline), "higher", float(line), "collapse", advice, note)


def visible_fill_errors(
    target: torch.Tensor, visible: torch.Tensor, scored: torch.Tensor, loss: str = "l1", median: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The errors of the trivial reconstructions on the ``scored`` voxels: every voxel of a crop filled with the mean,
    and with the median, of that crop's ``visible`` voxels.

    Args:
        target: ``(B, C, *spatial)`` what a reconstruction is compared with.
        visible: ``(B, 1 or C, *spatial)`` bool, the voxels the network was shown.
        scored: ``(B, 1 or C, *spatial)`` bool, the voxels the loss scores (the masked ones).
        loss: ``"l1"`` or ``"mse"``.
        median: also the median fill's error (a sort of the voxels; False where only the mean's is read).

    Returns:
        ``(mean_fill, median_fill)``: each the error summed over the scored voxels of the batch divided by their
        number, as the recipe's loss averages it (``median_fill`` None without ``median``). A crop with no visible
        voxel is filled with 0.
    """
    target = target.float()
    b, c = target.shape[:2]
    visible = visible.expand_as(target).reshape(b, c, -1)
    scored = scored.expand_as(target).reshape(b, c, -1)
    values = target.reshape(b, c, -1)
    # vectorised (no host sync on an accelerator): masked sums for the means, NaN outside the visible for the medians
    means = (values * visible).sum(dim=-1, keepdim=True) / visible.sum(dim=-1, keepdim=True).clamp_min(1)
    count = scored.sum().clamp_min(1)

    def error(fill: torch.Tensor) -> torch.Tensor:
        difference = values - fill
        per_voxel = difference.abs() if loss == "l1" else difference**2
        return (per_voxel * scored).sum() / count

    if not median:
        return error(means), None
    medians = torch.nan_to_num(values.masked_fill(~visible, float("nan")).nanmedian(dim=-1, keepdim=True).values)
    return error(means), error(medians)


def embedding_signals(embeddings: torch.Tensor) -> tuple[list[Signal], dict[str, float]]:
    """The collapse signals every recipe shares, of ``(N, D)`` pooled embeddings (one row per crop).

    Returns:
        ``(signals, extra)``: the signal ``embedding_std`` (per-dimension std of the L2-normalised embeddings times
        ``sqrt(D)``: ~1 spread, 0 collapsed), and ``extra``: ``rankme`` (raw), ``mean_share`` (the mean embedding's
        share of the squared norm: 1 when every embedding is the same) and ``rankme_centred`` (the rank of what is
        left after removing the mean; NaN, not read, when that residual is below :data:`MIN_RESIDUAL_SHARE`).

    Raises:
        ValueError: for fewer than 2 embeddings or a non-finite one (:func:`~components.training.rankme.effective_rank`).
    """
    raw = effective_rank(embeddings)
    matrix = embeddings.detach().to("cpu", torch.float64)
    dims = matrix.shape[1]
    normalised = torch.nn.functional.normalize(matrix, dim=1)
    std = float(normalised.std(dim=0).mean()) * math.sqrt(dims)
    mean = matrix.mean(dim=0)
    squared = float((matrix**2).sum(dim=1).mean())
    mean_share = float((mean**2).sum()) / squared if squared > 0 else 1.0
    residual = max(0.0, 1.0 - mean_share)
    centred = effective_rank(matrix - mean) if residual >= MIN_RESIDUAL_SHARE else float("nan")
    note = "" if residual >= MIN_RESIDUAL_SHARE else (
        f"the mean holds {mean_share:.7f} of the norm: the centred RankMe of the {residual:.1e} left is not read")  # fmt: skip
    advice = ("every crop gets nearly the same embedding: check the pretext signals; lower the learning rate or "
              "raise the budget; for self-distillation check centring and the teacher temperature")  # fmt: skip
    signal = collapse_signal("embedding_std", std, COLLAPSED_STD, advice, note)
    return [signal], {"rankme": raw, "mean_share": mean_share, "rankme_centred": centred}


def mean_of(batches: Iterable[Mapping[str, tuple[Any, Any]]], weights: Sequence[float]) -> dict[str, tuple[float, float]]:
    """The weighted mean over batches of each ``name -> (value, baseline)`` pair (a recipe's per-batch health)."""
    sums: dict[str, list[float]] = {}
    total = 0.0
    for batch, weight in zip(batches, weights):
        total += weight
        for name, (value, baseline) in batch.items():
            entry = sums.setdefault(name, [0.0, 0.0])
            entry[0] += weight * float(value)
            entry[1] += weight * float(baseline)
    return {name: (v / total, b / total) for name, (v, b) in sums.items()} if total else {}
