"""Demo-sized runs of the shipped bundles: what a pretraining or finetuning run of the demo's five-organ CT task
is, as command-line overrides of each bundle.

The demo (:mod:`components.demo.run`) and the low-data benchmark (``benchmarks/low_data.py``) both run the bundles
with these overrides. The demo's own budgets, data split and steps live in :mod:`~components.demo.run`, which no
process of the benchmark imports: tuning the demo leaves the benchmark's runs and result keys as they are.

The task is made small enough for a CPU: five large organs (:data:`~components.data.synthetic.DEMO_ORGANS`), 1x1x2 mm
voxels, 64x64x32 crops, feature size 12 and 4^3 attention windows (the recipe's 7^3 would pad the first stage's
tokens by half again). The finetuning loss is weighted by :func:`training_class_weights` and the crops are not
mirrored (the kidneys differ only by side).

Example::

    overrides = finetune_overrides(DemoBudget(), datalist, run_dir, "cpu", seed=1, pretrained=None)
    run_bundle(CT_BUNDLE, ("train.json",), overrides, log=run_dir / "train.log")
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config.overrides import defined_overrides
from ..data import synthetic
from .runner import BUNDLES_DIR

__all__ = [
    "DemoBudget", "DemoRecipe", "RECIPES", "SSL_BUNDLE", "DINO_BUNDLE", "MIM_BUNDLE", "CT_BUNDLE", "ROI_SIZE",
    "SPACING", "MASKED_IMAGE_ROI_SIZE", "SSL_ROI_SIZE", "SSL_LOSS_WEIGHTS", "WINDOW_SIZE", "NO_MIRRORING", "LABEL_NAMES", "dino_overrides",
    "finetune_overrides", "inference_overrides", "masked_image_overrides", "pretraining_overrides", "ssl_overrides",
    "training_class_weights",
]

SSL_BUNDLE = "swin_unetr_ssl_pretrain"
DINO_BUNDLE = "swin_unetr_dino_pretrain"
MIM_BUNDLE = "swin_unetr_mim_pretrain"
CT_BUNDLE = "swin_unetr_btcv_finetune"


@dataclass(frozen=True)
class DemoBudget:
    """How much the demo trains. ``ssl_epochs`` are epochs over the unlabeled training list (``ssl_batch``
    volumes x 1 crop per iteration); ``finetune_epochs`` are epochs over the labeled training list (1 volume x
    ``finetune_crops`` crops per iteration), validated every ``val_interval`` epochs. Pretraining uses the recipe's
    rate, 4e-4, after a short warm-up: at 1e-3 after 2 warm-up iterations the rotation loss jumped to 3.8 in the
    first epoch and the contrastive loss stayed at ln 3 (identical embeddings) from the third epoch on. The defaults
    size a run for a CPU; :data:`components.demo.run.BUDGETS` names the demo's budgets."""

    num_labeled: int = 14
    num_unlabeled: int = 48
    ssl_epochs: int = 10
    ssl_batch: int = 2
    ssl_learning_rate: float = 4e-4
    ssl_warmup_iterations: int = 20
    finetune_epochs: int = 42
    finetune_crops: int = 1
    finetune_learning_rate: float = 3e-3
    val_interval: int = 6
    feature_size: int = 12


ROI_SIZE = [64, 64, 32]
SPACING = [1.0, 1.0, 2.0]
# the masked image crop: the smallest SwinUNETR input at window 4, tiled by the bundle's 16^3 mask blocks
MASKED_IMAGE_ROI_SIZE = [64, 32, 32]
# the SSL crop (the rotation views need the last two axes equal): at 64x32x32 the rotation head learned only on crops
# showing the body's edge and ended near its line in every seed; a 64x64 rotation plane shows the edge more often and
# learned in all five demo seeds (benchmarks/results/demo_ssl_levers.json, docs/measuring.md)
SSL_ROI_SIZE = [32, 64, 64]
# a 4^3 attention window tiles the first stage's 32x32x16 (and the SSL crops' 32x16x16) tokens without padding;
# the recipe's 7^3 pads them to 35x35x21 and costs about twice the time per iteration here
WINDOW_SIZE = 4
# the recipe's random flips and 90-degree rotations swap left and right, which tell the kidneys apart
NO_MIRRORING = {"training#flip_prob": 0.0, "training#rotate90_prob": 0.0}
LABEL_NAMES = ["background", *synthetic.DEMO_ORGANS]
# the validation crops of the pretrainings' one health report, at their end (RankMe and the pretext signals): on 64
# crops the SSL rotation verdict of one encoder changed with the draw of the crops; the bundles' most, 256, did not
# (benchmarks/results/pretrain_curve_crop_draws.json), for a few seconds more once per run
_RANKME_CROPS = 256
# the SSL loss's weights (rotation, contrastive, inpainting; the bundle's are 1, 1, 1 as published): at 1,003
# iterations the rotation weighted 3 learned in 3 of 3 seeds read on 256 fixed crops, 1 in 2 of 3
# (benchmarks/results/pretrain_curve_reread/, docs/measuring.md)
SSL_LOSS_WEIGHTS = (3.0, 1.0, 1.0)
# every run starts fresh: a demo run again into the same folder must not resume the last one
_FRESH_RUN = {"checkpointing#auto_resume": False}


def masked_image_overrides(budget: DemoBudget, data_dir: Path, run_dir: Path, device: str, seed: int) -> dict[str, Any]:
    """Command-line overrides of a demo-sized pretraining run, every one an id of the SSL and of the masked image
    bundle: data, device, sizes, schedule, health crops, folders."""
    return {
        "dataset_dir": str(data_dir), "device": device, "feature_size": budget.feature_size, "network_def#window_size": WINDOW_SIZE,
        "roi_size": MASKED_IMAGE_ROI_SIZE,
        "batch_size": budget.ssl_batch, "training#num_samples": 1, "loader#num_workers": 0, "speed#amp": device == "cuda",
        "speed#use_checkpoint": False, "training#seed": seed, "training#log_interval": 1, "max_epochs": budget.ssl_epochs,
        "learning_rate": budget.ssl_learning_rate, "training#warmup_iterations": budget.ssl_warmup_iterations,
        "training#val_interval": budget.ssl_epochs, "training#rankme_crops": _RANKME_CROPS,
        "output_dir": str(run_dir / "eval"), "ckpt_dir": str(run_dir / "models"), **_FRESH_RUN,
    }


def ssl_overrides(budget: DemoBudget, data_dir: Path, run_dir: Path, device: str, seed: int) -> dict[str, Any]:
    """Command-line overrides of the SSL pretraining bundle for a demo-sized run: :func:`masked_image_overrides` with
    crops of :data:`SSL_ROI_SIZE` and the rotation term weighted :data:`SSL_LOSS_WEIGHTS`."""
    overrides = masked_image_overrides(budget, data_dir, run_dir, device, seed)
    return {**overrides, "roi_size": SSL_ROI_SIZE, "train#loss#alpha": list(SSL_LOSS_WEIGHTS)}


def dino_overrides(budget: DemoBudget, data_dir: Path, run_dir: Path, device: str, seed: int) -> dict[str, Any]:
    """Command-line overrides of the self-distillation bundle for a run of the SSL run's size: its data, device,
    volumes per iteration, epochs, feature size, attention window and folders; 32^3 global and local crops from 64^3
    regions, a small head and the teacher at temperature 0.04 throughout (DINO's code default): at these sizes the
    bundle's 0.04 warmed up to 0.07 left the teacher's targets uniform at every budget measured
    (``benchmarks/results/pretrain_curve.json``)."""
    ssl = masked_image_overrides(budget, data_dir, run_dir, device, seed)
    shared = ("dataset_dir", "device", "feature_size", "network_def#window_size", "batch_size", "loader#num_workers", "speed#amp",
              "speed#use_checkpoint", "training#seed", "training#log_interval", "max_epochs", "training#rankme_crops",
              "output_dir", "ckpt_dir", "checkpointing#auto_resume")  # fmt: skip
    return {
        **{key: ssl[key] for key in shared}, "roi_size": [32, 32, 32], "training#context_size": [64, 64, 64],
        "training#local_size": [32, 32, 32], "training#num_local_crops": 2, "training#prototypes": 1024,
        "training#head_hidden_dim": 256, "training#head_bottleneck_dim": 64, "training#warmup_epochs": 1,
        "training#teacher_temperature_warmup_epochs": 1, "training#teacher_temperature": 0.04,
        "training#val_interval": ssl["training#val_interval"], "training#num_samples": 2,
    }  # fmt: skip


@dataclass(frozen=True)
class DemoRecipe:
    """A pretraining recipe as the demo runs and draws it: its bundle, the overrides of a demo-sized run, the name
    of its arm, its loss parts (scalar tag -> legend) and its validation picture (TensorBoard tag, column titles,
    title; no picture when ``views_tag`` is None)."""

    bundle: str
    overrides: Callable[[DemoBudget, Path, Path, str, int], dict[str, Any]]
    name: str
    losses: Mapping[str, str]
    views_tag: str | None = None
    view_columns: tuple[str, ...] = ()
    views_title: str = ""


RECIPES: dict[str, DemoRecipe] = {
    "ssl": DemoRecipe(
        SSL_BUNDLE, ssl_overrides, "SSL",
        {"loss": "total", "loss_rot": "rotation (CE)", "loss_contrast": "contrastive (NT-Xent)", "loss_recon": "reconstruction (L1)"},
        "ssl_views", ("clean crop", "view 1 (rotated, cut out)", "view 2", "reconstruction 1", "reconstruction 2"),
        "What SSL learns: restore cut-out boxes (validation crops after pretraining)",
    ),
    "dino": DemoRecipe(
        DINO_BUNDLE, dino_overrides, "self-distillation",
        {"loss": "total", "loss_dino": "self-distillation (CE)", "loss_koleo": "KoLeo"},
    ),
    "mim": DemoRecipe(
        MIM_BUNDLE, masked_image_overrides, "masked image",
        {"loss": "total", "loss_recon": "masked voxels (L1)", "loss_distill": "masked-token distillation"},
        "masked_views", ("crop", "masked input", "reconstruction", "target"),
        "What masked image modelling learns: restore the masked blocks (validation crops after pretraining)",
    ),
}  # fmt: skip
"""The recipes ``run_demo(recipe=...)`` pretrains with: ``ssl`` (the default), ``dino``, ``mim``."""


def pretraining_overrides(recipe: str, budget: DemoBudget, data_dir: Path, run_dir: Path, device: str, seed: int) -> dict[str, Any]:
    """Command-line overrides of ``recipe``'s pretraining bundle (:data:`RECIPES`) for a demo-sized run."""
    return RECIPES[recipe].overrides(budget, data_dir, run_dir, device, seed)


def finetune_overrides(
    budget: DemoBudget, datalist: Path, run_dir: Path, device: str, seed: int, pretrained: Path | None,
    class_weights: list[float] | None = None,
) -> dict[str, Any]:
    """Command-line overrides of the CT finetuning bundle for the demo's five-organ task."""
    return {
        "dataset_dir": str(datalist.parent), "datalist": str(datalist), "device": device,
        "feature_size": budget.feature_size, "network_def#window_size": WINDOW_SIZE, "training#class_weights": class_weights,
        **NO_MIRRORING, "label_names": LABEL_NAMES,
        "roi_size": ROI_SIZE, "spacing": SPACING, "training#num_samples": budget.finetune_crops, "loader#num_workers": 0,
        "speed#amp": device == "cuda", "speed#use_checkpoint": False, "training#seed": seed, "training#log_interval": 5,
        "max_epochs": budget.finetune_epochs, "training#val_interval": budget.val_interval, "training#warmup_epochs": 1,
        "learning_rate": budget.finetune_learning_rate, "pretrained_path": None if pretrained is None else str(pretrained),
        "ckpt_dir": str(run_dir / "models"), "output_dir": str(run_dir / "eval"), **_FRESH_RUN,
    }


def training_class_weights(datalist: Path, label_names: list[str] | None = None) -> list[float]:
    """The finetuning loss's class weights from the labels of the datalist's ``training`` list
    (:func:`~components.training.segmentation.balanced_class_weights`) for ``label_names`` (default: the demo's): the organs
    are 0.1-2 % of a volume each and the small ones stay at Dice 0 for the first hundreds of iterations with an
    unweighted loss."""
    from ..training.segmentation import balanced_class_weights  # imports MONAI: only a finetuning's overrides need it

    items = json.loads(datalist.read_text())["training"]
    return balanced_class_weights([datalist.parent / item["label"] for item in items], len(label_names or LABEL_NAMES))


def inference_overrides(finetune: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The overrides of a finetuning run that the CT bundle's ``inference.json`` defines (its network, data and
    checkpoint folder; not the training knobs, which that config would refuse), writing under ``run_dir``."""
    inference = defined_overrides(finetune, [BUNDLES_DIR / CT_BUNDLE / "configs" / "inference.json"])
    return {**inference, "output_dir": str(run_dir / "segmentations")}
