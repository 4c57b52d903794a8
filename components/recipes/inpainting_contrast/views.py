"""Per-iteration self-supervised views for Swin UNETR pretraining (Tang et al., CVPR 2022): rotation and cutout/paste.

Tensor operations on batched ``(B, C, H, W, D)`` tensors on any device. All randomness comes from one optional
``torch.Generator`` (``None``: torch's default generator of the tensor's device), drawn batch-wide in a fixed
order, so a seeded generator reproduces the views exactly. The cutout boxes are then applied sample by sample,
the noise boxes one by one in drawing order and the pasted ones through one mask per sample, reading their corners
on the host: the trainer draws them on the host on accelerators (``box_generator``), so that reading them costs no
synchronisation.

Public functions:

- :func:`rot_rand` -- per-sample rotation by ``k * 90`` degrees in the last two spatial axes; label ``k``.
- :func:`aug_rand` -- per-sample "inner cutout" (noise boxes) and "paste" (boxes copied from another sample).
- :func:`ssl_views` -- the two corrupted rotated views of a batch, their labels and clean targets.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

__all__ = ["rot_rand", "aug_rand", "ssl_views", "SSLViews"]

# Probability bound, per sample and pass, that the first chunk of box slots falls short of the target.
_SHORTFALL_PROB = 1e-12


# ----------------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------------
def _check_volume(x: torch.Tensor, require_float: bool) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor of shape (B, C, H, W, D), got {type(x).__name__}.")
    if x.ndim != 5:
        raise ValueError(f"x must be a 5D tensor (B, C, H, W, D), got shape {tuple(x.shape)}.")
    if min(x.shape) < 1:
        raise ValueError(f"x must have B, C, H, W, D >= 1, got shape {tuple(x.shape)}.")
    if require_float and not x.is_floating_point():
        raise ValueError(f"x must be a floating point tensor, got dtype {x.dtype}.")


def _check_generator(generator: torch.Generator | None, device: torch.device, name: str = "generator") -> None:
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"{name} must be a torch.Generator or None, got {type(generator).__name__}.")
    gen_device = generator.device
    same = gen_device.type == device.type and (
        gen_device.index is None or device.index is None or gen_device.index == device.index
    )
    if not same:
        raise ValueError(
            f"{name} is on device {gen_device} but must be on {device}; "
            f"create it with torch.Generator(device={str(device)!r})."
        )


def _box_ranges(
    spatial: tuple[int, int, int], max_drop: float, max_block: float, min_block: float
) -> tuple[tuple[int, int], ...]:
    """Per spatial axis ``(tol, hi)``: sides drawn in ``[tol, hi)``, starts in ``[0, S - tol)``."""
    for name, value in (("max_drop", max_drop), ("max_block", max_block), ("min_block", min_block)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}.")
    if not 0.0 <= max_drop <= 1.0:
        raise ValueError(f"max_drop must lie in [0, 1], got {max_drop!r}.")
    if not 0.0 < min_block <= max_block <= 1.0:
        raise ValueError(
            f"need 0 < min_block <= max_block <= 1, got min_block={min_block!r}, max_block={max_block!r}."
        )
    ranges = []
    for axis, size in zip("HWD", spatial):
        tol, hi = int(min_block * size), int(max_block * size)
        if tol < 1:
            raise ValueError(
                f"int(min_block * {axis}) = int({min_block!r} * {size}) = {tol}: boxes need a minimum side "
                f">= 1 voxel; increase min_block or the spatial size {axis}={size}."
            )
        if hi <= tol:
            raise ValueError(
                f"empty box side range on axis {axis}={size}: sides are drawn from int(min_block*{axis})={tol} "
                f"to int(max_block*{axis})-1={hi - 1}; increase max_block ({max_block!r}) or the spatial size."
            )
        ranges.append((tol, hi))
    return tuple(ranges)


# ----------------------------------------------------------------------------------------------------
# rotation
# ----------------------------------------------------------------------------------------------------
def _rotation_table(size: int, device: torch.device) -> torch.Tensor:
    """(4, size*size) int64: for rotation k, the flat (W, D) source index of every flat output position."""
    grid = torch.arange(size * size, device=device).view(size, size)
    return torch.stack([torch.rot90(grid, k, (0, 1)).reshape(-1) for k in range(4)])


def rot_rand(x: torch.Tensor, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate every sample by an independent random multiple of 90 degrees in its last two spatial axes.

    For sample ``i``, ``k_i ~ U{0, 1, 2, 3}`` and the output equals ``torch.rot90(x[i], k_i, (2, 3))``
    exactly (the W and D axes of the ``(C, H, W, D)`` sample; axes 3, 4 of the batch).

    Vectorised as one gather: a ``(4, W*D)`` table holds, for each ``k``, the source of every flat (W, D)
    position (``rot90`` applied to ``arange``); each sample gathers with its own row. One pass over ``x``.

    Args:
        x: ``(B, C, H, W, D)`` tensor of any dtype with ``W == D``.
        generator: random source on ``x``'s device, or None for torch's default generator.

    Returns:
        ``(rotated, labels)``: ``rotated`` of the shape and dtype of ``x`` (a new tensor), ``labels`` int64
        ``(B,)`` on ``x``'s device equal to ``k``.
    """
    _check_volume(x, require_float=False)
    b, c, h, w, d = x.shape
    if w != d:
        raise ValueError(f"rot_rand rotates the last two spatial axes, which must be equal, got W={w}, D={d}.")
    _check_generator(generator, x.device)
    labels = torch.randint(0, 4, (b,), generator=generator, device=x.device)
    source = _rotation_table(w, x.device).index_select(0, labels)  # (B, W*D)
    index = source.view(b, 1, 1, w * d).expand(b, c, h, w * d)
    rotated = torch.gather(x.reshape(b, c, h, w * d), 3, index).view(b, c, h, w, d)
    return rotated, labels


# ----------------------------------------------------------------------------------------------------
# boxes
# ----------------------------------------------------------------------------------------------------
class _Boxes(NamedTuple):
    """Box slots of one cutout pass for a batch; slot ``m`` of sample ``b`` is used iff ``active[b, m]``.

    start, side, stop: (B, M, 3) int64 per axis (H, W, D): first voxel, side drawn before clipping, and
        ``min(start + side, S)`` (exclusive end), so the clipped side is ``stop - start``.
    active: (B, M) bool, a prefix of the slots of each sample: slot m is used iff the counted volume of
        slots < m is still below the target (the sequential ``while counted < target`` loop).
    target: (B,) float, target volume in voxels (0 for samples with no pass).
    counted: (B,) int64, summed clipped volumes of the active boxes (overlaps counted twice).
    """

    start: torch.Tensor
    side: torch.Tensor
    stop: torch.Tensor
    active: torch.Tensor
    target: torch.Tensor
    counted: torch.Tensor


@functools.lru_cache(maxsize=128)
def _slot_budget(spatial: tuple[int, int, int], max_drop: float, ranges: tuple[tuple[int, int], ...]) -> int:
    """Box slots drawn up front: a sample needs more with probability <= ``_SHORTFALL_PROB``.

    The number of boxes needed is N = min{n : V_1 + ... + V_n >= T} with iid clipped box volumes V_i and
    T <= max_drop * H*W*D, so P(N > n) = P(V_1 + ... + V_n < T). The per-axis clipped sides are
    independent, so mean and variance of V follow exactly from the per-axis moments; V >= tol_H*tol_W*tol_D
    (a clipped side is never below ``tol``). Bernstein's inequality for the lower tail then gives
    P(sum < T) <= exp(-t^2 / (2 (n var + (mean - v_min) t / 3))) with t = n mean - T; we take the least n
    whose bound is below ``_SHORTFALL_PROB``. At 96^3 with the defaults: 228 slots (mean need ~63, ~125
    at the largest target). Capped by the worst case ceil(T / v_min), which needs no bound.
    """
    mean, mean_sq, v_min = 1.0, 1.0, 1.0
    for size, (tol, hi) in zip(spatial, ranges):
        clipped = [min(side, size - start) for start in range(size - tol) for side in range(tol, hi)]
        mean *= sum(clipped) / len(clipped)
        mean_sq *= sum(c * c for c in clipped) / len(clipped)
        v_min *= tol
    var = max(mean_sq - mean * mean, 0.0)
    total = max_drop * math.prod(spatial)
    if total <= 0:
        return 1
    need = -math.log(_SHORTFALL_PROB)
    worst = max(1, math.ceil(total / v_min))  # n * v_min >= T: never short
    n = max(1, math.ceil(total / mean))
    while n < worst:
        t = n * mean - total
        if t > 0 and t * t >= need * 2.0 * (n * var + (mean - v_min) * t / 3.0):
            return n
        n += 1
    return worst


def _draw_boxes(
    batch: int,
    spatial: tuple[int, int, int],
    *,
    max_drop: float = 0.3,
    max_block: float = 0.25,
    min_block: float = 0.05,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
    enabled: torch.Tensor | None = None,
    num_slots: int | None = None,
    sync: bool | None = None,
) -> _Boxes:
    """Draw the boxes of one cutout pass for every sample of a batch at once.

    Per sample: target = U(0, max_drop) * H*W*D (0 where ``enabled`` is False); per slot and axis
    start ~ U{0..S-tol-1}, side ~ U{tol..hi-1} with tol = int(min_block*S), hi = int(max_block*S);
    stop = min(start + side, S). Slots are drawn in chunks of ``num_slots`` (default: the bound of
    :func:`_slot_budget`). With ``sync`` (default: only on CPU) the host checks that every sample reached
    its target, draws further chunks if not, and trims the slot axis to the longest active prefix. Without
    it the first chunk is kept whole, untrimmed: a sample whose target needs more than one chunk (probability
    <= 1e-12 with the default budget) keeps the boxes of the first chunk only.
    """
    device = torch.device(device)
    ranges = _box_ranges(spatial, max_drop, max_block, min_block)
    if num_slots is None:
        num_slots = _slot_budget(tuple(spatial), float(max_drop), ranges)
    if num_slots < 1:
        raise ValueError(f"num_slots must be >= 1, got {num_slots}.")
    if sync is None:
        sync = device.type == "cpu"
    target_dtype = torch.float32 if device.type == "mps" else torch.float64
    target = torch.rand((batch,), generator=generator, device=device, dtype=target_dtype)
    target = target * (max_drop * math.prod(spatial))
    if enabled is not None:
        target = torch.where(enabled, target, torch.zeros_like(target))

    def chunk() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        shape = (batch, num_slots)
        start = [
            torch.randint(0, s - tol, shape, generator=generator, device=device) for s, (tol, _) in zip(spatial, ranges)
        ]
        side = [torch.randint(tol, hi, shape, generator=generator, device=device) for tol, hi in ranges]
        stop = [(a + b).clamp_max(s) for a, b, s in zip(start, side, spatial)]
        return torch.stack(start, -1), torch.stack(side, -1), torch.stack(stop, -1)

    parts = [chunk()]
    while True:
        start, side, stop = (torch.cat(p, 1) if len(parts) > 1 else p[0] for p in zip(*parts))
        volume = (stop - start).prod(-1)  # (B, M) clipped volumes
        reached = volume.cumsum(1)  # (B, M) counted volume after each slot
        active = (reached - volume) < target[:, None]  # slot m used iff counted before it < target
        if not sync or bool((reached[:, -1] >= target).all()):
            break
        parts.append(chunk())
    if sync:
        used = max(int(active.sum(1).max()), 1)
        start, side, stop, active, volume = (t[:, :used] for t in (start, side, stop, active, volume))
    counted = (volume * active).sum(1)
    return _Boxes(start, side, stop, active, target, counted)


def _regions(boxes: _Boxes) -> list[list[tuple[int, tuple[slice, slice, slice]]]]:
    """Per sample, ``(slot, (h, w, d) slices)`` of its active boxes in drawing order, read on the host.

    Boxes drawn on an accelerator are copied to the host here (one synchronisation); host-drawn boxes cost nothing.
    """
    start, stop, active = boxes.start.tolist(), boxes.stop.tolist(), boxes.active.tolist()
    return [
        [(m, tuple(slice(a, b) for a, b in zip(start[i][m], stop[i][m]))) for m, used in enumerate(row) if used]
        for i, row in enumerate(active)
    ]


def _normalised_noise(noise: torch.Tensor, boxes: _Boxes) -> torch.Tensor:
    """Each slot's noise min-max normalised over its clipped box and all channels, ``(z - min) / (max - min)``.

    Box m of sample b reads ``noise[b, m, :, :sh, :sw, :sd]`` for its clipped sides (sh, sw, sd), so the minimum and
    maximum are taken there and the box attains exactly 0 and 1; a box whose noise is one value gets 0. All slots at
    once, so that an accelerator runs a few kernels per pass here rather than a few per box. Outside its box a block
    is read as its first value, which lies in the box (every side is at least 1), so one copy serves both the minimum
    and the maximum, each reduced over one flattened axis.

    Args:
        noise: (B, M, C, Lh, Lw, Ld) standard normal blocks, L the largest side per axis.
        boxes: the M slots of each sample.

    Returns:
        The normalised blocks, of the shape and dtype of ``noise``.
    """
    sides = (boxes.stop - boxes.start).to(noise.device, non_blocking=True)  # (B, M, 3) clipped sides
    within = [torch.arange(n, device=noise.device) < sides[..., a, None] for a, n in enumerate(noise.shape[-3:])]
    inside = within[0][..., :, None, None] & within[1][..., None, :, None] & within[2][..., None, None, :]
    in_box = torch.where(inside[:, :, None], noise, noise[:, :, :1, :1, :1, :1]).flatten(2)  # (B, M, C*Lh*Lw*Ld)
    low, high = in_box.amin(-1), in_box.amax(-1)
    span = high - low
    span = torch.where(span > 0, span, torch.ones_like(span))
    per_slot = (*span.shape, 1, 1, 1, 1)
    return torch.sub(noise, low.view(per_slot)).div_(span.view(per_slot))


def _fill_noise(x: torch.Tensor, boxes: _Boxes, noise: torch.Tensor) -> torch.Tensor:
    """Inner cutout pass: a copy of ``x`` where each active box holds its normalised noise (see
    :func:`_normalised_noise`), sample by sample and box by box, so a later box overwrites an earlier one."""
    out = x.clone()
    normed = _normalised_noise(noise, boxes)
    for out_i, normed_i, regions in zip(out, normed, _regions(boxes)):
        for m, (h, w, d) in regions:
            out_i[:, h, w, d] = normed_i[m, :, : h.stop - h.start, : w.stop - w.start, : d.stop - d.start]
    return out


def _paste(inner: torch.Tensor, partner: torch.Tensor, boxes: _Boxes) -> torch.Tensor:
    """Paste pass: a copy of ``inner`` where each active box of sample ``i`` holds sample ``partner[i]``'s voxels
    (all channels, same place), always read from ``inner`` so that the result does not depend on the sample order.

    All boxes of a sample copy from the same partner at the same place, so where they overlap they write the same
    values and their order does not matter: a sample's boxes are marked in one boolean mask, then copied at once.
    """
    out = torch.empty_like(inner)
    for i, (j, regions) in enumerate(zip(partner.tolist(), _regions(boxes))):
        if not regions:
            out[i] = inner[i]
            continue
        covered = torch.zeros(inner.shape[2:], dtype=torch.bool, device=inner.device)
        for _, box in regions:
            covered[box] = True
        torch.where(covered, inner[j], inner[i], out=out[i])
    return out


class _AugDraws(NamedTuple):
    """Everything random in one ``aug_rand`` call: inner-pass boxes and noise, paste partners and boxes."""

    inner: _Boxes
    noise: torch.Tensor  # (B, M, C, Lh, Lw, Ld)
    partner: torch.Tensor  # (B,) int64, j of each sample
    paste: _Boxes  # inactive for samples with partner == own index


def _noise_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _draw_aug(
    x: torch.Tensor,
    generator: torch.Generator | None,
    max_drop: float,
    max_block: float,
    min_block: float,
    sync: bool | None,
    box_generator: torch.Generator | None = None,
) -> _AugDraws:
    """Draw (in this order) inner boxes, inner noise, partners, paste boxes, all batch-wide on ``x.device``; with a
    CPU ``box_generator`` the boxes and partners are drawn and trimmed on the host (``sync`` there) and stay there,
    and only the noise is drawn on ``x.device``, from ``generator``."""
    b, c, h, w, d = x.shape
    spatial = (h, w, d)
    ranges = _box_ranges(spatial, max_drop, max_block, min_block)
    on_host = box_generator is not None
    box_device = torch.device("cpu") if on_host else x.device
    boxes_from = box_generator if on_host else generator
    common = dict(max_drop=max_drop, max_block=max_block, min_block=min_block, generator=boxes_from)
    common["sync"] = True if on_host else sync
    inner = _draw_boxes(b, spatial, device=box_device, **common)
    # one block of noise per slot, as large as the largest box: box m of sample i reads its corner of block (i, m)
    noise_shape = (b, inner.active.shape[1], c, *(hi - 1 for _, hi in ranges))
    noise = torch.randn(noise_shape, generator=generator, device=x.device, dtype=_noise_dtype(x.dtype))
    partner = torch.randint(0, b, (b,), generator=boxes_from, device=box_device)
    enabled = partner != torch.arange(b, device=box_device)
    paste = _draw_boxes(b, spatial, device=box_device, enabled=enabled, **common)
    return _AugDraws(inner, noise, partner, paste)


def _apply_aug(x: torch.Tensor, draws: _AugDraws) -> torch.Tensor:
    """Deterministic part of ``aug_rand``: inner cutout of every sample, then paste from the inner-augmented batch."""
    inner = _fill_noise(x, draws.inner, draws.noise)
    return _paste(inner, draws.partner, draws.paste)


def aug_rand(
    x: torch.Tensor,
    generator: torch.Generator | None = None,
    max_drop: float = 0.3,
    max_block: float = 0.25,
    min_block: float = 0.05,
    *,
    sync: bool | None = None,
    box_generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Corrupt every sample with random noise boxes ("inner cutout") and boxes copied from another sample.

    Semantics per sample ``i`` (Tang et al., CVPR 2022): one inner-cutout pass; then ``j ~ U{0..B-1}`` and, if
    ``j != i``, a paste pass copying boxes (all channels, same location) from sample ``j`` of the batch
    *after the inner pass*. (The original sequential loop pasted from a partly augmented batch: samples
    before ``i`` fully augmented, samples after ``i`` still clean; we paste from the inner-augmented batch
    so the result does not depend on the sample order.) A pass draws target = U(0, max_drop) * H*W*D
    voxels and adds boxes while the counted volume (clipped box volumes summed, overlaps counted twice)
    is below the target, so a positive target gives at least one box and the last box crosses it. Per
    axis of size S a box has start ~ U{0..S-int(min_block*S)-1}, side ~ U{int(min_block*S)..int(max_block*S)-1},
    end = min(start + side, S). Inner boxes hold Gaussian noise min-max normalised to [0, 1] over the box
    (all channels; it attains 0 and 1 inside the box), later boxes overwriting earlier ones.

    All boxes of a pass are drawn for the whole batch at once (``_draw_boxes``: a chunk of box slots per sample,
    enough with probability ``1 - 1e-12``, of which a prefix is active), so that one generator state gives one
    result whatever the device; the noise is one block per slot; then each sample's noise boxes are written in
    drawing order (``_fill_noise``) and its pasted boxes, whose order does not matter, through one mask (``_paste``).

    Args:
        x: ``(B, C, H, W, D)`` floating tensor; not modified. Treated as data (the result is detached).
        generator: random source on ``x``'s device, or None for torch's default generator.
        max_drop: upper end of the target volume fraction per pass, in [0, 1].
        max_block, min_block: box side range as fractions of each spatial size, 0 < min_block <= max_block <= 1,
            with int(min_block * S) >= 1 and int(max_block * S) > int(min_block * S) on every axis.
        sync: read the boxes on the host while drawing them: draw more slots for a sample short of its target and
            trim the unused ones (fewer noise blocks). None: only when the boxes are drawn on CPU. False draws one
            chunk of slots, untrimmed (the random stream an accelerator has always drawn); the boxes are read on
            the host to be applied either way, which on an accelerator synchronises once per pass.
        box_generator: a CPU generator for the boxes and partners of a batch on an accelerator: they are drawn
            and trimmed on the host, where reading them costs no synchronisation, and the device draws only the
            noise (from ``generator``). The trainer passes one on accelerators.

    Returns:
        A new tensor of the shape and dtype of ``x``.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> views = aug_rand(torch.rand(2, 1, 64, 64, 64), generator=g)
    """
    _check_volume(x, require_float=True)
    _check_generator(generator, x.device)
    _check_generator(box_generator, torch.device("cpu"), "box_generator")
    x = x.detach()
    draws = _draw_aug(x, generator, max_drop, max_block, min_block, sync, box_generator)
    return _apply_aug(x, draws)


class SSLViews(NamedTuple):
    """The network inputs and targets of one SSL step for a batch of B crops.

    inputs: (2B, C, H, W, D) ``cat([aug_rand(x1), aug_rand(x2)])``: view 1 of every crop, then view 2.
    rot_labels: (2B,) int64 ``cat([k1, k2])``, the rotation of each input.
    targets: (2B, C, H, W, D) ``cat([x1, x2])``, the rotated but uncorrupted views (reconstruction targets).
    """

    inputs: torch.Tensor
    rot_labels: torch.Tensor
    targets: torch.Tensor


def ssl_views(
    x: torch.Tensor,
    generator: torch.Generator | None = None,
    max_drop: float = 0.3,
    max_block: float = 0.25,
    min_block: float = 0.05,
    *,
    sync: bool | None = None,
    box_generator: torch.Generator | None = None,
) -> SSLViews:
    """Two independently rotated and corrupted views of every crop, with rotation labels and clean targets.

    ``x1, k1 = rot_rand(x)``; ``x2, k2 = rot_rand(x)``; ``a1 = aug_rand(x1)``; ``a2 = aug_rand(x2)`` (each
    view pastes only from its own view batch); returns ``SSLViews(inputs=cat([a1, a2]),
    rot_labels=cat([k1, k2]), targets=cat([x1, x2]))``. Rows ``i`` and ``i + B`` are the two views of crop ``i``
    (the contrastive positives). Draw order: k1, k2, aug of view 1, aug of view 2.

    Args:
        x: ``(B, C, H, W, D)`` floating tensor of clean crops with ``W == D``.
        generator, max_drop, max_block, min_block, sync, box_generator: as :func:`aug_rand`.
    """
    _check_volume(x, require_float=True)
    _box_ranges(tuple(x.shape[2:]), max_drop, max_block, min_block)  # fail before drawing anything
    x = x.detach()
    x1, k1 = rot_rand(x, generator)
    x2, k2 = rot_rand(x, generator)
    options = dict(max_drop=max_drop, max_block=max_block, min_block=min_block, sync=sync, box_generator=box_generator)
    a1 = aug_rand(x1, generator, **options)
    a2 = aug_rand(x2, generator, **options)
    return SSLViews(torch.cat([a1, a2]), torch.cat([k1, k2]), torch.cat([x1, x2]))
