"""One recipe-agnostic pretraining evaluator as a MONAI engine: a recipe's views and forward without gradients."""

from __future__ import annotations

from typing import Any

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events
from monai.engines import SupervisedEvaluator

from .recipe import Recipe, RecipeEngineMixin
from .seeding import epoch_seed, reseed_data

__all__ = ["PretrainingEvaluator"]


class PretrainingEvaluator(RecipeEngineMixin, SupervisedEvaluator):
    """``SupervisedEvaluator`` running a :class:`Recipe`'s views and forward without gradients.

    Views and crops are reseeded at every evaluation start, so each validation scores the same views and its
    metrics are comparable across evaluations. The output is the recipe's ``outputs`` dict.
    """

    def __init__(
        self,
        device: str | torch.device,
        val_data_loader: Any,
        network: torch.nn.Module,
        recipe: Recipe,
        amp: bool | str = False,
        amp_dtype: str | None = None,
        seed: int = 12345,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("metric_cmp_fn", lambda current, best: current < best)
        super().__init__(device=device, val_data_loader=val_data_loader, network=network, amp=False, decollate=False, **kwargs)
        self._setup_recipe(recipe, seed, amp, amp_dtype)
        self.add_event_handler(Events.STARTED, self._seed_evaluation)

    def _seed_evaluation(self, engine: Engine) -> None:
        seed = epoch_seed(self.seed, 0, idist.get_rank())
        self._seed_views(seed)
        reseed_data(self.data_loader, seed)

    def _iteration(self, engine: PretrainingEvaluator, batchdata: dict) -> dict:
        views = self._views(batchdata)
        self.network.eval()
        with torch.no_grad():
            outputs = self._forward(views)
        return self.recipe.outputs(outputs, views)
