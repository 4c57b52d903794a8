"""Readable progress: the training line's elapsed time and ETA, per-volume progress in evaluation and inference."""

from __future__ import annotations

import io
import logging

import pytest
import torch
from ignite.engine import Engine

from components.training import progress
from components.training.progress import StatsWithEta, VolumeProgress, remaining_seconds


class FakeClock:
    """Advances ``step`` seconds at every engine iteration (see ``_engine``)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Lines(logging.Handler):
    """The messages a logger emits (MONAI's StatsHandler logger does not propagate to pytest's caplog)."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []
        logging.getLogger(name).addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _engine(clock: FakeClock, seconds_per_iteration: float) -> Engine:
    def step(engine, batch):
        clock.now += seconds_per_iteration
        return {"loss": torch.tensor(0.5)}

    return Engine(step)


def test_pace():
    assert remaining_seconds(0, 10, 5.0) is None
    assert remaining_seconds(3, 10, 6.0) == pytest.approx(14.0)
    assert remaining_seconds(12, 10, 6.0) == 0.0


def test_training_line_ends_with_elapsed_and_eta():
    """2 epochs of 5 iterations at 2 s each: after iteration 3, 6 s elapsed and 7 iterations (14 s) left; the
    line keeps MONAI's format before the suffix."""
    clock = FakeClock()
    engine = _engine(clock, 2.0)
    StatsWithEta(output_transform=lambda out: {"train_loss": out["loss"]}, iteration_log=lambda e, i: i in (3, 10),
                 epoch_log=False, clock=clock, name="eta_test").attach(engine)  # fmt: skip
    lines = Lines("eta_test")
    engine.run(range(5), max_epochs=2)
    assert lines.messages == [
        "Epoch: 1/2, Iter: 3/5 -- train_loss: 0.5000  -- elapsed 0:00:06, ETA 0:00:14",
        "Epoch: 2/2, Iter: 5/5 -- train_loss: 0.5000  -- elapsed 0:00:20, ETA 0:00:00",
    ]


def test_eta_of_a_resumed_run_uses_this_process_pace():
    """Resumed at iteration 5 of 10: the pace is that of the iterations this process ran (3 s), not the restored
    count over this process's time."""
    clock = FakeClock()
    engine = _engine(clock, 3.0)
    engine.load_state_dict({"iteration": 5, "epoch_length": 5, "max_epochs": 2})
    StatsWithEta(output_transform=lambda out: {"train_loss": out["loss"]}, iteration_log=lambda e, i: i == 7,
                 epoch_log=False, clock=clock, name="eta_resume").attach(engine)  # fmt: skip
    lines = Lines("eta_resume")
    engine.run(range(5))
    (line,) = lines.messages
    assert line == ("Epoch: 2/2, Iter: 2/5 -- train_loss: 0.5000  -- elapsed 0:00:06, ETA 0:00:09")


def test_volume_progress_logs_a_line_per_volume_when_not_a_terminal(caplog):
    clock = FakeClock()
    engine = _engine(clock, 3.0)
    VolumeProgress(stream=io.StringIO(), clock=clock).attach(engine)
    with caplog.at_level(logging.INFO, logger="components.training.progress"):
        engine.run(range(4))
    lines = [r.getMessage() for r in caplog.records if r.name == "components.training.progress"]
    assert lines[1] == "volume 2/4 done (3.0 s) -- elapsed 0:00:06, ETA 0:00:06"
    assert lines[-1] == "volume 4/4 done (3.0 s) -- elapsed 0:00:12, ETA 0:00:00" and len(lines) == 4


def test_durations_read_as_python_timedeltas(caplog):
    """Elapsed time and ETA are ``str(datetime.timedelta)`` of the rounded seconds: 7.6 h per volume, 4 volumes."""
    clock = FakeClock()
    engine = _engine(clock, 27_360.4)
    VolumeProgress(stream=io.StringIO(), clock=clock).attach(engine)
    with caplog.at_level(logging.INFO, logger="components.training.progress"):
        engine.run(range(4))
    lines = [r.getMessage() for r in caplog.records if r.name == "components.training.progress"]
    assert lines[0] == "volume 1/4 done (27360.4 s) -- elapsed 7:36:00, ETA 22:48:01"
    assert lines[3] == "volume 4/4 done (27360.4 s) -- elapsed 1 day, 6:24:02, ETA 0:00:00"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_volume_progress_draws_a_bar_on_a_terminal(caplog):
    engine = _engine(FakeClock(), 0.0)
    terminal = Terminal()
    VolumeProgress(stream=terminal).attach(engine)
    with caplog.at_level(logging.INFO, logger="components.training.progress"):
        engine.run(range(4))
    assert "[4/4]" in terminal.getvalue() and "<" in terminal.getvalue()  # count and [elapsed<remaining]
    assert not [r for r in caplog.records if r.name == "components.training.progress"]


def test_volume_progress_is_silent_on_other_ranks(caplog, monkeypatch):
    monkeypatch.setattr(progress, "get_rank", lambda: 1)
    engine = _engine(FakeClock(), 1.0)
    terminal = Terminal()
    VolumeProgress(stream=terminal).attach(engine)
    with caplog.at_level(logging.INFO, logger="components.training.progress"):
        engine.run(range(3))
    assert terminal.getvalue() == "" and not [r for r in caplog.records if r.name == "components.training.progress"]
