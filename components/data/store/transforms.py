"""The deterministic transforms a store is written with: a bundle's ``train#transforms#deterministic`` as plain
configs (``_target_`` and resolved arguments), which both fingerprint the store and rebuild the transforms in each
preprocessing worker; and the size of the crops its ``train#transforms#random`` cut, which the store's chunks
follow. ``train#transforms`` may name one of the bundle's pipelines (``"%train#compact_transforms"``): it is read as
MONAI reads it, the overrides set and the ``%`` references replaced."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from monai.transforms import Compose

__all__ = ["build_transforms", "bundle_crop_size", "bundle_transforms"]

TRANSFORMS_ID = "train#transforms#deterministic"
RANDOM_ID = "train#transforms#random"
_CROP_SIZE = {"RandSpatialCropSamplesd": "roi_size", "RandSpatialCropd": "roi_size", "RandCropByPosNegLabeld":
              "spatial_size", "RandCropByLabelClassesd": "spatial_size", "RandCompactSpatialCropSamplesd": "roi_size"}
_DEVICE_ONLY = ("ToDeviced", "ToDevice")  # where a tensor lives is no part of what is stored


def _json_able(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def bundle_transforms(bundle: str | os.PathLike | Any, overrides: Mapping[str, Any] | None = None) -> list[dict]:
    """``train#transforms#deterministic`` of a bundle (its folder, e.g. ``components.demo.runner.bundle_dir(name)``, or
    a ``monai.bundle.ConfigParser`` already read) with ``overrides`` of its ids (e.g. ``{"roi_size": [64] * 3,
    "intensity_range": [-175, 250]}``), as a list of ``{"_target_": name, argument: value}``.

    Each argument is resolved (references and expressions evaluated, so ``"@roi_size"`` becomes ``[96, 96, 96]``);
    an argument whose value JSON cannot hold (a function from a ``"$lambda ..."``) keeps its expression, which must
    then reference no other id. Disabled transforms (``_disabled_`` true) and device moves (``ToDeviced``) are left
    out: they store nothing.

    Raises:
        FileNotFoundError: no ``configs/train.json`` in the folder.
        KeyError: the bundle has no ``train#transforms#deterministic``.
        ValueError: an argument that is neither JSON nor a self-contained expression, or an unknown override id.
    """
    parser = _parser(bundle, overrides)
    if TRANSFORMS_ID not in parser:
        raise KeyError(f"the bundle has no {TRANSFORMS_ID!r}: it names no deterministic transforms to store.")
    configs = []
    for index, raw in enumerate(parser[TRANSFORMS_ID]):
        where = f"{TRANSFORMS_ID}#{index}"
        target = str(raw.get("_target_", ""))
        if _disabled(parser, where, raw) or target.rsplit(".", 1)[-1] in _DEVICE_ONLY:
            continue
        config = {"_target_": target}
        for name, value in raw.items():
            if name.startswith("_"):
                continue
            resolved = parser.get_parsed_content(f"{where}#{name}", instantiate=False)
            if not _json_able(resolved):
                if not (isinstance(value, str) and value.startswith("$") and "@" not in value):
                    raise ValueError(f"{where} ({target}) argument {name!r}: {value!r} is neither JSON nor an "
                                     "expression without references; the store cannot record it.")  # fmt: skip
                resolved = value
            config[name] = resolved
        configs.append(config)
    return configs


def _parser(bundle: str | os.PathLike | Any, overrides: Mapping[str, Any] | None):
    """The bundle's ``ConfigParser`` (read from its folder unless given: ``train.json`` with the shared config) with
    ``overrides`` set and its ``%`` references replaced."""
    from monai.bundle import ConfigParser

    from ...config.running import run_config_files

    if isinstance(bundle, ConfigParser):
        parser = bundle
    else:
        config = Path(bundle) / "configs" / "train.json"
        if not config.is_file():
            raise FileNotFoundError(f"{config}: no such file; a bundle folder holds configs/train.json.")
        parser = ConfigParser()
        parser.read_config([str(f) for f in run_config_files(bundle, ["train.json"])])
    for key, value in (overrides or {}).items():
        if key not in parser:
            raise ValueError(f"override {key!r}: the bundle has no such id.")
        parser[key] = value
    parser.resolve_macro_and_relative_ids()
    return parser


def _disabled(parser: Any, where: str, raw: Mapping) -> bool:
    return "_disabled_" in raw and parser.get_parsed_content(f"{where}#_disabled_", instantiate=False) in (True, "true", "True")


def bundle_crop_size(bundle: str | os.PathLike | Any, overrides: Mapping[str, Any] | None = None) -> list[int] | None:
    """The spatial size of the crops a bundle's training cuts: the ``roi_size`` / ``spatial_size`` of the first
    enabled crop of ``train#transforms#random`` (resolved, with ``overrides``); None when it has none that is
    positive ints (MONAI's -1 "whole axis"), or no random transforms. What :func:`~.format.layout` sizes the
    store's chunks from."""
    parser = _parser(bundle, overrides)
    if RANDOM_ID not in parser:
        return None
    for index, raw in enumerate(parser[RANDOM_ID]):
        where = f"{RANDOM_ID}#{index}"
        argument = _CROP_SIZE.get(str(raw.get("_target_", "")).rsplit(".", 1)[-1])
        if argument is None or argument not in raw or _disabled(parser, where, raw):
            continue
        size = parser.get_parsed_content(f"{where}#{argument}", instantiate=False)
        ok = isinstance(size, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in size)
        return [int(v) for v in size] if ok else None
    return None


def build_transforms(configs: Sequence[Mapping]) -> Compose:
    """The transforms of ``configs`` (:func:`bundle_transforms`) instantiated, in order, as one ``Compose``."""
    from monai.bundle import ConfigParser

    parser = ConfigParser({"imports": ["$import components"], "transforms": [dict(c) for c in configs]})
    return Compose(parser.get_parsed_content("transforms"))


def loaded_keys(configs: Sequence[Mapping]) -> tuple[str, ...]:
    """The keys the first ``LoadImaged`` of ``configs`` reads: the datalist keys whose files the store is made from.

    Raises:
        ValueError: no ``LoadImaged``: the transforms read no file.
    """
    for config in configs:
        if str(config.get("_target_", "")).rsplit(".", 1)[-1] == "LoadImaged":
            keys = config.get("keys")
            return (keys,) if isinstance(keys, str) else tuple(keys)
    raise ValueError("the deterministic transforms have no LoadImaged: they read no file to store.")
