"""One recipe-agnostic pretraining trainer as a MONAI engine.

MONAI's ``SupervisedTrainer`` assumes ``loss(network(image), label)``, autocasts to CUDA only and steps nothing but
the optimizer. A self-supervised step needs views made on the device, a recipe-specific forward and loss, AMP on any
device, clipping after unscaling and a scheduler stepped only when the optimizer stepped (a GradScaler skips
steps on overflow, and stepping the schedule anyway shifts it).
:class:`PretrainingTrainer` owns exactly those shared pieces and replaces only ``_iteration``; what differs between
recipes comes from a :class:`~components.training.recipe.Recipe` (``components.recipes``): its views, its forward,
its loss with named parts and, optionally, an update after each optimizer step (a teacher's EMA).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from ignite.engine import Engine, Events
from monai.engines import SupervisedTrainer
from monai.engines.utils import IterationEvents
from monai.engines.workflow import Workflow
from monai.utils import CommonKeys as Keys
from torch.optim.lr_scheduler import LRScheduler

from ..config.values import as_bool, is_null
from ..distributed import all_reduce_mean
from .log_interval import log_filter
from .recipe import Recipe, RecipeEngineMixin
from .seeding import ReseedEachEpoch
from .settings import check_accumulation_steps

__all__ = ["PretrainingTrainer"]

LOG_KEY = "log"
LOSS_PARTS_KEY = "loss_parts"


class PretrainingTrainer(RecipeEngineMixin, SupervisedTrainer):
    """``SupervisedTrainer`` running one step of a pretraining :class:`Recipe`.

    One iteration: the recipe's views of the batch (drawn on the device from a generator reseeded per
    (seed, epoch, rank)), its forward under autocast, its loss, backward (scaled under fp16 AMP), gradient clipping
    after unscaling, optimizer step, then -- only when the optimizer really stepped (GradScaler skips steps on
    overflow) -- the LR scheduler and the recipe's ``after_step``. MONAI's ``IterationEvents`` fire in MONAI's
    order (FORWARD_COMPLETED, LOSS_COMPLETED, BACKWARD_COMPLETED, MODEL_COMPLETED), each with this iteration's
    values already in ``engine.state.output`` (as MONAI fills it), so a recipe or handler can act between backward
    and the optimizer step (e.g. drop the gradients of a frozen layer). Gradient accumulation is not supported:
    ``accumulation_steps`` other than the integer 1 is refused at construction.

    Args:
        recipe: the :class:`Recipe`; its ``loss`` is also the engine's ``loss_function``.
        lr_scheduler: scheduler stepped once per optimizer step (per iteration), or None.
        clip_grad_norm: max gradient norm, or None/0 for no clipping.
        amp: autocast the forward; fp16 also uses a GradScaler, bf16 needs none. Flags here and ``compile`` may be
            the words a command line passes (``"false"``).
        amp_dtype: "bfloat16" / "float16", or None to choose bf16 where supported.
        seed: base seed of the view generator and the data loader's random transforms.
        log_interval: the iterations whose output carries ``log`` (see :func:`log_filter`): the only iterations
            that reduce the logged values over ranks and read them back to the host.
        other args: as ``monai.engines.SupervisedTrainer`` (its own CUDA-only ``amp`` is not used).

    ``engine.state.output`` is a one-item list (as MONAI handlers expect: ``from_engine(["loss"], first=True)``) of
    a dict with the recipe's ``outputs`` (e.g. ``image``, ``pred``, ``label``), ``loss`` (this rank's, a detached
    tensor), ``loss_parts`` (this rank's named parts, detached tensors) and ``log``. At the log iterations ``log``
    holds ``loss``, ``loss_<part>`` for every named part, the recipe's ``monitor`` values (all averaged over ranks,
    as Python floats) and ``lr``; at the others it is None, which MONAI's stats handlers skip. So on CUDA an
    iteration between two log iterations never waits for the device (bf16; fp16's GradScaler reads its overflow
    flag every step).
    """

    def __init__(
        self,
        device: str | torch.device,
        max_epochs: int,
        train_data_loader: Any,
        network: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        recipe: Recipe,
        lr_scheduler: LRScheduler | None = None,
        clip_grad_norm: float | None = 1.0,
        amp: bool | str = False,
        amp_dtype: str | None = None,
        seed: int = 0,
        log_interval: int = 1,
        train_handlers: Sequence | None = None,
        epoch_length: int | None = None,
        **kwargs: Any,
    ) -> None:
        check_accumulation_steps(kwargs.pop("accumulation_steps", 1))
        if "compile" in kwargs:
            kwargs["compile"] = as_bool(kwargs["compile"], "compile")
        kwargs.setdefault("loss_function", getattr(recipe, "loss", None))
        self.log_due = log_filter(log_interval)
        super().__init__(
            device=device,
            max_epochs=max_epochs,
            train_data_loader=train_data_loader,
            network=network,
            optimizer=optimizer,
            train_handlers=train_handlers,
            epoch_length=epoch_length,
            amp=False,
            decollate=False,
            **kwargs,
        )
        self._setup_recipe(recipe, seed, amp, amp_dtype)
        self.lr_scheduler = lr_scheduler
        self.clip_grad_norm = None if is_null(clip_grad_norm) else clip_grad_norm  # "null" from a command line
        use_scaler = self.use_amp and self.amp_dtype == torch.float16
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=use_scaler)
        self._reseed_data = ReseedEachEpoch(self.seed)
        self.add_event_handler(Events.EPOCH_STARTED, self._seed_epoch)
        if callable(getattr(recipe, "attach", None)):
            recipe.attach(self)

    def run(self) -> None:  # type: ignore[override]
        """Runs the training with this trainer's own GradScaler (MONAI's ``Trainer.run`` would replace it with a
        CUDA-only one, or None)."""
        Workflow.run(self)

    def _seed_epoch(self, engine: Engine) -> None:
        """Crops, worker seeds and views of an epoch depend on (seed, epoch, rank) only: resuming at an epoch
        boundary replays the uninterrupted run."""
        self._seed_views(self._reseed_data(engine))

    def _optimizer_step(self) -> bool:
        """Clip after unscaling, step through the scaler; True when the optimizer really stepped."""
        if self.clip_grad_norm:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.network.parameters(), self.clip_grad_norm)
        scale_before = self.scaler.get_scale() if self.scaler.is_enabled() else None
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return scale_before is None or self.scaler.get_scale() >= scale_before

    def _iteration(self, engine: PretrainingTrainer, batchdata: dict) -> list[dict]:
        """One step. ``engine.state.output`` is this iteration's before each ``IterationEvents`` fires, as in MONAI's
        SupervisedTrainer: the recipe's outputs from FORWARD_COMPLETED on, ``loss`` and ``loss_parts`` from
        LOSS_COMPLETED on, ``log`` at MODEL_COMPLETED."""
        views = self._views(batchdata)
        self.network.train()
        self.optimizer.zero_grad(set_to_none=True)
        outputs = self._forward(views)
        # a one-item list: the shape MONAI handlers read with from_engine([...], first=True) (their decollated
        # outputs); the views of a batch have no per-sample meaning to decollate
        state = {**self.recipe.outputs(outputs, views), LOG_KEY: None}
        engine.state.output = [state]
        engine.fire_event(IterationEvents.FORWARD_COMPLETED)
        total, parts = self.loss_function(outputs, views)
        state.update({Keys.LOSS: total.detach(), LOSS_PARTS_KEY: {name: part.detach() for name, part in parts.items()}})
        engine.fire_event(IterationEvents.LOSS_COMPLETED)
        self.scaler.scale(total).backward()
        engine.fire_event(IterationEvents.BACKWARD_COMPLETED)
        if self._optimizer_step():
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            if callable(getattr(self.recipe, "after_step", None)):
                self.recipe.after_step(engine)
        if self.log_due(engine, engine.state.iteration):
            state[LOG_KEY] = self._log(outputs, views, total, parts)
        engine.fire_event(IterationEvents.MODEL_COMPLETED)
        return engine.state.output

    def _log(self, outputs: Any, views: Any, total: torch.Tensor, parts: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """The logged values, averaged over ranks in one all-reduce and read back to the host (one sync)."""
        monitor = self.recipe.monitor(outputs, views) if callable(getattr(self.recipe, "monitor", None)) else {}
        names = ["loss", *(f"loss_{name}" for name in parts), *monitor]
        values = [total.detach(), *(p.detach() for p in parts.values()), *(torch.as_tensor(m).detach() for m in monitor.values())]
        reduced = all_reduce_mean(torch.stack([v.float().to(total.device) for v in values])).tolist()
        return {**dict(zip(names, reduced)), "lr": self.optimizer.param_groups[0]["lr"]}
