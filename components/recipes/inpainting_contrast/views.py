"""Per-iteration self-supervised views for Swin UNETR pretraining (Tang et al., CVPR 2022): rotation and cutout/paste.

Pure tensor operations on batched ``(B, C, H, W, D)`` tensors on any device. All randomness comes from
one optional ``torch.Generator`` (``None``: torch's default generator of the tensor's device), drawn
batch-wide on that device, so a seeded generator reproduces the views exactly. Nothing here reads a
device value on the host unless the caller allows it (``sync``; by default only on CPU, where it is
free), so on an accelerator the views are queued without synchronisation.

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
    it nothing is read back: a sample whose target needs more than one chunk (probability
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


class _BitCode(NamedTuple):
    """How box-slot sets are packed into integer words and read back through a float's exponent field.

    A word holds ``bits`` slots; below 2**bits it converts to ``float_dtype`` exactly, so its exponent field
    (``view(int_dtype) >> mantissa``) is ``bias`` + the index of its highest set bit, and 0 for an empty
    word. Scaling word w of a group by 2**(bits * w) keeps this exact while the field stays finite:
    ``bias + bits * per_group - 1 <= 2 * bias``.
    """

    bits: int
    int_dtype: torch.dtype
    float_dtype: torch.dtype
    mantissa: int
    bias: int
    per_group: int


_CODE64 = _BitCode(53, torch.int64, torch.float64, 52, 1023, 19)  # field <= 1023 + 53 * 19 - 1 = 2029
_CODE32 = _BitCode(24, torch.int32, torch.float32, 23, 127, 5)  # field <= 127 + 24 * 5 - 1 = 246


def _bit_code(device: torch.device) -> _BitCode:
    """float64 words (53 slots each) wherever float64 exists; float32 words (24 slots) on Apple MPS."""
    return _CODE32 if device.type == "mps" else _CODE64


def _axis_words(boxes: _Boxes, spatial: tuple[int, int, int], code: _BitCode) -> list[torch.Tensor]:
    """Per axis, (B, Wn, S) words: bit ``m % bits`` of word ``m // bits`` is set iff slot m spans that coordinate.

    Inactive slots are cleared on the H axis, so they cover nothing.
    """
    b, m = boxes.active.shape
    words = -(-m // code.bits)
    pad = words * code.bits - m
    device = boxes.start.device
    weights = torch.pow(2, torch.arange(code.bits, device=device, dtype=code.int_dtype)).view(1, 1, code.bits, 1)
    out = []
    for axis, size in enumerate(spatial):
        coord = torch.arange(size, device=device)
        mask = (coord >= boxes.start[..., axis, None]) & (coord < boxes.stop[..., axis, None])  # (B, M, S)
        if axis == 0:
            mask = mask & boxes.active[..., None]
        if pad:
            mask = torch.nn.functional.pad(mask, (0, 0, 0, pad))
        packed = (mask.view(b, words, code.bits, size).to(code.int_dtype) * weights).sum(2, dtype=code.int_dtype)
        out.append(packed)
    return out


def _owner_code(boxes: _Boxes, spatial: tuple[int, int, int], code: _BitCode) -> torch.Tensor:
    """(B, H*W*D) integer code of the last active box covering each voxel: ``code.bias`` + slot, 0 if none.

    Word w of a voxel is ``wh[h] & ww[w] & wd[d]`` (its set of covering slots): one small (B, H, W) AND, then
    one full-volume AND. Converted to float (exact) and scaled by 2**(bits * w) (exact), the running maximum
    over the words of a group is dominated by the highest non-zero word, and its exponent field is
    ``bias`` + the highest covering slot, 0 for an empty set (see :class:`_BitCode`). Full-volume passes:
    2 for the first word, 4 for each further word, 1 for the exponent (plus 3 per further group of
    ``per_group`` words, i.e. beyond 1007 slots with float64).
    """
    word_h, word_w, word_d = _axis_words(boxes, spatial, code)
    b, words = word_h.shape[:2]
    result = None
    for g0 in range(0, words, code.per_group):
        acc = None
        for w in range(g0, min(g0 + code.per_group, words)):
            plane = word_h[:, w, :, None] & word_w[:, w, None, :]  # (B, H, W)
            value = (plane[..., None] & word_d[:, w, None, None, :]).to(code.float_dtype)  # (B, H, W, D)
            if w > g0:
                value.mul_(2.0 ** (code.bits * (w - g0)))
                acc = torch.maximum(acc, value, out=acc)
            else:
                acc = value
        group = acc.view(code.int_dtype).bitwise_right_shift_(code.mantissa).view(b, -1)  # bias + slot - bits*g0
        if result is None:
            result = group
        else:
            result = torch.where(group > 0, group + code.bits * g0, result)
    return result


def _coverage(boxes: _Boxes, spatial: tuple[int, int, int]) -> torch.Tensor:
    """(B, H, W, D) bool: covered by any active box (2 full-volume passes per word, plus 1)."""
    word_h, word_w, word_d = _axis_words(boxes, spatial, _bit_code(boxes.start.device))
    acc = None
    for w in range(word_h.shape[1]):
        bits = (word_h[:, w, :, None] & word_w[:, w, None, :])[..., None] & word_d[:, w, None, None, :]
        acc = bits if acc is None else acc.bitwise_or_(bits)
    return acc != 0


def _draw_noise(
    boxes: _Boxes,
    channels: int,
    box_shape: tuple[int, int, int],
    generator: torch.Generator | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """(B, M, C, Lh, Lw, Ld) standard normal noise, one block per box slot; ``box_shape`` = largest side per axis.

    Box m of sample b uses ``noise[b, m, :, :sh, :sw, :sd]`` for its clipped sides (sh, sw, sd): voxel
    (h, w, d) of the box reads local index (h - start_h, w - start_w, d - start_d).
    """
    b, m = boxes.active.shape
    return torch.randn((b, m, channels, *box_shape), generator=generator, device=boxes.start.device, dtype=dtype)


def _fill_noise(x: torch.Tensor, boxes: _Boxes, noise: torch.Tensor) -> torch.Tensor:
    """Inner cutout pass: a new tensor where each active box holds its noise min-max normalised to [0, 1].

    Each box's noise is normalised over its whole clipped region and all channels, ``(z - min) / (max - min)``
    (so it attains exactly 0 and 1 before later boxes overwrite parts of it; a box whose noise is a single
    value gets 0); where boxes overlap, the last one wins (``_owner_code``).

    Steps: min / max over each slot's clipped part of ``noise`` (pad positions replaced by the slot's first
    value), normalisation of the noise blocks, then per voxel one gather of its owner's base offset, one add
    of the voxel's fixed local offset, one ``take`` per channel and one ``where`` with ``x``.
    """
    b, c, h, w, d = x.shape
    m = boxes.active.shape[1]
    lh, lw, ld = noise.shape[-3:]
    box_numel = lh * lw * ld
    device = x.device
    # per slot min / max over its clipped region and all channels
    clipped = boxes.stop - boxes.start  # (B, M, 3)
    valid = [torch.arange(n, device=device) < clipped[..., a, None] for a, n in enumerate((lh, lw, ld))]
    inside = valid[0][:, :, :, None, None] & valid[1][:, :, None, :, None] & valid[2][:, :, None, None, :]
    filled = torch.where(inside[:, :, None], noise, noise[:, :, :1, :1, :1, :1])
    low, high = torch.aminmax(filled.reshape(b, m, -1), dim=-1)  # (B, M)
    del filled, inside
    span = high - low
    span = torch.where(span > 0, span, torch.ones_like(span))
    shape6 = (b, m, 1, 1, 1, 1)
    # normalised noise, flat, followed by a margin that any voxel's local offset stays inside
    local_max = (h - 1) * lw * ld + (w - 1) * ld + (d - 1) + (c - 1) * box_numel
    flat = torch.empty(noise.numel() + local_max + 1, dtype=noise.dtype, device=device)
    flat[noise.numel() :].zero_()  # not "= 0": a Python number set by indexing is a host-to-device copy on CUDA
    normed = flat[: noise.numel()].view(noise.shape)
    torch.sub(noise, low.view(shape6), out=normed).div_(span.view(shape6))
    # per box: flat offset of its local origin minus the fixed local offset of its start voxel;
    # table column 0 serves uncovered voxels (code 0), column bias + m box slot m
    slot_ids = torch.arange(b, device=device)[:, None] * m + torch.arange(m, device=device)  # (B, M)
    start = boxes.start
    box_base = slot_ids * (c * box_numel) - (start[..., 0] * (lw * ld) + start[..., 1] * ld + start[..., 2])
    bits = _bit_code(device)
    table = torch.zeros((b, bits.bias + m), dtype=torch.int64, device=device)
    table[:, bits.bias :] = box_base
    local = (
        torch.arange(h, device=device)[:, None, None] * (lw * ld)
        + torch.arange(w, device=device)[:, None] * ld
        + torch.arange(d, device=device)
    ).view(1, -1)  # (1, V)
    code = _owner_code(boxes, (h, w, d), bits)  # (B, V)
    index = table.gather(1, code.to(torch.int64)).add_(local)  # (B, V), flat index of channel 0
    if c > 1:
        index = index[:, None, :] + torch.arange(c, device=device)[:, None] * box_numel  # (B, C, V)
    value = flat.take(index).view(b, c, h, w, d).to(x.dtype)
    covered = (code > 0).view(b, 1, h, w, d)
    return torch.where(covered, value, x)


def _paste(x: torch.Tensor, source: torch.Tensor, boxes: _Boxes) -> torch.Tensor:
    """Paste pass: a new tensor equal to ``source`` inside the active boxes (all channels), ``x`` elsewhere."""
    b, c, h, w, d = x.shape
    covered = _coverage(boxes, (h, w, d))
    return torch.where(covered[:, None], source, x)


class _AugDraws(NamedTuple):
    """Everything random in one ``aug_rand`` call: inner-pass boxes and noise, paste partners and boxes."""

    inner: _Boxes
    noise: torch.Tensor  # (B, M, C, Lh, Lw, Ld)
    partner: torch.Tensor  # (B,) int64, j of each sample
    paste: _Boxes  # inactive for samples with partner == own index


def _noise_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _boxes_to(boxes: _Boxes, device: torch.device) -> _Boxes:
    """The box slots on ``device``: small asynchronous host-to-device copies, nothing read back."""
    return _Boxes(*(t.to(device, non_blocking=True) for t in boxes))


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
    CPU ``box_generator`` the boxes and partners are drawn and trimmed on the host (``sync`` there) and copied to
    ``x.device``, where only the noise is drawn, from ``generator``."""
    b, c, h, w, d = x.shape
    spatial = (h, w, d)
    ranges = _box_ranges(spatial, max_drop, max_block, min_block)
    on_host = box_generator is not None
    box_device = torch.device("cpu") if on_host else x.device
    boxes_from = box_generator if on_host else generator
    common = dict(max_drop=max_drop, max_block=max_block, min_block=min_block, generator=boxes_from)
    common["sync"] = True if on_host else sync
    inner = _draw_boxes(b, spatial, device=box_device, **common)
    if on_host:
        inner = _boxes_to(inner, x.device)
    noise = _draw_noise(inner, c, tuple(hi - 1 for _, hi in ranges), generator, _noise_dtype(x.dtype))
    partner = torch.randint(0, b, (b,), generator=boxes_from, device=box_device)
    enabled = partner != torch.arange(b, device=box_device)
    paste = _draw_boxes(b, spatial, device=box_device, enabled=enabled, **common)
    if on_host:
        partner, paste = partner.to(x.device, non_blocking=True), _boxes_to(paste, x.device)
    return _AugDraws(inner, noise, partner, paste)


def _apply_aug(x: torch.Tensor, draws: _AugDraws) -> torch.Tensor:
    """Deterministic part of ``aug_rand``: inner cutout of every sample, then paste from the inner-augmented batch."""
    inner = _fill_noise(x, draws.inner, draws.noise)
    return _paste(inner, inner.index_select(0, draws.partner), draws.paste)


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

    Vectorised design (B samples, M box slots, V = H*W*D; loops only over words of 53 slots):

    - boxes: all slots of all samples drawn at once as (B, M, 3) starts / sides; M comes from a
      Bernstein bound on the box count (``_slot_budget``: 228 at 96^3, a sample needs more with probability
      <= 1e-12; mean need ~63). ``active`` = (counted volume before the slot) < target, a per-sample prefix.
      With ``sync`` (default: on CPU only) the host draws another chunk in that rare case and trims M to the
      longest active prefix; without it nothing is read back, so accelerators never synchronise.
    - rasterising: per axis a (B, M, S) span mask packed into 53-bit words, (B, ceil(M/53), S) int64; per
      word one full-volume ``(wh & ww) & wd`` is each voxel's set of covering boxes; as exact float64 scaled
      by 2**(53 w), the running maximum's exponent is 1023 + the last covering slot (``_owner_code``;
      24-bit words through float32 on MPS, which has no float64).
    - noise: one (C, Lh, Lw, Ld) normal block per slot (L = the largest side); min / max over its clipped
      part, normalised blocks; each covered voxel takes its owner's value at its local offset (a gather of
      the owner's base offset plus a fixed per-voxel offset): no per-box loop.
    - paste: coverage = OR of the words; ``where(covered, inner[j], inner)``.

    Full-volume (B*V or B*C*V) passes: inner 2 + 4 per further word + 6, paste 2 per word + 3; on CPU (M trimmed
    to ~70-130, 2-3 words) about 20-25 passes, on an accelerator (M = 228, 5 words) about 40, plus ~5
    passes over the (B, M, C, Lh, Lw, Ld) noise blocks.

    Args:
        x: ``(B, C, H, W, D)`` floating tensor; not modified. Treated as data (the result is detached).
        generator: random source on ``x``'s device, or None for torch's default generator.
        max_drop: upper end of the target volume fraction per pass, in [0, 1].
        max_block, min_block: box side range as fractions of each spatial size, 0 < min_block <= max_block <= 1,
            with int(min_block * S) >= 1 and int(max_block * S) > int(min_block * S) on every axis.
        sync: allow reading device values on the host (see above); None: only when ``x`` is on CPU.
        box_generator: a CPU generator for the boxes and partners of a batch on an accelerator. They are then drawn
            and trimmed on the host, where reading them costs no device sync, and copied to the device, which
            draws only the noise (from ``generator``): the slots are trimmed as on CPU (about half the
            full-volume memory traffic at 96^3: 5 words of 53 slots become 2-3) and nothing is read back.

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
