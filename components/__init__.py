"""Components of the Swin UNETR self-supervised pretraining and finetuning bundles (``import components``).

The public names of the packages below are offered here and imported on first use (PEP 562 module ``__getattr__``,
:mod:`components.lazy`): ``import components`` costs nothing, ``components.SSLHead`` (as the bundle configs write it) or
``from components import SSLHead`` imports its module then. So ``python -m components --help`` does not pay for torch
and MONAI, and a command imports only what it needs. Each name is listed once, in its module's ``__all__``.

The packages, each one concern; imports point down this list, never up:

- ``release``: packaging, download, export, checkpoint conversion, the code-origin check;
- ``demo``: the demo, its pictures and the bundle runner;
- ``recipes``: one package per pretraining recipe (views, forward, loss, head) and the recipes' pictures;
- ``training``: the recipe-agnostic trainer and evaluator and what every run shares (loader, settings, progress,
  RankMe, the finetuning metrics);
- ``checkpoint``: published layouts, the architecture of a file, pretrained loading, resume, saving;
- ``data``: datalists, rank partitioning, datasets and caches, the data check, the on-disk store, synthetic data;
- ``networks``: the Swin ViT encoder, ``prepare_network``, fused attention, activation checkpointing, the probe;
- ``config``: config values, the running bundle's files and overrides, the override check;
- ``errors`` (the refusals told in one line, once across the ranks), ``distributed`` (the one module that calls
  ``torch.distributed``), ``files`` (atomic writes, digests) and ``lazy`` (these lazy names).
"""

from __future__ import annotations

import importlib

from .lazy import lazy_names

__version__ = "0.4.0"

# the sub-packages and modules whose public names (each module's __all__) are offered here; demo's are not
__getattr__, __dir__ = lazy_names(
    __name__,
    modules=("distributed", "errors", "files"),
    packages=("checkpoint", "config", "data", "networks", "recipes", "release", "training"),
    submodules=("demo",),
)

# the narrow filters of known-harmless third-party warnings (components.training.quiet; logging and warnings only)
importlib.import_module(".training.quiet", __name__).install_filters()
