"""Protocol v3's statistics: the contrast of a recipe as the mean over finetuning seeds per pretraining, then a
Student t-interval over pretrainings; the verdict against the equivalence margin; the secondary cells with a
Bonferroni correction; the finetuning's convergence rule; and the intervals' coverage simulated on the plan's own
structure.

A run record (``low_data_runs.run_finetuning``) carries ``arm``, ``k``, ``seed`` (the finetuning seed),
``pretraining_seed`` (None for ``scratch`` and ``probe_random``), ``dice[model][held-out set]["mean"]`` and
``validation_curve``. A contrast pairs each run of an arm with the baseline run of the same finetuning seed and k
(the same training, validation and held-out volumes).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np

from low_data_plan import MATCHED, PROBE_RANDOM, SCRATCH, Plan
from low_data_protocol import HELD_OUT_SETS, MODELS
from low_data_stats import t_quantile

VERDICTS = ("equivalent", "better", "worse", "inconclusive")
CORRECTION = "Bonferroni"


def verdict(interval: Sequence[float], margin: float) -> str:
    """The verdict of an interval [low, high] of a gain over the baseline, in this order: ``equivalent`` when it lies
    inside [-margin, +margin] (bounds included), ``better`` when low > 0, ``worse`` when high < 0, else
    ``inconclusive``."""
    low, high = interval
    if -margin <= low and high <= margin:
        return "equivalent"
    if low > 0:
        return "better"
    if high < 0:
        return "worse"
    return "inconclusive"


def t_interval(values: Sequence[float], level: float) -> dict:
    """The mean of ``values`` (None without any) and its Student t-interval at ``level`` (n - 1 degrees of freedom);
    no interval for fewer than 2 values."""
    n = len(values)
    mean = statistics.fmean(values) if n else None
    entry = {"mean": mean, "n": n, "df": n - 1 if n > 1 else None, "level": level, "interval": None, "half_width": None}
    if n > 1:
        half = t_quantile(level, n - 1) * statistics.stdev(values) / math.sqrt(n)
        entry.update(interval=[mean - half, mean + half], half_width=half)
    return entry


def _dice(runs: list[dict]) -> dict[tuple, dict]:
    return {(r["arm"], r.get("pretraining_seed"), r["k"], r["seed"]): r["dice"] for r in runs}


def unit_matrix(
    runs: list[dict], arm: str, baseline: str, pretrainings: Sequence[int], seeds: Sequence[int], ks: Sequence[int],
    sets: Sequence[str] = HELD_OUT_SETS, model: str = "selected",
) -> np.ndarray:
    """The (pretraining x finetuning seed) matrix of ``arm - baseline`` Dice differences, each entry the mean over
    ``ks`` and ``sets`` of that pair; NaN where a run of the pair is missing."""
    dice = _dice(runs)
    out = np.full((len(pretrainings), len(seeds)), np.nan)
    for i, p in enumerate(pretrainings):
        for j, f in enumerate(seeds):
            diffs = []
            for k in ks:
                run, base = dice.get((arm, p, k, f)), dice.get((baseline, None, k, f))
                if run is None or base is None:
                    diffs = []
                    break
                diffs += [run[model][s]["mean"] - base[model][s]["mean"] for s in sets]
            if diffs:
                out[i, j] = statistics.fmean(diffs)
    return out


def contrast(matrix: np.ndarray, pretrainings: Sequence[int], level: float, margin: float) -> dict:
    """The contrast of a :func:`unit_matrix`: per pretraining the mean over its finetuning seeds (``g_p``), then
    :func:`t_interval` over the pretrainings with all their seeds present, and its :func:`verdict` (None without an
    interval)."""
    complete = [i for i in range(len(pretrainings)) if matrix.shape[1] and not np.isnan(matrix[i]).any()]
    per = {str(pretrainings[i]): float(matrix[i].mean()) for i in complete}
    entry = t_interval(list(per.values()), level)
    entry.update(per_pretraining=per, verdict=verdict(entry["interval"], margin) if entry["interval"] else None)
    return entry


def welch(first: Sequence[float], second: Sequence[float], level: float, margin: float) -> dict:
    """mean(first) - mean(second) of two independent samples of pretraining means (None when one is empty) with
    Welch's t-interval (the Welch-Satterthwaite degrees of freedom, rounded down: conservative) from 2 values each,
    and its :func:`verdict`."""
    n1, n2 = len(first), len(second)
    mean = (statistics.fmean(first) - statistics.fmean(second)) if n1 and n2 else None
    entry = {"mean": mean, "n": [n1, n2], "df": None, "level": level, "interval": None, "half_width": None, "verdict": None}
    if n1 > 1 and n2 > 1:
        v1, v2 = statistics.variance(first) / n1, statistics.variance(second) / n2
        se = math.sqrt(v1 + v2)
        df = (v1 + v2) ** 2 / (v1**2 / (n1 - 1) + v2**2 / (n2 - 1)) if se > 0 else float(n1 + n2 - 2)
        half = t_quantile(level, max(1, math.floor(df))) * se
        entry.update(df=max(1, math.floor(df)), interval=[mean - half, mean + half], half_width=half)
        entry["verdict"] = verdict(entry["interval"], margin)
    return entry


def quarter_gain(values: Sequence[float]) -> float | None:
    """Mean of the last quarter of a validation curve's values minus the mean of the quarter before (a quarter is
    ``len // 4`` validations); None below 4 validations."""
    q = len(values) // 4
    if q < 1:
        return None
    return statistics.fmean(values[-q:]) - statistics.fmean(values[-2 * q : -q])


def convergence(runs: list[dict], arm: str, ks: Sequence[int], threshold: float) -> dict:
    """Per k, the arm's validation curve averaged over its runs (the steps all of them validated at), its
    :func:`quarter_gain` and whether that is below ``threshold`` (``converged``; None without a curve)."""
    out = {}
    for k in ks:
        curves = [dict((int(s), v) for s, v in r["validation_curve"]) for r in runs if r["arm"] == arm and r["k"] == k]
        if not curves:
            out[str(k)] = {"mean_curve": [], "last_quarter_gain": None, "converged": None, "runs": 0}
            continue
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        mean = [[s, statistics.fmean(c[s] for c in curves)] for s in steps]
        gain = quarter_gain([v for _, v in mean])
        out[str(k)] = {"mean_curve": mean, "last_quarter_gain": gain, "converged": None if gain is None else gain < threshold,
                       "runs": len(curves)}  # fmt: skip
    return out


def not_converged(table: dict) -> str | None:
    """"budget not converged at k=1,2" for the ks of a :func:`convergence` table that did not converge (or have no
    curve yet), None when every k converged."""
    ks = [k for k, entry in table.items() if not entry["converged"]]
    return f"budget not converged at k={','.join(ks)}" if ks else None


def secondary_cells(recipe: str, plan: Plan) -> list[tuple[str, str, str, tuple[int, ...], tuple[str, ...], str]]:
    """A recipe's secondary cells besides a matched recipe's comparison with its demo recipe: (name, arm, baseline,
    ks, held-out sets, model) of ``recipe - scratch`` per k, set and model, ``probe_<recipe> - probe_random`` pooled
    as the primary (the representation test), and the probe per k, set and model."""
    probe = f"probe_{recipe}"
    cells = [(f"{arm} - {base}, k={k}, {s}, {model}", arm, base, (k,), (s,), model)
             for arm, base in ((recipe, SCRATCH), (probe, PROBE_RANDOM)) for k in plan.ks for s in HELD_OUT_SETS for model in MODELS]  # fmt: skip
    cells.insert(len(cells) // 2, (f"{probe} - {PROBE_RANDOM}, pooled, selected", probe, PROBE_RANDOM, tuple(plan.ks), HELD_OUT_SETS, "selected"))
    return cells


def bonferroni_level(plan: Plan, recipe: str) -> tuple[int, float]:
    """(m, 1 - (1 - level) / m): the number of a recipe's secondary cells and the level of each of their intervals."""
    m = len(secondary_cells(recipe, plan)) + (1 if recipe in MATCHED else 0)
    return m, 1 - (1 - plan.level) / m


def family(runs: list[dict], recipe: str, passing: dict[str, list[int]], plan: Plan, seeds: Sequence[int]) -> dict:
    """A recipe's primary contrast and its secondary cells.

    Primary: ``recipe - scratch``, selected models, pooled over the plan's ks and both held-out sets, at ``plan.level``.
    Secondary, each at the Bonferroni level of :func:`bonferroni_level`: the cells of :func:`secondary_cells` and, for
    a matched recipe, its pooled gain against its demo recipe's (:func:`welch` on both recipes' pretraining means
    against scratch, whose shared scratch runs cancel). ``passing``: per recipe the seeds of the pretrainings that
    passed the gate.
    """
    own = passing.get(recipe, [])
    matrix = unit_matrix(runs, recipe, SCRATCH, own, seeds, plan.ks)
    primary = {"contrast": f"{recipe} - {SCRATCH}", "model": "selected", "ks": list(plan.ks), "sets": list(HELD_OUT_SETS),
               **contrast(matrix, own, plan.level, plan.margin)}  # fmt: skip
    m, level = bonferroni_level(plan, recipe)
    secondary = {name: {"kind": "probe" if arm.startswith("probe_") else "finetune",
                        **contrast(unit_matrix(runs, arm, base, own, seeds, ks, sets, model), own, level, plan.margin)}
                 for name, arm, base, ks, sets, model in secondary_cells(recipe, plan)}  # fmt: skip
    other = MATCHED.get(recipe)
    if other:
        theirs = passing.get(other, [])
        mine = contrast(matrix, own, level, plan.margin)["per_pretraining"]
        base = contrast(unit_matrix(runs, other, SCRATCH, theirs, seeds, plan.ks), theirs, level, plan.margin)["per_pretraining"]
        secondary[f"{recipe} - {other}, pooled, selected"] = {"kind": "finetune",
                                                                **welch(list(mine.values()), list(base.values()), level, plan.margin)}  # fmt: skip
    return {"primary": primary, "secondary": {"correction": CORRECTION, "m": m, "level": level, "cells": secondary}}


def coverage_by_kind(runs: list[dict], passing: dict[str, list[int]], plan: Plan, seeds: Sequence[int], draws: int = 2000) -> dict:
    """:func:`crossed_coverage` of the primary contrasts (one population per recipe with at least 2 passing
    pretrainings, at ``plan.level``) and of the secondary cells of :func:`secondary_cells` (each at its recipe's
    Bonferroni level); a matched recipe's Welch comparison is not simulated."""
    primary, secondary = [], []
    for recipe in plan.recipes:
        own = passing.get(recipe, [])
        primary.append((unit_matrix(runs, recipe, SCRATCH, own, seeds, plan.ks), plan.level))
        level = bonferroni_level(plan, recipe)[1]
        secondary += [(unit_matrix(runs, arm, base, own, seeds, ks, sets, model), level)
                      for _, arm, base, ks, sets, model in secondary_cells(recipe, plan)]  # fmt: skip
    return {"primary": crossed_coverage(primary, draws=draws), f"secondary ({CORRECTION})": crossed_coverage(secondary, draws=draws)}


def crossed_coverage(populations: list[tuple[np.ndarray, float]], draws: int = 2000, seed: int = 0) -> dict | None:
    """How often the interval of :func:`contrast` covers the mean of the population it is drawn from, on the plan's own
    structure: each complete (pretraining x finetuning seed) matrix of ``populations`` (with the level of its
    interval) is a population; ``draws`` times its rows (pretrainings) and, independently, its columns (finetuning
    seeds, which every pretraining shares) are resampled with replacement, the pretraining means of the drawn matrix
    get the t-interval at the level, and it covers or not the population's mean (up to float rounding). Returns the mean, lowest and highest share over the
    populations, or None without a population of at least 2 pretrainings.

    Example: a matrix of equal values is always covered.
    """
    rng = np.random.default_rng(seed)
    shares, levels = [], []
    for matrix, level in populations:
        if matrix.shape[0] < 2 or np.isnan(matrix).any():
            continue
        p, f = matrix.shape
        target, slack = matrix.mean(), 1e-12 * max(1.0, float(np.abs(matrix).max()))
        rows, cols = rng.integers(0, p, size=(draws, p)), rng.integers(0, f, size=(draws, f))
        means = matrix[rows[:, :, None], cols[:, None, :]].mean(axis=2)  # draws x p
        centre, half = means.mean(axis=1), t_quantile(level, p - 1) * means.std(axis=1, ddof=1) / math.sqrt(p)
        shares.append(float(np.mean((centre - half - slack <= target) & (target <= centre + half + slack))))
        levels.append(level)
    if not shares:
        return None
    return {"mean": statistics.fmean(shares), "min": min(shares), "max": max(shares), "populations": len(shares),
            "nominal": sorted(set(levels)), "draws": draws, "seed": seed,
            "resampled": "pretrainings (rows) and finetuning seeds (columns) with replacement, crossed"}  # fmt: skip
