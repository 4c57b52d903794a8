"""Multi-crop views of 3D volumes for self-distillation, drawn batch-wide on the device from one generator.

DINO (Caron et al., 2021) trains on 2 global crops and several smaller local crops of each image, each with its own
augmentation, and the two global crops differently: global crop 1 is always blurred, global crop 2 rarely blurred
(p 0.1) and sometimes solarised (p 0.2), local crops blurred with p 0.5. For CT/MRI the colour augmentations of
natural images become intensity ones (scale, shift, contrast/gamma, Gaussian noise); blur becomes a 3D Gaussian
smoothing with sigma in voxels, and solarisation the inversion of the intensities above a threshold of the crop's
min-max range (PIL's ``solarize`` at 128 of 255 is 0.5). The spatial ones are random crops resized to a fixed size
and flips.

Why not MONAI transforms: MONAI's random transforms draw from numpy per call and run per sample in the data loader;
here every view of a batch is drawn from the trainer's ``torch.Generator`` on the device (reseeded per
(seed, epoch, rank), as the SSL recipe's views), so a run replays exactly and the loader stays the plain crop
pipeline of the SSL bundle.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ...networks.swin import SPATIAL_REDUCTION

__all__ = ["MultiCropViews", "MultiCrop", "gaussian_blur"]


class MultiCropViews(NamedTuple):
    """The views of a batch of B volumes.

    global_crops: ``(G * B, C, *global_size)``, crop-major: rows ``g * B + i`` are global crop g of volume i.
    local_crops: ``(L * B, C, *local_size)``, the same order (empty with ``L = 0``).
    """

    global_crops: torch.Tensor
    local_crops: torch.Tensor


def gaussian_blur(x: torch.Tensor, sigma: torch.Tensor, radius: int) -> torch.Tensor:
    """Separable Gaussian smoothing of each crop with its own standard deviation, borders replicated.

    Args:
        x: crops ``(N, C, *spatial)`` with 1 to 3 spatial dims, floating.
        sigma: ``(N,)`` standard deviations in voxels, one per crop (the same along every axis); 0 leaves the crop
            unchanged, exactly.
        radius: the kernel's half-width in voxels, e.g. ``ceil(3 * max sigma)``.

    Returns:
        the smoothed crops, shape and dtype of ``x``: along each axis in turn, a convolution with
        ``exp(-d^2 / (2 sigma^2))`` for ``d = -radius .. radius``, normalised to sum 1 (``scipy.ndimage``'s
        ``gaussian_filter(mode="nearest", truncate=radius / sigma)`` per crop).

    Example::

        >>> x = torch.zeros(2, 1, 9, 9, 9); x[:, :, 4, 4, 4] = 1
        >>> y = gaussian_blur(x, torch.tensor([1.0, 0.0]), radius=3)
        >>> torch.equal(y[1], x[1]), round(float(y[0].sum()), 4)
        (True, 1.0)
    """
    n, c, *spatial = x.shape
    dims = len(spatial)
    if not 1 <= dims <= 3 or sigma.shape != (n,) or int(radius) < 0:
        raise ValueError(
            f"gaussian_blur needs x (N, C, 1 to 3 spatial dims), sigma (N,) and radius >= 0, got {tuple(x.shape)}, "
            f"{tuple(sigma.shape)} and {radius}."
        )
    offsets = torch.arange(-radius, radius + 1, device=x.device, dtype=x.dtype)
    # sigma 0 -> a tiny width: every weight but the centre's underflows to 0, a delta kernel (the identity)
    weights = torch.exp(-0.5 * (offsets / sigma.to(x.dtype).clamp_min(1e-6)[:, None]) ** 2)
    weights = weights / weights.sum(dim=1, keepdim=True)
    weights = weights[:, None].expand(n, c, 2 * radius + 1).reshape(n * c, 2 * radius + 1)  # crop i's for its channels
    conv = (F.conv1d, F.conv2d, F.conv3d)[dims - 1]
    y = x.reshape(1, n * c, *spatial)  # one group per crop and channel: each crop its own kernel
    for axis in range(dims):
        shape = [n * c, 1] + [1] * dims
        shape[2 + axis] = 2 * radius + 1
        pad = [0] * (2 * dims)  # F.pad lists the last axis first
        pad[2 * (dims - 1 - axis)] = pad[2 * (dims - 1 - axis) + 1] = radius
        y = conv(F.pad(y, pad, mode="replicate"), weights.view(shape), groups=n * c)
    return y.reshape(x.shape)


def _size(name: str, value: Sequence[int] | int, dims: int) -> tuple[int, ...]:
    size = (int(value),) * dims if isinstance(value, int) else tuple(int(v) for v in value)
    if len(size) != dims or any(s < SPATIAL_REDUCTION or s % SPATIAL_REDUCTION for s in size):
        raise ValueError(
            f"{name} must be {dims} positive multiples of {SPATIAL_REDUCTION} (the encoder's reduction), got {value!r}."
        )
    return size


def _range(name: str, value: Sequence[float], low: float, high: float) -> tuple[float, float]:
    a, b = (float(v) for v in value)
    if not low <= a <= b <= high:
        raise ValueError(f"{name} must be (min, max) with {low} <= min <= max <= {high}, got {value!r}.")
    return a, b


def _probability(name: str, p: float) -> float:
    if not 0.0 <= float(p) <= 1.0:
        raise ValueError(f"{name} must lie in [0, 1], got {p!r}.")
    return float(p)


def _per_global_crop(name: str, value: Sequence[float], num_global: int) -> tuple[float, ...]:
    probabilities = tuple(value) if isinstance(value, Sequence) and not isinstance(value, str) else (value,)
    if len(probabilities) != num_global:
        raise ValueError(
            f"{name} needs one probability per global crop (num_global={num_global}, e.g. DINO's (1.0, 0.1) for "
            f"blur), got {value!r}."
        )
    return tuple(_probability(f"{name}[{g}]", p) for g, p in enumerate(probabilities))


class MultiCrop:
    """Draws :class:`MultiCropViews` of a batch of volumes.

    Each crop: a random box whose volume is a fraction ``s ~ U(scale)`` of the input volume (side ``s ** (1/d)``
    of each axis, at a uniform position), resized (trilinear) to its output size; then, per crop independently,
    a flip of each spatial axis with ``flip_prob``, an intensity scale ``1 + U(-a, a)`` and shift ``U(-b, b)``,
    with ``contrast_prob`` a gamma ``U(contrast)`` applied to the crop's min-max range (MONAI's
    ``RandAdjustContrast``), with ``noise_prob`` Gaussian noise of standard deviation ``U(0, noise_std)``; then,
    with the probability of its kind of crop (DINO's: global crop 1 always, global crop 2 with 0.1, local crops with
    0.5), a Gaussian smoothing with sigma ``U(blur_sigma)`` voxels (:func:`gaussian_blur`, radius
    ``ceil(3 * blur_sigma[1])``), and with the solarisation probability of its kind of crop (DINO's: global crop 2
    with 0.2, no other) the inversion ``v -> min + max - v`` of the intensities ``v >= min + solarize_threshold *
    (max - min)`` of the crop.

    Args:
        global_size: spatial size of the global crops, multiples of 32 (e.g. the ROI, 96^3).
        local_size: spatial size of the local crops, multiples of 32 (e.g. 32^3 or 64^3).
        num_global: global crops per volume (2 in DINO).
        num_local: local crops per volume (0 turns multi-crop off).
        global_scale, local_scale: (min, max) volume fractions of the input covered by a crop.
        flip_prob, intensity_scale, intensity_shift, contrast, contrast_prob, noise_std, noise_prob: as above.
        global_blur_prob, global_solarize_prob: one probability per global crop (``num_global`` values).
        local_blur_prob, local_solarize_prob: the probabilities of every local crop.
        blur_sigma: (min, max) standard deviation of the blur in voxels (DINO's blur radius 0.1 to 2 pixels).
        solarize_threshold: the fraction of the crop's min-max range above which intensities are inverted.

    Call with ``(x, generator, host_generator=None)``: ``x`` of shape ``(B, C, *spatial)`` floating, ``generator``
    on ``x``'s device. The crop boxes are read on the host to slice them; with a CPU ``host_generator`` they are
    drawn there, so an accelerator is never asked for them (no device sync), else from ``generator``. Every other
    draw is batch-wide on the device, from ``generator``.

    Example::

        >>> views = MultiCrop((64, 64, 64), (32, 32, 32), num_local=4)(torch.rand(2, 1, 96, 96, 96), torch.Generator())
        >>> views.global_crops.shape, views.local_crops.shape
        (torch.Size([4, 1, 64, 64, 64]), torch.Size([8, 1, 32, 32, 32]))
    """

    def __init__(
        self,
        global_size: Sequence[int],
        local_size: Sequence[int],
        num_global: int = 2,
        num_local: int = 4,
        global_scale: Sequence[float] = (0.4, 1.0),
        local_scale: Sequence[float] = (0.05, 0.4),
        flip_prob: float = 0.5,
        intensity_scale: float = 0.1,
        intensity_shift: float = 0.1,
        contrast: Sequence[float] = (0.7, 1.5),
        contrast_prob: float = 0.5,
        noise_std: float = 0.05,
        noise_prob: float = 0.3,
        global_blur_prob: Sequence[float] = (1.0, 0.1),
        global_solarize_prob: Sequence[float] = (0.0, 0.2),
        local_blur_prob: float = 0.5,
        local_solarize_prob: float = 0.0,
        blur_sigma: Sequence[float] = (0.1, 2.0),
        solarize_threshold: float = 0.5,
    ) -> None:
        dims = len(global_size)
        self.global_size = _size("global_size", global_size, dims)
        self.local_size = _size("local_size", local_size, dims)
        if int(num_global) < 2 or int(num_local) < 0:
            raise ValueError(f"need num_global >= 2 and num_local >= 0, got {num_global} and {num_local}.")
        self.num_global, self.num_local = int(num_global), int(num_local)
        self.global_scale = _range("global_scale", global_scale, 1e-6, 1.0)
        self.local_scale = _range("local_scale", local_scale, 1e-6, 1.0)
        self.contrast = _range("contrast", contrast, 1e-3, 10.0)
        self.flip_prob = _probability("flip_prob", flip_prob)
        self.contrast_prob = _probability("contrast_prob", contrast_prob)
        self.noise_prob = _probability("noise_prob", noise_prob)
        self.intensity_scale, self.intensity_shift = float(intensity_scale), float(intensity_shift)
        self.noise_std = float(noise_std)
        self.global_blur_prob = _per_global_crop("global_blur_prob", global_blur_prob, self.num_global)
        self.global_solarize_prob = _per_global_crop("global_solarize_prob", global_solarize_prob, self.num_global)
        self.local_blur_prob = _probability("local_blur_prob", local_blur_prob)
        self.local_solarize_prob = _probability("local_solarize_prob", local_solarize_prob)
        self.blur_sigma = _range("blur_sigma", blur_sigma, 1e-3, 10.0)
        self.blur_radius = math.ceil(3.0 * self.blur_sigma[1])
        self.solarize_threshold = _probability("solarize_threshold", solarize_threshold)

    def step_inputs(self, batch_size: int, channels: int) -> list[list[int]]:
        """The shapes of the network inputs of a training step over ``batch_size`` volumes of ``channels``: the global
        crops, then the local ones (what ``prepare_network`` sizes activation checkpointing from)."""
        return [[int(batch_size) * self.num_global, int(channels), *self.global_size],
                [int(batch_size) * self.num_local, int(channels), *self.local_size]]  # fmt: skip

    def __call__(
        self, x: torch.Tensor, generator: torch.Generator | None = None, host_generator: torch.Generator | None = None
    ) -> MultiCropViews:
        if x.ndim != len(self.global_size) + 2 or not x.is_floating_point():
            raise ValueError(f"x must be a floating (B, C, {len(self.global_size)} spatial dims) tensor, got {tuple(x.shape)}.")
        x = x.detach()
        boxes_from = host_generator if host_generator is not None else generator
        global_crops = self._crops(x, self.num_global, self.global_size, self.global_scale, boxes_from)
        local_crops = self._crops(x, self.num_local, self.local_size, self.local_scale, boxes_from)
        local_blur = (self.local_blur_prob,) * self.num_local
        local_solarize = (self.local_solarize_prob,) * self.num_local
        return MultiCropViews(
            self._augment(global_crops, generator, self.global_blur_prob, self.global_solarize_prob),
            self._augment(local_crops, generator, local_blur, local_solarize),
        )

    def _crops(
        self, x: torch.Tensor, n: int, size: tuple[int, ...], scale: tuple[float, float], generator: torch.Generator | None
    ) -> torch.Tensor:
        """``(n * B, C, *size)`` random resized crops, crop-major; boxes drawn from ``generator`` on its device."""
        b, c, *spatial = x.shape
        if n == 0:
            return x.new_zeros((0, c, *size))
        dims = len(spatial)
        device = generator.device if generator is not None else x.device
        fraction = torch.empty((n, b), device=device).uniform_(*scale, generator=generator) ** (1.0 / dims)
        position = torch.rand((n, b, dims), device=device, generator=generator)
        # the sizes enter as Python numbers (kernel arguments): a tensor made of them would be a copy to the device
        sides = torch.stack([fraction * s for s in spatial], dim=-1).round().clamp(min=1).long()  # (n, B, dims)
        room = torch.stack([s - sides[..., a] + 1 for a, s in enumerate(spatial)], dim=-1)  # start positions per axis
        starts = (position * room).floor().long()
        sides, starts = sides.tolist(), starts.tolist()  # one read for all crops (no device sync from the host)
        mode = "trilinear" if dims == 3 else "bilinear"
        crops = []
        for k in range(n):
            for i in range(b):
                box = tuple(slice(s, s + w) for s, w in zip(starts[k][i], sides[k][i]))
                crop = x[(slice(i, i + 1), slice(None), *box)]
                crops.append(F.interpolate(crop, size=size, mode=mode, align_corners=False))
        return torch.cat(crops)

    def _augment(
        self,
        x: torch.Tensor,
        generator: torch.Generator | None,
        blur_prob: Sequence[float],
        solarize_prob: Sequence[float],
    ) -> torch.Tensor:
        """Per-crop flips and intensity augmentations, drawn batch-wide; ``blur_prob`` and ``solarize_prob`` hold
        one probability per crop of a volume (rows ``k * B .. k * B + B - 1`` are crop k)."""
        n = x.shape[0]
        if n == 0:
            return x
        device, dims = x.device, x.ndim - 2
        expand = (n,) + (1,) * (x.ndim - 1)
        volumes = n // len(blur_prob)

        def uniform(low: float, high: float) -> torch.Tensor:
            return torch.empty(n, device=device).uniform_(low, high, generator=generator).view(expand)

        def chance(p: float | Sequence[float]) -> torch.Tensor:
            """``(n, 1, ...)`` booleans, true with ``p`` (one value, or one per crop of a volume)."""
            if isinstance(p, Sequence) and len(set(p)) == 1:
                p = p[0]
            if isinstance(p, Sequence):  # fill kernels, not a tensor copied from the host
                p = torch.cat([torch.full((volumes,), float(q), device=device) for q in p]).view(expand)
            return torch.rand(n, device=device, generator=generator).view(expand) < p

        for axis in range(2, 2 + dims):
            x = torch.where(chance(self.flip_prob), x.flip(axis), x)
        x = x * (1.0 + uniform(-self.intensity_scale, self.intensity_scale)) + uniform(
            -self.intensity_shift, self.intensity_shift
        )
        low, high = _range_of(x)
        span = (high - low).clamp_min(1e-7)
        gamma = uniform(*self.contrast)
        adjusted = ((x - low) / span).pow(gamma) * span + low
        x = torch.where(chance(self.contrast_prob), adjusted, x)
        noise = torch.randn(x.shape, device=device, generator=generator, dtype=x.dtype) * uniform(0.0, self.noise_std)
        x = torch.where(chance(self.noise_prob), x + noise, x)
        if any(p > 0 for p in blur_prob):
            sigma = torch.where(chance(blur_prob), uniform(*self.blur_sigma), 0.0).view(n)
            x = gaussian_blur(x, sigma, self.blur_radius)
        if any(p > 0 for p in solarize_prob):
            low, high = _range_of(x)
            solarized = torch.where(x >= low + self.solarize_threshold * (high - low), low + high - x, x)
            x = torch.where(chance(solarize_prob), solarized, x)
        return x


def _range_of(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each crop's minimum and maximum, ``(N, 1, ...)``."""
    dims = tuple(range(1, x.ndim))
    return x.amin(dim=dims, keepdim=True), x.amax(dim=dims, keepdim=True)
