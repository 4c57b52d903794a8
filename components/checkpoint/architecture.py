"""The Swin ViT architecture a checkpoint was trained with, read from its tensors' shapes alone.

A checkpoint file names no architecture, but its tensors tell it: the patch embedding's weight
``(feature_size, in_channels, p, p, p)`` gives the feature size, the input channels and the patch size; each block's
``relative_position_bias_table`` of ``(2w - 1) ** 3`` rows and one column per head gives the attention window and
the heads of its stage; the block indices give the depths; the residual blocks ``layers1c`` .. ``layers4c`` of
MONAI's ``use_v2=True`` encoder give v2. :func:`infer_architecture` reads them from a checkpoint of any layout
:mod:`.layouts` knows, :func:`check_architecture` turns a difference from the configured network into one line
with the bundle overrides that fix it, and :func:`adopt_architecture` takes the checkpoint's values instead
(``pretrained_arch: "auto"``).
"""

from __future__ import annotations

import inspect
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..config.values import as_bool, optional_path
from ..networks.swin import network_parameters
from .layouts import (
    _ENCODER_PREFIX,
    PATCH_EMBED_WEIGHT,
    CheckpointLoadError,
    beside_training_progress,
    extract_state_dict,
    map_state_dict,
    read_checkpoint,
    source_name,
)

__all__ = [
    "OVERRIDE_IDS",
    "PRETRAINED_ARCH",
    "SwinArchitecture",
    "adopt_architecture",
    "build_for_weights",
    "check_architecture",
    "infer_architecture",
]

logger = logging.getLogger("components.checkpoint")  # one logger name for the whole package, as the logs show it

#: what ``pretrained_arch`` may say: ``"config"`` (the configured network must fit the checkpoint) or ``"auto"``
#: (the network takes the checkpoint's architecture).
PRETRAINED_ARCH: tuple[str, ...] = ("config", "auto")

#: the bundle config id of each architecture value, as the overrides of a mismatch message name them
#: (``--feature_size 96 --network_def#use_v2 true --network_def#window_size 7``), in the order the message lists them.
OVERRIDE_IDS: dict[str, str] = {
    "feature_size": "feature_size",
    "use_v2": "network_def#use_v2",
    "window_size": "network_def#window_size",
    "depths": "network_def#depths",
    "num_heads": "network_def#num_heads",
    "patch_size": "network_def#patch_size",
    "in_channels": "in_channels",
}

_BLOCK = re.compile(r"^swinViT\.layers([1-4])\.0\.blocks\.(\d+)\.")
_BIAS_TABLE_SUFFIX = ".attn.relative_position_bias_table"
_V2_BLOCK = re.compile(r"^swinViT\.layers[1-4]c\.")
_STAGE = re.compile(r"^swinViT\.layers[1-4]\.")
_FIRST_NORM = "swinViT.layers1.0.blocks.0.norm1.weight"
_STAGES = (1, 2, 3, 4)


@dataclass(frozen=True)
class SwinArchitecture:
    """The configuration of a MONAI Swin ViT encoder (``SwinUNETR.swinViT``), as far as its tensors tell it.

    Attributes:
        feature_size: the embedding size of the first stage (``SwinUNETR(feature_size=...)``).
        use_v2: whether the stages have MONAI's v2 residual convolution blocks (``layers1c`` ...).
        window_size: edge of the cubic attention window.
        depths: Swin blocks per stage.
        num_heads: attention heads per stage.
        patch_size: edge of the cubic patch of the patch embedding (a tuple when not cubic).
        in_channels: image channels the patch embedding takes.

    A field is None when the tensors given do not hold it (e.g. the depths of a truncated encoder).
    """

    feature_size: int | None = None
    use_v2: bool | None = None
    window_size: int | None = None
    depths: tuple[int, ...] | None = None
    num_heads: tuple[int, ...] | None = None
    patch_size: int | tuple[int, ...] | None = None
    in_channels: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """The known fields in ``OVERRIDE_IDS`` order, e.g. ``{"feature_size": 48, "use_v2": True, ...}``."""
        return {name: getattr(self, name) for name in OVERRIDE_IDS if getattr(self, name) is not None}


def _edge(size: Sequence[int]) -> int | tuple[int, ...]:
    return int(size[0]) if len(set(size)) == 1 else tuple(int(s) for s in size)


def _window_of(rows: int, spatial_dims: int | None = None) -> int | None:
    """The cubic window edge ``w`` of a relative position bias table of ``(2w - 1) ** spatial_dims`` rows (None if
    ``rows`` is no such power; ``spatial_dims`` None tries 3, then 2)."""
    for dims in (spatial_dims,) if spatial_dims else (3, 2):
        edge = round(rows ** (1 / dims))
        if edge**dims == rows and edge % 2 == 1:
            return (edge + 1) // 2
    return None


def encoder_architecture(state: Mapping[str, Any]) -> SwinArchitecture:
    """The architecture of the ``swinViT.*`` tensors of a state dict in the collection's key space.

    Only shapes are read, so tensors on the ``meta`` device do. Other keys are ignored; a field the tensors do not
    determine is None.
    """
    shapes = {k: tuple(v.shape) for k, v in state.items() if k.startswith(_ENCODER_PREFIX) and hasattr(v, "shape")}
    patch = shapes.get(PATCH_EMBED_WEIGHT)
    spatial_dims = len(patch) - 2 if patch else None
    first_norm = shapes.get(_FIRST_NORM)
    blocks: dict[int, set[int]] = {}
    heads: dict[int, dict[int, int]] = {}
    windows = set()
    for key, shape in shapes.items():
        m = _BLOCK.match(key)
        if m is None:
            continue
        stage, block = int(m.group(1)), int(m.group(2))
        blocks.setdefault(stage, set()).add(block)
        if key.endswith(_BIAS_TABLE_SUFFIX) and len(shape) == 2:
            heads.setdefault(stage, {})[block] = int(shape[1])
            windows.add(_window_of(int(shape[0]), spatial_dims))
    complete = all(s in blocks and blocks[s] == set(range(len(blocks[s]))) for s in _STAGES)
    if any(_V2_BLOCK.match(k) for k in shapes):
        use_v2: bool | None = True
    else:
        use_v2 = False if any(_STAGE.match(k) for k in shapes) else None
    return SwinArchitecture(
        feature_size=int(patch[0]) if patch else (int(first_norm[0]) if first_norm else None),
        use_v2=use_v2,
        window_size=windows.pop() if len(windows) == 1 else None,
        depths=tuple(len(blocks[s]) for s in _STAGES) if complete else None,
        num_heads=tuple(heads[s][min(heads[s])] for s in _STAGES) if all(s in heads for s in _STAGES) else None,
        patch_size=_edge(patch[2:]) if patch else None,
        in_channels=int(patch[1]) if patch else None,
    )


def infer_architecture(source: str | os.PathLike | Mapping) -> SwinArchitecture:
    """Read the Swin ViT architecture of a checkpoint of any known layout from its tensors' shapes.

    Args:
        source: a checkpoint path, a loaded checkpoint or a state dict (e.g. ``model.state_dict()``). A path is
            read with ``torch.load(weights_only=True, mmap=True)`` onto the CPU: only the shapes are looked at, so
            the tensors' data stays on disk (a multi-GB encoder is then read once, by the loader).

    Raises:
        FileNotFoundError / CheckpointLoadError: an unreadable file, an unknown layout, or no patch embedding and no
            first block to read the feature size from.

    Example::

        >>> infer_architecture("VoCo_L_SSL_head.pt")
        SwinArchitecture(feature_size=96, use_v2=True, window_size=7, depths=(2, 2, 2, 2),
                         num_heads=(3, 6, 12, 24), patch_size=2, in_channels=1)
    """
    where = source_name(source)
    raw = read_checkpoint(source, "cpu", mmap=True) if isinstance(source, (str, os.PathLike)) else source
    state, container = extract_state_dict(raw, where)
    layout, _, mapped = map_state_dict(state, where, beside_training_progress(raw, container))
    found = encoder_architecture({m.target: m.value for m in mapped if m.target is not None})
    if found.feature_size is None:
        raise CheckpointLoadError(
            f"checkpoint {where} (layout={layout}): no Swin ViT patch embedding and no first block to read the "
            f"architecture from."
        )
    return found


def _normalised(name: str, value: Any) -> Any:
    """A configured value in the form :class:`SwinArchitecture` holds it (``"true"`` -> True, ``[7, 7, 7]`` -> 7)."""
    try:
        if name == "use_v2":
            return as_bool(value, name)
        if name in ("window_size", "patch_size"):
            return _edge(value) if isinstance(value, Sequence) and not isinstance(value, str) else int(value)
        if name in ("depths", "num_heads"):
            return tuple(int(v) for v in value)
        return int(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"architecture value {name}={value!r} is not of the expected form: {e}") from e


def _cli(value: Any) -> str:
    """A value as a bundle command line takes it: ``true``, ``96``, ``[2,2,6,2]``."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return "[" + ",".join(str(v) for v in value) + "]"
    return str(value)


def architecture_differences(found: SwinArchitecture, configured: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(name, checkpoint value, configured value)`` for every field known on both sides that differs.

    Raises:
        ValueError: ``configured`` names a field :class:`SwinArchitecture` does not have, or a value of the wrong form.
    """
    unknown = sorted(set(configured) - set(OVERRIDE_IDS))
    if unknown:
        raise ValueError(f"unknown architecture field(s) {unknown}; expected some of {list(OVERRIDE_IDS)}.")
    known = found.as_dict()
    return [
        (name, known[name], _normalised(name, configured[name]))
        for name in OVERRIDE_IDS
        if name in configured and name in known and known[name] != _normalised(name, configured[name])
    ]


def check_architecture(
    found: SwinArchitecture,
    configured: Mapping[str, Any],
    source: str = "<mapping>",
    override_ids: Mapping[str, str] | None = None,
) -> None:
    """Fail when the configured network is not the one the checkpoint was trained with.

    Args:
        found: the checkpoint's architecture (:func:`infer_architecture`).
        configured: the network's values by field name (``feature_size``, ``use_v2``, ``window_size``, ``depths``,
            ``num_heads``, ``patch_size``, ``in_channels``), as a config holds them (``"true"``, ``[2, 2, 2, 2]``).
            Only the fields given here and known from the checkpoint are compared.
        source: the checkpoint's name for the message.
        override_ids: config ids to name in the overrides instead of :data:`OVERRIDE_IDS`.

    Raises:
        CheckpointLoadError: (a ValueError) one line naming each mismatch and the exact overrides, e.g.
            ``checkpoint VoCo_L.pt was trained with another network: feature_size=96 in the checkpoint, 48 in the
            network; use_v2=true in the checkpoint, false in the network. Run with --feature_size 96 --network_def#use_v2 true.``
            (:func:`adopt_architecture` builds the checkpoint's network instead.)
    """
    differences = architecture_differences(found, configured)
    if not differences:
        return
    ids = {**OVERRIDE_IDS, **(override_ids or {})}
    named = "; ".join(
        f"{name}={_cli(ours)} in the checkpoint, {_cli(theirs)} in the network" for name, ours, theirs in differences
    )
    overrides = " ".join(f"--{ids[name]} {_cli(ours)}" for name, ours, _ in differences)
    raise CheckpointLoadError(
        f"checkpoint {source} was trained with another network: {named}. Run with {overrides}."
    )


def adopt_architecture(
    source: str | os.PathLike | Mapping | None,
    configured: Mapping[str, Any],
    pretrained_arch: str = "config",
    override_ids: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The architecture values to build a network with, given the checkpoint it will start from.

    Args:
        source: the pretrained checkpoint (path, loaded checkpoint or state dict); None, ``""``, ``"none"`` or
            ``"null"`` mean none.
        configured: the configured values by field name, as for :func:`check_architecture`.
        pretrained_arch: ``"config"``: the configured values are returned once :func:`check_architecture` passed, so
            a mismatch fails when the config is parsed, before any data is cached. ``"auto"``: the checkpoint's
            values replace the configured ones, each change logged at WARNING and the architecture taken at INFO;
            fields the checkpoint determines and ``configured`` lacks are added.
        override_ids: as for :func:`check_architecture`.

    ``in_channels`` is neither checked nor adopted: the data decides it, and ``channel_policy`` of the loader adapts
    the patch embedding (or fails) when the checkpoint has other channels.

    Returns:
        a new dict: ``configured`` with the values to use.

    Example (a bundle config; the network then reads ``"$@architecture['feature_size']"`` ...)::

        "architecture": "$components.adopt_architecture(@pretrained_path, {'feature_size': @feature_size,
                         'use_v2': @use_v2}, @pretrained_arch)"
    """
    found = _checkpoint_architecture(source, pretrained_arch)
    if found is None:
        return dict(configured)
    return _adopt(found, configured, pretrained_arch, source_name(source), override_ids)


def _checkpoint_architecture(
    source: str | os.PathLike | Mapping | None, pretrained_arch: str
) -> SwinArchitecture | None:
    """The checkpoint's architecture (None without a checkpoint), once ``pretrained_arch`` is known to be valid."""
    if pretrained_arch not in PRETRAINED_ARCH:
        raise ValueError(f"pretrained_arch must be one of {list(PRETRAINED_ARCH)}, got {pretrained_arch!r}.")
    if source is None or (isinstance(source, (str, os.PathLike)) and optional_path(source) is None):
        return None
    return infer_architecture(source)


def _adopt(
    found: SwinArchitecture,
    configured: Mapping[str, Any],
    pretrained_arch: str,
    where: str,
    override_ids: Mapping[str, str] | None,
) -> dict[str, Any]:
    """:func:`adopt_architecture` once the checkpoint's architecture ``found`` is read."""
    compared = {k: v for k, v in configured.items() if k != "in_channels"}
    if pretrained_arch == "config":
        check_architecture(found, compared, where, override_ids)
        return dict(configured)
    for name, ours, theirs in architecture_differences(found, compared):
        logger.warning(
            "pretrained_arch='auto': %s=%s from the checkpoint %s instead of the configured %s",
            name, _cli(ours), where, _cli(theirs),
        )  # fmt: skip
    taken = {name: value for name, value in found.as_dict().items() if name != "in_channels"}
    logger.info(
        "pretrained_arch='auto': the network takes the architecture of the checkpoint %s: %s",
        where, ", ".join(f"{name}={_cli(value)}" for name, value in taken.items()),
    )  # fmt: skip
    return {**configured, **taken}


def _check_built(network: nn.Module, found: SwinArchitecture, where: str, builder: Callable[..., nn.Module]) -> None:
    """Fail when the built ``network`` lacks an architecture value of the checkpoint: ``build_for_weights`` passes
    only the values ``builder`` takes, so a value it has no argument for (the depths of a fixed encoder) would
    otherwise be dropped silently, to fail later in the loader with overrides the class cannot take."""
    built = encoder_architecture(network.state_dict()).as_dict()
    built.pop("in_channels", None)  # the channel policy's to handle
    differences = architecture_differences(found, built)
    if not differences:
        return
    name = getattr(builder, "__name__", type(network).__name__)
    accepted = network_parameters(builder)
    named = "; ".join(
        f"{field}={_cli(needed)}, which {name} cannot take (it "
        + ("has no " if field not in accepted else "ignores its ")
        + f"'{field}' argument and builds {_cli(has)})"
        for field, needed, has in differences
    )
    raise CheckpointLoadError(f"checkpoint {where} needs {named}.")


def build_for_weights(
    network: Callable[..., nn.Module],
    pretrained_path: str | os.PathLike | None = None,
    pretrained_arch: str = "config",
    **kwargs: Any,
) -> nn.Module:
    """``network(**kwargs)`` with the architecture of the weights it will start from: the bundles' ``network_def``.

    The architecture values ``network`` accepts (``feature_size``, ``use_v2``, ``window_size``, ``depths``,
    ``num_heads``, and for MONAI's ``SwinUNETR`` also ``patch_size``; ``kwargs`` or the defaults of the arguments
    :func:`~components.networks.swin.network_parameters` reads) go
    through :func:`adopt_architecture`: with ``pretrained_arch="config"`` a checkpoint of another architecture fails
    here, when the config builds the network (the bundles build it before their data is cached), with one line
    naming each difference and the overrides; with ``"auto"`` the network takes the checkpoint's values (logged).
    Then the built network's encoder is compared with the checkpoint's: a value the class has no argument for and
    builds otherwise (e.g. depths (2, 2, 6, 2) for a class that always builds (2, 2, 2, 2)) fails with one line naming
    it and the class, instead of being dropped. Without ``pretrained_path`` this is ``network(**kwargs)``.

    Args:
        network: the class (or factory) to build, e.g. MONAI's ``SwinUNETR`` or :class:`~components.SSLHead`.
        pretrained_path: the pretrained checkpoint (any layout :mod:`.layouts` knows); None or ``"none"``: none.
        pretrained_arch: ``"config"`` or ``"auto"`` (:data:`PRETRAINED_ARCH`).
        kwargs: the network's arguments.

    Raises:
        CheckpointLoadError: an unreadable checkpoint; with ``"config"``, a checkpoint of another architecture; a
            checkpoint value the class cannot take.
        ValueError: an unknown ``pretrained_arch``.

    Example (``network_def`` of a bundle config)::

        "network_def": {"_target_": "components.build_for_weights", "network": "$monai.networks.nets.SwinUNETR",
                        "pretrained_path": "@pretrained_path", "pretrained_arch": "@training#pretrained_arch",
                        "in_channels": 1, "out_channels": 14, "feature_size": 48, "use_v2": false}
    """
    accepted = network_parameters(network)
    configured = {
        name: kwargs.get(name, accepted[name].default)
        for name in OVERRIDE_IDS
        if name != "in_channels" and name in accepted
        and (name in kwargs or accepted[name].default is not inspect.Parameter.empty)
    }
    found = _checkpoint_architecture(pretrained_path, pretrained_arch)
    if found is None:
        return network(**kwargs)
    where = source_name(pretrained_path)
    values = _adopt(found, configured, pretrained_arch, where, None)
    built = network(**{**kwargs, **{name: value for name, value in values.items() if name in accepted}})
    _check_built(built, found, where, network)
    return built
