"""The health report of a saved encoder: ``python -m components health CHECKPOINT --datalist LIST``.

The same report a pretraining bundle logs at every validation (:mod:`components.training.health`), for any checkpoint
the loaders read: this collection's ``model.pt`` of the SSL and masked image bundles (the recipe's heads are in it, so
the pretext signals are computed beside their trivial answers), and any encoder-only layout (the self-distillation
bundle's teacher encoder, the published ``model_swinvit.pt``, MONAI's, VoCo's, ...), for which the embedding signals
alone are computed. The crops are those the pretraining bundles draw (the pretraining transforms of the bundles, at
``roi_size``), from the datalist's ``list_name`` list.
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

__all__ = ["checkpoint_health", "recipe_of"]

def recipe_of(state: dict[str, Any]) -> str:
    """Which pretext heads a state dict holds: ``"mim"`` (a mask token and a decoder), ``"ssl"`` (rotation and
    contrastive heads and a reconstruction decoder) or ``"encoder"`` (none: the embedding signals alone)."""
    keys = set(without_wrappers(state))
    if "mask_token" in keys and any(k.startswith("decoder.") for k in keys):
        return "mim"
    if any(k.startswith("rotation_head.") for k in keys) and any(k.startswith("contrastive_head.") for k in keys):
        return "ssl"
    return "encoder"


def _network(kind: str, state: dict[str, Any], checkpoint: Any, architecture: dict[str, Any]) -> tuple[torch.nn.Module, Any]:
    """The network holding the checkpoint's weights and its recipe (None for an encoder)."""
    keys = set(state)
    if kind == "mim":
        decoder = "deconv" if "decoder.0.weight" in keys else "linear"
        network = MaskedImageModel(decoder=decoder, **architecture)
        network.load_state_dict(state, strict=True)
        return network, MaskedImageRecipe(MaskedReconstructionLoss(), mask_block=16)
    if kind == "ssl":
        upsample = "vae" if "conv.20.weight" in keys else "large_kernel_deconv" if "conv.weight" in keys else "deconv"
        network = SSLHead(upsample=upsample, **architecture)
        network.load_state_dict(state, strict=True)
        return network, InpaintingContrastRecipe(SSLLoss())
    network = SwinViTEmbedding(**architecture)
    load_pretrained(network, checkpoint)
    return network, None


def _crops(datalist: str, list_name: str, roi_size: Sequence[int], intensity_range: Sequence[float], count: int, seed: int) -> list[torch.Tensor]:
    """``count`` crops of the list, drawn with the pretraining bundles' transforms (two crops per visit)."""
    from monai.data import Dataset

    items = load_split(datalist, list_name)
    if not items:
        raise ConfigError(f"{datalist}: its {list_name!r} list is empty: give --list_name a list that holds volumes.")
    keys = ["image"]
    transform = Compose([
        LoadImaged(keys), EnsureChannelFirstd(keys), Orientationd(keys, axcodes="RAS"),
        ScaleIntensityRanged(keys, a_min=intensity_range[0], a_max=intensity_range[1], b_min=0.0, b_max=1.0, clip=True),
        SpatialPadd(keys, spatial_size=roi_size), CropForegroundd(keys, source_key="image", k_divisible=roi_size, allow_smaller=True),
        RandSpatialCropSamplesd(keys, roi_size=roi_size, num_samples=2, random_size=False),
    ])  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        return list(draw_crops(Dataset([{"image": item["image"]} for item in items], transform), count, seed))


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
    source = os.fspath(checkpoint)
    raw = read_checkpoint(source)  # read once: the layout, the architecture and the weights all come from it
    state = without_wrappers(extract_state_dict(raw, source)[0], source)
    kind = recipe_of(state)
    architecture = {name: value for name, value in infer_architecture(raw).as_dict().items() if name != "patch_size"}
    network, recipe = _network(kind, state, raw, architecture)
    network.to(device)
    drawn = _crops(os.fspath(datalist), list_name, list(roi_size), list(intensity_range), int(crops), int(seed))
    return kind, recipe_health(recipe, network, drawn, batch_size, seed)
