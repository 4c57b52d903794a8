"""A training run always ends with a ``models/model.pt``: every training bundle validates its last epoch when
``training#val_interval`` skips it (``components.FinalValidationHandler``), so the key-metric saver writes the model.

- The handler on a bare ignite trainer: the epochs it validates for a few schedules, once per epoch, none at the end
  of a run stopped with ``engine.terminate()``.
- Each training bundle run as a user runs it (``python -m monai.bundle run``, a subprocess) with ``--max_epochs 1``
  below ``--training#val_interval 2``: it exits 0 with ``models/model.pt`` (before, the finetuning, SSL and MIM
  bundles wrote only ``checkpoint.pt`` and inference then asked for the training run just made). The
  self-distillation bundle has no validator: its teacher is saved as ``model.pt`` when the run completes.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from ignite.engine import Engine, Events
from monai.engines import Evaluator

from components import FinalValidationHandler, write_dataset
from components.demo.runner import BUNDLES_DIR
from tests.test_pretrain_bundle import _run
from tests.test_restarts import BUNDLES, IDS

#: the training bundle without a validator (its model.pt is the teacher saved when the run completes)
NO_VALIDATOR = "swin_unetr_dino_pretrain"
RUNS = [(b, i) for b, i in zip(BUNDLES, IDS) if i in ("ssl", "dino", "mim", "btcv", "brats")]


def _validated_epochs(
    max_epochs: int, interval: int, stop_at: int | None = None, epoch_level: bool = True
) -> list[int]:
    """The trainer epochs at which the handler ran the validator in a run of ``max_epochs`` epochs of 2 iterations,
    stopped (``engine.terminate()``) at the end of epoch ``stop_at`` when given."""
    validated: list[int] = []
    validator = Evaluator(device="cpu", val_data_loader=[0], iteration_update=lambda engine, batch: None)
    validator.add_event_handler(Events.EPOCH_COMPLETED, lambda engine: validated.append(engine.state.epoch))
    trainer = Engine(lambda engine, batch: None)
    if stop_at is not None:  # attached first, as the bundles' guards are
        trainer.add_event_handler(Events.EPOCH_COMPLETED(once=stop_at), lambda engine: engine.terminate())
    FinalValidationHandler(interval=interval, validator=validator, epoch_level=epoch_level).attach(trainer)
    trainer.run([0, 1], max_epochs=max_epochs)
    return validated


@pytest.mark.parametrize(
    "max_epochs, interval, expected",
    [(2, 100, [2]), (1, 2, [1]), (5, 2, [2, 4, 5]), (4, 2, [2, 4]), (3, 1, [1, 2, 3])],
)
def test_the_last_epoch_is_validated_once_whatever_the_interval(max_epochs, interval, expected):
    assert _validated_epochs(max_epochs, interval) == expected


def test_iteration_level_validation_adds_the_last_epoch_when_its_last_iteration_was_skipped():
    """Every 3 iterations of 2 per epoch: iterations 3 and 6 (epochs 2 and 3), then none more at the end of epoch 3;
    with 4 epochs, iteration 8 is not a multiple of 3, so the last epoch is validated too."""
    assert _validated_epochs(3, 3, epoch_level=False) == [2, 3]
    assert _validated_epochs(4, 3, epoch_level=False) == [2, 3, 4]


def test_a_run_stopped_early_is_not_validated_at_its_end():
    """Terminated (``engine.terminate()``, e.g. an early stop) at the end of its last epoch or before: the run ends
    where its stopper decided."""
    assert _validated_epochs(3, 100, stop_at=3) == []
    assert _validated_epochs(3, 100, stop_at=1) == []


@pytest.mark.slow
@pytest.mark.parametrize("bundle", [b for b, _ in RUNS], ids=[i for _, i in RUNS])
def test_a_run_shorter_than_the_validation_interval_ends_with_a_model(bundle, tmp_path):
    data = tmp_path / "data"
    write_dataset(data, kind=bundle.kind, num=4, seed=1)
    root = tmp_path / bundle.name
    shutil.copytree(BUNDLES_DIR / bundle.name, root, ignore=shutil.ignore_patterns("models", "eval", "data"))
    overrides = {**bundle.overrides, "dataset_dir": str(data), "max_epochs": 1, "training#val_interval": 2}
    output = _run(root, overrides)  # asserts exit status 0
    model = root / "models" / "model.pt"
    assert model.is_file(), f"no {model}; the run wrote {sorted(p.name for p in model.parent.iterdir())}"
    assert torch.load(model, map_location="cpu", weights_only=True)
    if bundle.name != NO_VALIDATOR:
        assert f"Got new best metric of {bundle.metric}" in output, output[-3000:]
