"""The low-data protocol's statistics: paired differences over seeds and their intervals (Student t from 5 pairs on,
the range below), the seed rule, the intervals' coverage simulated on committed pairs, the per-arm tables and the
validation curves behind the budget."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from low_data_protocol import HELD_OUT_SETS, MODELS

if TYPE_CHECKING:
    from low_data_protocol import Plan


T_MIN_PAIRS = 5  # from this many pairs on, a 95 % Student t-interval; below, the range [min, max] (no stated coverage)


def _t_two_sided(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with ``df`` (integer) degrees of freedom: the finite series of Abramowitz and
    Stegun 26.7.3 in theta = atan(t / sqrt(df))."""
    theta = math.atan(t / math.sqrt(df))
    sin, cos2 = math.sin(theta), math.cos(theta) ** 2
    series = 0.0
    if df % 2:  # odd: 2/pi (theta + sin (cos + 2/3 cos^3 + ... + 2.4...(df-3) / 1.3...(df-2) cos^(df-2)))
        term = math.cos(theta)
        for k in range((df - 1) // 2):
            series += term
            term *= cos2 * (2 * k + 2) / (2 * k + 3)
        return 2 / math.pi * (theta + sin * series)
    term = 1.0  # even: sin (1 + 1/2 cos^2 + 1.3/2.4 cos^4 + ... + 1.3...(df-3) / 2.4...(df-2) cos^(df-2))
    for k in range(df // 2):
        series += term
        term *= cos2 * (2 * k + 1) / (2 * k + 2)
    return sin * series


def t_quantile(level: float, df: int) -> float:
    """The t with P(|T| <= t) = ``level`` for ``df`` degrees of freedom, by bisection of :func:`_t_two_sided`
    (scipy is no runtime dependency). Example: ``t_quantile(0.95, 8)`` is 2.306."""
    if not 0.0 < level < 1.0 or df < 1:
        raise ValueError(f"level must be in (0, 1) and df at least 1, got {level} and {df}.")
    low, high = 0.0, 1.0
    while _t_two_sided(high, df) < level:
        low, high = high, 2 * high
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if _t_two_sided(mid, df) < level else (low, mid)
        if high - low <= 1e-13 * high:
            break
    return (low + high) / 2


def t_half_width(differences: list[float], level: float = 0.95) -> float:
    """Half the width of the Student t-interval of the mean: ``t(level, n - 1) * sd / sqrt(n)``."""
    n = len(differences)
    return t_quantile(level, n - 1) * statistics.stdev(differences) / math.sqrt(n)


def paired_entry(differences: list[float]) -> dict | None:
    """The paired differences without NaNs (a class absent everywhere) and their mean, with from :data:`T_MIN_PAIRS`
    pairs on the 95 % t-interval of the mean (``interval_kind`` "t95", ``half_width``), below it the range [min, max]
    ("range": no stated coverage, no half-width), for one pair none; None when no difference is left."""
    diffs = [d for d in differences if not math.isnan(d)]
    if not diffs:
        return None
    mean = statistics.fmean(diffs)
    entry = {"mean": mean, "n": len(diffs), "differences": diffs, "interval": None, "interval_kind": None, "half_width": None}
    if len(diffs) >= T_MIN_PAIRS:
        half = t_half_width(diffs)
        entry.update(interval=[mean - half, mean + half], interval_kind="t95", half_width=half)
    elif len(diffs) > 1:
        entry.update(interval=[min(diffs), max(diffs)], interval_kind="range")
    return entry


def paired(runs: list[dict], ks: tuple[int, ...], contrasts: dict[str, tuple[str, str]]) -> dict:
    """Per held-out set, model, contrast and k: :func:`paired_entry` of the differences over the seeds that both arms
    finished."""
    dice = {(r["arm"], r["k"], r["seed"]): r["dice"] for r in runs}
    out: dict = {}
    for held_out in HELD_OUT_SETS:
        for model in MODELS:
            for contrast, (arm, base) in contrasts.items():
                for k in ks:
                    seeds = sorted(s for (a, kk, s) in dice if a == arm and kk == k and (base, k, s) in dice)
                    entry = paired_entry([dice[(arm, k, s)][model][held_out]["mean"] - dice[(base, k, s)][model][held_out]["mean"]
                                          for s in seeds])  # fmt: skip
                    if entry is not None:
                        out.setdefault(held_out, {}).setdefault(model, {}).setdefault(contrast, {})[str(k)] = entry
    return out


def seeds_for_half_width(differences: list[float], target: float) -> int | None:
    """About how many seeds make the 95 % t-interval of the mean paired difference at most ``target`` wide on either
    side at the spread of ``differences``: the least n >= :data:`T_MIN_PAIRS` with ``t(0.95, n - 1) sd / sqrt(n) <=
    target``; None for fewer than 2. A planning figure: the sd of a few differences is itself rough.

    Example: differences 0.00, 0.04, 0.08 (sd 0.04) need 10 seeds for +-0.03.
    """
    if len(differences) < 2:
        return None
    sd = statistics.stdev(differences)
    n = T_MIN_PAIRS
    while t_quantile(0.95, n - 1) * sd / math.sqrt(n) > target:
        n += 1
    return n


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


def needs_more_seeds(intervals: dict, narrow_ks: tuple[int, ...], target: float) -> bool:
    """True while a paired entry at ``narrow_ks`` (any set, model, contrast) has no t-interval (fewer than
    :data:`T_MIN_PAIRS` pairs) or one wider than ``target`` on either side."""
    for per_model in intervals.values():
        for per_contrast in per_model.values():
            for per_k in per_contrast.values():
                for k in narrow_ks:
                    entry = per_k.get(str(k))
                    if entry is not None and (entry["half_width"] is None or entry["half_width"] > target):
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


COVERAGE_NS = (3, 5, 9)  # the seed counts of the old plan (3), the t-interval's threshold (5) and the new plan (9)
INTERVALS = ("bootstrap95", "t95", "range")  # the old protocol's, the new one's from 5 pairs, the new one's below


def populations(intervals: dict) -> list[list[float]]:
    """The differences of every entry of :func:`paired`'s output with at least :data:`T_MIN_PAIRS` pairs, in its
    order: the populations :func:`coverage` draws from."""
    return [entry["differences"] for per_model in intervals.values() for per_contrast in per_model.values()
            for per_k in per_contrast.values() for entry in per_k.values() if entry["n"] >= T_MIN_PAIRS]  # fmt: skip


def summary_populations(summary: dict, records: Path) -> list[list[float]]:
    """:func:`populations` of a summary's contrasts (its ``paired`` names, "arm - base", in its order), recomputed from
    its runs' records in the folder ``records``.

    Raises:
        ValueError: for a record whose Dice differs from the summary's copy of it.
    """
    runs = []
    for run in summary["runs"]:
        record = json.loads((records / f"{run['arm']}_k{run['k']}_seed{run['seed']}_{run['key']}.json").read_text())
        if record["dice"] != run["dice"]:
            raise ValueError(f"the record of {run['arm']} k={run['k']} seed={run['seed']} differs from the summary's copy.")
        runs.append(record)
    names = next(iter(next(iter(summary["paired"].values())).values()))
    contrasts = {name: tuple(name.split(" - ")) for name in names}
    return populations(paired(runs, tuple(summary["settings"]["ks"]), contrasts))


def bootstrap_bounds(samples: np.ndarray, resamples: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``samples`` (rows x n), the old protocol's 95 % percentile bootstrap interval of the mean:
    ``resamples`` means of n values drawn from the row with replacement, their 2.5th and 97.5th percentiles;
    vectorised over rows in chunks. With n = 3 every mean's lowest value, all three draws the minimum, has
    probability 1/27 > 2.5 %: the interval is exactly [min, max]."""
    lows, highs = [], []
    for start in range(0, len(samples), 250):
        chunk = samples[start : start + 250]
        picks = rng.integers(0, chunk.shape[1], size=(len(chunk), resamples, chunk.shape[1]))
        means = chunk[np.arange(len(chunk))[:, None, None], picks].mean(axis=2)
        low, high = np.percentile(means, [2.5, 97.5], axis=1)
        lows.append(low)
        highs.append(high)
    return np.concatenate(lows), np.concatenate(highs)


def coverage(
    populations: list[list[float]], ns: tuple[int, ...] = COVERAGE_NS, draws: int = 2000, resamples: int = 1000, seed: int = 0,
) -> dict:
    """How often each interval covers the mean of the population it is drawn from: each population (a contrast's
    paired differences) stands for the distribution of a difference; ``draws`` times, n values are drawn from it with
    replacement and the old protocol's percentile bootstrap (``resamples`` resamples), the t-interval and the range
    are computed on them. Returns per n and interval the mean, lowest and highest share of draws covered over the
    populations (no n without a population: a plan of fewer than :data:`T_MIN_PAIRS` seeds), with the settings.
    Covered means within the interval up to float rounding (1e-12 of the largest value): a constant population is
    always covered.

    Example: for the population -1, 0, 1 the range of 3 draws misses 0 only when all three are 1 or all are -1,
    2 / 27 of the time.
    """
    rng = np.random.default_rng(seed)
    out: dict = {"populations": len(populations), "population_sizes": sorted({len(p) for p in populations}),
                 "draws": draws, "bootstrap_resamples": resamples, "seed": seed, "by_n": {}}  # fmt: skip
    for n in ns if populations else ():
        shares: dict[str, list[float]] = {kind: [] for kind in INTERVALS}
        t_factor = t_quantile(0.95, n - 1) / math.sqrt(n)
        for population in populations:
            values = np.asarray(population, dtype=np.float64)
            mean, slack = values.mean(), 1e-12 * max(1.0, float(np.abs(values).max()))
            samples = values[rng.integers(0, len(values), size=(draws, n))]
            centre, half = samples.mean(axis=1), t_factor * samples.std(axis=1, ddof=1)
            low, high = bootstrap_bounds(samples, resamples, rng)
            for kind, (lo, hi) in (("bootstrap95", (low, high)), ("t95", (centre - half, centre + half)),
                                   ("range", (samples.min(axis=1), samples.max(axis=1)))):  # fmt: skip
                shares[kind].append(float(np.mean((lo - slack <= mean) & (mean <= hi + slack))))
        out["by_n"][str(n)] = {kind: {"mean": statistics.fmean(v), "min": min(v), "max": max(v)} for kind, v in shares.items()}
    return out
