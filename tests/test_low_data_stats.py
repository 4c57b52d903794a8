"""The low-data protocol's statistics (benchmarks/low_data_stats.py): Student t-intervals of the mean paired
difference from 5 pairs on, the range [min, max] below (never called 95 %), and the seed rule built on them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import low_data_docs as docs  # noqa: E402
import low_data_stats as stats  # noqa: E402


def test_the_t_quantile_is_scipys_to_ten_digits():
    scipy_stats = pytest.importorskip("scipy.stats", reason="scipy (a test extra) gives the reference quantiles")
    for df in [*range(1, 41), 60, 120, 500]:
        for level in (0.5, 0.9, 0.95, 0.99):
            assert stats.t_quantile(level, df) == pytest.approx(scipy_stats.t.ppf(0.5 + level / 2, df), rel=1e-10), (df, level)
    assert round(stats.t_quantile(0.95, 8), 3) == 2.306 and round(stats.t_quantile(0.95, 4), 3) == 2.776


def test_from_five_pairs_the_interval_is_the_t_interval_of_the_mean():
    differences = [0.01, 0.02, 0.03, 0.04, 0.05]
    entry = stats.paired_entry(differences)
    half = 2.7764451051977987 * np.std(differences, ddof=1) / np.sqrt(5)  # t(0.975, 4) * sd / sqrt(n)
    assert entry["interval_kind"] == "t95" and entry["n"] == 5 and entry["mean"] == pytest.approx(0.03)
    assert entry["interval"] == pytest.approx([0.03 - half, 0.03 + half]) and entry["half_width"] == pytest.approx(half)
    nine = stats.paired_entry([-0.15, -0.04, -0.001, 0.004, 0.057, 0.076, 0.132, 0.145, 0.188])
    assert nine["interval"] == pytest.approx([-0.0350279, 0.1263613], abs=1e-7)  # scipy.stats.t.interval(0.95, 8, ...)


def test_below_five_pairs_the_interval_is_the_range_and_one_pair_has_none():
    three = stats.paired_entry([0.08, 0.0, 0.04, float("nan")])  # a NaN (a class absent everywhere) is left out
    assert three["interval_kind"] == "range" and three["interval"] == [0.0, 0.08] and three["n"] == 3
    assert three["half_width"] is None  # a range is no interval of stated coverage: the seed rule never stops on it
    one = stats.paired_entry([0.1])
    assert one["interval"] is None and one["interval_kind"] is None
    assert stats.paired_entry([float("nan")]) is None


def test_the_seed_rule_asks_for_a_t_interval_within_the_target():
    assert stats.seeds_for_half_width([0.0, 0.04, 0.08], 0.03) == 10  # t(9) 0.04 / sqrt(10) = 0.0286 <= 0.03 < n = 9's
    assert stats.seeds_for_half_width([0.05, 0.05], 0.03) == stats.T_MIN_PAIRS
    assert stats.seeds_for_half_width([0.1], 0.03) is None
    narrow_range = {"in_domain": {"selected": {"ssl - scratch": {"1": stats.paired_entry([0.05, 0.051, 0.052])}}}}
    assert stats.needs_more_seeds(narrow_range, narrow_ks=(1,), target=0.03)  # 3 pairs: a range, however narrow
    wide = {"in_domain": {"selected": {"ssl - scratch": {"1": stats.paired_entry([0.0, 0.2, -0.2, 0.1, -0.1])}}}}
    narrow = {"in_domain": {"selected": {"ssl - scratch": {"1": stats.paired_entry([0.05, 0.051, 0.052, 0.05, 0.051])}}}}
    assert stats.needs_more_seeds(wide, (1,), 0.03) and not stats.needs_more_seeds(narrow, (1,), 0.03)


def test_the_tables_call_a_t_interval_95_and_a_range_a_range():
    nine = stats.paired_entry([0.0, 0.04, 0.08, 0.02, 0.06, 0.01, 0.03, 0.05, 0.07])
    result = {"settings": {"ks": [1, 2, 4], "target_half_width": 0.03}, "table": {},
              "paired": {"in_domain": {m: {"ssl - scratch": {"1": nine, "2": stats.paired_entry([0.0, 0.04, 0.08]),
                                                             "4": stats.paired_entry([0.1])}} for m in ("selected", "last")}}}
    text = docs.markdown_tables(result)
    row = next(line for line in text.splitlines() if line.startswith("| ssl - scratch"))
    low, high = nine["interval"]
    assert row == (f"| ssl - scratch | +0.040 [{low:+.3f}, {high:+.3f}] (9; ~{stats.seeds_for_half_width(nine['differences'], 0.03)}) "
                   "| +0.040 range [+0.000, +0.080] (3; ~10) | +0.100 (n = 1: no interval) |")
    headers = [line for line in text.splitlines() if line.startswith("Paired differences")]
    assert headers and all("95 % t-interval from 5 pairs, the range [min, max] below" in h for h in headers)
    assert "bootstrap" not in text


def test_coverage_counts_how_often_each_interval_covers_the_population_mean():
    """Population -1, 0, 1: a range of n draws misses the mean 0 only when all n are 1 or all are -1 (2 / 3^n); a
    population of one repeated value is always covered by all three intervals."""
    result = stats.coverage([[-1.0, 0.0, 1.0], [0.2] * 9], ns=(3, 5), draws=4000, resamples=200, seed=1)
    assert result["populations"] == 2 and result["draws"] == 4000 and result["bootstrap_resamples"] == 200
    for n in (3, 5):
        ranges = result["by_n"][str(n)]["range"]
        assert ranges["min"] == pytest.approx(1 - 2 / 3**n, abs=0.015) and ranges["mean"] == pytest.approx(1 - 1 / 3**n, abs=0.01)
        assert all(result["by_n"][str(n)][kind]["max"] == 1.0 for kind in ("bootstrap95", "t95", "range"))
    assert stats.coverage([])["by_n"] == {}  # a plan of fewer than 5 seeds: no population to draw from
    assert stats.coverage([[-1.0, 0.0, 1.0]], ns=(3,), draws=4000, resamples=200, seed=1) == stats.coverage(
        [[-1.0, 0.0, 1.0]], ns=(3,), draws=4000, resamples=200, seed=1)  # seeded: reproducible


def test_the_committed_coverage_is_recomputed_from_the_records():
    """benchmarks/results/low_data_cpu_9seeds.json's ``coverage``: each of its 32 contrasts' 9 differences (recomputed
    from the records in benchmarks/results/low_data_cpu/) as a population. The old protocol's percentile bootstrap
    covers the mean far less often than 95 % at 3 and 5 pairs, the t-interval comes closer at every n."""
    summary = json.loads((REPO / "benchmarks/results/low_data_cpu_9seeds.json").read_text())
    stored = summary["coverage"]
    populations = stats.summary_populations(summary, REPO / "benchmarks/results/low_data_cpu")
    assert len(populations) == 32 and {len(p) for p in populations} == {9}
    again = stats.coverage(populations, ns=tuple(int(n) for n in stored["by_n"]), draws=stored["draws"],
                           resamples=stored["bootstrap_resamples"], seed=stored["seed"])  # fmt: skip
    for n, per_kind in stored["by_n"].items():
        for kind, figures in per_kind.items():
            assert again["by_n"][n][kind] == pytest.approx(figures, abs=1e-3), (n, kind)
    by_n = stored["by_n"]
    assert by_n["3"]["bootstrap95"]["mean"] < 0.75 and by_n["5"]["bootstrap95"]["mean"] < 0.85
    assert by_n["9"]["bootstrap95"]["mean"] < 0.9 < by_n["9"]["t95"]["mean"]
    assert all(by_n[n]["t95"]["mean"] > by_n[n]["bootstrap95"]["mean"] + 0.03 for n in ("3", "5", "9"))


def test_the_old_protocols_bootstrap_at_three_pairs_is_the_range():
    """The review's finding, by construction: all three resampled values are the minimum with probability 1/27, more
    than the 2.5 % the lower bound cuts, so the percentile interval of 3 pairs is [min, max]; at 9 pairs it is inside."""
    samples = np.array([[0.0, 0.04, 0.08], [0.3, 0.1, 0.2]])
    low, high = stats.bootstrap_bounds(samples, 10_000, np.random.default_rng(0))
    assert low == pytest.approx([0.0, 0.1], abs=1e-15) and high == pytest.approx([0.08, 0.3], abs=1e-15)
    nine = np.array([[0.0, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08]])
    low, high = stats.bootstrap_bounds(nine, 10_000, np.random.default_rng(0))
    assert 0.0 < low[0] < 0.04 < high[0] < 0.08
