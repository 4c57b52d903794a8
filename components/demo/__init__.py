"""The demo: ``python -m components demo``.

- ``run``: ``run_demo``: synthetic CT, SSL pretraining, finetuning and held-out evaluation, all real bundle runs;
  ``BUDGETS``.
- ``recipes``: the demo-sized runs of each bundle (``DemoBudget``, ``RECIPES``, ``finetune_overrides``, ...), which
  the low-data benchmark runs too.
- ``plots``: the demo's pictures (losses, views, Dice curves, segmentations).
- ``runner``: ``run_bundle``: a ``python -m monai.bundle run`` of a named bundle with overrides, logged.

The names are re-exported here, imported on first use.
"""

from __future__ import annotations

from ..lazy import lazy_names

# the modules whose public names (each one's __all__) are offered here
__getattr__, __dir__ = lazy_names(__name__, modules=("recipes", "run", "runner"))
