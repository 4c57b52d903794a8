"""Checkpoint layouts and key mapping: which published layout a state dict is in, and what each key becomes.

This module is the only place that knows checkpoint layouts. The published Swin UNETR / SSL checkpoints come in
several layouts (``LAYOUTS``); every key is mapped explicitly and whatever does not map is named in a
:class:`LoadReport`.

A file is first unwrapped from its container (``state_dict``, ``model``, ``network``, ``net``, ``network_weights``,
``model_state_dict``), then the wrapper prefixes are stripped from every key: ``module.`` (DDP / DataParallel),
``_orig_mod.`` (torch.compile) and ``backbone.`` (a Swin UNETR held as ``backbone`` by VoCo and SuPreM), alone or
combined (``module.backbone.``). The older ``swin_vit.`` spelling of ``swinViT.`` is accepted everywhere, and so are
the residual blocks ``layers1c`` .. ``layers4c`` of a ``use_v2=True`` encoder. The layouts then detected, and where in
the public code each comes from:

========================= ===================================================================================
``model_swinvit``         the CVPR release encoder ``model_swinvit.pt``: ``{"state_dict": {"module.patch_embed.*",
                          "module.layers{1..4}.*", "module.norm.*"}}`` with ``mlp.fc1`` / ``mlp.fc2``; the final
                          ``norm.*`` is dropped. Read by MONAI's ``SwinUNETR.load_from`` and by
                          Project-MONAI/research-contributions ``SwinUNETR/BTCV/main.py`` (``--use_ssl_pretrained``).
``ssl_original``          the original SSL code's checkpoints: ``{"global_step" | "epoch", "state_dict":
                          {"module.swinViT.*", "module.rotation_head.*", "module.contrastive_head.*",
                          "module.conv.*"}, "optimizer"}`` (older ones spell ``swin_vit``), written by
                          research-contributions ``SwinUNETR/Pretrain/main.py`` (``models/ssl_head.py``); trained
                          on one GPU (no DDP) the keys have no ``module.``, and the container tells it from
                          ``ssl_collection``: the state dict under ``state_dict`` beside ``epoch`` / ``global_step``.
                          lab-smile/BrainSegFounder ``pretrain/main.py`` / ``main_T1T2.py`` and
                          ``downstream/BraTS/ssl/main_T1T2.py`` save the same SSLHead the same way (with ``epoch`` and
                          ``global_step``), at other shapes: 2 or 4 input channels, depths (2, 2, 2, 2) / (2, 2, 6, 2)
                          / (2, 2, 18, 2), heads from 3, 4 or 6; those are read from the tensors
                          (:mod:`.architecture`).
``ssl_collection``        this collection's :class:`~components.recipes.inpainting_contrast.SSLHead`: ``swinViT.*``
                          plus heads, no wrapper prefix (``_orig_mod.`` allowed): the SSL bundle's ``model.pt``
                          (MONAI ``CheckpointSaver`` of one object: a bare state dict) and resumable checkpoints
                          (``{"model": ...}``), never under ``state_dict``.
``monai_ssl_autoencoder`` MONAI's disruptive-autoencoder ``ssl_pretrained_weights.pth`` (~50k volumes):
                          ``{"model": {"encoder.patch_embed.*", "encoder.layersN.0.0.*", "encoder.mask_token",
                          "encoder.norm.*", "out.conv.conv.*"}}``, read by Project-MONAI/tutorials
                          ``self_supervised_pretraining/swinunetr_pretrained/swinunetr_finetune.ipynb`` and MONAI's
                          ``filter_swinunetr``; mask token, final norm and reconstruction head are dropped.
``swinunetr``             a full MONAI SwinUNETR: ``swinViT.*`` plus ``encoder1..``, ``decoder1..``, ``out.*``. The
                          Model Zoo's ``swin_unetr_btcv_segmentation`` ``models/model.pt`` is one (its
                          ``configs/train.json`` saves ``{"model": network}`` through ``CheckpointSaver``: a bare
                          state dict, feature 48, 14 outputs); so are research-contributions ``SwinUNETR/BTCV``
                          finetuning checkpoints (``{"epoch", "best_acc", "state_dict"}``, sometimes ``backbone.``),
                          BrainSegFounder's ``downstream/BraTS/finetuning`` ones, and SuPreM's
                          ``*_backbone.pth`` (``{"net": backbone.state_dict()}``, no ``out``).
``swinvit_encoder``       ``swinViT.*`` keys only: :func:`convert_checkpoint` with ``full_state=False``, and the
                          self-distillation bundle's ``model.pt`` (the teacher encoder, ``{"swinViT": ...}``).
``voco``                  VoCo (Luffy03/Large-Scale-Medical): ``VoCoHead`` of ``Self-supervised/models/voco_head.py``
                          holds a ``use_v2=True`` encoder with ``encoder1..4`` / ``encoder10`` as ``backbone`` plus
                          ``student`` / ``teacher`` projection heads (dropped); the ``Omni-supervised`` one holds a
                          whole SwinUNETR (21 outputs). ``voco_train.py`` saves ``{"global_step", "state_dict":
                          {"module.backbone.*", "module.student.*", "module.teacher.*"}}`` and ``final_model.pt`` as
                          the bare ``backbone.*`` / ``student.*`` / ``teacher.*`` state dict; the downstream loader
                          (``Downstream/monai/*/utils/utils.py``: ``state_dict`` | ``network_weights`` | ``net``,
                          strips ``module.``, ``backbone.``, ``swin_vit``) reads both. Sizes B / L / H: feature 48 /
                          96 / 192. The released ``VoCo_B_SSL_head.pt`` / ``_L_`` / ``_H_`` (huggingface
                          ``Luffy503/VoCo``) are the bare state dict of that backbone (``Swin``): ``swinViT.*`` and
                          ``encoder1..4`` / ``encoder10`` with no decoder and no ``out``, no container, no prefix; a
                          SwinUNETR takes all of it, as from a ``swinunetr`` file.
``suprem``                SuPreM and the CLIP-Driven Universal Model (MrGiovanni/SuPreM
                          ``supervised_pretraining/train.py``): ``{"net": {"module.backbone.*" (a SwinUNETR without
                          ``out``), "module.precls_conv.*", "module.GAP.*", "module.controller.*",
                          "module.organ_embedding", "module.text_to_vision.*"}, "optimizer", "scheduler", "epoch"}``
                          (``backbone/Universal_model.py``); the task heads are dropped.
``dino_collection``       this collection's self-distillation network
                          (:class:`~components.recipes.self_distillation.SelfDistillationNetwork`): ``swinViT.*`` plus
                          the DINO projection ``head.*``, as the self-distillation bundle's resumable checkpoints hold
                          it (``{"model": ...}``).
``mim_collection``        this collection's masked image model
                          (:class:`~components.recipes.masked_image.MaskedImageModel`): ``swinViT.*`` plus
                          ``mask_token``, the reconstruction ``decoder.*`` and, with the masked-token distillation,
                          its ``token_head.*``, as the masked image bundle's
                          ``model.pt`` and resumable checkpoints hold it.
========================= ===================================================================================

A file in none of these layouts raises :class:`CheckpointLoadError` naming its first keys and the layouts known.

``relative_position_index`` buffers: MONAI registers them as persistent buffers, so they are in every MONAI state
dict, and the CVPR release contains them too (``SwinUNETR.load_from`` copies them). They are a deterministic
function of the window size: when a checkpoint has them they are loaded like any other tensor (keeping the index
the bias table was trained with), when it lacks them the model's own (identical for the same window size) are
kept; they are never *required* and show up as missing-but-allowed.
"""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ..errors import UserError

__all__ = [
    "CHANNEL_POLICIES",
    "LAYOUTS",
    "PATCH_EMBED_WEIGHT",
    "REQUIRED_POLICIES",
    "TARGETS",
    "CheckpointLoadError",
    "LoadReport",
    "UnusedKey",
    "detect_layout",
    "extract_state_dict",
    "read_checkpoint",
]

#: layouts :func:`detect_layout` can name (see the module docstring).
LAYOUTS: tuple[str, ...] = (
    "model_swinvit",
    "ssl_original",
    "ssl_collection",
    "monai_ssl_autoencoder",
    "swinunetr",
    "swinvit_encoder",
    "voco",
    "suprem",
    "dino_collection",
    "mim_collection",
)
#: kinds of target model: MONAI ``SwinUNETR``, :class:`~components.recipes.inpainting_contrast.SSLHead`, or any other module that
#: holds the encoder as attribute ``swinViT``.
TARGETS: tuple[str, ...] = ("swinunetr", "sslhead", "encoder")
CHANNEL_POLICIES: tuple[str, ...] = ("error", "repeat", "skip")
REQUIRED_POLICIES: tuple[str, ...] = ("encoder", "all", "none")

#: the one tensor whose input-channel count may differ between checkpoint and model (``channel_policy``).
PATCH_EMBED_WEIGHT = "swinViT.patch_embed.proj.weight"

_CONTAINER_KEYS = ("state_dict", "model", "network", "net", "network_weights", "model_state_dict")
_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "backbone.")
_ENCODER_PREFIX = "swinViT."
_OLD_ENCODER_PREFIX = "swin_vit."
_REL_INDEX_SUFFIX = ".relative_position_index"

_MLP_FC = re.compile(r"\.mlp\.fc([12])\.")
_BARE_ENCODER = re.compile(r"^(patch_embed|layers[1-4]c?)\.")
_SSL_HEADS = re.compile(r"^(rotation_head|contrastive_head|conv)\.")
_SEG_DECODER = re.compile(r"^(encoder\d+|decoder\d+|out)\.")
_ENCODER_BLOCKS = re.compile(r"^encoder\d+\.")
_DECODER_BLOCKS = re.compile(r"^(decoder\d+|out)\.")
_PROGRESS_KEYS = ("epoch", "global_step")
_DINO_HEAD = re.compile(r"^head\.")
_MIM_PARTS = re.compile(r"^(mask_token$|decoder\.|token_head\.)")
_VOCO_HEADS = re.compile(r"^(student|teacher)\.")
_UNIVERSAL_HEADS = re.compile(r"^(precls_conv\.|GAP\.|controller\.|text_to_vision\.|organ_embedding(\.|$))")
_DAE_LAYER_NESTED = re.compile(r"^encoder\.(layers[1-4]c?)\.0\.0\.(.+)$")
_DAE_LAYER_FLAT = re.compile(r"^encoder\.(layers[1-4]c?)\.0\.(\D.*)$")
_DAE_ENCODER = re.compile(r"^encoder\.(patch_embed|layers[1-4]c?)\.")


class CheckpointLoadError(UserError, ValueError):
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
        shape_mismatched: target key -> (checkpoint shape, model shape) for tensors not loaded for their shape
            (they keep the model's initialisation, e.g. ``out.*`` of a SwinUNETR with another number of classes).
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
            "shape mismatched, the model's initialisation kept",
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


def read_checkpoint(path: str | os.PathLike, map_location: Any = "cpu", *, mmap: bool = False) -> Any:
    """``torch.load(path, map_location, weights_only=True)`` with errors that name the file.

    With ``mmap=True`` the tensors of a zip-format file (every ``torch.save`` since PyTorch 1.6) are memory-mapped:
    reading their shapes costs no read of their data, which is how the architecture is inferred from a multi-GB
    file before the loader reads it. A legacy-format file is read whole.

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
        if mmap and zipfile.is_zipfile(p):
            return torch.load(p, map_location=map_location, weights_only=True, mmap=True)
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


def source_name(source: Any) -> str:
    """How messages and reports name a checkpoint: its path, or ``"<mapping>"`` for an in-memory one."""
    return str(source) if isinstance(source, (str, os.PathLike)) else "<mapping>"


def _is_state_dict(obj: Mapping) -> bool:
    return bool(obj) and all(isinstance(v, torch.Tensor) for v in obj.values())


def extract_state_dict(obj: Any, where: str = "<mapping>") -> tuple[dict[str, Any], str]:
    """Unwrap a checkpoint container down to its state dict.

    Accepts a bare state dict or one nested under ``state_dict`` / ``model`` / ``network`` / ``net`` /
    ``network_weights`` / ``model_state_dict`` (also next to ``optimizer``, ``epoch``, ``global_step``, ...), at most
    4 levels deep; the first of these names present is taken.

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
    """Remove leading ``module.`` (DDP / DataParallel), ``_orig_mod.`` (torch.compile) and ``backbone.`` (a network
    held as ``backbone``, as VoCo and SuPreM do), in any order and number, and ``_orig_mod`` of a compiled submodule
    anywhere in the key."""
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
                f"({', '.join(_WRAPPER_PREFIXES)}) are removed; the file mixes two models."
            )
        out[new] = (key, value)
    return out, sorted(prefixes)


def without_wrappers(state: Mapping[str, Any], where: str = "<mapping>") -> dict[str, Any]:
    """``state`` with the wrapper prefixes (``module.``, ``_orig_mod.``, ``backbone.``) removed from its keys.

    Raises:
        CheckpointLoadError: two keys become one (the file mixes two models).
    """
    return {key: value for key, (_, value) in _strip_all(state, where)[0].items()}


def beside_training_progress(checkpoint: Any, container: str) -> bool:
    """Whether :func:`extract_state_dict` found the state dict under ``state_dict`` beside ``epoch`` or
    ``global_step``: the container of the original SSL code's ``save_ckp``, which this collection never writes (its
    savers write a bare state dict or ``{"model": ...}``)."""
    return (
        container == "state_dict"
        and isinstance(checkpoint, Mapping)
        and any(key in checkpoint for key in _PROGRESS_KEYS)
    )


def detect_layout(keys: Any, had_module_prefix: bool = False, training_progress: bool = False) -> str | None:
    """Name the layout of state-dict keys with the wrapper prefixes already stripped (None if unknown).

    The heads beside the encoder tell the publisher: ``student`` / ``teacher`` (VoCo), the Universal Model's task
    heads (SuPreM), ``head`` (this collection's self-distillation), the SSL heads (``rotation_head`` ...), a
    segmentation decoder (``decoder1`` ..., ``out``: a SwinUNETR), the encoder blocks ``encoder1`` ... alone (VoCo's
    ``Swin`` backbone, as its released ``VoCo_*_SSL_head.pt`` holds it). With the SSL heads, the file tells the
    original SSL code's checkpoints (``ssl_original``) from this collection's (``ssl_collection``):
    ``had_module_prefix`` (the keys carried ``module.``: DDP) or ``training_progress``
    (:func:`beside_training_progress`: one GPU).

    Example::

        >>> detect_layout(["swinViT.patch_embed.proj.weight", "encoder10.layer.conv1.conv.weight"])
        'voco'
    """
    keys = [str(k) for k in keys]
    if any(_DAE_ENCODER.match(k) for k in keys):
        return "monai_ssl_autoencoder"
    swin_new = any(k.startswith(_ENCODER_PREFIX) for k in keys)
    swin_old = any(k.startswith(_OLD_ENCODER_PREFIX) for k in keys)
    if swin_new or swin_old:
        if any(_VOCO_HEADS.match(k) for k in keys):
            return "voco"
        if any(_UNIVERSAL_HEADS.match(k) for k in keys):
            return "suprem"
        if any(_DINO_HEAD.match(k) for k in keys):
            return "dino_collection"
        if any(_MIM_PARTS.match(k) for k in keys):
            return "mim_collection"
        if any(_DECODER_BLOCKS.match(k) for k in keys):
            return "swinunetr"
        if any(_ENCODER_BLOCKS.match(k) for k in keys):
            return "voco"
        has_heads = any(_SSL_HEADS.match(k) for k in keys)
        if swin_old or (has_heads and (had_module_prefix or training_progress)):
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
    if layout == "voco" and _VOCO_HEADS.match(key):
        return None, UnusedKey("dropped", "VoCo's student / teacher projection head (pretraining only)")
    if layout == "suprem" and _UNIVERSAL_HEADS.match(key):
        return None, UnusedKey(
            "dropped", "the Universal Model's organ embedding and dynamic segmentation head (SuPreM pretraining only)"
        )
    # every other layout is already in (nearly) the collection's key space
    if key.startswith(_OLD_ENCODER_PREFIX):
        key = _ENCODER_PREFIX + key[len(_OLD_ENCODER_PREFIX) :]
    if key.startswith(_ENCODER_PREFIX):
        return _rename_mlp(key), None
    if _SSL_HEADS.match(key) or _SEG_DECODER.match(key) or _DINO_HEAD.match(key) or _MIM_PARTS.match(key):
        return key, None
    return None, UnusedKey("unknown", f"not a tensor of the {layout} layout")


def _category(key: str) -> str:
    if key.startswith(_ENCODER_PREFIX):
        return "encoder"
    if _SSL_HEADS.match(key):
        return "ssl_head"
    if _SEG_DECODER.match(key):
        return "seg_decoder"
    if _DINO_HEAD.match(key):
        return "dino_head"
    if _MIM_PARTS.match(key):
        return "mim_head"
    return "other"


class MappedKey(NamedTuple):
    """One source tensor: its key in the file, the collection key it maps to (None if unused, then ``unused``
    says why), and its value."""

    source: str
    target: str | None
    unused: UnusedKey | None
    value: Any


def map_state_dict(
    state: Mapping[str, Any], where: str = "<mapping>", training_progress: bool = False
) -> tuple[str, list[str], list[MappedKey]]:
    """Detect the layout of an unwrapped state dict and map every key to the collection's key space.

    ``training_progress``: the state dict was found beside ``epoch`` / ``global_step``
    (:func:`beside_training_progress`), as :func:`detect_layout` takes it.

    Returns:
        ``(layout, stripped wrapper prefixes, one MappedKey per source key in file order)``.

    Raises:
        CheckpointLoadError: the layout is unknown (the message shows the first keys and the layouts known), or two
            source keys collapse onto one once the wrapper prefixes are stripped.
    """
    stripped, prefixes = _strip_all(state, where)
    layout = detect_layout(stripped, had_module_prefix="module." in prefixes, training_progress=training_progress)
    if layout is None:
        raise CheckpointLoadError(
            f"checkpoint {where}: unknown layout; first keys {list(state)[:6]} ({len(state)} keys in all). Known "
            f"layouts: {', '.join(LAYOUTS)} (e.g. 'module.patch_embed.proj.weight', 'swinViT.layers1.0...', "
            f"'module.backbone.swinViT...', 'encoder.layers1.0.0...')."
        )
    mapped = []
    for key, (orig, value) in stripped.items():
        if not isinstance(value, torch.Tensor):
            mapped.append(MappedKey(orig, None, UnusedKey("unknown", f"not a tensor ({type(value).__name__})"), value))
            continue
        canon, unused = _canonical(layout, key)
        mapped.append(MappedKey(orig, canon, unused, value))
    return layout, prefixes, mapped
