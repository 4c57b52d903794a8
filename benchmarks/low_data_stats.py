"""The low-data protocol's statistics: paired differences over seeds and their intervals, the per-arm tables, the
seed rule and the validation curves behind the budget."""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING

import numpy as np

from low_data_arms import CONTRASTS
from low_data_protocol import HELD_OUT_SETS, MODELS

if TYPE_CHECKING:
    from low_data_protocol import Plan

def bootstrap_interval(differences: list[float], seed: int = 0, resamples: int = 10_000) -> tuple[float, float] | None:
    """95 % percentile bootstrap interval of the mean of ``differences`` (resampled with replacement); None for
    fewer than 2 values."""
    if len(differences) < 2:
        return None
    values = np.asarray(differences, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), size=(resamples, len(values)))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(low), float(high)


def paired(runs: list[dict], plan: Plan, seed: int) -> dict:
    """Per held-out set, model, contrast and k: the paired differences over the seeds that both arms finished, their
    mean, the bootstrap interval and its half-width."""
    dice = {(r["arm"], r["k"], r["seed"]): r["dice"] for r in runs}
    out: dict = {}
    for held_out in HELD_OUT_SETS:
        for model in MODELS:
            for contrast, (arm, base) in CONTRASTS.items():
                if arm not in plan.arms or base not in plan.arms:
                    continue
                for k in plan.ks:
                    seeds = sorted(s for (a, kk, s) in dice if a == arm and kk == k and (base, k, s) in dice)
                    entry = paired_entry([dice[(arm, k, s)][model][held_out]["mean"] - dice[(base, k, s)][model][held_out]["mean"]
                                          for s in seeds], seed)  # fmt: skip
                    if entry is not None:
                        out.setdefault(held_out, {}).setdefault(model, {}).setdefault(contrast, {})[str(k)] = entry
    return out


def paired_entry(differences: list[float], seed: int) -> dict | None:
    """The paired differences without NaNs (a class absent everywhere), their mean, 95 % bootstrap interval and
    its half-width; None when no difference is left."""
    diffs = [d for d in differences if not math.isnan(d)]
    if not diffs:
        return None
    interval = bootstrap_interval(diffs, seed)
    half_width = None if interval is None else (interval[1] - interval[0]) / 2
    return {"mean": statistics.fmean(diffs), "ci95": interval, "n": len(diffs), "differences": diffs, "half_width": half_width}


def seeds_for_half_width(differences: list[float], target: float) -> int | None:
    """About how many seeds make the 95 % interval of the mean paired difference at most ``target`` wide on either
    side: ``(1.96 sd / target)^2`` rounded up (at least 2), with ``sd`` the sample sd of ``differences``; None for
    fewer than 2. A planning figure: the sd of a few differences is itself rough.

    Example: differences 0.00, 0.04, 0.08 (sd 0.04) need 7 seeds for +-0.03.
    """
    if len(differences) < 2:
        return None
    return max(2, math.ceil((1.96 * statistics.stdev(differences) / target) ** 2))


def table(runs: list[dict], plan: Plan) -> dict:
    """Per held-out set, model, arm and k: mean and sd over seeds of the held-out mean Dice."""
    out: dict = {}
    for held_out in HELD_OUT_SETS:
        for model in MODELS:
            for arm in plan.arms:
                for k in plan.ks:
                    values = [r["dice"][model][held_out]["mean"] for r in runs if r["arm"] == arm and r["k"] == k]
                    values = [v for v in values if not math.isnan(v)]
                    if values:
                        out.setdefault(held_out, {}).setdefault(model, {}).setdefault(arm, {})[str(k)] = {
                            "mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
                            "n": len(values)}  # fmt: skip
    return out


def needs_more_seeds(intervals: dict, plan: Plan) -> bool:
    """True while a paired interval at ``narrow_ks`` (any set, model, contrast) is unknown or wider than the target."""
    for per_model in intervals.values():
        for per_contrast in per_model.values():
            for per_k in per_contrast.values():
                for k in plan.narrow_ks:
                    entry = per_k.get(str(k))
                    if entry is not None and (entry["half_width"] is None or entry["half_width"] > plan.target_half_width):
                        return True
    return False


def convergence(runs: list[dict], plan: Plan) -> dict:
    """Per arm and k, the validation curve averaged over seeds, and the gain of its last quarter (mean of the
    validations in the last quarter of the budget minus the mean of those in the quarter before): near 0 once the
    arm has converged."""
    out: dict = {}
    for arm in plan.arms:
        for k in plan.ks:
            curves = [dict(r["validation_curve"]) for r in runs if r["arm"] == arm and r["k"] == k]
            if not curves:
                continue
            steps = sorted(set.intersection(*(set(c) for c in curves)))
            mean = [(s, statistics.fmean(c[s] for c in curves)) for s in steps]
            q = plan.finetune_iterations / 4
            last = [v for s, v in mean if s > 3 * q]
            before = [v for s, v in mean if 2 * q < s <= 3 * q]
            out.setdefault(arm, {})[str(k)] = {"mean_curve": mean, "last_quarter_gain":
                                               statistics.fmean(last) - statistics.fmean(before) if last and before else None}  # fmt: skip
    return out
