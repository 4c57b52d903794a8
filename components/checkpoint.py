"""Checkpoint layouts, key mapping and pretrained loading with a report; atomic and resumable training checkpoints.

Two concerns live here, and this module is the only place that knows checkpoint layouts:

1. **Pretrained weights** (:func:`load_pretrained`, :func:`convert_state_dict`, :func:`convert_checkpoint`,
   :class:`PretrainedLoader`). The published Swin UNETR / SSL checkpoints come in several layouts (see
   ``LAYOUTS`` and recipe.md s3). The common finetuning rule "strip ``module.``, rename ``swin_vit``, load with
   ``strict=False``" loads *zero* tensors of the CVPR release ``model_swinvit.pt`` and says nothing. Here the
   layout is detected and named, every key is mapped explicitly, and a :class:`LoadReport` lists what was
   loaded, what is missing, what was not used and why, and what did not fit. ``load_state_dict(strict=False)``
   is only called with a state dict whose keys were all checked against the model, after the ``required``
   check passed, so the model is never left half-loaded when an error is raised.

2. **Resumable training checkpoints** (:func:`save_atomic`, :class:`ResumableCheckpointSaver`,
   :class:`ResumeHandler`): one file with model, optimizer, LR scheduler, AMP scaler, trainer progress and the
   evaluator's best metric, written atomically and restored so that ignite continues where it stopped.

Layouts detected (after unwrapping a container and stripping ``module.`` / ``_orig_mod.``):

========================== ==================================================================================
``model_swinvit``          the CVPR release encoder: bare ``patch_embed.*`` / ``layers{1..4}.*`` keys (``module.``
                           in the file), ``mlp.fc1`` / ``mlp.fc2``, and an extra final ``norm.*`` (dropped)
``ssl_original``           the original SSL code's checkpoints: ``swinViT.*`` with a ``module.`` prefix in the file
                           or the older ``swin_vit.*`` spelling, plus ``rotation_head`` / ``contrastive_head`` /
                           ``conv``
``ssl_collection``         this collection's :class:`~components.networks.SSLHead`: ``swinViT.*`` plus heads, no
                           wrapper prefix (a ``_orig_mod.`` from torch.compile is allowed)
``monai_ssl_autoencoder``  MONAI's disruptive-autoencoder ``ssl_pretrained_weights.pth``: ``encoder.*`` with an
                           extra nesting level ``encoder.layersN.0.0.*`` (what ``filter_swinunetr`` collapses),
                           plus ``encoder.mask_token``, ``encoder.norm.*`` and ``out.conv.conv.*`` (all dropped)
``swinunetr``              a full MONAI SwinUNETR: ``swinViT.*`` plus ``encoder1..``, ``decoder1..``, ``out.*``
``swinvit_encoder``        ``swinViT.*`` keys only (e.g. a file written by :func:`convert_checkpoint` with
                           ``full_state=False``)
========================== ==================================================================================

``relative_position_index`` buffers: MONAI registers them as persistent buffers, so they are in every MONAI state
dict, and the CVPR release contains them too (``SwinUNETR.load_from`` copies them). They are a deterministic
function of the window size: when a checkpoint has them they are loaded like any other tensor (keeping the index
the bias table was trained with), when it lacks them the model's own (identical for the same window size) are
kept; they are never *required* and show up as missing-but-allowed.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import re
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from ignite.engine import Engine, Events
from monai.handlers import CheckpointSaver
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from .atomic import atomic_write, temp_prefix
from .distributed import broadcast_from_rank0
from .faults import CheckpointEvents, register_checkpoint_events, resolve_resume
from .runtime import as_bool, optional_path

__all__ = [
    "LAYOUTS",
    "TARGETS",
    "CHANNEL_POLICIES",
    "REQUIRED_POLICIES",
    "CheckpointLoadError",
    "UnusedKey",
    "LoadReport",
    "read_checkpoint",
    "extract_state_dict",
    "detect_layout",
    "convert_state_dict",
    "load_pretrained",
    "convert_checkpoint",
    "save_atomic",
    "ResumableCheckpointSaver",
    "ResumeHandler",
    "BestModelSaver",
    "PretrainedLoader",
    "restore_schedule",
]

logger = logging.getLogger(__name__)

#: layouts :func:`detect_layout` can name (see the module docstring).
LAYOUTS: tuple[str, ...] = (
    "model_swinvit",
    "ssl_original",
    "ssl_collection",
    "monai_ssl_autoencoder",
    "swinunetr",
    "swinvit_encoder",
)
#: kinds of target model: MONAI ``SwinUNETR``, :class:`~components.networks.SSLHead`, or any other module that
#: holds the encoder as attribute ``swinViT``.
TARGETS: tuple[str, ...] = ("swinunetr", "sslhead", "encoder")
CHANNEL_POLICIES: tuple[str, ...] = ("error", "repeat", "skip")
REQUIRED_POLICIES: tuple[str, ...] = ("encoder", "all", "none")

#: the one tensor whose input-channel count may differ between checkpoint and model (``channel_policy``).
PATCH_EMBED_WEIGHT = "swinViT.patch_embed.proj.weight"

_CONTAINER_KEYS = ("state_dict", "model", "network", "net", "model_state_dict")
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")
_ENCODER_PREFIX = "swinViT."
_REL_INDEX_SUFFIX = ".relative_position_index"

_MLP_FC = re.compile(r"\.mlp\.fc([12])\.")
_BARE_ENCODER = re.compile(r"^(patch_embed|layers[1-4]c?)\.")
_SSL_HEADS = re.compile(r"^(rotation_head|contrastive_head|conv)\.")
_SEG_DECODER = re.compile(r"^(encoder\d+|decoder\d+|out)\.")
_DAE_LAYER_NESTED = re.compile(r"^encoder\.(layers[1-4]c?)\.0\.0\.(.+)$")
_DAE_LAYER_FLAT = re.compile(r"^encoder\.(layers[1-4]c?)\.0\.(\D.*)$")
_DAE_ENCODER = re.compile(r"^encoder\.(patch_embed|layers[1-4]c?)\.")


class CheckpointLoadError(ValueError):
    """A checkpoint could not be read, recognised or mapped onto the model as required."""


class UnusedKey(NamedTuple):
    """Why a source tensor was not used: ``kind`` is ``"dropped"`` (by design) or ``"unknown"``."""

    kind: str
    reason: str


@dataclass
class LoadReport:
    """What :func:`convert_state_dict` / :func:`load_pretrained` did with each tensor.

    Attributes:
        layout: the detected source layout (one of ``LAYOUTS``).
        target: the kind of target model (one of ``TARGETS``).
        source: the file read, or ``"<mapping>"`` for an in-memory state dict.
        container: the path of container keys unwrapped, e.g. ``"state_dict"`` or ``"model"`` (``""`` if bare).
        stripped_prefixes: wrapper prefixes removed from the source keys (``module.``, ``_orig_mod.``).
        loaded: target keys that receive a tensor from the checkpoint.
        missing: target keys that keep the model's current value.
        allowed_missing: the subset of ``missing`` that ``required`` does not ask for.
        unexpected: source key (as in the file) -> :class:`UnusedKey` for every source tensor not loaded.
        shape_mismatched: target key -> (checkpoint shape, model shape) for tensors not loaded for their shape.
        adapted: target key -> what the channel policy did (``repeat``: adapted and loaded; ``skip``: left as is).
        encoder_keys: the target's encoder keys (``swinViT.*``), for the counts of :meth:`summary`.
        required: the ``required`` policy that was checked.
    """

    layout: str
    target: str
    source: str = "<mapping>"
    container: str = ""
    stripped_prefixes: list[str] = field(default_factory=list)
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    allowed_missing: list[str] = field(default_factory=list)
    unexpected: dict[str, UnusedKey] = field(default_factory=dict)
    shape_mismatched: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    adapted: dict[str, str] = field(default_factory=dict)
    encoder_keys: list[str] = field(default_factory=list)
    required: str = "encoder"

    @property
    def dropped(self) -> dict[str, str]:
        """Source keys dropped by design (final release norm, SSL heads into SwinUNETR, ...) -> reason."""
        return {k: u.reason for k, u in self.unexpected.items() if u.kind == "dropped"}

    @property
    def unknown(self) -> dict[str, str]:
        """Source keys this module could not place -> reason; worth a look when not empty."""
        return {k: u.reason for k, u in self.unexpected.items() if u.kind == "unknown"}

    @property
    def encoder_loaded(self) -> list[str]:
        loaded = set(self.loaded)
        return [k for k in self.encoder_keys if k in loaded]

    @property
    def encoder_missing(self) -> list[str]:
        loaded = set(self.loaded)
        return [k for k in self.encoder_keys if k not in loaded]

    def summary(self) -> str:
        """One line, e.g. ``layout=model_swinvit target=swinunetr: loaded 126/126 encoder tensors, ...``."""
        n_target = len(self.loaded) + len(self.missing)
        return (
            f"layout={self.layout} target={self.target}: loaded {len(self.encoder_loaded)}/{len(self.encoder_keys)} "
            f"encoder tensors ({len(self.loaded)}/{n_target} model tensors), {len(self.missing)} missing "
            f"({len(self.encoder_missing)} encoder; {len(self.allowed_missing)} allowed by "
            f"required={self.required!r}), "
            f"{len(self.unexpected)} unused ({len(self.dropped)} dropped by design, {len(self.unknown)} unknown), "
            f"{len(self.shape_mismatched)} shape-mismatched, {len(self.adapted)} adapted"
        )

    def details(self, max_keys: int = 20) -> str:
        """A multi-line listing of the report for a CLI or a log (at most ``max_keys`` keys per section)."""

        def _section(title: str, items: list[str]) -> list[str]:
            if not items:
                return []
            shown = [f"  {s}" for s in items[:max_keys]]
            if len(items) > max_keys:
                shown.append(f"  ... and {len(items) - max_keys} more")
            return [f"{title} ({len(items)}):", *shown]

        lines = [self.summary(), f"source: {self.source}" + (f" [{self.container}]" if self.container else "")]
        if self.stripped_prefixes:
            lines.append(f"stripped prefixes: {', '.join(self.stripped_prefixes)}")
        allowed = set(self.allowed_missing)
        lines += _section(
            "missing", [k + (" (allowed)" if k in allowed else "") for k in self.missing]
        )
        lines += _section("dropped by design", [f"{k}: {r}" for k, r in self.dropped.items()])
        lines += _section("unknown", [f"{k}: {r}" for k, r in self.unknown.items()])
        lines += _section(
            "shape mismatched",
            [f"{k}: checkpoint {list(s)} vs model {list(d)}" for k, (s, d) in self.shape_mismatched.items()],
        )
        lines += _section("adapted", [f"{k}: {r}" for k, r in self.adapted.items()])
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serialisable view of the report."""
        return {
            "layout": self.layout,
            "target": self.target,
            "source": self.source,
            "container": self.container,
            "stripped_prefixes": list(self.stripped_prefixes),
            "loaded": list(self.loaded),
            "missing": list(self.missing),
            "allowed_missing": list(self.allowed_missing),
            "unexpected": {k: {"kind": u.kind, "reason": u.reason} for k, u in self.unexpected.items()},
            "shape_mismatched": {k: [list(s), list(d)] for k, (s, d) in self.shape_mismatched.items()},
            "adapted": dict(self.adapted),
            "required": self.required,
            "summary": self.summary(),
        }


# ---------------------------------------------------------------------------------------------------------------
# reading a checkpoint
# ---------------------------------------------------------------------------------------------------------------


def _weights_only_reason(exc: BaseException) -> str:
    for line in str(exc).splitlines():
        if "Unsupported global" in line or "WeightsUnpickler error" in line:
            return line.strip()
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def read_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> Any:
    """``torch.load(path, map_location, weights_only=True)`` with errors that name the file.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointLoadError: ``path`` is not a file, cannot be read, is not a torch file, or holds objects that
            ``weights_only=True`` refuses (a pickled class, a function, a numpy array, ...).
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint file '{p}' does not exist.")
    if not p.is_file():
        raise CheckpointLoadError(f"checkpoint path '{p}' is not a file.")
    try:
        return torch.load(p, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        reason = _weights_only_reason(e)
        if "Unsupported global" in reason:
            raise CheckpointLoadError(
                f"checkpoint '{p}' holds objects other than tensors, numbers, strings and containers, which "
                f"torch.load(weights_only=True) refuses ({reason}). Only plain state dicts are accepted: re-save "
                f"the weights in a trusted environment, e.g. torch.save({{'state_dict': model.state_dict()}}, path)."
            ) from e
        raise CheckpointLoadError(
            f"checkpoint '{p}' is not a readable torch checkpoint (corrupt, truncated or another format): {reason}"
        ) from e
    except (OSError, RuntimeError, EOFError, ValueError) as e:
        raise CheckpointLoadError(f"could not read checkpoint '{p}': {type(e).__name__}: {e}") from e


def _is_state_dict(obj: Mapping) -> bool:
    return bool(obj) and all(isinstance(v, torch.Tensor) for v in obj.values())


def extract_state_dict(obj: Any, where: str = "<mapping>") -> tuple[dict[str, Any], str]:
    """Unwrap a checkpoint container down to its state dict.

    Accepts a bare state dict or one nested under ``state_dict`` / ``model`` / ``network`` / ``net`` /
    ``model_state_dict`` (also next to ``optimizer``, ``epoch``, ``global_step``, ...), at most 4 levels deep.

    Returns:
        ``(state_dict, container)`` where ``container`` is the path of keys unwrapped, e.g. ``"state_dict"``.
    """
    path: list[str] = []
    for _ in range(5):
        if not isinstance(obj, Mapping):
            raise CheckpointLoadError(
                f"checkpoint {where}: expected a state dict or a dict holding one, got {type(obj).__name__}"
                + (f" under '{'/'.join(path)}'" if path else "")
                + "."
            )
        if _is_state_dict(obj):
            break
        inner = next((k for k in _CONTAINER_KEYS if isinstance(obj.get(k), Mapping)), None)
        if inner is None:
            if any(isinstance(v, torch.Tensor) for v in obj.values()):
                break  # a state dict with a few non-tensor entries: they are reported as unknown
            raise CheckpointLoadError(
                f"checkpoint {where}: found no state dict"
                + (f" under '{'/'.join(path)}'" if path else "")
                + f"; its entries are {sorted(map(str, obj))[:12]}. Expected a bare state dict or one under one of "
                f"{list(_CONTAINER_KEYS)}."
            )
        path.append(inner)
        obj = obj[inner]
    else:
        raise CheckpointLoadError(f"checkpoint {where}: containers nested too deep ({'/'.join(path)}).")
    bad = [k for k in obj if not isinstance(k, str)]
    if bad:
        raise CheckpointLoadError(f"checkpoint {where}: state dict keys must be strings, got e.g. {bad[:3]!r}.")
    return dict(obj), "/".join(path)


def _strip_wrappers(key: str) -> tuple[str, list[str]]:
    """Remove leading ``module.`` (DDP / DataParallel) and ``_orig_mod.`` (torch.compile), in any order and number,
    and ``_orig_mod`` of a compiled submodule anywhere in the key."""
    stripped: list[str] = []
    changed = True
    while changed:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix) :]
                stripped.append(prefix)
                changed = True
    if "._orig_mod." in key:
        key = key.replace("._orig_mod.", ".")
        stripped.append("_orig_mod.")
    return key, stripped


def _strip_all(state: Mapping[str, Any], where: str) -> tuple[dict[str, tuple[str, Any]], list[str]]:
    """stripped key -> (original key, value); raises when two source keys collapse onto one."""
    out: dict[str, tuple[str, Any]] = {}
    prefixes: set[str] = set()
    for key, value in state.items():
        new, stripped = _strip_wrappers(key)
        prefixes.update(stripped)
        if new in out:
            raise CheckpointLoadError(
                f"checkpoint {where}: keys '{out[new][0]}' and '{key}' both become '{new}' once the wrapper prefixes "
                f"(module., _orig_mod.) are removed; the file mixes two models."
            )
        out[new] = (key, value)
    return out, sorted(prefixes)


def detect_layout(keys: Any, had_module_prefix: bool = False) -> str | None:
    """Name the layout of state-dict keys with the wrapper prefixes already stripped (None if unknown).

    ``had_module_prefix`` tells whether the keys carried ``module.`` in the file: this is what distinguishes the
    original SSL code's DDP checkpoints (``ssl_original``) from this collection's (``ssl_collection``).
    """
    keys = [str(k) for k in keys]
    if any(_DAE_ENCODER.match(k) for k in keys):
        return "monai_ssl_autoencoder"
    swin_new = any(k.startswith(_ENCODER_PREFIX) for k in keys)
    swin_old = any(k.startswith("swin_vit.") for k in keys)
    if swin_new or swin_old:
        if any(_SEG_DECODER.match(k) for k in keys):
            return "swinunetr"
        has_heads = any(_SSL_HEADS.match(k) for k in keys)
        if swin_old or (has_heads and had_module_prefix):
            return "ssl_original"
        if has_heads:
            return "ssl_collection"
        return "swinvit_encoder"
    if any(_BARE_ENCODER.match(k) for k in keys):
        return "model_swinvit"
    return None


def _rename_mlp(key: str) -> str:
    return _MLP_FC.sub(lambda m: f".mlp.linear{m.group(1)}.", key)


def _canonical(layout: str, key: str) -> tuple[str | None, UnusedKey | None]:
    """Map a (prefix-stripped) source key to the collection's key space, or say why it is not used."""
    if layout == "model_swinvit":
        if key in ("norm.weight", "norm.bias"):
            return None, UnusedKey(
                "dropped",
                "final LayerNorm of the CVPR release encoder; MONAI's SwinTransformer has none "
                "(it normalises each stage output without parameters)",
            )
        if _BARE_ENCODER.match(key):
            return _ENCODER_PREFIX + _rename_mlp(key), None
        return None, UnusedKey("unknown", "not a Swin ViT encoder tensor of the CVPR release layout")
    if layout == "monai_ssl_autoencoder":
        if key == "encoder.mask_token":
            return None, UnusedKey("dropped", "mask token of the disruptive autoencoder (pretraining only)")
        if key.startswith("encoder.norm."):
            return None, UnusedKey(
                "dropped", "final LayerNorm of the autoencoder's encoder; MONAI's SwinTransformer has none"
            )
        if key.startswith("encoder.patch_embed."):
            return _ENCODER_PREFIX + _rename_mlp(key[len("encoder.") :]), None
        m = _DAE_LAYER_NESTED.match(key) or _DAE_LAYER_FLAT.match(key)
        if m:
            return _rename_mlp(f"{_ENCODER_PREFIX}{m.group(1)}.0.{m.group(2)}"), None
        if key.startswith("encoder."):
            return None, UnusedKey("unknown", "an encoder.* tensor with no Swin ViT counterpart")
        return None, UnusedKey(
            "dropped", "autoencoder part outside the encoder (reconstruction head); filter_swinunetr drops it too"
        )
    # ssl_original, ssl_collection, swinunetr, swinvit_encoder: already in (nearly) the collection's key space
    if key.startswith("swin_vit."):
        key = _ENCODER_PREFIX + key[len("swin_vit.") :]
    if key.startswith(_ENCODER_PREFIX):
        return _rename_mlp(key), None
    if _SSL_HEADS.match(key) or _SEG_DECODER.match(key):
        return key, None
    return None, UnusedKey("unknown", f"not a tensor of the {layout} layout")


def _category(key: str) -> str:
    if key.startswith(_ENCODER_PREFIX):
        return "encoder"
    if _SSL_HEADS.match(key):
        return "ssl_head"
    if _SEG_DECODER.match(key):
        return "seg_decoder"
    return "other"


# ---------------------------------------------------------------------------------------------------------------
# the target model
# ---------------------------------------------------------------------------------------------------------------


def _unwrap_model(model: nn.Module) -> nn.Module:
    """The module whose ``state_dict`` has no ``module.`` / ``_orig_mod.`` prefixes (DDP, DataParallel, compile)."""
    for _ in range(8):
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model
    return model


def _detect_target(model: nn.Module) -> str:
    from monai.networks.nets import SwinUNETR

    if isinstance(model, SwinUNETR):
        return "swinunetr"
    if not isinstance(getattr(model, "swinViT", None), nn.Module):
        raise TypeError(
            f"load_pretrained: the target model ({type(model).__name__}) has no 'swinViT' submodule; expected "
            f"MONAI's SwinUNETR, components.networks.SSLHead or another module holding the encoder as 'swinViT'."
        )
    if hasattr(model, "rotation_head") or hasattr(model, "contrastive_head"):
        return "sslhead"
    return "encoder"


def _adapt_in_channels(weight: torch.Tensor, c_dst: int) -> torch.Tensor:
    """Spread a patch-embedding kernel over ``c_dst`` input channels with the same response to a constant input.

    ``c_dst`` a multiple of ``c_src``: the kernel is tiled over the channels and scaled by ``c_src / c_dst``
    (1 -> 4 channels: ``w.repeat(1, 4, ...) / 4``). Otherwise the channel mean is used for every channel, scaled
    the same way. In both cases the sum over input channels, i.e. the response to a constant image, is kept.
    """
    c_src = weight.shape[1]
    reps = [1] * weight.ndim
    if c_dst % c_src == 0:
        reps[1] = c_dst // c_src
        spread = weight.repeat(*reps)
    else:
        reps[1] = c_dst
        spread = weight.mean(dim=1, keepdim=True).repeat(*reps)
    # multiply then divide: for c_src = 1 this is exactly ``repeat / c_dst``
    return ((spread * c_src) / c_dst).to(weight.dtype)


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}.")
    return value


def _window_of(bias_table_shape: tuple[int, ...]) -> int | None:
    """The attention window edge ``w`` of a relative position bias table of ``(2w - 1) ** d`` rows (d = 3 or 2)."""
    rows = bias_table_shape[0]
    for dims in (3, 2):
        edge = round(rows ** (1 / dims))
        if edge**dims == rows and edge % 2 == 1:
            return (edge + 1) // 2
    return None


def _hint(report: LoadReport, missing_required: list[str], src_embed: int | None, dst_embed: int | None) -> str:
    if src_embed is not None and dst_embed is not None and src_embed != dst_embed:
        return (
            f"the checkpoint's embedding size is {src_embed} but the model's is {dst_embed}: build the model with "
            f"feature_size={src_embed}"
        )
    tables = [shapes for k, shapes in report.shape_mismatched.items() if k.endswith("relative_position_bias_table")]
    if tables:
        src_window, dst_window = (_window_of(shape) for shape in tables[0])
        return (
            f"the checkpoint's attention window is {src_window} but the model's is {dst_window}: build the model "
            f"with window_size={src_window}"
        )
    if any(k in report.shape_mismatched for k in missing_required):
        return "some tensors have other shapes: the checkpoint was made for a different configuration of the network"
    if not report.encoder_loaded and report.encoder_keys:
        return "no encoder tensor of the checkpoint matched the model: is it a checkpoint of another architecture?"
    return (
        "the checkpoint lacks these tensors (a partial or truncated encoder?); pass required='none' to accept a "
        "partial load, which is then reported"
    )


def _source_name(source: Any) -> str:
    return str(source) if isinstance(source, (str, os.PathLike)) else "<mapping>"


def convert_state_dict(
    source: str | os.PathLike | Mapping,
    target_model: nn.Module,
    *,
    target: str | None = None,
    channel_policy: str = "error",
    required: str = "encoder",
    map_location: Any = "cpu",
) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """Map a checkpoint onto ``target_model``'s key space without loading it.

    The returned state dict holds exactly the report's ``loaded`` keys, with the model's shapes (the patch
    embedding adapted when ``channel_policy="repeat"``). Arguments are those of :func:`load_pretrained`, and the
    same ``required`` check is applied, so a returned state dict is one :func:`load_pretrained` would load.

    Returns:
        ``(state_dict, report)``.
    """
    _check_choice("channel_policy", channel_policy, CHANNEL_POLICIES)
    _check_choice("required", required, REQUIRED_POLICIES)
    if target is not None:
        _check_choice("target", target, TARGETS)
    where = _source_name(source)
    raw = read_checkpoint(source, map_location) if isinstance(source, (str, os.PathLike)) else source
    state, container = extract_state_dict(raw, where)
    model = _unwrap_model(target_model)
    target = target or _detect_target(model)

    stripped, prefixes = _strip_all(state, where)
    layout = detect_layout(stripped, had_module_prefix="module." in prefixes)
    if layout is None:
        sample = list(state)[:6]
        raise CheckpointLoadError(
            f"checkpoint {where}: unknown layout; sample keys {sample} ({len(state)} keys in all). Known layouts: "
            f"{', '.join(LAYOUTS)} (e.g. 'module.patch_embed.proj.weight', 'swinViT.layers1.0...', "
            f"'encoder.layers1.0.0...')."
        )

    report = LoadReport(
        layout=layout,
        target=target,
        source=where,
        container=container,
        stripped_prefixes=prefixes,
        required=required,
    )
    tgt_state = model.state_dict()
    report.encoder_keys = [k for k in tgt_state if k.startswith(_ENCODER_PREFIX)]
    tgt_categories = {_category(k) for k in tgt_state}
    category_names = {"ssl_head": "SSL pretraining head/decoder", "seg_decoder": "SwinUNETR segmentation decoder"}

    mapped: dict[str, torch.Tensor] = {}
    mapped_from: dict[str, str] = {}
    skipped: set[str] = set()
    src_embed: int | None = None
    dst_embed = int(tgt_state[PATCH_EMBED_WEIGHT].shape[0]) if PATCH_EMBED_WEIGHT in tgt_state else None
    for key, (orig, value) in stripped.items():
        if not isinstance(value, torch.Tensor):
            report.unexpected[orig] = UnusedKey("unknown", f"not a tensor ({type(value).__name__})")
            continue
        canon, unused = _canonical(layout, key)
        if canon is None:
            report.unexpected[orig] = unused  # type: ignore[assignment]
            continue
        if canon == PATCH_EMBED_WEIGHT and value.ndim >= 2:
            src_embed = int(value.shape[0])
        if canon not in tgt_state:
            cat = _category(canon)
            if cat in category_names and cat not in tgt_categories:
                report.unexpected[orig] = UnusedKey("dropped", f"{category_names[cat]}; the {target} model has none")
            else:
                report.unexpected[orig] = UnusedKey("unknown", f"maps to '{canon}', which the model does not have")
            continue
        if canon in mapped_from:
            raise CheckpointLoadError(
                f"checkpoint {where}: keys '{mapped_from[canon]}' and '{orig}' both map to '{canon}' "
                f"(layout={layout}); the file mixes two spellings of the same model."
            )
        mapped_from[canon] = orig
        dst = tgt_state[canon]
        if tuple(value.shape) == tuple(dst.shape):
            mapped[canon] = value
            continue
        only_channels = (
            canon == PATCH_EMBED_WEIGHT
            and value.ndim == dst.ndim
            and value.shape[0] == dst.shape[0]
            and value.shape[2:] == dst.shape[2:]
        )
        if not only_channels:
            report.shape_mismatched[canon] = (tuple(value.shape), tuple(dst.shape))
            continue
        c_src, c_dst = int(value.shape[1]), int(dst.shape[1])
        if channel_policy == "error":
            raise CheckpointLoadError(
                f"checkpoint {where} (layout={layout}): the patch embedding '{canon}' has {c_src} input channel(s) "
                f"in the checkpoint (shape {list(value.shape)}) but the model has {c_dst} (shape {list(dst.shape)}). "
                f"Choose channel_policy='repeat' (repeat the kernel over the {c_dst} channels scaled by "
                f"{c_src}/{c_dst}, so a constant input gives the same response) or channel_policy='skip' (keep the "
                f"model's random patch embedding). The model was not modified."
            )
        if channel_policy == "repeat":
            mapped[canon] = _adapt_in_channels(value, c_dst)
            how = "tiled" if c_dst % c_src == 0 else "channel mean repeated"
            report.adapted[canon] = (
                f"repeat: input channels {c_src} -> {c_dst}, kernel {how} and scaled by {c_src}/{c_dst} "
                f"(shape {list(value.shape)} -> {list(dst.shape)})"
            )
        else:
            skipped.add(canon)
            report.adapted[canon] = (
                f"skip: checkpoint has {c_src} input channel(s) (shape {list(value.shape)}), model {c_dst} "
                f"(shape {list(dst.shape)}); kept the model's initial weights"
            )

    report.loaded = [k for k in tgt_state if k in mapped]
    report.missing = [k for k in tgt_state if k not in mapped]
    exempt = {k for k in tgt_state if k.endswith(_REL_INDEX_SUFFIX)} | skipped
    if required == "encoder":
        required_keys = [k for k in report.encoder_keys if k not in exempt]
    elif required == "all":
        required_keys = [k for k in tgt_state if k not in exempt]
    else:
        required_keys = []
    required_set = set(required_keys)
    report.allowed_missing = [k for k in report.missing if k not in required_set]
    missing_required = [k for k in required_keys if k not in mapped]
    if missing_required:
        parts = [
            f"checkpoint {where} (layout={layout}) into {target}: {len(missing_required)} of {len(required_keys)} "
            f"required tensors (required={required!r}) would not load, first: {missing_required[:5]}."
        ]
        mism = [k for k in missing_required if k in report.shape_mismatched]
        if mism:
            k0 = mism[0]
            src_shape, dst_shape = report.shape_mismatched[k0]
            parts.append(
                f"{len(mism)} of them have another shape, e.g. '{k0}': checkpoint {list(src_shape)} "
                f"vs model {list(dst_shape)}."
            )
        if report.unknown:
            parts.append(f"Unused source keys of unknown role: {list(report.unknown)[:5]}.")
        parts.append(f"Hint: {_hint(report, missing_required, src_embed, dst_embed)}. The model was not modified.")
        raise CheckpointLoadError(" ".join(parts))
    return {k: mapped[k] for k in report.loaded}, report


def load_pretrained(
    model: nn.Module,
    source: str | os.PathLike | Mapping,
    *,
    target: str | None = None,
    channel_policy: str = "error",
    required: str = "encoder",
    map_location: Any = "cpu",
) -> LoadReport:
    """Load pretrained Swin ViT weights of any known layout into ``model`` and report exactly what happened.

    Args:
        model: MONAI ``SwinUNETR``, :class:`~components.networks.SSLHead` or another module with a ``swinViT``
            encoder; DDP / DataParallel / torch.compile wrappers are unwrapped.
        source: a checkpoint path, or an already loaded checkpoint (a state dict or a dict holding one). Files
            are read with ``torch.load(weights_only=True)``.
        target: ``"swinunetr"``, ``"sslhead"`` or ``"encoder"``; None detects it (``isinstance`` of SwinUNETR,
            then a ``swinViT`` attribute with or without SSL heads). Only used to classify dropped keys.
        channel_policy: what to do when the patch embedding's input channels differ (e.g. 1-channel CT weights
            into a 4-channel MRI model): ``"error"`` raises, ``"repeat"`` tiles the kernel over the channels
            scaled by ``C_src / C_dst`` (same response to a constant input), ``"skip"`` keeps the model's weights.
        required: ``"encoder"``: every ``swinViT.*`` tensor must load; ``"all"``: every tensor of the model;
            ``"none"``: anything goes (still reported). ``relative_position_index`` buffers (deterministic) and a
            patch embedding skipped by ``channel_policy="skip"`` are never required.
        map_location: passed to ``torch.load``.

    Returns:
        the :class:`LoadReport`; its summary is logged at INFO (unknown keys and shape mismatches at WARNING).

    Raises:
        FileNotFoundError / CheckpointLoadError: unreadable file, unknown layout, channel mismatch with
            ``channel_policy="error"``, or a ``required`` tensor that would not load. Raised before the model is
            touched.

    Example::

        model = SwinUNETR(in_channels=4, out_channels=3, feature_size=48)
        report = load_pretrained(model, "model_swinvit.pt", channel_policy="repeat")
        print(report.summary())
    """
    state, report = convert_state_dict(
        source, model, target=target, channel_policy=channel_policy, required=required, map_location=map_location
    )
    module = _unwrap_model(model)
    # every key of `state` is a key of the model with the model's shape (checked above), so strict=False only
    # tolerates the keys the report lists as missing; verify that torch agrees with the report.
    result = module.load_state_dict(state, strict=False)
    if result.unexpected_keys or set(result.missing_keys) != set(report.missing):
        raise RuntimeError(
            "load_pretrained: internal inconsistency between the report and torch's load_state_dict: "
            f"unexpected {result.unexpected_keys[:5]}, "
            f"missing differs on {sorted(set(result.missing_keys) ^ set(report.missing))[:5]}"
        )
    logger.info(report.summary())
    for key, how in report.adapted.items():
        logger.info("load_pretrained: adapted %s: %s", key, how)
    if report.unknown:
        logger.warning(
            "load_pretrained: %d source tensors of unknown role were not used, e.g. %s",
            len(report.unknown),
            list(report.unknown)[:5],
        )
    if report.shape_mismatched:
        logger.warning(
            "load_pretrained: %d tensors not loaded for their shape (checkpoint vs model): %s",
            len(report.shape_mismatched),
            dict(list(report.shape_mismatched.items())[:5]),
        )
    return report


def _build_target(target: str, in_channels: int, feature_size: int, out_channels: int, upsample: str) -> nn.Module:
    if target == "swinunetr":
        from monai.networks.nets import SwinUNETR

        return SwinUNETR(in_channels=in_channels, out_channels=out_channels, feature_size=feature_size)
    if target == "sslhead":
        from components.networks import SSLHead

        return SSLHead(in_channels=in_channels, feature_size=feature_size, upsample=upsample)
    raise ValueError(f"convert_checkpoint: target must be 'swinunetr' or 'sslhead', got {target!r}.")


def convert_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    target: str = "swinunetr",
    in_channels: int = 1,
    feature_size: int = 48,
    channel_policy: str = "error",
    required: str = "encoder",
    out_channels: int = 14,
    upsample: str = "vae",
    full_state: bool = True,
    seed: int = 0,
) -> LoadReport:
    """Convert a checkpoint of any known layout into a clean bare state dict of the target architecture.

    The target model is built (``SwinUNETR(in_channels, out_channels, feature_size)`` or
    ``SSLHead(in_channels, feature_size, upsample=upsample)``) with parameters initialised under
    ``torch.manual_seed(seed)``, the checkpoint is loaded with :func:`load_pretrained`, and

    - ``full_state=True`` (default): the model's *full* state dict is written, so the file loads with
      ``strict=True`` into that architecture (``model.load_state_dict(torch.load(dst, weights_only=True))``).
      Tensors the source did not provide (e.g. the SwinUNETR decoder) hold the seeded random initialisation;
      the returned report lists them as ``missing``.
    - ``full_state=False``: only the loaded tensors are written (layout ``swinvit_encoder`` or a partial model),
      to be loaded with :func:`load_pretrained`.

    The file is written with :func:`save_atomic`. ``out_channels`` only shapes the SwinUNETR decoder output.

    Returns:
        the :class:`LoadReport` of the conversion.
    """
    _check_choice("target", target, ("swinunetr", "sslhead"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _build_target(target, in_channels, feature_size, out_channels, upsample)
    report = load_pretrained(model, src, target=target, channel_policy=channel_policy, required=required)
    state = model.state_dict()
    if not full_state:
        loaded = set(report.loaded)
        state = {k: v for k, v in state.items() if k in loaded}
    save_atomic({k: v.detach().clone() for k, v in state.items()}, dst)
    logger.info("convert_checkpoint: wrote %d tensors to %s", len(state), dst)
    return report


# ---------------------------------------------------------------------------------------------------------------
# atomic, resumable training checkpoints
# ---------------------------------------------------------------------------------------------------------------


def save_atomic(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save(obj, path)`` so that ``path`` holds either the previous file or the complete new one.

    Written through :func:`components.atomic.atomic_write` (temporary file, ``fsync``, ``os.replace``, directory
    ``fsync``). A killed process leaves a ``.<name>.<random>.tmp`` behind, never a partial ``path``
    (:class:`ResumableCheckpointSaver` removes such leftovers of its file at start). Why not ignite's
    ``DiskSaver(atomic=True)``: see :mod:`components.atomic`; through ``Checkpoint`` it also insists on its own
    file naming and retention.
    """
    path = Path(path)
    with atomic_write(path) as f:
        torch.save(obj, f)
    return path


def _is_rank0() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _plain(value: Any) -> Any:
    """Numbers as Python numbers (numpy scalars and one-element tensors included) for ``weights_only`` loading."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().item() if value.numel() == 1 else value.detach().cpu()
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():
        return value.item()
    return value


def _engine_scaler(engine: Engine | None) -> Any:
    return getattr(engine, "scaler", None) if engine is not None else None


def _batch_size(engine: Engine) -> int | None:
    """The batch size of the trainer's data loader (MONAI's ``data_loader`` or ignite's ``state.dataloader``)."""
    loader = getattr(engine, "data_loader", None) or getattr(engine.state, "dataloader", None)
    size = getattr(loader, "batch_size", None)
    return None if size is None else int(size)


def _differs(a: Any, b: Any) -> bool:
    try:
        return bool(a != b)
    except (RuntimeError, TypeError, ValueError):  # tensors of several elements
        return not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b))


def restore_schedule(scheduler: Any, saved: Mapping[str, Any]) -> str:
    """Continue ``scheduler``, configured by *this* run, at the step count of ``saved`` (its ``state_dict()``).

    ``LRScheduler.load_state_dict`` would bring back the whole saved ``__dict__``: for MONAI's
    ``WarmupCosineSchedule`` that is the old ``t_total`` and ``warmup_steps``, so a run resumed with a larger
    ``max_epochs`` reaches LR 0 at the old end and climbs back up after it. For a ``LambdaLR`` (MONAI's schedules
    among them), whose LR is ``base_lr * lambda(step)``, only the step counters are restored and the LR of that step
    is recomputed from the current settings. Other schedulers are restored whole (logged at WARNING).

    Returns:
        ``"position"`` or ``"full"``: what was restored.
    """
    if isinstance(scheduler, LambdaLR) and "last_epoch" in saved:
        last_epoch = int(saved["last_epoch"])
        step_count = int(saved.get("_step_count", last_epoch + 1))
        scheduler.last_epoch = last_epoch - 1
        scheduler._step_count = step_count - 1
        with warnings.catch_warnings():  # step() warns when it believes no optimizer step happened yet
            warnings.simplefilter("ignore", UserWarning)
            scheduler.step()  # last_epoch, _step_count and the optimizer's LRs now those of the saved step
        return "position"
    scheduler.load_state_dict(saved)
    logger.warning(
        "restore_schedule: %s is restored whole from the checkpoint, with its saved settings (only a LambdaLR "
        "schedule, such as MONAI's WarmupCosineSchedule, follows this run's config on resume)",
        type(scheduler).__name__,
    )
    return "full"


def _check_interval(name: str, value: int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer or None, got {value!r}.")
    return value


RESUME_FORMAT = "components.checkpoint/resumable-v1"


class ResumableCheckpointSaver:
    """Save everything needed to resume training to one file, atomically, every few epochs and/or iterations.

    The file (``ckpt_dir / filename``, overwritten in place with :func:`save_atomic`) holds plain tensors,
    numbers and dicts only (it loads with ``torch.load(weights_only=True)``)::

        {"format": "components.checkpoint/resumable-v1",
         "model": state dict of the network without DDP / torch.compile wrappers,
         "optimizer": ..., "lr_scheduler": ..., "scaler": ...,      # when given (None entries are skipped)
         "trainer": {"epoch", "iteration", "epoch_length", "max_epochs", "batch_size"},
         "sampler": {"seed", "shuffle", "num_samples", "epoch", "position"},  # when a sampler is given
         "recipe": state dict of a stateful recipe (e.g. a teacher and its centre),  # when a recipe is given
         "best_metric": ..., "best_metric_epoch": ..., "best_metric_iteration": ...}  # when an evaluator is given

    Only rank 0 writes (when ``torch.distributed`` is initialised). The ``"model"`` entry makes the file a valid
    source for :func:`load_pretrained` too.

    Why not MONAI's ``CheckpointSaver``: it writes with ``atomic=False`` (a kill mid-write destroys the previous
    checkpoint) and saves the trainer's ignite state without the evaluator's best metric; ignite's ``Checkpoint``
    with ``n_saved=1`` and a fixed file name removes the previous file *before* writing the new one. This class
    reuses ignite's event filters and adds its own atomic write.

    Args:
        ckpt_dir: directory of the checkpoint file (created if needed).
        network: the model (DDP / torch.compile wrappers are unwrapped).
        optimizer, lr_scheduler: saved when not None.
        scaler: an AMP ``GradScaler`` (anything with ``state_dict``); None saves ``engine.scaler`` if the engine
            has one (MONAI's trainers create their scaler in ``run()``).
        evaluator: an engine whose ``state.best_metric`` / ``state.best_metric_epoch`` (MONAI workflows) are saved,
            with the trainer iteration at which that best validation ran (``state.best_metric_iteration``, kept here).
        sampler: the training loader's :class:`~components.EpochShuffleSampler` (anything with
            ``state_dict(position)``): its order and the position inside the current epoch (samples already used:
            iterations of the epoch x the loader's ``batch_size``) are saved, so a restart continues the epoch.
        recipe: a pretraining recipe with state of its own (an ``nn.Module``, e.g.
            :class:`~components.SelfDistillationRecipe`: the teacher and the loss's centre).
        filename: file name in ``ckpt_dir``.
        epoch_interval: save every this many epochs (None: not on epochs).
        iteration_interval: save every this many iterations (None: not on iterations).
        time_interval_s: save when about this many seconds have passed since the last save (or the start), by rank
            0's clock (None: not by time). Every rank must save at the same iteration (the save's guards run
            collectives), so no rank reads its clock per iteration: rank 0 times the first
            ``calibration_iterations`` iterations, and from its seconds per iteration and the time left chooses the
            iteration of the next look at the clock, where it measures again (one small broadcast per look):
            it saves there once the interval has passed, never early, else looks again later.
        calibration_iterations: iterations timed before the first look at the clock.
        save_final: save when the run completes (a later run with a larger ``max_epochs`` can continue from it).

    With an ``evaluator`` the file is also written whenever a validation becomes the best, so the best metric it
    holds always describes ``model.pt`` (a resumed run replaces ``model.pt`` only by a strictly better one).

    Attach it *after* the validation handler of the same event, so that the best metric of the epoch just
    validated is in the file (ignite calls handlers of one event in the order they were attached).

    Example::

        saver = ResumableCheckpointSaver("runs/ckpt", net, optimizer, scheduler, evaluator=evaluator)
        saver.attach(trainer)
        ResumeHandler("runs/ckpt/checkpoint.pt", net, optimizer, scheduler, evaluator=evaluator).attach(trainer)
    """

    def __init__(
        self,
        ckpt_dir: str | os.PathLike,
        network: nn.Module,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        scaler: Any = None,
        evaluator: Engine | None = None,
        filename: str = "checkpoint.pt",
        epoch_interval: int | None = 1,
        iteration_interval: int | None = None,
        save_final: bool = True,
        sampler: Any = None,
        recipe: nn.Module | None = None,
        time_interval_s: float | None = None,
        calibration_iterations: int = 10,
    ) -> None:
        if not isinstance(network, nn.Module):
            raise TypeError(
                f"ResumableCheckpointSaver: network must be a torch.nn.Module, got {type(network).__name__}."
            )
        if recipe is not None and not isinstance(recipe, nn.Module):
            raise TypeError(f"ResumableCheckpointSaver: recipe must be a torch.nn.Module, got {type(recipe).__name__}.")
        for name, obj in (("optimizer", optimizer), ("lr_scheduler", lr_scheduler), ("scaler", scaler)):
            if obj is not None and not callable(getattr(obj, "state_dict", None)):
                raise TypeError(f"ResumableCheckpointSaver: {name} has no state_dict() ({type(obj).__name__}).")
        if not filename or Path(filename).name != filename:
            raise ValueError(f"ResumableCheckpointSaver: filename must be a plain file name, got {filename!r}.")
        self.epoch_interval = _check_interval("epoch_interval", epoch_interval)
        self.iteration_interval = _check_interval("iteration_interval", iteration_interval)
        self.calibration_iterations = _check_interval("calibration_iterations", calibration_iterations)
        if time_interval_s is not None and not (isinstance(time_interval_s, (int, float)) and time_interval_s > 0):
            raise ValueError(f"time_interval_s must be a positive number of seconds or None, got {time_interval_s!r}.")
        self.time_interval_s = None if time_interval_s is None else float(time_interval_s)
        intervals = (self.epoch_interval, self.iteration_interval, self.time_interval_s)
        if all(i is None for i in intervals) and not save_final and evaluator is None:
            raise ValueError(
                "ResumableCheckpointSaver: nothing to do (no epoch_interval, iteration_interval, time_interval_s, "
                "save_final or evaluator)."
            )
        self.path = Path(ckpt_dir) / filename
        self.network = network
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.scaler = scaler
        self.evaluator = evaluator
        self.save_final = save_final
        if sampler is not None and not callable(getattr(sampler, "state_dict", None)):
            raise TypeError(f"ResumableCheckpointSaver: sampler has no state_dict() ({type(sampler).__name__}).")
        self.sampler = sampler
        self.recipe = recipe
        self._last_saved: tuple | None = None
        self._trainer: Engine | None = None
        self._clock: tuple[int, float] | None = None  # (iteration, time) of the last time-based decision
        self._last_save_time: float | None = None  # rank 0's clock at the last save (or the run's first iteration)
        self._next_timed_save: int | None = None
        self.clock: Callable[[], float] = time.monotonic

    def attach(self, engine: Engine) -> None:
        self._trainer = engine
        register_checkpoint_events(engine)
        engine.add_event_handler(Events.STARTED, self._remove_stale_temps)
        if self.evaluator is not None:  # after the evaluator's own best-metric update (attached when it was built)
            self.evaluator.add_event_handler(Events.EPOCH_COMPLETED, self._note_best_iteration)
        if self.epoch_interval is not None:
            engine.add_event_handler(Events.EPOCH_COMPLETED(every=self.epoch_interval), self.save)
        if self.iteration_interval is not None:
            engine.add_event_handler(Events.ITERATION_COMPLETED(every=self.iteration_interval), self.save)
        if self.time_interval_s is not None:
            engine.add_event_handler(Events.ITERATION_COMPLETED, self._save_on_time)
        if self.save_final:
            engine.add_event_handler(Events.COMPLETED, self.save)

    def _save_on_time(self, engine: Engine) -> None:
        """At the iteration chosen last time, measures again (rank 0's clock, one broadcast) and saves when the
        interval has passed (within half an iteration), else chooses a later iteration. Every rank runs the same
        iterations and receives the same numbers, so all ranks save together."""
        iteration = engine.state.iteration
        if self._clock is None:  # the first iteration of this run (it includes start-up): the clock starts after it
            self._clock = (iteration, self.clock())
            self._last_save_time = self._last_save_time or self._clock[1]
            self._next_timed_save = iteration + self.calibration_iterations
            return
        if iteration < self._next_timed_save:
            return
        per_iteration, left = self._measure(iteration)
        if left <= per_iteration / 2:
            self.save(engine)
            left = self.time_interval_s
        self._next_timed_save = iteration + max(1, math.ceil(left / max(per_iteration, 1e-9)))

    def _measure(self, iteration: int) -> tuple[float, float]:
        """(seconds per iteration since the last measurement, seconds left of the interval), rank 0's, broadcast."""
        start_iteration, start = self._clock
        now = self.clock()
        self._clock = (iteration, now)
        per_iteration = (now - start) / max(iteration - start_iteration, 1)
        per_iteration, left = broadcast_from_rank0([per_iteration, self.time_interval_s - (now - self._last_save_time)])
        return per_iteration, left

    def _remove_stale_temps(self, engine: Engine | None = None) -> None:
        if not _is_rank0() or not self.path.parent.is_dir():
            return
        for leftover in self.path.parent.glob(f"{temp_prefix(self.path)}*.tmp"):
            try:
                leftover.unlink()
                logger.info("ResumableCheckpointSaver: removed the leftover of an interrupted save: %s", leftover)
            except OSError:
                pass

    def _note_best_iteration(self, evaluator: Engine) -> None:
        """The trainer iteration of a validation that just became the best (MONAI sets best_metric_epoch to it);
        the file is written at once, so its best metric describes the ``model.pt`` saved for that validation."""
        state = evaluator.state
        if self._trainer is not None and getattr(state, "best_metric_epoch", None) == state.epoch:
            state.best_metric_iteration = int(self._trainer.state.iteration)
            self.save(self._trainer)

    def _best(self) -> tuple[Any, Any, Any]:
        state = self.evaluator.state  # type: ignore[union-attr]
        return (
            _plain(getattr(state, "best_metric", None)),
            _plain(getattr(state, "best_metric_epoch", None)),
            _plain(getattr(state, "best_metric_iteration", None)),
        )

    def _position(self, engine: Engine) -> int:
        """Samples of the current epoch already used: completed iterations of the epoch x the batch size."""
        state = engine.state
        in_epoch = state.iteration % state.epoch_length if state.epoch_length else 0
        if in_epoch == 0:
            return 0
        batch_size = _batch_size(engine)
        if batch_size is None:
            raise RuntimeError(
                "ResumableCheckpointSaver: a sampler was given but the trainer's data loader has no batch_size; "
                "the position inside the epoch cannot be saved."
            )
        return in_epoch * batch_size

    def checkpoint_dict(self, engine: Engine) -> dict[str, Any]:
        """The dict that :meth:`save` writes for the current state of ``engine``."""
        state = engine.state
        ckpt: dict[str, Any] = {
            "format": RESUME_FORMAT,
            "model": _unwrap_model(self.network).state_dict(),
            "trainer": {
                "epoch": int(state.epoch),
                "iteration": int(state.iteration),
                "epoch_length": None if state.epoch_length is None else int(state.epoch_length),
                "max_epochs": None if state.max_epochs is None else int(state.max_epochs),
                "batch_size": _batch_size(engine),
            },
        }
        scaler = self.scaler if self.scaler is not None else _engine_scaler(engine)
        for name, obj in (("optimizer", self.optimizer), ("lr_scheduler", self.lr_scheduler), ("scaler", scaler)):
            if obj is not None:
                ckpt[name] = obj.state_dict()
        if self.sampler is not None:
            ckpt["sampler"] = self.sampler.state_dict(position=self._position(engine))
        if self.recipe is not None:
            ckpt["recipe"] = self.recipe.state_dict()
        if self.evaluator is not None:
            ckpt["best_metric"], ckpt["best_metric_epoch"], ckpt["best_metric_iteration"] = self._best()
        return ckpt

    def save(self, engine: Engine) -> Path | None:
        """Write the checkpoint now (rank 0 only); returns the path written, None when skipped. Fires
        ``CheckpointEvents.BEFORE_SAVE`` on every rank first (a non-finite-loss guard raises there)."""
        register_checkpoint_events(engine)
        engine.fire_event(CheckpointEvents.BEFORE_SAVE)
        if not _is_rank0():
            return None
        marker = (engine.state.iteration, *(self._best() if self.evaluator is not None else ()))
        if marker == self._last_saved and self.path.exists():
            return None  # same iteration and best metric already on disk (e.g. EPOCH_COMPLETED then COMPLETED)
        save_atomic(self.checkpoint_dict(engine), self.path)
        self._last_saved = marker
        self._last_save_time = self.clock()
        logger.info(
            "saved resumable checkpoint %s (epoch %s, iteration %s)",
            self.path,
            engine.state.epoch,
            engine.state.iteration,
        )
        return self.path


def _written_with(ckpt: Mapping) -> dict[str, Any]:
    """The settings a resumable checkpoint records about its run: the trainer's loop and the sampler's order."""
    trainer = ckpt.get("trainer") if isinstance(ckpt.get("trainer"), Mapping) else {}
    sampler = ckpt.get("sampler") if isinstance(ckpt.get("sampler"), Mapping) else {}
    settings = {k: trainer.get(k) for k in ("max_epochs", "epoch_length", "batch_size") if trainer.get(k) is not None}
    settings.update({f"sampler_{k}": sampler[k] for k in ("seed", "num_samples") if sampler.get(k) is not None})
    return settings


class ResumeHandler:
    """Restore a :class:`ResumableCheckpointSaver` file when the trainer starts, so ignite continues from it.

    At ``Events.STARTED`` (attach it to the trainer): loads the file with ``weights_only=True``, restores the
    model (strict), a stateful recipe's state (strict), the optimizer state, the LR schedule's position, the scaler,
    the evaluator's best metric
    (``best_metric``, ``best_metric_epoch``, ``best_metric_iteration``), the sampler's position inside the epoch,
    and sets ``trainer.state.iteration`` and ``trainer.state.epoch`` (completed epochs, ``iteration // epoch_length``).

    What follows this run's config rather than the file: ``max_epochs`` (it may be larger or smaller than the saved
    one), the LR schedule's settings (:func:`restore_schedule`: the step count comes from the file, ``t_total``,
    warm-up and base LR from this run, so the LR at every iteration equals that of an uninterrupted run with this
    run's ``max_epochs``) and the optimizer's hyperparameters (``lr``, ``weight_decay``, ...; its moments come from
    the file; changes are logged). What cannot be honoured raises: another ``epoch_length`` or ``batch_size``, or,
    with a sampler, another seed or shard size.

    ignite 0.5.5 semantics this relies on: ``Engine.run`` sets up its state (``epoch = iteration = 0``) *before*
    firing STARTED, and after STARTED loops ``while not _is_done(state): state.epoch += 1 ...``, taking the
    position inside the epoch from ``state.iteration % epoch_length`` when the data iterator is first set up;
    so values set at STARTED are where the run continues. If the checkpoint is already at or past ``max_epochs``,
    ignite runs no epoch and only COMPLETED fires (a warning is logged). A mid-epoch checkpoint
    (``iteration_interval``) continues that epoch: with ``sampler`` given, the loader yields the epoch's remaining
    batches in the uninterrupted order (:class:`~components.EpochShuffleSampler`); without it, the rest of that
    epoch sees the loader's first batches (logged at WARNING).

    Args:
        path: the checkpoint file; None, ``""``, ``"None"`` or ``"null"`` make the handler a no-op.
        network, optimizer, lr_scheduler, scaler, evaluator, sampler, recipe: as for :class:`ResumableCheckpointSaver`.
            Every object given must have its entry in the file (the sampler excepted: a file without one is
            continued from the trainer's counters). ``scaler=None`` restores ``engine.scaler`` when the engine has
            one and the file has a ``scaler`` entry.
        map_location: for ``torch.load`` (optimizer states are moved to their parameters' devices by torch).
        missing_ok: a ``path`` that does not exist is skipped (logged) instead of raising, for "resume if there
            is a checkpoint" setups.
        auto_resume: with ``path`` None, continue from ``<ckpt_dir>/checkpoint.pt`` when it exists
            (:func:`~components.resolve_resume`; a restarted or relaunched run continues). ``"true"`` / ``"false"``
            strings are accepted (command-line overrides). A file found this way that cannot be continued raises an
            error that says it was auto-resumed, from which file, and how to start fresh.
        ckpt_dir: the folder ``auto_resume`` looks in (required with ``auto_resume``).

    After a resume, ``report`` holds what was restored (file, epoch, iteration, best metric and where it came
    from, schedule, changed optimizer settings); it is also logged at INFO, starting with one line that names the
    file, how it was chosen (given or auto_resume), its epoch and iteration and the settings it was written with.

    Raises:
        FileNotFoundError / CheckpointLoadError at STARTED: missing file, unreadable file, an entry missing from
        the file, a model that does not match it, a different ``epoch_length`` / ``batch_size`` / data order.
        Checked before anything is modified.
    """

    def __init__(
        self,
        path: str | os.PathLike | None,
        network: nn.Module,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        scaler: Any = None,
        evaluator: Engine | None = None,
        map_location: Any = "cpu",
        missing_ok: bool = False,
        sampler: Any = None,
        recipe: nn.Module | None = None,
        auto_resume: bool | str = False,
        ckpt_dir: str | os.PathLike | None = None,
    ) -> None:
        if not isinstance(network, nn.Module):
            raise TypeError(f"ResumeHandler: network must be a torch.nn.Module, got {type(network).__name__}.")
        if recipe is not None and not isinstance(recipe, nn.Module):
            raise TypeError(f"ResumeHandler: recipe must be a torch.nn.Module, got {type(recipe).__name__}.")
        auto_resume = as_bool(auto_resume, "auto_resume")
        if auto_resume and optional_path(ckpt_dir) is None:
            raise ValueError("ResumeHandler: auto_resume needs ckpt_dir (the folder to look for checkpoint.pt in).")
        restorable = {"optimizer": optimizer, "lr_scheduler": lr_scheduler, "scaler": scaler, "sampler": sampler}
        for name, obj in restorable.items():
            if obj is not None and not callable(getattr(obj, "load_state_dict", None)):
                raise TypeError(f"ResumeHandler: {name} has no load_state_dict() ({type(obj).__name__}).")
        given = optional_path(path)
        path = resolve_resume(given, ckpt_dir, auto_resume) if auto_resume else given
        self.path = None if path is None else Path(path)
        self.auto = given is None and path is not None  # found by auto_resume, not asked for
        self.network = network
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.scaler = scaler
        self.evaluator = evaluator
        self.sampler = sampler
        self.recipe = recipe
        self.map_location = map_location
        self.missing_ok = missing_ok
        self.resumed = False
        self.report: dict[str, Any] = {}

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.STARTED, self)

    def _fail(self, msg: str) -> CheckpointLoadError:
        if self.auto:
            return CheckpointLoadError(
                f"auto_resume found '{self.path}' (a checkpoint an earlier run left in ckpt_dir) but cannot continue "
                f"it: {msg} To start fresh, pass --auto_resume false or another --ckpt_dir (or remove that file)."
            )
        return CheckpointLoadError(f"resume checkpoint '{self.path}': {msg}")

    def _check_model(self, module: nn.Module, state: Mapping, entry: str = "model") -> dict[str, torch.Tensor]:
        if not isinstance(state, Mapping):
            raise self._fail(f"entry {entry!r} is not a state dict ({type(state).__name__}).")
        state = {_strip_wrappers(k)[0]: v for k, v in state.items()}
        own = module.state_dict()
        missing = [k for k in own if k not in state]
        extra = [k for k in state if k not in own]
        shapes = [
            f"{k}: file {list(v.shape)} vs model {list(own[k].shape)}"
            for k, v in state.items()
            if k in own and isinstance(v, torch.Tensor) and tuple(v.shape) != tuple(own[k].shape)
        ]
        if missing or extra or shapes:
            raise self._fail(
                f"entry {entry!r} does not match the {'network' if entry == 'model' else entry} ({type(module).__name__}): {len(missing)} missing "
                f"{missing[:5]}, {len(extra)} unexpected {extra[:5]}, {len(shapes)} with another shape {shapes[:3]}. "
                "Resume needs the same architecture; use load_pretrained for weights of another model."
            )
        return state

    def _check_loop(self, engine: Engine, trainer: Any) -> tuple[int, int | None]:
        """(iteration, epoch_length) of the file, checked against this run's epoch length and batch size."""
        if not isinstance(trainer, Mapping) or "iteration" not in trainer:
            raise self._fail("entry 'trainer' has no 'iteration'.")
        saved_len, cur_len = trainer.get("epoch_length"), engine.state.epoch_length
        if cur_len is not None and saved_len is not None and int(saved_len) != int(cur_len):
            raise self._fail(
                f"it was written with epoch_length={saved_len} but this run has epoch_length={cur_len}; "
                "resuming needs the same number of iterations per epoch (same data and batch size per rank)."
            )
        saved_bs, cur_bs = trainer.get("batch_size"), _batch_size(engine)
        if saved_bs is not None and cur_bs is not None and int(saved_bs) != int(cur_bs):
            raise self._fail(
                f"it was written with batch_size={saved_bs} but this run has batch_size={cur_bs}; resuming needs "
                "the same batch size (the position inside the epoch and the schedule count batches)."
            )
        epoch_len = cur_len if cur_len is not None else saved_len
        return int(trainer["iteration"]), None if epoch_len is None else int(epoch_len)

    def _restore_optimizer(self, saved: Any) -> dict[str, str]:
        """Optimizer state from the file, hyperparameters from this run's config; returns those that changed."""
        assert self.optimizer is not None
        configured = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        self.optimizer.load_state_dict(saved)
        changed: dict[str, str] = {}
        for i, (group, own) in enumerate(zip(self.optimizer.param_groups, configured)):
            for key, value in own.items():
                if key not in ("lr", "initial_lr") and key in group and _differs(group[key], value):
                    changed[f"param_groups[{i}].{key}"] = f"{group[key]!r} -> {value!r}"
            group.update(own)
        return changed

    def _restore_sampler(self, ckpt: Mapping, engine: Engine, iteration: int, epoch_len: int | None) -> int:
        """Position of the sampler inside the current epoch (samples), from the file or the trainer's counters."""
        in_epoch = iteration % epoch_len if epoch_len else 0
        state = ckpt.get("sampler")
        if state is None:
            batch_size = _batch_size(engine) or 1
            state = {**self.sampler.state_dict(), "epoch": iteration // epoch_len + 1 if epoch_len else 0,
                     "position": in_epoch * batch_size}  # fmt: skip
            logger.info("ResumeHandler: %s has no sampler entry; position taken from the iteration count", self.path)
        elif in_epoch == 0 and int(state.get("position", 0)):
            raise self._fail(f"entry 'sampler' is at position {state.get('position')} but the trainer at an epoch end.")
        try:
            self.sampler.load_state_dict(state)
        except ValueError as err:
            raise self._fail(str(err)) from err
        return int(state.get("position", 0))

    def __call__(self, engine: Engine) -> None:
        if self.path is None:
            logger.debug("ResumeHandler: no checkpoint path, starting from scratch")
            return
        if self.resumed:
            logger.debug("ResumeHandler: already resumed from %s in this process; not reloading", self.path)
            return
        if not self.path.exists() and self.missing_ok:
            logger.info("ResumeHandler: %s does not exist (missing_ok=True), starting from scratch", self.path)
            return
        try:
            ckpt = read_checkpoint(self.path, self.map_location)
        except CheckpointLoadError as err:
            raise self._fail(str(err)) from err
        if not isinstance(ckpt, Mapping):
            raise self._fail(f"expected a dict written by ResumableCheckpointSaver, got {type(ckpt).__name__}.")

        engine_scaler = _engine_scaler(engine)
        scaler = self.scaler if self.scaler is not None else (engine_scaler if "scaler" in ckpt else None)
        needed = ["model", "trainer"]
        needed += [n for n, o in (("optimizer", self.optimizer), ("lr_scheduler", self.lr_scheduler)) if o is not None]
        needed += ["recipe"] if self.recipe is not None else []
        if self.scaler is not None:
            needed.append("scaler")
        if self.evaluator is not None:
            needed += ["best_metric", "best_metric_epoch"]
        absent = [n for n in needed if n not in ckpt]
        if absent:
            raise self._fail(
                f"missing entr{'y' if len(absent) == 1 else 'ies'} {absent} (the file has {sorted(map(str, ckpt))}). "
                "Was it written by ResumableCheckpointSaver with the same objects (optimizer, lr_scheduler, scaler, "
                "evaluator)?"
            )
        if engine_scaler is not None and self.scaler is None and "scaler" not in ckpt:
            logger.warning(
                "ResumeHandler: %s has no scaler state (AMP off before?); the scaler starts fresh", self.path
            )

        iteration, epoch_len = self._check_loop(engine, ckpt["trainer"])
        epoch = iteration // epoch_len if epoch_len else int(ckpt["trainer"].get("epoch", 0))
        module = _unwrap_model(self.network)
        model_state = self._check_model(module, ckpt["model"])
        recipe_state = self._check_model(self.recipe, ckpt["recipe"], "recipe") if self.recipe is not None else None
        if self.optimizer is not None:
            groups = ckpt["optimizer"].get("param_groups", []) if isinstance(ckpt["optimizer"], Mapping) else []
            own = self.optimizer.state_dict()["param_groups"]
            if [len(g["params"]) for g in groups] != [len(g["params"]) for g in own]:
                raise self._fail(
                    "entry 'optimizer' has parameter groups of sizes "
                    f"{[len(g['params']) for g in groups]}, the optimizer {[len(g['params']) for g in own]}."
                )
        position = self._restore_sampler(ckpt, engine, iteration, epoch_len) if self.sampler is not None else None

        # everything checked: restore
        module.load_state_dict(model_state, strict=True)
        if recipe_state is not None:
            self.recipe.load_state_dict(recipe_state, strict=True)
        report: dict[str, Any] = {"path": str(self.path), "auto": self.auto, "epoch": epoch, "iteration": iteration}
        report["written_with"] = _written_with(ckpt)
        if self.optimizer is not None:
            report["optimizer_changed"] = self._restore_optimizer(ckpt["optimizer"])
        if self.lr_scheduler is not None:
            report["lr_schedule"] = restore_schedule(self.lr_scheduler, ckpt["lr_scheduler"])
        if scaler is not None and "scaler" in ckpt:
            scaler.load_state_dict(ckpt["scaler"])
        if self.evaluator is not None:
            for key in ("best_metric", "best_metric_epoch", "best_metric_iteration"):
                if ckpt.get(key) is not None:
                    setattr(self.evaluator.state, key, ckpt[key])
            report.update({k: ckpt.get(k) for k in ("best_metric", "best_metric_epoch", "best_metric_iteration")})
        if engine.state.epoch_length is None and epoch_len is not None:
            engine.state.epoch_length = epoch_len
        engine.state.iteration = iteration
        engine.state.epoch = epoch
        self.resumed = True
        report["sampler_position"] = position
        self.report = report
        self._log(engine, report, epoch_len)

    def _log(self, engine: Engine, report: dict[str, Any], epoch_len: int | None) -> None:
        epoch, iteration = report["epoch"], report["iteration"]
        how = "found by auto_resume; --auto_resume false or another --ckpt_dir starts fresh" if self.auto else "given"
        settings = ", ".join(f"{k}={v}" for k, v in report["written_with"].items())
        logger.info(
            "resumed from %s (%s) at epoch %d, iteration %d; it was written with %s",
            self.path, how, epoch, iteration, settings or "no recorded settings",
        )  # fmt: skip
        if self.evaluator is not None:
            name = getattr(self.evaluator.state, "key_metric_name", None) or "key metric"
            if report.get("best_metric_epoch") in (None, -1):
                logger.info("ResumeHandler: no validation in the checkpoint yet: no best %s restored", name)
            else:
                logger.info(
                    "ResumeHandler: restored best %s %s (epoch %s, iteration %s): the model saved then stays the best "
                    "until a strictly better validation",
                    name, report["best_metric"], report["best_metric_epoch"], report.get("best_metric_iteration"),
                )  # fmt: skip
        if self.lr_scheduler is not None:
            optimizer = getattr(self.lr_scheduler, "optimizer", self.optimizer)
            lrs = [group["lr"] for group in optimizer.param_groups] if optimizer is not None else None
            step = getattr(self.lr_scheduler, "last_epoch", None)
            if report["lr_schedule"] == "position":
                names = [k for k in ("warmup_steps", "t_total") if hasattr(self.lr_scheduler, k)]
                settings = {k: getattr(self.lr_scheduler, k) for k in names}
                logger.info(
                    "ResumeHandler: LR schedule continues at step %s with this run's settings %s: lr %s",
                    step, settings, lrs,
                )  # fmt: skip
            else:
                logger.info("ResumeHandler: LR schedule restored whole from the checkpoint at step %s: lr %s", step, lrs)
        for key, change in report.get("optimizer_changed", {}).items():
            logger.info("ResumeHandler: optimizer %s from this run's config (checkpoint -> config)", f"{key}: {change}")
        in_epoch = iteration % epoch_len if epoch_len else 0
        if in_epoch:
            left = epoch_len - in_epoch  # type: ignore[operator]
            if self.sampler is not None:
                logger.info(
                    "ResumeHandler: the checkpoint is mid-epoch (iteration %d of epoch %d): the remaining %d "
                    "iterations continue the epoch's order from sample %d",
                    in_epoch, epoch + 1, left, report["sampler_position"],
                )  # fmt: skip
            else:
                logger.warning(
                    "ResumeHandler: the checkpoint is mid-epoch (iteration %d of epoch %d) and no sampler was given: "
                    "the remaining %d iterations of that epoch start again from the loader's first batches",
                    in_epoch, epoch + 1, left,
                )  # fmt: skip
        max_epochs = engine.state.max_epochs
        if max_epochs is not None and epoch >= max_epochs:
            logger.warning(
                "ResumeHandler: %s is at epoch %d >= max_epochs=%d: nothing left to train; raise max_epochs to "
                "continue%s",
                self.path,
                epoch,
                max_epochs,
                " (it was found by auto_resume: --auto_resume false or another --ckpt_dir starts fresh)" if self.auto else "",
            )


class BestModelSaver(CheckpointSaver):
    """MONAI's ``CheckpointSaver`` of the best model by the key metric (``save_key_metric=True``, one file), whose
    record of the best score survives a resume or a restart.

    MONAI's saver (an ignite ``Checkpoint`` with a score) keeps the best score in memory only: after a restart the
    first validation always overwrites ``model.pt``, even with a worse model. This one, when an evaluation starts
    and it has saved nothing yet in this process, takes the best score from the evaluator's state, where
    :class:`ResumeHandler` restored ``best_metric`` / ``best_metric_epoch`` / ``best_metric_iteration`` from the
    resumable checkpoint, through MONAI's own ``load_state_dict``. ``model.pt`` is then replaced only by a strictly
    better validation (``key_metric_greater_or_equal=False``), and ``checkpoint.pt``'s best metric keeps describing it.
    If the evaluator has a best metric but the file is missing, the next validation writes it (logged at WARNING).

    Args:
        save_dir, save_dict: as for ``CheckpointSaver``.
        key_metric_filename: the best model's file name in ``save_dir``.
        key_metric_negative_sign: lower is better (the saved score is ``-metric``).
        kwargs: other ``CheckpointSaver`` arguments (``save_key_metric`` is always True).

    Attach it to the evaluator, like ``CheckpointSaver``.
    """

    def __init__(
        self,
        save_dir: str,
        save_dict: dict,
        key_metric_filename: str = "model.pt",
        key_metric_negative_sign: bool = False,
        **kwargs: Any,
    ) -> None:
        kwargs["save_key_metric"] = True
        super().__init__(
            save_dir,
            save_dict,
            key_metric_filename=key_metric_filename,
            key_metric_negative_sign=key_metric_negative_sign,
            **kwargs,
        )
        self.path = Path(save_dir) / key_metric_filename
        self.sign = -1.0 if key_metric_negative_sign else 1.0

    def attach(self, engine: Engine) -> None:
        super().attach(engine)
        engine.add_event_handler(Events.STARTED, self.restore_best)

    def restore_best(self, engine: Engine) -> None:
        """Seed the saver's best score from ``engine.state`` once, before this process saved any model."""
        if self._key_metric_checkpoint.state_dict()["_saved"]:
            return
        state = engine.state
        epoch, best = getattr(state, "best_metric_epoch", None), getattr(state, "best_metric", None)
        if epoch is None or best is None or int(epoch) < 1:
            return  # no validation before this run
        name = getattr(state, "key_metric_name", None) or "key metric"
        where = f"epoch {epoch}, iteration {getattr(state, 'best_metric_iteration', None)}"
        if not self.path.is_file():
            logger.warning(
                "BestModelSaver: the resumed best %s %s (%s) has no model file %s; the next validation writes it",
                name, best, where, self.path,
            )  # fmt: skip
            return
        self.load_state_dict({"_saved": [(self.sign * float(best), self.path.name)]})
        logger.info(
            "BestModelSaver: best model %s has %s %s (%s, restored from the resumed checkpoint); it is replaced only "
            "by a strictly better validation",
            self.path, name, best, where,
        )  # fmt: skip


class PretrainedLoader:
    """Ignite handler around :func:`load_pretrained`: load pretrained weights when the trainer starts.

    Args:
        path: checkpoint file of any layout :func:`load_pretrained` knows; None, ``""``, ``"None"`` or ``"null"``
            (``--pretrained_path null`` on a command line) mean none: the model keeps its random initialisation.
        network: the model to load into (wrappers are unwrapped).
        channel_policy, required, target: as for :func:`load_pretrained`.
        warn_from_scratch: say at WARNING (else INFO) that the model trains from random initialisation when no path
            is given: a finetuning run without its pretrained weights is a silent failure otherwise.
        hint: appended to that message, e.g. where the default weights were looked for.

    Every start says where the weights came from: the file and the load report at INFO, or the random
    initialisation at WARNING (``warn_from_scratch``). The load happens once per handler (the first STARTED, or an
    explicit call), so a second ``run()`` of the same trainer does not overwrite trained weights. Errors propagate
    and stop the run. Independent of :class:`ResumeHandler`: if both are attached, the one attached later wins for
    the weights.

    Example::

        PretrainedLoader("model_swinvit.pt", net, channel_policy="repeat").attach(trainer)
    """

    def __init__(
        self,
        path: str | os.PathLike | None,
        network: nn.Module,
        channel_policy: str = "error",
        required: str = "encoder",
        target: str | None = None,
        warn_from_scratch: bool = True,
        hint: str | None = None,
    ) -> None:
        _check_choice("channel_policy", channel_policy, CHANNEL_POLICIES)
        _check_choice("required", required, REQUIRED_POLICIES)
        if target is not None:
            _check_choice("target", target, TARGETS)
        self.path = optional_path(path)
        self.warn_from_scratch = bool(warn_from_scratch)
        self.hint = hint
        self.network = network
        self.channel_policy = channel_policy
        self.required = required
        self.target = target
        self.report: LoadReport | None = None

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.STARTED, self)

    def __call__(self, engine: Engine | None = None) -> LoadReport | None:
        name = type(_unwrap_model(self.network)).__name__
        if self.path is None:
            logger.log(
                logging.WARNING if self.warn_from_scratch else logging.INFO,
                "PretrainedLoader: no pretrained weights (pretrained_path is none): %s trains from random "
                "initialisation%s",
                name,
                f"; {self.hint}" if self.hint else "",
            )
            return None
        if self.report is not None:
            return self.report
        self.report = load_pretrained(
            self.network,
            self.path,
            target=self.target,
            channel_policy=self.channel_policy,
            required=self.required,
        )
        logger.info("PretrainedLoader: %s starts from %s: %s", name, self.path, self.report.summary())
        return self.report
