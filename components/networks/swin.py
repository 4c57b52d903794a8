"""What every recipe and bundle shares about the network: the Swin ViT encoder in ``SwinUNETR``'s configuration
(its arguments written once in :class:`SwinViTSettings`, which every network builds its encoder from), the ROI check,
and :func:`prepare_network` (attention kernel, activation checkpointing, device) that every bundle's ``network`` goes
through. The recipes' heads live in :mod:`components.recipes`, the linear probe in :mod:`components.networks.probe`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

import torch
from monai.networks.nets.swin_unetr import SwinTransformer
from torch import nn

from .attention import use_fused_attention
from ..config.values import as_bool
from ..distributed import wrap_ddp
from .step_memory import checkpointing_decision, set_checkpointing

__all__ = ["SwinViTSettings", "check_roi_size", "network_parameters", "prepare_network"]

#: total downsampling of the encoder: patch embedding (2) times four patch-merging stages (2**4).
SPATIAL_REDUCTION: int = 32

#: attention window of the published SSL model (and of MONAI's ``SwinUNETR``).
DEFAULT_WINDOW: int = 7

#: Swin blocks per stage and attention heads per stage of the published SSL model (and of MONAI's ``SwinUNETR``);
#: BrainSegFounder's encoders go deeper: depths (2, 2, 6, 2) or (2, 2, 18, 2), heads from 4 or 6.
DEFAULT_DEPTHS: tuple[int, ...] = (2, 2, 2, 2)
DEFAULT_NUM_HEADS: tuple[int, ...] = (3, 6, 12, 24)

# the patch embedding's edge: the decoders and check_roi_size rely on the total reduction of 32
_PATCH = 2
# MONAI's SwinTransformer holds exactly the stages layers1 .. layers4
_NUM_STAGES = 4
# its forward returns the patch embedding, then each stage's output: one feature map more than stages
NUM_FEATURE_MAPS: int = _NUM_STAGES + 1


def _nearest_multiples(size: int, k: int) -> tuple[int, int]:
    """The multiples of ``k`` just below and just above ``size`` (the lower one at least ``k``)."""
    lower = max(k, (size // k) * k)
    upper = max(k, -(-size // k) * k)
    return lower, upper


def check_roi_size(roi_size: Sequence[int], spatial_dims: int | None = None) -> int:
    """Check that a spatial size can go through :class:`SSLHead` and return its number of final tokens.

    The encoder reduces every spatial dimension by 32 (patch size 2, then four patch-merging stages), and the
    reconstruction decoders upsample by exactly 32, so every spatial size must be a multiple of 32 for the
    reconstruction to match the input. The rotation head reads final token 0 and the contrastive head final
    token 1, so the last stage must hold at least two tokens (e.g. 32^3 gives 1 token and fails, 64^3 gives 8).

    Args:
        roi_size: the spatial size, e.g. ``(96, 96, 96)``; no batch or channel dimension.
        spatial_dims: if given, the number of spatial dimensions ``roi_size`` must have.

    Returns:
        the number of tokens of the last encoder stage, ``prod(s // 32 for s in roi_size)``.

    Raises:
        ValueError: when the size has the wrong number of dimensions, a size is not a positive multiple of
            32, or the last stage would hold fewer than two tokens.

    Example::

        >>> check_roi_size((96, 96, 96))
        27
    """
    roi = tuple(int(s) for s in roi_size)
    if spatial_dims is not None and len(roi) != spatial_dims:
        raise ValueError(
            f"SSLHead: expected a spatial size with {spatial_dims} dimensions (spatial_dims={spatial_dims}), "
            f"got {len(roi)}: {roi}."
        )
    k = SPATIAL_REDUCTION
    if any(s <= 0 for s in roi):
        raise ValueError(f"SSLHead: spatial sizes must be positive, got {roi}.")
    bad = [(i, s) for i, s in enumerate(roi) if s % k != 0]
    if bad:
        lower = tuple(_nearest_multiples(s, k)[0] for s in roi)
        upper = tuple(_nearest_multiples(s, k)[1] for s in roi)
        rec = tuple(-(-s // k) * k for s in roi)
        bad_txt = ", ".join(f"dim {i} = {s}" for i, s in bad)
        options = [upper] if lower == upper or math.prod(s // k for s in lower) < 2 else [lower, upper]
        options_txt = " or ".join(str(o) for o in options)
        raise ValueError(
            f"SSLHead: every spatial size must be divisible by {k} (the encoder reduces each dimension by {k} "
            f"and the decoder upsamples by {k}); got {roi} ({bad_txt}). The reconstruction would have size "
            f"{rec} and would not match the input. Nearest valid size: {options_txt} "
            f"(crop or pad the input, e.g. with monai.transforms.DivisiblePad(k={k}))."
        )
    grid = tuple(s // k for s in roi)
    n_tokens = math.prod(grid)
    if n_tokens < 2:
        works = tuple(2 * k for _ in roi)
        raise ValueError(
            f"SSLHead: the ROI {roi} gives {n_tokens} token at the last encoder stage (grid {grid}), but at "
            f"least 2 tokens are needed: the rotation head reads token 0 and the contrastive head token 1. "
            f"Use a larger ROI, e.g. {works}, which gives {math.prod(s // k for s in works)} tokens."
        )
    return n_tokens


def _stage_values(name: str, value: Sequence[int]) -> tuple[int, ...]:
    """``value`` as a tuple of one positive integer per stage; ValueError naming ``name`` otherwise."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        values = list(value)
        if len(values) == _NUM_STAGES and all(
            isinstance(v, Integral) and not isinstance(v, bool) and v > 0 for v in values
        ):
            return tuple(int(v) for v in values)
    raise ValueError(
        f"{name} must be {_NUM_STAGES} positive integers, one per Swin stage (MONAI's SwinTransformer has "
        f"layers1 .. layers{_NUM_STAGES}), got {value!r}"
    )


def check_stages(
    feature_size: int, depths: Sequence[int] = DEFAULT_DEPTHS, num_heads: Sequence[int] = DEFAULT_NUM_HEADS
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Check ``depths`` and ``num_heads`` against what MONAI's ``SwinTransformer`` builds, before it is built.

    It has four stages; stage ``i`` (from 1) works on ``feature_size * 2 ** (i - 1)`` channels, which its attention
    splits evenly over its heads. MONAI checks neither: other lengths build a broken encoder, and heads that do
    not divide a stage's channels fail only in the first forward pass.

    Returns:
        ``(depths, num_heads)`` as tuples of ints (a config gives lists).

    Raises:
        ValueError: one line naming the value at fault.

    Example::

        >>> check_stages(48, [2, 2, 6, 2], [4, 8, 16, 32])
        ((2, 2, 6, 2), (4, 8, 16, 32))
    """
    stage_depths = _stage_values("depths", depths)
    stage_heads = _stage_values("num_heads", num_heads)
    for stage, heads in enumerate(stage_heads):
        channels = int(feature_size) * 2**stage
        if channels % heads:
            raise ValueError(
                f"num_heads={num_heads!r}: stage {stage + 1} has {channels} channels (feature_size {feature_size}), "
                f"which {heads} heads do not divide (each head takes an equal share)"
            )
    return stage_depths, stage_heads


@dataclass
class SwinViTSettings:
    """The arguments of the Swin ViT encoder, written once: every network of this collection takes them as keywords
    (``**encoder``), checks them here and builds its encoder with :meth:`build`, held as attribute ``swinViT``.

    The encoder is MONAI's ``SwinTransformer`` in the configuration of ``SwinUNETR`` (patch 2, MLP ratio 4, no
    dropout but the stochastic depth), so its state dict loads into
    ``SwinUNETR(feature_size=f, window_size=w, use_v2=v, depths=d, num_heads=h).swinViT``.

    Args:
        in_channels: image channels.
        feature_size: the encoder's ``embed_dim``; stage ``i`` (from 1) has ``feature_size * 2 ** (i - 1)`` channels
            and the last stage output ``16 * feature_size``.
        spatial_dims: 2 or 3.
        dropout_path_rate: stochastic-depth rate, in [0, 1].
        use_checkpoint: activation checkpointing in every Swin block (``use_reentrant=False`` in MONAI >= 1.3).
        window_size: edge of the cubic attention window (7, as published); weights load only into an encoder of the
            same window size (the relative position bias table has ``(2 * window_size - 1) ** spatial_dims`` rows).
        use_v2: SwinUNETR v2 (the encoder of VoCo B / L / H): MONAI's residual convolution block (``UnetrBasicBlock``)
            before each stage, keys ``layers1c`` .. ``layers4c``; the other keys are those of v1. Accepts a config
            flag ("true" / "false").
        depths, num_heads: Swin blocks and attention heads per stage, four each, checked by :func:`check_stages` when
            the encoder is built ((2, 2, 2, 2) and (3, 6, 12, 24) as published; BrainSegFounder: depths (2, 2, 6, 2)
            or (2, 2, 18, 2), heads (4, 8, 16, 32) or (6, 12, 24, 48)).

    Raises:
        ValueError: one line naming the argument out of range (a count that is not a positive integer, a window under
            2, ``spatial_dims`` other than 2 or 3, a rate outside [0, 1]).

    Example::

        >>> encoder = SwinViTSettings(in_channels=2, feature_size=12, depths=(2, 2, 6, 2), num_heads=(4, 8, 16, 32))
        >>> len(encoder.build().layers3[0].blocks)
        6
        >>> SwinViTSettings(feature_size=48, use_v2=True).build().layers1c[0].__class__.__name__
        'UnetrBasicBlock'
    """

    in_channels: int = 1
    feature_size: int = 48
    spatial_dims: int = 3
    dropout_path_rate: float = 0.0
    use_checkpoint: bool = False
    window_size: int = DEFAULT_WINDOW
    use_v2: bool | str = False
    depths: Sequence[int] = DEFAULT_DEPTHS
    num_heads: Sequence[int] = DEFAULT_NUM_HEADS

    def __post_init__(self) -> None:
        self.in_channels = _integer("in_channels", self.in_channels, 1)
        self.feature_size = _integer("feature_size", self.feature_size, 1)
        self.window_size = _integer("window_size", self.window_size, 2)
        if isinstance(self.spatial_dims, bool) or self.spatial_dims not in (2, 3):
            raise ValueError(f"spatial_dims must be 2 or 3, got {self.spatial_dims!r}.")
        self.spatial_dims = int(self.spatial_dims)
        rate = self.dropout_path_rate
        if isinstance(rate, bool) or not isinstance(rate, Real):
            raise ValueError(f"dropout_path_rate must be a number in [0, 1], got {rate!r}.")
        if not 0.0 <= float(rate) <= 1.0:
            raise ValueError(f"dropout_path_rate must be in [0, 1], got {rate}.")

    def check_reusable(self) -> SwinViTSettings:
        """These settings, once ``feature_size`` is a multiple of 12: ``SwinUNETR``, which reuses a pretrained
        encoder's weights, needs one. Every pretraining network checks it; the linear probe, which only reads an
        encoder, does not.

        Raises:
            ValueError: ``feature_size`` is not a multiple of 12.
        """
        if self.feature_size % 12:
            raise ValueError(
                f"feature_size must be a multiple of 12, got {self.feature_size} (SwinUNETR, which reuses these "
                "weights, needs a multiple of 12; e.g. 12, 24, 48)."
            )
        return self

    def build(self) -> SwinTransformer:
        """The encoder: its last stage output (``swinViT(x, normalize=True)[4]``) has shape
        ``(B, 16 * feature_size, *[s // 32])``.

        Raises:
            ValueError: ``use_v2`` is not a clear yes / no, or ``depths`` / ``num_heads`` that :func:`check_stages`
                refuses.
        """
        stage_depths, stage_heads = check_stages(self.feature_size, self.depths, self.num_heads)
        return SwinTransformer(
            in_chans=self.in_channels,
            embed_dim=self.feature_size,
            window_size=(self.window_size,) * self.spatial_dims,
            patch_size=(_PATCH,) * self.spatial_dims,
            depths=stage_depths,
            num_heads=stage_heads,
            mlp_ratio=4.0,
            qkv_bias=True,
            drop_rate=0.0,
            attn_drop_rate=0.0,
            drop_path_rate=float(self.dropout_path_rate),
            norm_layer=nn.LayerNorm,
            use_checkpoint=bool(self.use_checkpoint),
            spatial_dims=self.spatial_dims,
            downsample="merging",
            use_v2=as_bool(self.use_v2, "use_v2"),
        )


def _integer(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int, refused (ValueError naming ``name``) when it is not an integer at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__}).")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}.")
    return int(value)


def network_parameters(network: Callable[..., nn.Module]) -> dict[str, inspect.Parameter]:
    """The arguments ``network`` takes by name: its signature's, with the fields of :class:`SwinViTSettings` in place of
    a ``**encoder`` catch-all (the encoder's arguments, as this collection's networks take them), keyword-only with
    their defaults. What :func:`~components.build_for_weights` reads to know which architecture values a class takes.

    Example::

        >>> from components import SSLHead
        >>> network_parameters(SSLHead)["window_size"].default
        7
    """
    parameters = {}
    for name, parameter in inspect.signature(network).parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD and name == "encoder":
            for field in inspect.signature(SwinViTSettings).parameters.values():
                parameters.setdefault(field.name, field.replace(kind=inspect.Parameter.KEYWORD_ONLY))
        else:
            parameters[name] = parameter
    return parameters


def prepare_network(
    network: nn.Module,
    device: str | torch.device,
    fused_attention: bool | str = True,
    use_checkpoint: bool | str = False,
    step_inputs: Sequence[Sequence[int]] | None = None,
    amp: bool | str = False,
    teacher: bool | str = False,
    world_size: int | None = None,
    ddp: bool | str = False,
) -> nn.Module:
    """The network of a run, from the bundle's ``network_def``: its window-attention kernel
    (:func:`~components.networks.attention.use_fused_attention`), activation checkpointing (true, false, or ``"auto"``:
    :func:`~components.networks.step_memory.checkpointing_decision` for one training step whose network inputs have the
    shapes ``step_inputs``; ``teacher``: a frozen copy of the network trains too, as in self-distillation;
    ``world_size``: the ranks training, default the process group's) and its device; with ``ddp``, wrapped in
    DistributedDataParallel when a process group runs (:func:`~components.distributed.wrap_ddp`: the pretraining
    bundles, whose recipes call the module on every rank). Every bundle config builds ``train#network`` with this one
    component, so ``network_def`` stays the bare architecture that ``monai.bundle.load`` returns.

    Raises:
        ValueError: for a flag that is not a clear yes / no, or ``"auto"`` without ``step_inputs``.

    Example (``train#network`` of a bundle config)::

        {"_target_": "components.prepare_network", "network": "@network_def", "device": "@device",
         "fused_attention": "@speed#fused_attention", "use_checkpoint": "@speed#use_checkpoint",
         "step_inputs": "$[[@batch_size * @training#num_samples, @in_channels] + list(@roi_size)]",
         "amp": "@speed#amp"}
    """
    use_fused_attention(network, as_bool(fused_attention, "fused_attention"))
    if step_inputs is None and str(use_checkpoint).strip().lower() == "auto":
        raise ValueError('use_checkpoint "auto" needs the shapes of a training step\'s inputs (step_inputs).')
    enabled = as_bool(use_checkpoint, "use_checkpoint") if step_inputs is None else checkpointing_decision(
        network, use_checkpoint, step_inputs, device, amp, teacher=teacher, world_size=world_size)  # fmt: skip
    network = set_checkpointing(network, enabled).to(device)
    return wrap_ddp(network, device) if as_bool(ddp, "ddp") else network

