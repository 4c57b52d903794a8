"""The SSL view augmentations (``components.rot_rand`` + ``aug_rand``) against a per-sample, per-box reference.

The reference below has the shape of the original recipe's code: a python loop over samples, per box a numpy
``randint`` for each start and side, one slice assignment per box (noise drawn and min-max normalised per box, or
the box copied from the partner sample), and ``torch.rot90`` per sample. It implements the same semantics as
``components.recipes.inpainting_contrast.views`` (recipe.md s1; the paste pass copies from the inner-augmented batch), so the two must agree
in distribution, which is checked on:

- the changed fraction of every sample (voxels that differ from the input, on continuous random inputs);
- the clipped side lengths and volumes of the boxes, and the number of boxes per inner pass;

with summary statistics and the two-sample Kolmogorov-Smirnov statistic (small statistics and large p-values mean
the samples are indistinguishable). Timings: one view (``rot_rand`` + ``aug_rand``) and
the two views of an SSL step (``ssl_views``) of a batch of 4 crops at 96^3, medians over repetitions. Traffic: the
kernels and bytes written by the views on each of their paths (accelerator, host-drawn boxes, CPU), counted at the
dispatcher, which runs the same operators on any device. With
``--ssl-step-json`` (a saved ``benchmarks/ssl_step.py`` result) the two-view time is also given as a share of the
paper-size forward + backward time of the same number of crops (target <= 2%). The process runs with
``components.tune_allocator()`` as the bundle does with ``--tune_allocator true`` (``--plain-allocator`` to
compare): without it, the large temporaries of the augmentation (the noise blocks) are page-faulted afresh on every
call.

    python benchmarks/augment.py
    python benchmarks/augment.py --reps 50 --ssl-step-json ssl_step.json
    python benchmarks/augment.py --small        # CI: 32^3, a few repetitions

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from components import aug_rand, rot_rand, ssl_views, tune_allocator
from components.recipes.inpainting_contrast.views import _apply_aug, _draw_aug

from machine import machine_info


# ---------------------------------------------------------------------------------------------------------------
# the reference: per sample, per box, numpy draws, python loops
# ---------------------------------------------------------------------------------------------------------------
def reference_cutout(
    sample: torch.Tensor,
    rng: np.random.RandomState,
    source: torch.Tensor | None = None,
    max_drop: float = 0.3,
    max_block: float = 0.25,
    min_block: float = 0.05,
) -> list[tuple[int, ...]]:
    """One cutout pass on ``sample`` (C, H, W, D), in place: boxes of noise (``source`` None) or copied from
    ``source`` until the counted volume reaches U(0, max_drop) * H*W*D. Returns the clipped sides of its boxes."""
    channels, *spatial = sample.shape
    target = rng.uniform(0, max_drop) * math.prod(spatial)
    low = [int(min_block * s) for s in spatial]
    high = [int(max_block * s) for s in spatial]
    counted, boxes = 0, []
    while counted < target:
        start = [rng.randint(0, s - t) for s, t in zip(spatial, low)]
        stop = [min(a + rng.randint(t, h), s) for a, t, h, s in zip(start, low, high, spatial)]
        box = (slice(None), *(slice(a, b) for a, b in zip(start, stop)))
        sides = tuple(b - a for a, b in zip(start, stop))
        if source is None:
            noise = torch.randn((channels, *sides), dtype=sample.dtype)
            low_value, high_value = noise.min(), noise.max()
            span = high_value - low_value
            sample[box] = (noise - low_value) / span if span > 0 else torch.zeros_like(noise)
        else:
            sample[box] = source[box]
        counted += math.prod(sides)
        boxes.append(sides)
    return boxes


def reference_aug_rand(x: torch.Tensor, rng: np.random.RandomState) -> tuple[torch.Tensor, list, list]:
    """``aug_rand``'s semantics, sample by sample: an inner pass each, then a paste pass from a random partner of
    the inner-augmented batch (skipped when the partner is the sample itself). Returns (views, inner boxes per
    sample, paste boxes per pasting sample)."""
    inner = x.detach().clone()
    inner_boxes = [reference_cutout(inner[i], rng) for i in range(x.shape[0])]
    out = inner.clone()
    paste_boxes = []
    for i in range(x.shape[0]):
        j = rng.randint(0, x.shape[0])
        if j != i:
            paste_boxes.append(reference_cutout(out[i], rng, source=inner[j]))
    return out, inner_boxes, paste_boxes


def reference_rot_rand(x: torch.Tensor, rng: np.random.RandomState) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample rotated by ``k * 90`` degrees in its last two axes, ``k`` drawn per sample."""
    out = torch.empty_like(x)
    labels = torch.zeros(x.shape[0], dtype=torch.long)
    for i in range(x.shape[0]):
        k = rng.randint(0, 4)
        out[i] = torch.rot90(x[i], k, (2, 3))
        labels[i] = k
    return out, labels


def reference_ssl_views(x: torch.Tensor, rng: np.random.RandomState):
    x1, k1 = reference_rot_rand(x, rng)
    x2, k2 = reference_rot_rand(x, rng)
    a1, a2 = reference_aug_rand(x1, rng)[0], reference_aug_rand(x2, rng)[0]
    return torch.cat([a1, a2]), torch.cat([k1, k2]), torch.cat([x1, x2])


# ---------------------------------------------------------------------------------------------------------------
# measurements
# ---------------------------------------------------------------------------------------------------------------
def _timed(fn, reps: int, warmup: int = 2) -> dict:
    for _ in range(warmup):  # first calls grow the heap (tune_allocator keeps it) and warm the caches
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return {"median_s": round(statistics.median(times), 5), "min_s": round(min(times), 5), "reps": reps}


def _ours_draw(x: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, list, list]:
    """One ``aug_rand`` (its own two steps, so that the boxes it used can be read): views, inner and paste boxes."""
    draws = _draw_aug(x, generator, 0.3, 0.25, 0.05, None)
    out = _apply_aug(x, draws)

    def boxes(b) -> list[list[tuple[int, ...]]]:
        sides = (b.stop - b.start).tolist()
        active = b.active.tolist()
        return [[tuple(s) for s, a in zip(sides[i], active[i]) if a] for i in range(len(active))]

    partner = draws.partner.tolist()
    paste = [p for i, p in enumerate(boxes(draws.paste)) if partner[i] != i]
    return out, boxes(draws.inner), paste


def _summary(values: list[float]) -> dict:
    a = np.asarray(values, dtype=np.float64)
    return {
        "n": int(a.size),
        "mean": round(float(a.mean()), 5),
        "std": round(float(a.std()), 5),
        "p10": round(float(np.percentile(a, 10)), 5),
        "median": round(float(np.median(a)), 5),
        "p90": round(float(np.percentile(a, 90)), 5),
    }


def ks_2samp(a: list[float], b: list[float]) -> tuple[float, float]:
    """Two-sample Kolmogorov-Smirnov statistic D = max |F_a - F_b| over all values (ties handled by evaluating both
    empirical CDFs right of each value) and its asymptotic p-value, Q_KS((sqrt(ne) + 0.12 + 0.11 / sqrt(ne)) D) with
    ne = n m / (n + m) (Numerical Recipes); conservative for discrete data such as box sides."""
    x, y = np.sort(np.asarray(a, dtype=np.float64)), np.sort(np.asarray(b, dtype=np.float64))
    grid = np.concatenate([x, y])
    d = float(np.max(np.abs(np.searchsorted(x, grid, "right") / x.size - np.searchsorted(y, grid, "right") / y.size)))
    ne = x.size * y.size / (x.size + y.size)
    lam = (math.sqrt(ne) + 0.12 + 0.11 / math.sqrt(ne)) * d
    if lam < 1e-3:
        return d, 1.0
    p = 2.0 * sum((-1) ** (k - 1) * math.exp(-2.0 * k * k * lam * lam) for k in range(1, 101))
    return d, min(max(p, 0.0), 1.0)


def _ks(a: list[float], b: list[float]) -> dict:
    statistic, p_value = ks_2samp(a, b)
    return {"statistic": round(statistic, 5), "p_value": round(p_value, 5)}


def distributions(size: int, batch: int, reps: int, seed: int) -> dict:
    """Changed fraction and box statistics of ours and the reference over ``reps`` batches of random crops."""
    generator = torch.Generator().manual_seed(seed)
    rng = np.random.RandomState(seed)
    data = torch.Generator().manual_seed(seed + 1)
    stats: dict[str, dict[str, list[float]]] = {
        name: {"changed_fraction": [], "box_volume": [], "box_side": [], "boxes_per_inner_pass": [], "paste_passes": []}
        for name in ("ours", "reference")
    }
    for _ in range(reps):
        x = torch.rand(batch, 1, size, size, size, generator=data)
        runs = (("ours", lambda v: _ours_draw(v, generator)), ("reference", lambda v: reference_aug_rand(v, rng)))
        for name, run in runs:
            out, inner, paste = run(x)
            s = stats[name]
            s["changed_fraction"] += (out != x).any(1).flatten(1).float().mean(1).tolist()
            for sample_boxes in inner + paste:
                s["box_volume"] += [math.prod(b) for b in sample_boxes]
                s["box_side"] += [side for b in sample_boxes for side in b]
            s["boxes_per_inner_pass"] += [len(b) for b in inner]
            s["paste_passes"].append(len(paste) / batch)
    result = {}
    for key in stats["ours"]:
        result[key] = {
            "ours": _summary(stats["ours"][key]),
            "reference": _summary(stats["reference"][key]),
            "ks": _ks(stats["ours"][key], stats["reference"][key]),
        }
    return result


def timings(size: int, batch: int, reps: int, seed: int) -> dict:
    x = torch.rand(batch, 1, size, size, size, generator=torch.Generator().manual_seed(seed))
    generator = torch.Generator().manual_seed(seed)
    rng = np.random.RandomState(seed)
    ours_view = _timed(lambda: aug_rand(rot_rand(x, generator)[0], generator), reps)
    reference_view = _timed(lambda: reference_aug_rand(reference_rot_rand(x, rng)[0], rng), reps)
    ours_step = _timed(lambda: ssl_views(x, generator), reps)
    reference_step = _timed(lambda: reference_ssl_views(x, rng), reps)
    return {
        "one_view": {"ours": ours_view, "reference": reference_view},
        "ssl_views_two_views": {"ours": ours_step, "reference": reference_step},
        "speedup_one_view": round(reference_view["median_s"] / ours_view["median_s"], 2),
        "speedup_two_views": round(reference_step["median_s"] / ours_step["median_s"], 2),
    }


class _KernelTally(TorchDispatchMode):
    """Counts the aten operators that launch work (views of tensors excluded) and the bytes of their outputs."""

    NO_KERNEL = {"aten.view", "aten.unsqueeze", "aten.select", "aten.slice", "aten.expand", "aten._unsafe_view",
                 "aten.detach", "aten.permute", "aten.transpose", "aten.as_strided", "aten.alias"}  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.kernels, self.bytes_written = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func.overloadpacket) not in self.NO_KERNEL:
            self.kernels += 1
            outputs = out if isinstance(out, (tuple, list)) else [out]
            self.bytes_written += sum(o.numel() * o.element_size() for o in outputs if isinstance(o, torch.Tensor))
        return out


def traffic(size: int, batch: int, reps: int, seed: int) -> dict:
    """Kernels and bytes written by the two views of an SSL step (``ssl_views``) on each of its paths, counted at
    the dispatcher (device-independent: the same operators run on a GPU). ``accelerator``: boxes drawn on the
    device with every slot of the budget (read back once per pass to be applied); ``host_boxes``: boxes drawn and
    trimmed on the host (``box_generator``), as the trainer does on an accelerator; ``cpu``: drawn and trimmed on
    the host."""
    x = torch.rand(batch, 1, size, size, size, generator=torch.Generator().manual_seed(seed))
    paths = {
        "accelerator": lambda g: ssl_views(x, g, sync=False),
        "host_boxes": lambda g: ssl_views(x, g, sync=False, box_generator=torch.Generator().manual_seed(g.initial_seed())),
        "cpu": lambda g: ssl_views(x, g, sync=True),
    }
    result = {}
    for name, views in paths.items():
        kernels, written = [], []
        for rep in range(reps):
            with _KernelTally() as tally:
                views(torch.Generator().manual_seed(seed + rep))
            kernels.append(tally.kernels)
            written.append(tally.bytes_written)
        result[name] = {"kernels_median": int(statistics.median(kernels)),
                        "gb_written_median": round(statistics.median(written) / 1e9, 3)}  # fmt: skip
    result["host_boxes_over_accelerator_bytes"] = round(
        result["host_boxes"]["gb_written_median"] / result["accelerator"]["gb_written_median"], 3
    )
    return result


def share_of_step(views_s: float, batch: int, ssl_step_json: Path) -> dict:
    """The two-view time of ``batch`` crops as a share of the paper-size forward + backward of as many crops."""
    saved = json.loads(ssl_step_json.read_text())
    paper = saved["sizes"]["paper"]
    fwd_bwd = sum(paper["phase_median_s"][k] for k in ("forward", "loss", "backward"))
    per_crop = fwd_bwd / paper["crops_per_step"]
    return {
        "paper_forward_backward_s_per_crop": round(per_crop, 4),
        "views_share_of_forward_backward": round(views_s / (per_crop * batch), 5),
        "target_max": 0.02,
        "from": str(ssl_step_json),
        "measured_on": saved.get("machine", {}),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=96, help="crop side (the recipe: 96)")
    parser.add_argument("--batch", type=int, default=4, help="crops per batch")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions")
    parser.add_argument("--dist-reps", type=int, default=25, help="batches drawn for the distribution comparison")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--ssl-step-json", type=Path, default=None, help="a saved ssl_step result (paper size)")
    parser.add_argument("--plain-allocator", action="store_true", help="skip components.tune_allocator()")
    parser.add_argument("--small", action="store_true", help="CI: 32^3, 2 timed repetitions, 4 batches drawn")
    args = parser.parse_args(argv)
    if args.small:
        args.size, args.reps, args.dist_reps = 32, 2, 4
    if args.threads:
        torch.set_num_threads(args.threads)
    tuned = False if args.plain_allocator else tune_allocator(True)  # as the bundle's start-up does with --tune_allocator true
    result: dict = {
        "benchmark": "augment",
        "machine": machine_info(),
        "tune_allocator": tuned,
        "size": args.size,
        "batch": args.batch,
        "timing": timings(args.size, args.batch, args.reps, args.seed),
        "distributions": distributions(args.size, args.batch, args.dist_reps, args.seed),
        "traffic": traffic(args.size, args.batch, args.reps, args.seed),
    }
    if args.ssl_step_json is not None:
        views_s = result["timing"]["ssl_views_two_views"]["ours"]["median_s"]
        result["share_of_paper_step"] = share_of_step(views_s, args.batch, args.ssl_step_json)
    result["machine"]["load_avg_1_5_15_at_end"] = [round(v, 2) for v in os.getloadavg()]
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
