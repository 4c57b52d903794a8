"""Networks: what every recipe and bundle shares about the network.

- ``swin``: the Swin ViT encoder in ``SwinUNETR``'s configuration (``SwinViTSettings``), ``check_roi_size``,
  ``check_stages`` and ``prepare_network``, which every bundle's ``network`` goes through.
- ``probe``: ``LinearProbe``, the finetuning bundles' test of a pretrained encoder alone.
- ``attention``: ``FusedWindowAttention`` (the fused attention kernel in MONAI's window attention).
- ``step_memory``: activation checkpointing decided from a step's memory (``checkpointing_decision``).
- ``wrappers``: ``unwrap`` (the network under its DDP, DataParallel and ``torch.compile`` wrappers).

The recipes' heads live in :mod:`components.recipes`. The names are re-exported here and in ``components``.
"""

from __future__ import annotations

from ..lazy import lazy_names

# the modules whose public names (each one's __all__) are offered here
__getattr__, __dir__ = lazy_names(__name__, modules=("attention", "probe", "step_memory", "swin", "wrappers"))
