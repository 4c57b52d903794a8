"""What a pretraining recipe gives the engines (:class:`Recipe`), and the steps both engines run of it
(:class:`RecipeEngineMixin`: the batch image on the device, the views from generators the engine reseeds, the
forward under autocast on any device).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from monai.utils import CommonKeys as Keys

from ..config.values import as_bool, is_null

__all__ = ["Recipe"]

#: the autocast dtypes ``amp_dtype`` names (None or "null": bf16 where the device supports it, fp16 otherwise)
AMP_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@runtime_checkable
class Recipe(Protocol):
    """What a pretraining recipe gives :class:`PretrainingTrainer` (and :class:`PretrainingEvaluator`).

    - ``views(image, generator)``: the network inputs (and targets) of a batch of crops ``image`` (B, C, *spatial),
      already on the device, drawn from ``generator`` only (reseeded per (seed, epoch, rank) by the trainer). A
      ``views`` with a ``host_generator`` parameter also gets a CPU generator, reseeded alike, on accelerators (None
      on CPU): small draws made there can be read on the host without a device sync.
    - ``forward(network, views)``: the network outputs; runs under autocast when AMP is on.
    - ``loss(outputs, views)``: ``(total, {name: part})``, scalar tensors; the trainer logs every part as
      ``loss_<name>``, averaged over ranks.
    - ``outputs(outputs, views)``: the detached tensors the engine's output holds for handlers (``image``, ``pred``, ...).

    Optional: ``monitor(outputs, views) -> {name: scalar}`` (diagnostics logged under their names, averaged over
    ranks), ``after_step(engine)`` (called after every real optimizer step, e.g. a teacher's EMA) and
    ``attach(engine)`` (registers the recipe's own event handlers on the trainer).
    """

    def views(self, image: torch.Tensor, generator: torch.Generator) -> Any: ...

    def forward(self, network: torch.nn.Module, views: Any) -> Any: ...

    def loss(self, outputs: Any, views: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...

    def outputs(self, outputs: Any, views: Any) -> dict[str, Any]: ...


def resolve_amp_dtype(device: torch.device, amp_dtype: str | None) -> torch.dtype:
    """The autocast dtype: ``amp_dtype`` if given, else bf16 where the device supports it, fp16 otherwise."""
    if not is_null(amp_dtype):  # "null" from a command line is None
        if amp_dtype not in AMP_DTYPES:
            raise ValueError(f"amp_dtype must be one of {sorted(AMP_DTYPES)} or None (auto), got {amp_dtype!r}.")
        return AMP_DTYPES[amp_dtype]
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def check_recipe(recipe: Any) -> None:
    """Raises TypeError naming the methods of :class:`Recipe` that ``recipe`` lacks."""
    missing = [name for name in ("views", "forward", "loss", "outputs") if not callable(getattr(recipe, name, None))]
    if missing:
        raise TypeError(f"recipe {type(recipe).__name__} lacks {missing}: see components.training.recipe.Recipe.")


class RecipeEngineMixin:
    """Shared pieces of the trainer and evaluator: the batch image on the device, the recipe's views, autocast."""

    network: torch.nn.Module

    def _setup_recipe(self, recipe: Recipe, seed: int, amp: bool | str, amp_dtype: str | None) -> None:
        check_recipe(recipe)
        self.recipe = recipe
        self.device = torch.device(self.state.device)
        self.seed = int(seed)
        self.use_amp = as_bool(amp, "amp")
        self.amp_dtype = resolve_amp_dtype(self.device, amp_dtype)
        self.view_generator = torch.Generator(device=self.device)
        self.host_generator = torch.Generator() if self.device.type != "cpu" else None
        self._views_take_host = "host_generator" in inspect.signature(recipe.views).parameters

    def _seed_views(self, seed: int) -> None:
        self.view_generator.manual_seed(seed)
        if self.host_generator is not None:
            self.host_generator.manual_seed(seed)

    def _views(self, batchdata: dict) -> Any:
        if not isinstance(batchdata, Mapping) or Keys.IMAGE not in batchdata:
            raise ValueError(f"pretraining batches must be dicts with an {Keys.IMAGE!r} key, got {type(batchdata).__name__}.")
        image = batchdata[Keys.IMAGE]
        image = image.as_tensor() if hasattr(image, "as_tensor") else image
        image = image.to(self.device, non_blocking=True)
        if self._views_take_host:
            return self.recipe.views(image, self.view_generator, host_generator=self.host_generator)
        return self.recipe.views(image, self.view_generator)

    def _forward(self, views: Any) -> Any:
        autocast = torch.autocast(self.device.type, dtype=self.amp_dtype) if self.use_amp else contextlib.nullcontext()
        with autocast:
            return self.recipe.forward(self.network, views)
