"""The health report of a saved encoder: ``python -m components health CHECKPOINT --datalist LIST``.

The same report a pretraining bundle logs at every validation (:mod:`components.training.health`), for any checkpoint
the loaders read: this collection's ``model.pt`` of the SSL and masked image bundles (the recipe's heads are in it, so
the pretext signals are computed beside their trivial answers), and any encoder-only layout (the self-distillation
bundle's teacher encoder, the published ``model_swinvit.pt``, MONAI's, VoCo's, ...), for which the embedding signals
alone are computed. The crops are those the pretraining bundles draw (the pretraining transforms of the bundles, at
``roi_size``), from the datalist's ``list_name`` list.

:func:`checkpoint_health` is two steps, each public so that a measurement can read a network on crops it chose:
:func:`checkpoint_network` (the network holding a checkpoint's weights, and its recipe) and :func:`datalist_crops`
(the crops).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from monai.transforms import (
    Compose,
    CropForegroundd,
    EnsureChannelFirstd,
    LoadImaged,
    Orientationd,
    RandSpatialCropSamplesd,
    ScaleIntensityRanged,
    SpatialPadd,
)

from ..checkpoint.architecture import infer_architecture
from ..checkpoint.layouts import extract_state_dict, read_checkpoint, without_wrappers
from ..checkpoint.pretrained import load_pretrained
from ..data.datalists import load_split
from ..errors import ConfigError
from ..recipes import InpaintingContrastRecipe, MaskedImageModel, MaskedImageRecipe, MaskedReconstructionLoss, SSLHead, SSLLoss
from ..recipes.self_distillation import SwinViTEmbedding
from ..training.health import HealthReport
from ..training.health_handler import recipe_health
from ..training.rankme import draw_crops

__all__ = ["checkpoint_health", "checkpoint_network", "datalist_crops", "recipe_of"]

def recipe_of(state: dict[str, Any]) -> str:
    """Which pretext heads a state dict holds: ``"mim"`` (a mask token and a decoder), ``"ssl"`` (rotation and
    contrastive heads and a reconstruction decoder) or ``"encoder"`` (none: the embedding signals alone)."""
    keys = set(without_wrappers(state))
    if "mask_token" in keys and any(k.startswith("decoder.") for k in keys):
        return "mim"
    if any(k.startswith("rotation_head.") for k in keys) and any(k.startswith("contrastive_head.") for k in keys):
        return "ssl"
    return "encoder"


def checkpoint_network(checkpoint: str | os.PathLike) -> tuple[str, torch.nn.Module, Any]:
    """The network of a saved encoder, built from the architecture its weights show and holding them.

    Args:
        checkpoint: a checkpoint of any layout the loaders read (read once, with ``weights_only=True``).

    Returns:
        ``(kind, network, recipe)``: which heads the checkpoint holds (:func:`recipe_of`); a
        :class:`~components.MaskedImageModel`, :class:`~components.SSLHead` or, for an encoder alone, a
        :class:`~components.recipes.self_distillation.SwinViTEmbedding`, on the CPU; the recipe whose ``views`` and
        ``forward`` the heads answer (None for an encoder alone).

    Raises:
        FileNotFoundError / CheckpointLoadError: an unreadable checkpoint or an unknown layout; RuntimeError: this
            collection's weights that do not fit the architecture read from them.
    """
    source = os.fspath(checkpoint)
    raw = read_checkpoint(source)  # read once: the layout, the architecture and the weights all come from it
    state = without_wrappers(extract_state_dict(raw, source)[0], source)
    kind = recipe_of(state)
    architecture = {name: value for name, value in infer_architecture(raw).as_dict().items() if name != "patch_size"}
    keys = set(state)
    if kind == "mim":
        decoder = "deconv" if "decoder.0.weight" in keys else "linear"
        network = MaskedImageModel(decoder=decoder, **architecture)
        network.load_state_dict(state, strict=True)
        return kind, network, MaskedImageRecipe(MaskedReconstructionLoss(), mask_block=16)
    if kind == "ssl":
        upsample = "vae" if "conv.20.weight" in keys else "large_kernel_deconv" if "conv.weight" in keys else "deconv"
        network = SSLHead(upsample=upsample, **architecture)
        network.load_state_dict(state, strict=True)
        return kind, network, InpaintingContrastRecipe(SSLLoss())
    network = SwinViTEmbedding(**architecture)
    load_pretrained(network, raw)
    return kind, network, None


def datalist_crops(
    datalist: str | os.PathLike,
    list_name: str,
    roi_size: Sequence[int],
    intensity_range: Sequence[float],
    count: int,
    seed: int,
) -> list[torch.Tensor]:
    """Crops of a datalist's volumes as the pretraining bundles draw them (two crops per visit of a volume).

    Args:
        datalist: a Decathlon-style datalist; ``list_name`` names its list of volumes (``validation``, ``training``).
        roi_size: the crop size.
        intensity_range: the Hounsfield units mapped to [0, 1], clipped (the bundles' ``intensity_range``).
        count: how many crops; seed: the seed of the draw (the global random state is left as it was).

    Returns:
        ``count`` crops, each ``(C, *roi_size)``, scaled to [0, 1].

    Raises:
        ConfigError: an empty list.
    """
    from monai.data import Dataset

    source = os.fspath(datalist)
    items = load_split(source, list_name)
    if not items:
        raise ConfigError(f"{source}: its {list_name!r} list is empty: give --list_name a list that holds volumes.")
    roi = list(roi_size)
    keys = ["image"]
    transform = Compose([
        LoadImaged(keys), EnsureChannelFirstd(keys), Orientationd(keys, axcodes="RAS"),
        ScaleIntensityRanged(keys, a_min=intensity_range[0], a_max=intensity_range[1], b_min=0.0, b_max=1.0, clip=True),
        SpatialPadd(keys, spatial_size=roi), CropForegroundd(keys, source_key="image", k_divisible=roi, allow_smaller=True),
        RandSpatialCropSamplesd(keys, roi_size=roi, num_samples=2, random_size=False),
    ])  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        return list(draw_crops(Dataset([{"image": item["image"]} for item in items], transform), int(count), int(seed)))


def checkpoint_health(
    checkpoint: str | os.PathLike,
    datalist: str | os.PathLike,
    list_name: str = "validation",
    roi_size: Sequence[int] = (96, 96, 96),
    intensity_range: Sequence[float] = (-1000.0, 1000.0),
    crops: int = 64,
    batch_size: int = 4,
    seed: int = 0,
    device: str = "cpu",
) -> tuple[str, HealthReport]:
    """The health report of a saved encoder on crops of a datalist.

    Args:
        checkpoint: a checkpoint of any layout the loaders read (read with ``weights_only=True``).
        datalist: a Decathlon-style datalist; ``list_name`` names its list of volumes (``validation``, ``training``).
        roi_size: the crop size (every axis a multiple of 32; the SSL heads need the last two equal).
        intensity_range: the Hounsfield units mapped to [0, 1], as the pretraining bundles' ``intensity_range``.
        crops: how many crops (at least 2); batch_size: crops per forward; seed: the crops' and views' seed.
        device: where the network runs.

    Returns:
        ``(kind, report)``: which heads the checkpoint holds (:func:`recipe_of`) and the report.

    Raises:
        FileNotFoundError / CheckpointLoadError: an unreadable checkpoint or an unknown layout; ValueError: an empty
            list; RuntimeError: this collection's weights that do not fit the architecture read from them.
    """
    kind, network, recipe = checkpoint_network(checkpoint)
    network.to(device)
    drawn = datalist_crops(datalist, list_name, roi_size, intensity_range, crops, seed)
    return kind, recipe_health(recipe, network, drawn, batch_size, seed)
