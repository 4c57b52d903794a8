"""The time budget of ``benchmarks/gpu_health.py``: each recipe's share of the budget, what its calibration run
measured, and the ``max_epochs`` (with its schedule and validation interval) whose run finishes inside the share.

Why a calibration: a pretraining's schedule (a warm-up, then a cosine decay to ``max_epochs``) cut short by a kill
leaves an encoder in the middle of its decay, which is not the recipe's health at any budget. So each recipe first
runs its bundle for a few epochs, validated once at the end; from that run's TensorBoard wall times and health report
come the seconds per iteration after the first epoch (the epochs' ends and checkpoint saves included), the seconds of
a validation, the seconds of the health report per crop, and what is left of the run's wall time: start-up (imports,
caching, building the network, the first epoch's warm-up) and exit. The run that is read is then the longest whole
number of epochs whose predicted wall time fits what is left of the share, less a margin against the prediction's
error, with its schedule compressed into those epochs (:func:`schedule_overrides`).

Nothing here trains or imports a training library: every function is arithmetic on what the runs measured.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

#: health reports along a run, besides the one at its end (the validation interval is ``max_epochs // REPORTS``)
REPORTS = 4
#: the share of the time left for the run read that the plan keeps free against the prediction's error, and seconds
#: kept free besides
MARGIN = 0.15
MARGIN_S = 3.0
#: an iteration warm-up longer than this share of the run is shortened to it (DINO's 10 of 100 epochs)
WARMUP_SHARE = 0.1
#: bundle ids of a warm-up counted in iterations, and of schedules counted in epochs (compressed with ``max_epochs``)
ITERATION_WARMUPS = ("training#warmup_iterations",)
EPOCH_SCHEDULES = (
    "training#warmup_epochs", "training#teacher_temperature_warmup_epochs", "training#freeze_last_layer_epochs",
    "masking#teacher_temperature_warmup_epochs",
)  # fmt: skip


def share(left_s: float, remaining: int) -> float:
    """The next recipe's share of the ``left_s`` seconds, equal among the ``remaining`` recipes (the time a recipe
    leaves unused goes to the later ones).

    Raises:
        ValueError: ``remaining`` below 1.
    """
    if remaining < 1:
        raise ValueError(f"no recipe left to share {left_s:.0f} s with (remaining={remaining}).")
    return max(0.0, left_s) / remaining


def validation_interval(epochs: int) -> int:
    """Epochs between two health reports of a run of ``epochs``: :data:`REPORTS` along it, at least every epoch."""
    return max(1, int(epochs) // REPORTS)


def report_count(epochs: int, interval: int) -> int:
    """Reports (validation and health) of a run: every ``interval`` epochs and at its last epoch."""
    return int(epochs) // int(interval) + (1 if int(epochs) % int(interval) else 0)


def iteration_seconds(walls: Sequence[tuple[int, float]], epoch_length: int) -> float:
    """Seconds per iteration from the ``(iteration, wall time)`` of a run's logged iterations: the slope from the
    first one logged after the first epoch (whose warm-up is start-up) to the last, the epochs' ends in between
    included; from the second one logged on when the first epoch holds all but one.

    Raises:
        ValueError: fewer than two logged iterations after the first.
    """
    points = sorted(walls)
    later = [p for p in points if p[0] > epoch_length]
    if len(later) < 2:
        later = points[1:]
    if len(later) < 2 or later[-1][0] == later[0][0]:
        raise ValueError(f"cannot time iterations: {len(points)} logged iteration(s) {[p[0] for p in points]}, "
                         "need two after the first; run the calibration for more epochs.")  # fmt: skip
    (first, start), (last, end) = later[0], later[-1]
    return (end - start) / (last - first)


@dataclass(frozen=True)
class Calibration:
    """What a recipe's calibration run measured (seconds, wall clock).

    Attributes:
        epochs: the epochs it ran, validated once, at the end.
        epoch_length: iterations per epoch.
        wall_s: the run's wall time, start to exit.
        iteration_s: seconds per iteration after the first epoch, epochs' ends included.
        validation_s: the validation at the end, without the health report.
        health_s: the health report at the end (its own timing).
        health_crops: the crops of that report.
    """

    epochs: int
    epoch_length: int
    wall_s: float
    iteration_s: float
    validation_s: float
    health_s: float
    health_crops: int

    @property
    def startup_s(self) -> float:
        """What the iterations and the report leave of the wall time: start-up, the first epoch's extra, exit."""
        trained = self.epochs * self.epoch_length * self.iteration_s
        return max(0.0, self.wall_s - trained - self.validation_s - self.health_s)

    @property
    def health_s_per_crop(self) -> float:
        return self.health_s / max(1, self.health_crops)

    def as_dict(self) -> dict:
        return {**asdict(self), "startup_s": round(self.startup_s, 2), "health_s_per_crop": round(self.health_s_per_crop, 4)}


def calibrate(
    loss_walls: Sequence[tuple[int, float]], health_wall: float, iterations: int, epochs: int, wall_s: float,
    health_s: float, health_crops: int,
) -> Calibration:
    """A :class:`Calibration` from a run of ``epochs`` epochs and ``iterations`` iterations that reported once, at its
    end: ``loss_walls`` the ``(iteration, wall time)`` of its logged losses, ``health_wall`` the wall time its health
    scalars were logged at (after the validation and the report), ``health_s`` and ``health_crops`` the report's own.

    Raises:
        ValueError: ``iterations`` not a whole number of ``epochs``, or too few logged iterations to time.
    """
    if epochs < 1 or iterations % epochs:
        raise ValueError(f"{iterations} iterations are not whole epochs of a {epochs}-epoch run.")
    epoch_length = iterations // epochs
    seconds = iteration_seconds(loss_walls, epoch_length)
    last, last_wall = max(loss_walls)
    report = health_wall - last_wall - (iterations - last) * seconds  # from the last iteration to the health scalars
    return Calibration(epochs, epoch_length, wall_s, seconds, max(0.0, report - health_s), health_s, health_crops)


@dataclass(frozen=True)
class Plan:
    """The run to read: ``max_epochs``, its validation interval, iterations, reports and their health crops, its
    predicted wall time and the seconds it had."""

    max_epochs: int
    val_interval: int
    iterations: int
    reports: int
    health_crops: int
    predicted_s: float
    available_s: float

    def as_dict(self) -> dict:
        return {key: round(value, 1) if isinstance(value, float) else value for key, value in asdict(self).items()}


def predicted_seconds(calibration: Calibration, epochs: int, crops_for: Callable[[int], int]) -> float:
    """The wall time of a run of ``epochs`` epochs reporting every :func:`validation_interval` epochs, each report of
    ``crops_for(interval)`` crops."""
    interval = validation_interval(epochs)
    report = calibration.validation_s + calibration.health_s_per_crop * crops_for(interval)
    trained = epochs * calibration.epoch_length * calibration.iteration_s
    return calibration.startup_s + trained + report_count(epochs, interval) * report


def plan_epochs(
    calibration: Calibration, available_s: float, crops_for: Callable[[int], int], cap: int | None = None
) -> Plan | None:
    """The longest run (at most ``cap`` epochs) predicted to end within ``available_s`` less :data:`MARGIN` and
    :data:`MARGIN_S`; None when not even one epoch fits. ``crops_for(interval)``: a report's health crops at that
    validation interval (the bundles' ``"auto"`` crops grow with it)."""
    target = available_s * (1.0 - MARGIN) - MARGIN_S
    per_epoch = calibration.epoch_length * calibration.iteration_s
    bound = int(max(0.0, target) / per_epoch) + 1 if per_epoch > 0 else 1
    best = None
    for epochs in range(1, (min(cap, bound) if cap else bound) + 1):
        seconds = predicted_seconds(calibration, epochs, crops_for)
        if seconds <= target:
            best = (epochs, seconds)
    if best is None:
        return None
    epochs, seconds = best
    interval = validation_interval(epochs)
    return Plan(epochs, interval, epochs * calibration.epoch_length, report_count(epochs, interval), crops_for(interval),
                seconds, available_s)  # fmt: skip


def _shipped(config: Mapping, key: str) -> object:
    """The value of bundle id ``key`` (``group#name``) in a train.json's content, None when it has none."""
    node: object = config
    for part in key.split("#"):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def schedule_overrides(config: Mapping, epochs: int, epoch_length: int) -> dict[str, int]:
    """The bundle's schedule (``config``: its train.json's content) compressed into ``epochs`` epochs of
    ``epoch_length`` iterations: each epoch schedule of :data:`EPOCH_SCHEDULES` keeps its share of the shipped
    ``max_epochs`` (at least one epoch when it ships one; at most the run), each iteration warm-up of
    :data:`ITERATION_WARMUPS` its shipped length unless that exceeds :data:`WARMUP_SHARE` of the run. Ids the bundle
    does not have are left out.

    Raises:
        ValueError: a schedule id whose shipped value is not an integer literal.

    Example:
        >>> schedule_overrides({"max_epochs": 100, "training": {"warmup_epochs": 10, "warmup_iterations": 500}}, 20, 14)
        {'training#warmup_iterations': 28, 'training#warmup_epochs': 2}
    """
    shipped_epochs = _shipped(config, "max_epochs")
    overrides = {}
    for key in ITERATION_WARMUPS + EPOCH_SCHEDULES:
        value = _shipped(config, key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not isinstance(shipped_epochs, int):
            raise ValueError(f"{key} = {value!r} (max_epochs = {shipped_epochs!r}) in the bundle's train.json: a "
                             "schedule compressed into a short run must ship integers.")  # fmt: skip
        if key in ITERATION_WARMUPS:
            overrides[key] = min(value, math.ceil(WARMUP_SHARE * epochs * epoch_length))
        else:
            overrides[key] = 0 if value == 0 else min(epochs, max(1, round(value * epochs / shipped_epochs)))
    return overrides
