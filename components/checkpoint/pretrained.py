"""Pretrained weights into a model, with a report: :func:`load_pretrained`, :func:`convert_state_dict` and the
:class:`PretrainedLoader` handler (:func:`components.release.conversion.convert_checkpoint` writes converted files).

The common finetuning rule "strip ``module.``, rename ``swin_vit``, load with ``strict=False``" loads *zero*
tensors of the CVPR release ``model_swinvit.pt`` and says nothing. Here the layout is detected and named
(:mod:`components.checkpoint.layouts`), every key is mapped explicitly, and a :class:`LoadReport` lists what was
loaded, what is missing, what was not used and why, and what did not fit. ``load_state_dict(strict=False)`` is only
called with a state dict whose keys were all checked against the model, after the ``required`` check passed, so the
model is never left half-loaded when an error is raised.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
from ignite.engine import Engine, Events
from torch import nn

from ..config.values import optional_path
from ..errors import ConfigError
from ..networks.wrappers import unwrap
from .architecture import check_architecture, encoder_architecture
from .layouts import (
    _ENCODER_PREFIX,
    _REL_INDEX_SUFFIX,
    CHANNEL_POLICIES,
    PATCH_EMBED_WEIGHT,
    REQUIRED_POLICIES,
    TARGETS,
    CheckpointLoadError,
    LoadReport,
    MappedKey,
    UnusedKey,
    _category,
    beside_training_progress,
    extract_state_dict,
    map_state_dict,
    read_checkpoint,
    source_name,
)

__all__ = ["PretrainedLoader", "check_pretrained", "convert_state_dict", "load_pretrained"]

logger = logging.getLogger("components.checkpoint")  # one logger name for the whole package, as the logs show it

#: the bundle config ids of the loader's options, as its messages name them by default (``--training#channel_policy
#: repeat``); ``required`` has none in the bundles, so its advice names the argument (``required='none'``).
LOADER_OVERRIDE_IDS: dict[str, str] = {"channel_policy": "training#channel_policy"}

# ---------------------------------------------------------------------------------------------------------------
# the target model
# ---------------------------------------------------------------------------------------------------------------


def _detect_target(model: nn.Module) -> str:
    from monai.networks.nets import SwinUNETR

    if isinstance(model, SwinUNETR):
        return "swinunetr"
    if not isinstance(getattr(model, "swinViT", None), nn.Module):
        raise TypeError(
            f"load_pretrained: the target model ({type(model).__name__}) has no 'swinViT' submodule; expected "
            f"MONAI's SwinUNETR, components.recipes.inpainting_contrast.SSLHead or another module holding the encoder as 'swinViT'."
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
        raise ConfigError(f"{name} must be one of {list(choices)}, got {value!r}.")
    return value


def _check_options(channel_policy: str, required: str, target: str | None) -> None:
    """Raises ConfigError for an option outside its choices, before any file is read."""
    _check_choice("channel_policy", channel_policy, CHANNEL_POLICIES)
    _check_choice("required", required, REQUIRED_POLICIES)
    if target is not None:
        _check_choice("target", target, TARGETS)


#: what a model lacks when a checkpoint's head is dropped, by key category (see ``layouts._category``)
_HEAD_NAMES = {
    "ssl_head": "SSL pretraining head/decoder",
    "seg_decoder": "SwinUNETR segmentation decoder",
    "dino_head": "self-distillation projection head",
    "mim_head": "masked image modelling mask token / decoder / token head",
}


def _check_one_source_per_key(keys: list[MappedKey], where: str, layout: str) -> None:
    """Raises CheckpointLoadError when two source keys map to one model key: the file mixes two spellings."""
    mapped_from: dict[str, str] = {}
    for key in keys:
        if key.target is None:
            continue
        if key.target in mapped_from:
            raise CheckpointLoadError(
                f"checkpoint {where}: keys '{mapped_from[key.target]}' and '{key.source}' both map to "
                f"'{key.target}' (layout={layout}); the file mixes two spellings of the same model."
            )
        mapped_from[key.target] = key.source


def _check_same_architecture(
    keys: list[MappedKey], model_state: Mapping[str, torch.Tensor], where: str, ids: Mapping[str, str]
) -> None:
    """Raises CheckpointLoadError for another feature size, window, depth, v2 or not: one line naming the overrides,
    before any shape is compared. The input channels are left out: they are the channel policy's to handle."""
    configured = encoder_architecture(model_state).as_dict()
    configured.pop("in_channels", None)
    check_architecture(encoder_architecture({k.target: k.value for k in keys if k.target}), configured, where, ids)


def _unused_reason(key: str, model_categories: set[str], target: str) -> UnusedKey:
    """Why a source tensor mapped to ``key``, which the model lacks, is not used: a head of which the model (its key
    categories ``model_categories``) has none is dropped by design; anything else is unknown."""
    category = _category(key)
    if category in _HEAD_NAMES and category not in model_categories:
        return UnusedKey("dropped", f"{_HEAD_NAMES[category]}; the {target} model has none")
    return UnusedKey("unknown", f"maps to '{key}', which the model does not have")


def _differs_only_in_channels(key: str, value: torch.Tensor, dst: torch.Tensor) -> bool:
    """Whether ``value`` is the patch embedding's kernel for another number of input channels than ``dst``."""
    return (
        key == PATCH_EMBED_WEIGHT
        and value.ndim == dst.ndim
        and value.shape[0] == dst.shape[0]
        and value.shape[2:] == dst.shape[2:]
    )


def _apply_channel_policy(
    key: str, value: torch.Tensor, dst: torch.Tensor, policy: str, report: LoadReport, policy_id: str
) -> torch.Tensor | None:
    """The patch embedding's kernel for the model's input channels under ``policy`` (None for ``"skip"``: the model
    keeps its own), with what was done recorded in ``report.adapted``.

    Raises:
        CheckpointLoadError: ``policy`` is ``"error"``; the message names both settings that would load it.
    """
    c_src, c_dst = int(value.shape[1]), int(dst.shape[1])
    if policy == "error":
        raise CheckpointLoadError(
            f"checkpoint {report.source} (layout={report.layout}): the patch embedding '{key}' has {c_src} input "
            f"channel(s) in the checkpoint (shape {list(value.shape)}) but the model has {c_dst} (shape "
            f"{list(dst.shape)}). Run with --{policy_id} repeat (channel_policy='repeat': the kernel repeated over the "
            f"{c_dst} channels and scaled by {c_src}/{c_dst}, so a constant input gives the same response) or "
            f"--{policy_id} skip (channel_policy='skip': the model's random patch embedding kept). The model was not "
            "modified."
        )
    if policy == "repeat":
        how = "tiled" if c_dst % c_src == 0 else "channel mean repeated"
        report.adapted[key] = (
            f"repeat: input channels {c_src} -> {c_dst}, kernel {how} and scaled by {c_src}/{c_dst} "
            f"(shape {list(value.shape)} -> {list(dst.shape)})"
        )
        return _adapt_in_channels(value, c_dst)
    report.adapted[key] = (
        f"skip: checkpoint has {c_src} input channel(s) (shape {list(value.shape)}), model {c_dst} "
        f"(shape {list(dst.shape)}); kept the model's initial weights"
    )
    return None


def _match_to_model(
    keys: list[MappedKey], model_state: Mapping[str, torch.Tensor], report: LoadReport, channel_policy: str,
    policy_id: str,
) -> tuple[dict[str, torch.Tensor], set[str]]:  # fmt: skip
    """The source tensors that fit the model, by model key; every other one recorded in ``report`` with its reason:
    ``unexpected`` without a model key, ``shape_mismatched`` for another shape, ``adapted`` for the patch embedding
    of other input channels (:func:`_apply_channel_policy`).

    Returns:
        ``(tensors, skipped)``: the tensors to load, and the model keys the ``"skip"`` policy left to the model.
    """
    tensors: dict[str, torch.Tensor] = {}
    skipped: set[str] = set()
    model_categories = {_category(k) for k in model_state}
    for key in keys:
        if key.target is None:
            report.unexpected[key.source] = key.unused  # type: ignore[assignment]
            continue
        if key.target not in model_state:
            report.unexpected[key.source] = _unused_reason(key.target, model_categories, report.target)
            continue
        dst = model_state[key.target]
        if tuple(key.value.shape) == tuple(dst.shape):
            tensors[key.target] = key.value
        elif not _differs_only_in_channels(key.target, key.value, dst):
            report.shape_mismatched[key.target] = (tuple(key.value.shape), tuple(dst.shape))
        else:
            kernel = _apply_channel_policy(key.target, key.value, dst, channel_policy, report, policy_id)
            if kernel is None:
                skipped.add(key.target)
            else:
                tensors[key.target] = kernel
    return tensors, skipped


def _required_keys(model_state: Mapping[str, torch.Tensor], report: LoadReport, skipped: set[str]) -> list[str]:
    """The model keys ``report.required`` asks for; deterministic ``relative_position_index`` buffers and a patch
    embedding the channel policy skipped are never required."""
    exempt = {k for k in model_state if k.endswith(_REL_INDEX_SUFFIX)} | skipped
    if report.required == "encoder":
        return [k for k in report.encoder_keys if k not in exempt]
    if report.required == "all":
        return [k for k in model_state if k not in exempt]
    return []


def _check_required(report: LoadReport, required_keys: list[str], required_id: str | None) -> None:
    """Raises CheckpointLoadError when a required key would not load, naming the first ones, the shape mismatches
    among them, the unused source keys of unknown role and a hint (``required_id``: how to accept a partial load)."""
    loaded = set(report.loaded)
    missing_required = [k for k in required_keys if k not in loaded]
    if not missing_required:
        return
    parts = [
        f"checkpoint {report.source} (layout={report.layout}) into {report.target}: {len(missing_required)} of "
        f"{len(required_keys)} required tensors (required={report.required!r}) would not load, first: "
        f"{missing_required[:5]}."
    ]
    mismatched = [k for k in missing_required if k in report.shape_mismatched]
    if mismatched:
        src_shape, dst_shape = report.shape_mismatched[mismatched[0]]
        parts.append(
            f"{len(mismatched)} of them have another shape, e.g. '{mismatched[0]}': checkpoint {list(src_shape)} "
            f"vs model {list(dst_shape)}."
        )
    if report.unknown:
        parts.append(f"Unused source keys of unknown role: {list(report.unknown)[:5]}.")
    parts.append(f"Hint: {_hint(report, missing_required, required_id)}. The model was not modified.")
    raise CheckpointLoadError(" ".join(parts))


def _hint(report: LoadReport, missing_required: list[str], required_id: str | None) -> str:
    if any(k in report.shape_mismatched for k in missing_required):
        return "some tensors have other shapes: the checkpoint was made for a different configuration of the network"
    if not report.encoder_loaded and report.encoder_keys:
        return "no encoder tensor of the checkpoint matched the model: is it a checkpoint of another architecture?"
    accept = f"run with --{required_id} none" if required_id else "pass required='none'"
    return (
        f"the checkpoint lacks these tensors (a partial or truncated encoder?); {accept} to accept a partial load, "
        "which is then reported"
    )


def convert_state_dict(
    source: str | os.PathLike | Mapping,
    target_model: nn.Module,
    *,
    target: str | None = None,
    channel_policy: str = "error",
    required: str = "encoder",
    map_location: Any = "cpu",
    override_ids: Mapping[str, str] | None = None,
    mmap: bool = False,
) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """Map a checkpoint onto ``target_model``'s key space without loading it.

    The returned state dict holds exactly the report's ``loaded`` keys, with the model's shapes (the patch
    embedding adapted when ``channel_policy="repeat"``). Arguments are those of :func:`load_pretrained`, and the
    same ``required`` check is applied, so a returned state dict is one :func:`load_pretrained` would load;
    ``mmap`` memory-maps a file's tensors (:func:`read_checkpoint`), for a check that reads only their shapes.

    Steps: read and unwrap the checkpoint and map its keys (:mod:`~components.checkpoint.layouts`), check that no
    model key has two sources and that the architectures agree, match each tensor to the model, then check that
    every required tensor loads.

    Returns:
        ``(state_dict, report)``.
    """
    _check_options(channel_policy, required, target)
    ids = {**LOADER_OVERRIDE_IDS, **(override_ids or {})}
    where = source_name(source)
    raw = read_checkpoint(source, map_location, mmap=mmap) if isinstance(source, (str, os.PathLike)) else source
    state, container = extract_state_dict(raw, where)
    model = unwrap(target_model)
    target = target or _detect_target(model)
    layout, prefixes, keys = map_state_dict(state, where, beside_training_progress(raw, container))
    report = LoadReport(layout=layout, target=target, source=where, container=container, stripped_prefixes=prefixes,
                        required=required)  # fmt: skip
    model_state = model.state_dict()
    report.encoder_keys = [k for k in model_state if k.startswith(_ENCODER_PREFIX)]
    _check_one_source_per_key(keys, where, layout)
    _check_same_architecture(keys, model_state, where, ids)
    tensors, skipped = _match_to_model(keys, model_state, report, channel_policy, ids["channel_policy"])
    report.loaded = [k for k in model_state if k in tensors]
    report.missing = [k for k in model_state if k not in tensors]
    required_keys = _required_keys(model_state, report, skipped)
    report.allowed_missing = [k for k in report.missing if k not in set(required_keys)]
    _check_required(report, required_keys, ids.get("required"))
    return {k: tensors[k] for k in report.loaded}, report


def load_pretrained(
    model: nn.Module,
    source: str | os.PathLike | Mapping,
    *,
    target: str | None = None,
    channel_policy: str = "error",
    required: str = "encoder",
    map_location: Any = "cpu",
    override_ids: Mapping[str, str] | None = None,
) -> LoadReport:
    """Load pretrained Swin ViT weights of any known layout into ``model`` and report exactly what happened.

    Args:
        model: MONAI ``SwinUNETR``, :class:`~components.recipes.inpainting_contrast.SSLHead` or another module with a ``swinViT``
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
        override_ids: how the error messages name the options to change, by option (an architecture field of
            :data:`~components.checkpoint.architecture.OVERRIDE_IDS`, ``channel_policy``, ``required``): default the
            bundles' config ids (``--network_def#use_v2 true``, ``--training#channel_policy repeat``); a command
            line gives its own flags.

    Returns:
        the :class:`LoadReport`; its summary is logged at INFO (unknown keys and shape mismatches at WARNING).

    Raises:
        FileNotFoundError / CheckpointLoadError: unreadable file, unknown layout, a network of another architecture
            than the checkpoint's (feature size, v2 or not, window, depths, heads, patch size: one line naming each
            difference and the overrides, see :func:`~components.checkpoint.architecture.check_architecture`),
            channel mismatch with ``channel_policy="error"``, or a ``required`` tensor that would not load. Raised
            before the model is touched.

    Example::

        model = SwinUNETR(in_channels=4, out_channels=3, feature_size=48)
        report = load_pretrained(model, "model_swinvit.pt", channel_policy="repeat")
        print(report.summary())
    """
    state, report = convert_state_dict(
        source,
        model,
        target=target,
        channel_policy=channel_policy,
        required=required,
        map_location=map_location,
        override_ids=override_ids,
    )
    module = unwrap(model)
    # every key of `state` is a key of the model with the model's shape (checked above), so strict=False only
    # tolerates the keys the report lists as missing; verify that torch agrees with the report.
    result = module.load_state_dict(state, strict=False)
    # batch norms set an absent ``num_batches_tracked`` themselves (old checkpoints lack it) and do not list it missing
    expected_missing = {key for key in report.missing if not key.endswith("num_batches_tracked")}
    if result.unexpected_keys or set(result.missing_keys) != expected_missing:
        raise RuntimeError(
            "load_pretrained: internal inconsistency between the report and torch's load_state_dict: "
            f"unexpected {result.unexpected_keys[:5]}, "
            f"missing differs on {sorted(set(result.missing_keys) ^ expected_missing)[:5]}"
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
            "load_pretrained: %d tensors not loaded for their shape, the model keeps its own initialisation of them "
            "(e.g. an output layer for another number of classes; checkpoint vs model): %s",
            len(report.shape_mismatched),
            dict(list(report.shape_mismatched.items())[:5]),
        )
    return report


def check_pretrained(
    path: str | os.PathLike | None,
    network: nn.Module,
    channel_policy: str = "error",
    required: str = "encoder",
    target: str | None = None,
) -> LoadReport | None:
    """Checks, before any data is read, that :class:`PretrainedLoader` with these arguments will load ``path`` into
    ``network`` when the trainer starts: the file readable, its layout known, the network's architecture, the patch
    embedding's input channels under ``channel_policy`` and the shape of every required tensor, all by
    :func:`convert_state_dict` on the memory-mapped file. The network is not touched.

    Returns:
        the :class:`LoadReport` the load will give, or None when ``path`` is none (see :func:`optional_path`).

    Raises:
        as :func:`load_pretrained`, e.g. CheckpointLoadError for a 2-channel encoder into a 1-channel network.

    Example (``initialize`` of a bundle config)::

        "$components.check_pretrained(@pretrained_path, @network_def, @training#channel_policy)"
    """
    path = optional_path(path)
    if path is None:
        return None
    return convert_state_dict(path, network, target=target, channel_policy=channel_policy, required=required,
                              mmap=True)[1]  # fmt: skip


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
        _check_options(channel_policy, required, target)
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
        name = type(unwrap(self.network)).__name__
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

