"""The trainer's validation schedule: :class:`FinalValidationHandler`, MONAI's ``ValidationHandler`` that also
validates the last epoch, so that a run always ends with the best model (``model.pt``) its key metric picked."""

from __future__ import annotations

from ignite.engine import Engine, Events
from monai.handlers import ValidationHandler

__all__ = ["FinalValidationHandler"]


class FinalValidationHandler(ValidationHandler):
    """Runs the validator every ``interval`` epochs (or iterations), as MONAI's ``ValidationHandler`` does, and once
    more at the end of the last epoch when that one was not validated.

    Why: the best-model saver (:class:`~components.BestModelSaver`) writes ``model.pt`` only when a validation runs.
    With ``max_epochs`` below ``val_interval`` (a short first run, e.g. ``--max_epochs 2`` with the finetuning
    bundles' interval of 100), or any ``max_epochs`` that is not a multiple of it, the last weights were never
    validated: a run could exit 0 with no ``model.pt`` at all. A run stopped with ``engine.terminate()`` by a handler
    attached before this one (e.g. an early stop) ends where that handler decided, without a validation more.

    Args:
        interval, validator, epoch_level, exec_at_start: as for ``monai.handlers.ValidationHandler``.

    Attach it where the ``ValidationHandler`` would be (before a checkpoint saver of the same event): the validation
    of the last epoch runs at that epoch's ``EPOCH_COMPLETED``, like any other.

    Example (a bundle's ``train#handlers``)::

        {"_target_": "components.FinalValidationHandler", "validator": "@validate#evaluator",
         "interval": "@training#val_interval"}
    """

    def attach(self, engine: Engine) -> None:
        super().attach(engine)
        engine.add_event_handler(Events.EPOCH_COMPLETED, self.validate_last_epoch)

    def validate_last_epoch(self, engine: Engine) -> None:
        """Validates when the epoch just completed is the run's last, the interval skipped it and the run was not
        stopped."""
        state = engine.state
        if state.epoch != state.max_epochs or engine.should_terminate:
            return
        counter = state.epoch if self.epoch_level else state.iteration
        if counter % self.interval != 0:
            self(engine)
