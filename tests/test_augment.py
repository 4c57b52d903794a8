"""Tests of components.recipes.inpainting_contrast.views: rot_rand, aug_rand (against a per-sample per-box reference), ssl_views."""

from __future__ import annotations

import math

import pytest
import torch

from components import InpaintingContrastRecipe
from components.recipes.inpainting_contrast.views import (
    SSLViews,
    _apply_aug,
    _box_ranges,
    _draw_aug,
    _draw_boxes,
    _fill_noise,
    _slot_budget,
    aug_rand,
    rot_rand,
    ssl_views,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # the test machine's 2 cores are shared: OpenMP threads contending with other processes are far slower
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------------------------------
# reference implementations (straightforward, per sample, per box) consuming the same draws
# ----------------------------------------------------------------------------------------------------
def reference_aug(x: torch.Tensor, draws) -> torch.Tensor:
    """The recipe's loops: inner cutout of every sample, then paste from the inner-augmented batch."""
    out = x.clone()
    b = x.shape[0]
    inner = draws.inner
    for i in range(b):
        for m in range(inner.active.shape[1]):
            if not bool(inner.active[i, m]):
                continue
            (h0, w0, d0), (h1, w1, d1) = inner.start[i, m].tolist(), inner.stop[i, m].tolist()
            z = draws.noise[i, m, :, : h1 - h0, : w1 - w0, : d1 - d0]
            low, high = z.min(), z.max()
            value = (z - low) / (high - low) if high > low else torch.zeros_like(z)
            out[i, :, h0:h1, w0:w1, d0:d1] = value.to(x.dtype)
    source = out.clone()
    for i in range(b):
        j = int(draws.partner[i])
        if j == i:
            assert not bool(draws.paste.active[i].any())
            continue
        for m in range(draws.paste.active.shape[1]):
            if not bool(draws.paste.active[i, m]):
                continue
            (h0, w0, d0), (h1, w1, d1) = draws.paste.start[i, m].tolist(), draws.paste.stop[i, m].tolist()
            out[i, :, h0:h1, w0:w1, d0:d1] = source[j, :, h0:h1, w0:w1, d0:d1]
    return out


def axis_moments(size: int, tol: int, hi: int) -> tuple[float, float, torch.Tensor]:
    """Mean and mean square of a clipped side, and the probability that a box covers each coordinate."""
    clipped = [min(side, size - start) for start in range(size - tol) for side in range(tol, hi)]
    cover = torch.zeros(size, dtype=torch.float64)
    for start in range(size - tol):
        for side in range(tol, hi):
            cover[start : min(start + side, size)] += 1
    n = len(clipped)
    return sum(clipped) / n, sum(c * c for c in clipped) / n, cover / n


# ----------------------------------------------------------------------------------------------------
# rot_rand
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("channels", [1, 4])
def test_rot_rand_matches_per_sample_rot90(channels):
    x = torch.randn(6, channels, 5, 7, 7)
    before = x.clone()
    rotated, labels = rot_rand(x, gen(0))
    assert labels.dtype == torch.int64 and labels.shape == (6,)
    assert rotated.shape == x.shape and rotated.dtype == x.dtype
    for i in range(6):
        assert torch.equal(rotated[i], torch.rot90(x[i], int(labels[i]), (2, 3)))
    assert torch.equal(x, before)


def test_rot_rand_labels_uniform_and_integer_dtype():
    x = torch.arange(2 * 3 * 4 * 4, dtype=torch.int32).view(2, 1, 3, 4, 4).repeat(32, 1, 1, 1, 1)  # (64, ...)
    g = gen(1)
    counts = torch.zeros(4)
    for _ in range(40):
        rotated, labels = rot_rand(x, g)
        counts += torch.bincount(labels, minlength=4)
        for i in (0, 63):
            assert torch.equal(rotated[i], torch.rot90(x[i], int(labels[i]), (2, 3)))
    n = counts.sum()
    expected, sd = n / 4, math.sqrt(n * 0.25 * 0.75)
    assert ((counts - expected).abs() < 5 * sd).all(), counts


def test_rot_rand_seeded():
    x = torch.randn(16, 1, 4, 6, 6)
    a, la = rot_rand(x, gen(3))
    b, lb = rot_rand(x, gen(3))
    _, lc = rot_rand(x, gen(4))
    assert torch.equal(a, b) and torch.equal(la, lb)
    assert not torch.equal(la, lc)


def test_rot_rand_errors():
    with pytest.raises(ValueError, match="W=6, D=5"):
        rot_rand(torch.zeros(1, 1, 4, 6, 5))
    with pytest.raises(ValueError, match="5D"):
        rot_rand(torch.zeros(1, 4, 6, 6))
    with pytest.raises(TypeError, match="generator"):
        rot_rand(torch.zeros(1, 1, 4, 6, 6), generator=3)
    with pytest.raises(ValueError, match="generator is on device cpu"):
        rot_rand(torch.zeros(1, 1, 4, 6, 6, device="meta"), generator=gen(0))


# ----------------------------------------------------------------------------------------------------
# box drawing
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spatial", [(32, 32, 32), (48, 40, 24)])
def test_draw_boxes_ranges_and_stopping_rule(spatial):
    b = 16
    ranges = _box_ranges(spatial, 0.3, 0.25, 0.05)
    assert ranges == tuple((int(0.05 * s), int(0.25 * s)) for s in spatial)
    g = gen(5)
    for _ in range(10):
        boxes = _draw_boxes(b, spatial, generator=g)
        m = boxes.active.shape[1]
        assert boxes.start.shape == boxes.side.shape == boxes.stop.shape == (b, m, 3)
        for a, (size, (tol, hi)) in enumerate(zip(spatial, ranges)):
            start, side, stop = boxes.start[..., a], boxes.side[..., a], boxes.stop[..., a]
            assert int(start.min()) >= 0 and int(start.max()) <= size - tol - 1
            assert int(side.min()) >= tol and int(side.max()) <= hi - 1
            assert torch.equal(stop, torch.clamp(start + side, max=size))
        volume = (boxes.stop - boxes.start).prod(-1)
        assert int(volume.min()) >= math.prod(t for t, _ in ranges)
        target = boxes.target
        assert bool((target >= 0).all()) and bool((target < 0.3 * math.prod(spatial)).all())
        for i in range(b):
            n = int(boxes.active[i].sum())
            assert bool(boxes.active[i, :n].all()) and not bool(boxes.active[i, n:].any())  # a prefix
            counted = int(volume[i, :n].sum())
            assert counted == int(boxes.counted[i])
            if float(target[i]) > 0:
                assert n >= 1
                assert counted >= float(target[i])  # reached the target ...
                assert counted - int(volume[i, n - 1]) < float(target[i])  # ... crossed by the last box
            else:
                assert n == 0
        assert m == max(int(boxes.active.sum(1).max()), 1)  # CPU default: trimmed to the longest prefix


def test_draw_boxes_more_chunks_when_short_and_disabled_samples():
    spatial = (32, 32, 32)
    enabled = torch.tensor([True, False, True, True])
    boxes = _draw_boxes(4, spatial, generator=gen(6), num_slots=3, enabled=enabled, sync=True)
    assert float(boxes.target[1]) == 0 and not bool(boxes.active[1].any()) and int(boxes.counted[1]) == 0
    assert bool((boxes.counted >= boxes.target).all())
    assert boxes.active.shape[1] > 3  # several chunks of 3 were needed
    # without sync nothing is read back: exactly the first chunk, possibly short of the target
    nosync = _draw_boxes(4, spatial, generator=gen(6), num_slots=3, enabled=enabled, sync=False)
    assert nosync.active.shape == (4, 3)
    assert torch.equal(nosync.start, boxes.start[:, :3]) and torch.equal(nosync.side, boxes.side[:, :3])


def test_slot_budget():
    spatial = (96, 96, 96)
    ranges = _box_ranges(spatial, 0.3, 0.25, 0.05)
    assert ranges == ((4, 24),) * 3
    budget = _slot_budget(spatial, 0.3, ranges)
    mean = math.prod(axis_moments(96, 4, 24)[0] for _ in range(3))
    assert 0.3 * 96**3 / mean < budget < 4 * 0.3 * 96**3 / mean  # above the mean need, far below worst case
    assert _slot_budget(spatial, 0.0, ranges) == 1
    boxes = _draw_boxes(2, spatial, generator=gen(0), sync=False)
    assert boxes.active.shape == (2, budget)


def test_counted_volume_mean_matches_recipe():
    """E[counted] = E[target] + E[overshoot] = max_drop/2 * V + E[v^2] / (2 E[v]) (renewal theory)."""
    spatial, b, draws = (32, 32, 32), 64, 40
    v = math.prod(spatial)
    m1, m2, _ = axis_moments(32, 1, 8)
    overshoot = m2**3 / (2 * m1**3)
    g = gen(7)
    counted = torch.cat([_draw_boxes(b, spatial, generator=g).counted.double() / v for _ in range(draws)])
    expected = 0.15 + overshoot / v
    se = counted.std().item() / math.sqrt(counted.numel())
    assert abs(counted.mean().item() - expected) < 4 * se + 1e-3, (counted.mean().item(), expected)


def test_hundreds_of_overlapping_boxes_equal_the_reference():
    """Several hundred small boxes a sample, each overlapping many others: the last box drawn wins everywhere."""
    spatial = (20, 24, 16)
    x = torch.full((3, 2, *spatial), 5.0)
    draws = _draw_aug(x, gen(19), 1.0, 0.25, 0.1, None)
    assert int(draws.inner.active.sum(1).max()) > 200
    assert torch.equal(_apply_aug(x, draws), reference_aug(x, draws))


# ----------------------------------------------------------------------------------------------------
# aug_rand
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "shape, sync",
    [((4, 1, 32, 32, 32), True), ((4, 4, 24, 32, 40), True), ((3, 2, 32, 32, 32), False), ((1, 1, 32, 32, 32), True)],
)
def test_aug_rand_equals_reference(shape, sync):
    x = torch.rand(shape) * 3 + 2  # values outside [0, 1]
    before = x.clone()
    g = gen(9)
    draws = _draw_aug(x, g, 0.3, 0.25, 0.05, sync)
    out = _apply_aug(x, draws)
    assert torch.equal(out, reference_aug(x, draws))
    assert torch.equal(aug_rand(x, gen(9), sync=sync), out)  # aug_rand = apply(draws) for the same stream
    assert torch.equal(x, before)
    assert out.shape == x.shape and out.dtype == x.dtype


def test_aug_rand_reference_with_heavy_overlap():
    x = torch.full((3, 2, 16, 16, 16), 5.0)
    draws = _draw_aug(x, gen(10), 1.0, 0.5, 0.25, None)
    assert torch.equal(_apply_aug(x, draws), reference_aug(x, draws))


def test_single_voxel_boxes_get_zero():
    """Sides of exactly 1 voxel and one channel: min == max, the recipe's 0/0 is defined as 0."""
    x = torch.full((2, 1, 20, 20, 20), 5.0)
    draws = _draw_aug(x, gen(20), 0.3, 0.1, 0.05, None)
    assert int(draws.inner.side.min()) == int(draws.inner.side.max()) == 1
    out = _apply_aug(x, draws)
    assert torch.equal(out, reference_aug(x, draws))
    assert bool((out[out != 5.0] == 0).all()) and bool((out != 5.0).any())


def test_aug_rand_seeded_and_input_untouched():
    x = torch.rand(4, 1, 32, 32, 32)
    before = x.clone()
    a = aug_rand(x, gen(11))
    b = aug_rand(x, gen(11))
    c = aug_rand(x, gen(12))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(x, before)
    assert a.data_ptr() != x.data_ptr()
    torch.manual_seed(0)
    d = aug_rand(x)  # default generator
    torch.manual_seed(0)
    assert torch.equal(d, aug_rand(x))


def test_inner_pass_noise_in_unit_range_and_attains_bounds():
    x = torch.full((4, 2, 32, 32, 32), 5.0)
    g = gen(13)
    for _ in range(5):
        draws = _draw_aug(x, g, 0.3, 0.25, 0.05, None)
        inner = _fill_noise(x, draws.inner, draws.noise)
        changed = inner != 5.0
        assert bool(((inner[changed] >= 0) & (inner[changed] <= 1)).all())
        for i in range(4):
            n = int(draws.inner.active[i].sum())
            if n == 0:
                continue
            (h0, w0, d0), (h1, w1, d1) = draws.inner.start[i, n - 1].tolist(), draws.inner.stop[i, n - 1].tolist()
            last = inner[i, :, h0:h1, w0:w1, d0:d1]  # the last box is never overwritten
            assert float(last.min()) == 0.0 and float(last.max()) == 1.0


def test_changed_fraction_per_pass_bounds_and_mean():
    """Changed fraction of one inner pass: in [0, max_drop + one box], mean = E[union of the boxes].

    A voxel p is missed by one box with probability 1 - q(p), q(p) = q_H(p_H) q_W(p_W) q_D(p_D) the exact
    per-axis coverage probabilities; with E[N] = (T + E[overshoot]) / E[v] boxes (Wald) the expected
    covered fraction is about mean_p E_T[1 - (1 - q(p))^E[N]] (Jensen: the true value is slightly lower).
    """
    spatial, b, draws = (32, 32, 32), 8, 60
    v = math.prod(spatial)
    m1, m2, q = axis_moments(32, 1, 8)
    mean_volume, overshoot = m1**3, m2**3 / (2 * m1**3)
    q3 = (q[:, None, None] * q[:, None] * q).reshape(-1)
    u = (torch.arange(400, dtype=torch.float64) + 0.5) / 400
    n_boxes = (u * 0.3 * v + overshoot) / mean_volume
    expected = (1 - (1 - q3[None]) ** n_boxes[:, None]).mean().item()
    x = torch.full((b, 1, *spatial), 5.0)
    g = gen(14)
    fractions = []
    for _ in range(draws):
        d = _draw_aug(x, g, 0.3, 0.25, 0.05, None)
        changed = (_fill_noise(x, d.inner, d.noise) != 5.0).double().mean((1, 2, 3, 4))
        assert bool((changed <= d.inner.counted / v).all())  # union <= counted volume
        assert bool((changed < 0.3 + 7**3 / v).all())
        fractions.append(changed)
    fractions = torch.cat(fractions)
    se = fractions.std().item() / math.sqrt(fractions.numel())
    assert abs(fractions.mean().item() - expected) < 4 * se + 0.005, (fractions.mean().item(), expected)
    assert 0.10 < fractions.mean().item() < 0.15


def test_paste_copies_from_the_partner_sample():
    b = 4
    x = (10.0 + torch.arange(b, dtype=torch.float32)).view(b, 1, 1, 1, 1).expand(b, 2, 32, 32, 32).contiguous()
    g = gen(15)
    seen_paste = 0
    for _ in range(6):
        draws = _draw_aug(x, g, 0.3, 0.25, 0.05, None)
        # paste only: disable the inner boxes
        paste_only = draws._replace(inner=draws.inner._replace(active=torch.zeros_like(draws.inner.active)))
        out = _apply_aug(x, paste_only)
        for i in range(b):
            changed = out[i] != x[i]
            j = int(draws.partner[i])
            if j == i:
                assert not bool(changed.any())
                continue
            seen_paste += int(changed.any())
            assert bool((out[i][changed] == 10.0 + j).all())
        # full aug: every changed voxel holds noise in [0, 1] or the partner's value
        out = _apply_aug(x, draws)
        for i in range(b):
            values = out[i][out[i] != x[i]]
            j = int(draws.partner[i])
            ok = ((values >= 0) & (values <= 1)) | ((values == 10.0 + j) & (j != i))
            assert bool(ok.all())
    assert seen_paste > 0


def test_aug_rand_zero_drop_and_low_precision():
    x = torch.rand(2, 1, 32, 32, 32)
    out = aug_rand(x, gen(16), max_drop=0.0)
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()
    xb = torch.full((2, 1, 32, 32, 32), 5.0, dtype=torch.bfloat16)
    out = aug_rand(xb, gen(17))
    assert out.dtype == torch.bfloat16
    changed = out[out != 5.0]
    assert changed.numel() > 0 and bool(((changed >= 0) & (changed <= 1)).all())


def test_host_drawn_boxes_are_trimmed_and_the_result_equals_the_reference():
    """box_generator: boxes and partners from the CPU generator, trimmed as the CPU path trims them (the draws a
    sync=True CPU call makes from that generator), noise from the device generator; the result is the recipe's."""
    x = torch.rand(4, 1, 32, 32, 32)
    draws = _draw_aug(x, gen(1), 0.3, 0.25, 0.05, sync=False, box_generator=gen(2))
    host = gen(2)  # the host stream: inner boxes, partners, paste boxes, each drawn and trimmed with sync
    options = dict(max_drop=0.3, max_block=0.25, min_block=0.05, generator=host, sync=True)
    inner = _draw_boxes(4, (32, 32, 32), **options)
    partner = torch.randint(0, 4, (4,), generator=host)
    paste = _draw_boxes(4, (32, 32, 32), enabled=partner != torch.arange(4), **options)
    for name in ("start", "stop", "active"):
        assert torch.equal(getattr(draws.inner, name), getattr(inner, name))
        assert torch.equal(getattr(draws.paste, name), getattr(paste, name))
    assert torch.equal(draws.partner, partner)
    untrimmed = _draw_aug(x, gen(2), 0.3, 0.25, 0.05, sync=False)
    assert draws.inner.active.shape[1] < untrimmed.inner.active.shape[1]  # fewer slots, fewer noise blocks
    noise = torch.randn(draws.noise.shape, generator=gen(1))  # the device stream draws the noise only
    assert torch.equal(draws.noise, noise)
    out = _apply_aug(x, draws)
    assert torch.equal(out, reference_aug(x, draws))
    assert torch.equal(aug_rand(x, gen(1), sync=False, box_generator=gen(2)), out)


def test_host_drawn_boxes_read_nothing_from_the_device():
    """On the meta device any read of a value fails: the boxes come from the host and stay there, the device only
    draws noise."""
    x = torch.empty(2, 1, 64, 64, 64, device="meta")
    draws = _draw_aug(x, None, 0.3, 0.25, 0.05, sync=None, box_generator=gen(0))
    assert {draws.inner.start.device.type, draws.paste.stop.device.type, draws.partner.device.type} == {"cpu"}
    assert draws.noise.device.type == "meta"
    views = ssl_views(x, box_generator=gen(0))
    assert views.inputs.shape == (4, 1, 64, 64, 64) and views.inputs.device.type == "meta"
    recipe_views = InpaintingContrastRecipe(None).views(x, None, host_generator=gen(0))
    assert recipe_views.inputs.device.type == "meta"


def test_aug_rand_errors():
    x = torch.rand(2, 1, 32, 32, 32)
    with pytest.raises(ValueError, match="5D"):
        aug_rand(torch.rand(1, 32, 32, 32))
    with pytest.raises(ValueError, match="floating"):
        aug_rand(torch.zeros(1, 1, 32, 32, 32, dtype=torch.int64))
    with pytest.raises(ValueError, match="max_drop must lie in"):
        aug_rand(x, max_drop=1.5)
    with pytest.raises(ValueError, match="max_drop must lie in"):
        aug_rand(x, max_drop=-0.1)
    with pytest.raises(ValueError, match="min_block=0"):
        aug_rand(x, min_block=0)
    with pytest.raises(ValueError, match="min_block=0.3, max_block=0.25"):
        aug_rand(x, min_block=0.3)
    with pytest.raises(ValueError, match="max_block=1.5"):
        aug_rand(x, max_block=1.5)
    with pytest.raises(ValueError, match="finite"):
        aug_rand(x, max_drop=float("nan"))
    with pytest.raises(ValueError, match=r"int\(min_block \* H\) = int\(0.05 \* 16\) = 0"):
        aug_rand(torch.rand(1, 1, 16, 32, 32))
    with pytest.raises(ValueError, match="empty box side range on axis W=10"):
        aug_rand(torch.rand(1, 1, 40, 10, 40), min_block=0.2, max_block=0.25)
    with pytest.raises(ValueError, match="generator is on device cpu but must be on meta"):
        aug_rand(torch.empty(1, 1, 32, 32, 32, device="meta"), generator=gen(0))
    with pytest.raises(TypeError, match="box_generator must be a torch.Generator or None, got int"):
        aug_rand(x, box_generator=0)


# ----------------------------------------------------------------------------------------------------
# ssl_views
# ----------------------------------------------------------------------------------------------------
def test_ssl_views_shapes_labels_and_targets():
    b = 3
    x = torch.rand(b, 1, 32, 32, 32) * 3 + 2
    before = x.clone()
    views = ssl_views(x, gen(18))
    assert isinstance(views, SSLViews)
    inputs, labels, targets = views
    assert inputs.shape == targets.shape == (2 * b, 1, 32, 32, 32)
    assert labels.shape == (2 * b,) and labels.dtype == torch.int64
    for r in range(2 * b):
        assert torch.equal(targets[r], torch.rot90(x[r % b], int(labels[r]), (2, 3)))
        changed = inputs[r] != targets[r]
        assert bool(changed.any())  # sample values lie in [2, 5]: every corrupted voxel differs
    assert torch.equal(x, before)
    # the same stream step by step
    g = gen(18)
    x1, k1 = rot_rand(x, g)
    x2, k2 = rot_rand(x, g)
    a1, a2 = aug_rand(x1, g), aug_rand(x2, g)
    assert torch.equal(inputs, torch.cat([a1, a2])) and torch.equal(labels, torch.cat([k1, k2]))
    assert torch.equal(targets, torch.cat([x1, x2]))
    again = ssl_views(x, gen(18))
    assert all(torch.equal(p, q) for p, q in zip(views, again))


def test_ssl_views_errors():
    with pytest.raises(ValueError, match="W=32, D=24"):
        ssl_views(torch.rand(1, 1, 32, 32, 24))
    with pytest.raises(ValueError, match="max_drop must lie in"):
        ssl_views(torch.rand(1, 1, 32, 32, 32), max_drop=2.0)
    with pytest.raises(ValueError, match="floating"):
        ssl_views(torch.zeros(1, 1, 32, 32, 32, dtype=torch.uint8))
