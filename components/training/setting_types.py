"""What each setting of the bundles accepts, checked in ``initialize`` before any data is read.

:data:`BUNDLE_SETTINGS` names every setting the bundles share (top-level ids, the ``training``, ``loader``, ``speed``
and ``checkpointing`` groups, the ``network_def`` arguments the docs tell users to override) with its kind
(:mod:`components.config.kinds`); each recipe package adds its own (``components.SSL_SETTINGS``,
``MASKED_IMAGE_SETTINGS``, ``SELF_DISTILLATION_SETTINGS``), which win over these. :func:`check_setting_types` checks
the running bundle's values against them (:func:`components.config.types.check_types`): ``--training#num_samples
1.5`` stops the run at start with ``training#num_samples must be an integer >= 1, got 1.5.``, not after caching.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..checkpoint.architecture import PRETRAINED_ARCH
from ..checkpoint.layouts import CHANNEL_POLICIES
from ..config.kinds import Dict, Either, Flag, Integer, Kind, ListOf, Number, OneOf, Text, or_null
from ..config.running import RunningBundle
from ..config.types import check_types
from ..data.partition import CACHE_MODES
from ..data.store.dataset import ON_READ_ERROR, SOURCE_CHECKS
from .recipe import AMP_DTYPES

__all__ = ["BUNDLE_SETTINGS", "Device", "check_setting_types"]


@dataclass(frozen=True)
class Device(Kind):
    """A device torch can name: ``"cpu"``, ``"cuda"``, ``"cuda:1"`` or a ``torch.device``."""

    @property
    def accepted(self) -> str:
        return "a torch device such as 'cpu', 'cuda' or 'cuda:1'"

    def accepts(self, value: Any) -> bool:
        if isinstance(value, torch.device):
            return True
        try:
            return isinstance(value, str) and torch.device(value) is not None
        except (RuntimeError, ValueError):
            return False


_PATH = Text("a path")
_FOLDER = Text("a folder")
_COUNT = Integer(1)
_SIZE = ListOf(Integer(1), 3).because("voxels along each axis")
_PROBABILITY = Number(0, 1)

#: the kinds of the settings every bundle shares, by id
BUNDLE_SETTINGS: dict[str, Kind] = {
    # where things are
    "bundle_root": _FOLDER,
    "dataset_dir": _FOLDER,
    "datalist": _PATH,
    "output_dir": _FOLDER,
    "ckpt_dir": _FOLDER,
    "checkpoint": _PATH,
    "pretrained_path": or_null(_PATH),
    "eval_list": Text("the name of a list of the datalist, e.g. 'validation' or 'test'"),
    # the run
    "device": Device(),
    "debug": Flag(),
    "max_epochs": _COUNT,
    "batch_size": _COUNT,
    "learning_rate": Number(above=0),
    "roi_size": _SIZE,
    "spacing": ListOf(Number(above=0), 3).because("mm along each axis"),
    "intensity_range": ListOf(Number(), 2).because("the window [low, high] scaled to [0, 1]"),
    "in_channels": _COUNT,
    "label_names": ListOf(Text("a name")),
    "feature_size": Integer(12, multiple_of=12).because("Swin UNETR's embedding size"),
    "corrupt": Flag(),
    "et_label": Integer(0).because("the label of enhancing tumour in the written segmentations"),
    # the network's architecture (network_def arguments the docs name)
    "network_def#use_v2": Flag(),
    "network_def#window_size": _COUNT,
    "network_def#depths": ListOf(_COUNT, 4),
    "network_def#num_heads": ListOf(_COUNT, 4),
    "network_def#pretrained_arch": OneOf(PRETRAINED_ARCH),
    # multi_gpu_*.json
    "dist_backend": OneOf(("nccl", "gloo", "mpi", "ucc")),
    "dist_timeout_s": Number(above=0),
    "log_per_rank": Flag(),
    "scale_lr_with_world_size": Flag(),
    # training
    "training#ssl_bundle_model": _PATH,
    "training#num_samples": _COUNT.because("crops per volume"),
    "training#class_weights": or_null(ListOf(Number(0)).because("one weight per class")),
    "training#flip_prob": _PROBABILITY,
    "training#rotate90_prob": _PROBABILITY,
    "training#weight_decay": Number(0),
    "training#warmup_epochs": Integer(0),
    "training#warmup_iterations": Integer(0),
    "training#encoder_lr_decay": Number(above=0, high=1),
    "training#freeze_encoder_iterations": Integer(0),
    "training#clip_grad_norm": or_null(Number(0)).because("0 or null: no clipping"),
    "training#val_interval": _COUNT.because("epochs between validations"),
    "training#log_interval": _COUNT.because("iterations between log lines"),
    "training#seed": Integer(0),
    "training#sw_batch_size": _COUNT,
    "training#channel_policy": OneOf(CHANNEL_POLICIES),
    "training#pretrained_arch": OneOf(PRETRAINED_ARCH),
    "training#rankme_crops": Either((OneOf(("auto",)), Integer(2))),
    "training#health_warmup_epochs": Integer(0),
    "train#trainer#accumulation_steps": Integer(1, 1).because(
        "PretrainingTrainer does not accumulate gradients: one optimizer step per iteration keeps the scheduler, the "
        "scaler and the recipe's after_step, e.g. a teacher's EMA, in step; raise batch_size or num_samples instead"
    ),
    # loader
    "loader#num_workers": Integer(0),
    "loader#persistent_workers": Flag(),
    "loader#prefetch_factor": _COUNT,
    "loader#pin_memory": Flag(),
    "loader#data_on_device": Flag(),
    "loader#cache": OneOf(CACHE_MODES),
    "loader#store": or_null(_FOLDER.because("the folder `python -m components preprocess` wrote")),
    "loader#on_read_error": OneOf(ON_READ_ERROR),
    "loader#max_read_errors": or_null(Integer(0)),
    "loader#source_root": or_null(_FOLDER.because("the folder that now holds what the store's source root held")),
    "loader#source_check": OneOf(SOURCE_CHECKS),
    "loader#cache_rate": _PROBABILITY,
    "loader#cache_num": _COUNT,
    "loader#replace_rate": _PROBABILITY,
    "loader#check_data": Flag(),
    # speed
    "speed#amp": Flag(),
    "speed#amp_dtype": or_null(OneOf(tuple(AMP_DTYPES))).because(
        "null: bfloat16 where the device supports it in pretraining, autocast's float16 in finetuning"
    ),
    "speed#use_checkpoint": Either((Flag(), OneOf(("auto",)))),
    "speed#fused_attention": Flag(),
    "speed#compile": Flag(),
    "speed#compile_kwargs": Dict(),
    "speed#tune_allocator": Flag(),
    # checkpointing
    "checkpointing#resume": or_null(_PATH),
    "checkpointing#auto_resume": Flag(),
    "checkpointing#iteration_interval": or_null(_COUNT),
    "checkpointing#epoch_interval": or_null(_COUNT),
    "checkpointing#time_interval_s": or_null(Number(above=0)),
}


def check_setting_types(*recipe_settings: Mapping[str, Kind], bundle: RunningBundle | None = None) -> None:
    """Stops the run when a setting has a value of the wrong type or outside what it accepts, in one line per bad
    setting naming the id, the value and what it accepts, before any data is read: the kinds of
    :data:`BUNDLE_SETTINGS`, those of ``recipe_settings`` winning. Call it in ``initialize`` right after
    ``check_overrides``.

    Raises:
        ConfigError: e.g. ``speed#compile must be true or false, got 'maybe'.``

    Example (``initialize`` of the self-distillation bundle)::

        "$components.check_setting_types(components.SELF_DISTILLATION_SETTINGS)"
    """
    kinds = dict(BUNDLE_SETTINGS)
    for settings in recipe_settings:
        kinds.update(settings)
    check_types(kinds, bundle)
