"""Test-only probes a layered bundle config attaches to a trainer (``$import tests.probes as probes``)."""

from __future__ import annotations

import json
from pathlib import Path

from ignite.engine import Engine, Events


def record_lr(trainer: Engine, path: str) -> None:
    """Appends ``{"iteration": i, "lr": lr}`` for every iteration, exactly (no log rounding)."""

    def write(engine: Engine) -> None:
        with open(path, "a") as f:
            f.write(json.dumps({"iteration": engine.state.iteration, "lr": engine.optimizer.param_groups[0]["lr"]}) + "\n")

    trainer.add_event_handler(Events.ITERATION_COMPLETED, write)


def stop_after_iteration(trainer: Engine, iteration: int) -> None:
    """Ends the run after ``iteration`` (mid-epoch), like a killed job, once that iteration's handlers have run."""
    trainer.add_event_handler(Events.ITERATION_COMPLETED(once=iteration), lambda engine: engine.terminate())


def stop_after_epoch(trainer: Engine, epoch: int) -> None:
    """Ends the run after ``epoch`` and its validation and checkpoint, like a job stopped between epochs."""
    trainer.add_event_handler(Events.EPOCH_COMPLETED(once=epoch), lambda engine: engine.terminate())


def read_lr(path: str | Path) -> dict[int, float]:
    return {r["iteration"]: r["lr"] for r in map(json.loads, Path(path).read_text().splitlines())}
