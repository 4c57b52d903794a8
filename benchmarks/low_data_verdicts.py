"""Protocol v3's statistics: the contrast of a recipe as the mean over its finetuning seeds per pretraining (each
pretraining has its own block of seeds, ``low_data_plan.finetune_block``), then a Student t-interval over
pretrainings; the verdict against the equivalence margin; the secondary cells with a Bonferroni correction; the
finetuning's convergence rule; and the intervals' coverage simulated on the plan's own structure.

A run record (``low_data_runs.run_finetuning``) carries ``arm``, ``k``, ``seed`` (the finetuning seed),
``pretraining_seed`` (None for ``scratch`` and ``probe_random``), ``dice[model][held-out set]["mean"]`` and
``validation_curve``. A contrast pairs each run of an arm with the baseline run of the same finetuning seed and k
(the same training, validation and held-out volumes): pretraining p's runs pair with the baselines of its block.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np

from low_data_plan import MATCHED, PROBE_RANDOM, SCRATCH, Plan, finetune_block
from low_data_protocol import HELD_OUT_SETS
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


def detectable_gain(pretrainings: int, sd: float, level: float, power: float = 0.8) -> float:
    """The true mean gain that the primary interval (level ``level``, over ``pretrainings`` pretraining means of
    standard deviation ``sd``) puts above 0 with probability about ``power``: ``(t_(1+level)/2 + t_power) sd / sqrt(P)``,
    P - 1 degrees of freedom (the usual approximation of the noncentral t). Stated before the runs: what the plan can
    detect."""
    df = pretrainings - 1
    return (t_quantile(level, df) + t_quantile(2 * power - 1, df)) * sd / math.sqrt(pretrainings)


def equivalence_sd(pretrainings: int, level: float, margin: float) -> float:
    """The standard deviation of the pretraining means below which an interval around a zero gain lies inside
    [-margin, +margin] (its half-width ``t sd / sqrt(P)`` below the margin): above it, "equivalent" cannot be reached."""
    return margin * math.sqrt(pretrainings) / t_quantile(level, pretrainings - 1)


def _dice(runs: list[dict]) -> dict[tuple, dict]:
    return {(r["arm"], r.get("pretraining_seed"), r["k"], r["seed"]): r["dice"] for r in runs}


def unit_matrix(
    runs: list[dict], arm: str, baseline: str, pretrainings: Sequence[int], plan: Plan, ks: Sequence[int],
    sets: Sequence[str] = HELD_OUT_SETS, model: str = "selected",
) -> np.ndarray:
    """The (pretraining x finetuning seed of its block) matrix of ``arm - baseline`` Dice differences, each entry the
    mean over ``ks`` and ``sets`` of that pair; NaN where a run of the pair is missing."""
    dice = _dice(runs)
    out = np.full((len(pretrainings), plan.finetune_seeds), np.nan)
    for i, p in enumerate(pretrainings):
        for j, f in enumerate(finetune_block(p, plan)):
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


def paired(first: dict[str, float], second: dict[str, float], level: float, margin: float) -> dict:
    """``first - second`` of two recipes' pretraining means (:func:`contrast`'s ``per_pretraining``) paired by
    pretraining seed, that is by block (same finetuning seeds, volumes and draws, same baselines, which cancel): the
    :func:`t_interval` of the differences over the seeds both passed, and its :func:`verdict`."""
    common = sorted(set(first) & set(second), key=int)
    entry = t_interval([first[p] - second[p] for p in common], level)
    entry.update(blocks=[int(p) for p in common], verdict=verdict(entry["interval"], margin) if entry["interval"] else None)
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
    ks, held-out sets, model) of ``recipe - scratch`` per k and set, ``probe_<recipe> - probe_random`` pooled as the
    primary (the representation test), and the probe per k and set; selected models only (the last models' Dice is
    in the records: cells of them would widen every secondary interval by the correction and answer no question of
    the protocol)."""
    probe = f"probe_{recipe}"
    cells = [(f"{arm} - {base}, k={k}, {s}, selected", arm, base, (k,), (s,), "selected")
             for arm, base in ((recipe, SCRATCH), (probe, PROBE_RANDOM)) for k in plan.ks for s in HELD_OUT_SETS]  # fmt: skip
    cells.insert(len(cells) // 2, (f"{probe} - {PROBE_RANDOM}, pooled, selected", probe, PROBE_RANDOM, tuple(plan.ks), HELD_OUT_SETS, "selected"))
    return cells


def bonferroni_level(plan: Plan, recipe: str) -> tuple[int, float]:
    """(m, 1 - (1 - level) / m): the number of a recipe's secondary cells and the level of each of their intervals."""
    m = len(secondary_cells(recipe, plan)) + (1 if recipe in MATCHED else 0)
    return m, 1 - (1 - plan.level) / m


def family(runs: list[dict], recipe: str, passing: dict[str, list[int]], plan: Plan) -> dict:
    """A recipe's primary contrast and its secondary cells.

    Primary: ``recipe - scratch``, selected models, pooled over the plan's ks and both held-out sets, at ``plan.level``.
    Secondary, each at the Bonferroni level of :func:`bonferroni_level`: the cells of :func:`secondary_cells` and, for
    a matched recipe, its pooled gain against its demo recipe's (:func:`paired` on both recipes' pretraining means
    against scratch, by block). ``passing``: per recipe the seeds of the pretrainings that
    passed the gate.
    """
    own = passing.get(recipe, [])
    matrix = unit_matrix(runs, recipe, SCRATCH, own, plan, plan.ks)
    primary = {"contrast": f"{recipe} - {SCRATCH}", "model": "selected", "ks": list(plan.ks), "sets": list(HELD_OUT_SETS),
               **contrast(matrix, own, plan.level, plan.margin)}  # fmt: skip
    m, level = bonferroni_level(plan, recipe)
    secondary = {name: {"kind": "probe" if arm.startswith("probe_") else "finetune",
                        **contrast(unit_matrix(runs, arm, base, own, plan, ks, sets, model), own, level, plan.margin)}
                 for name, arm, base, ks, sets, model in secondary_cells(recipe, plan)}  # fmt: skip
    other = MATCHED.get(recipe)
    if other:
        theirs = passing.get(other, [])
        mine = contrast(matrix, own, level, plan.margin)["per_pretraining"]
        base = contrast(unit_matrix(runs, other, SCRATCH, theirs, plan, plan.ks), theirs, level, plan.margin)["per_pretraining"]
        secondary[f"{recipe} - {other}, pooled, selected"] = {"kind": "finetune",
                                                                **paired(mine, base, level, plan.margin)}  # fmt: skip
    return {"primary": primary, "secondary": {"correction": CORRECTION, "m": m, "level": level, "cells": secondary}}


def coverage_by_kind(runs: list[dict], passing: dict[str, list[int]], plan: Plan, draws: int = 2000) -> dict:
    """:func:`simulated_coverage` of the primary contrasts (one population per recipe with at least 2 passing
    pretrainings, at ``plan.level``) and of the secondary cells (each at its recipe's Bonferroni level: those of
    :func:`secondary_cells` and a matched recipe's paired comparison with its demo recipe)."""
    primary, secondary = [], []
    for recipe in plan.recipes:
        own = passing.get(recipe, [])
        matrix = unit_matrix(runs, recipe, SCRATCH, own, plan, plan.ks)
        primary.append((matrix, plan.level))
        level = bonferroni_level(plan, recipe)[1]
        secondary += [(unit_matrix(runs, arm, base, own, plan, ks, sets, model), level)
                      for _, arm, base, ks, sets, model in secondary_cells(recipe, plan)]  # fmt: skip
        other = MATCHED.get(recipe)
        common = [p for p in own if p in passing.get(other, [])]
        if other and common:
            theirs = unit_matrix(runs, other, SCRATCH, common, plan, plan.ks)
            secondary.append((unit_matrix(runs, recipe, SCRATCH, common, plan, plan.ks) - theirs, level))
    return {"primary": simulated_coverage(primary, draws=draws), f"secondary ({CORRECTION})": simulated_coverage(secondary, draws=draws)}


def _covered(means: np.ndarray, target: float, level: float, slack: float) -> float:
    """The share of rows of ``means`` (draws x pretrainings) whose t-interval at ``level`` covers ``target``."""
    p = means.shape[1]
    centre, half = means.mean(axis=1), t_quantile(level, p - 1) * means.std(axis=1, ddof=1) / math.sqrt(p)
    return float(np.mean((centre - half - slack <= target) & (target <= centre + half + slack)))


def simulated_coverage(populations: list[tuple[np.ndarray, float]], draws: int = 2000, seed: int = 0) -> dict | None:
    """How often the interval of :func:`contrast` covers the true mean on the plan's own structure, from each
    complete (pretraining x finetuning seed of its block) matrix of ``populations`` (with its interval's level).

    Each matrix is fitted as ``mu + a_p + e_pf`` (one-way random effects, moments: the within variance pooled over
    rows, the between-pretraining variance ``max(0, var(row means) - within / F)``), then ``draws`` matrices of the same
    shape are simulated twice: ``normal`` draws ``a_p`` and ``e_pf`` from normal laws of the fitted variances;
    ``resampled`` draws ``a_p`` alike and ``e_pf`` with replacement from the pooled residuals (rescaled by
    ``sqrt(F / (F - 1))``), which keeps the finetuning's own tails and skew (the P row effects are too few to resample).
    Under normality the pretraining means are independent normal draws and the coverage is the nominal level up to the
    simulation's error; ``resampled`` checks that the finetuning's shape does not break it. Returns per simulation the
    mean, lowest and highest share over the populations, or None without a population of at least 2 pretrainings.

    Example: a matrix of equal values is always covered.
    """
    rng = np.random.default_rng(seed)
    shares: dict[str, list[float]] = {"normal": [], "resampled": []}
    levels = []
    for matrix, level in populations:
        if matrix.shape[0] < 2 or np.isnan(matrix).any():
            continue
        p, f = matrix.shape
        rows = matrix.mean(axis=1)
        residuals = (matrix - rows[:, None]).ravel() * (math.sqrt(f / (f - 1)) if f > 1 else 0.0)
        within = float(residuals.var()) if f > 1 else 0.0
        between = max(0.0, float(rows.var(ddof=1)) - within / f)
        slack = 1e-12 * max(1.0, float(np.abs(matrix).max()))
        effects = rng.normal(0, math.sqrt(between), (2, draws, p))
        normal = effects[0] + rng.normal(0, math.sqrt(within), (draws, p, f)).mean(axis=2)
        resampled = effects[1] + rng.choice(residuals, (draws, p, f)).mean(axis=2)
        shares["normal"].append(_covered(normal, 0.0, level, slack))
        shares["resampled"].append(_covered(resampled, 0.0, level, slack))
        levels.append(level)
    if not levels:
        return None
    summary = {name: {"mean": statistics.fmean(v), "min": min(v), "max": max(v)} for name, v in shares.items()}
    return {**summary, "populations": len(levels), "nominal": sorted(set(levels)), "draws": draws, "seed": seed,
            "model": "one-way random effects (pretraining, finetuning seed within it), fitted by moments"}  # fmt: skip
