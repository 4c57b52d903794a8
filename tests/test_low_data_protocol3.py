"""Protocol v3 of the low-data benchmark (benchmarks/low_data_plan.py, low_data_verdicts.py, low_data_schedule.py):
the data draws per finetuning seed, the health gate and the seeds it schedules, the primary contrast over
pretrainings and its verdict, the Bonferroni-corrected secondary cells, the convergence rule, and the pilot.

The bundle runs are replaced by stand-ins that return records of known Dice and health verdicts.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import low_data_plan as plan_module  # noqa: E402
import low_data_protocol as protocol  # noqa: E402
import low_data_schedule as schedule  # noqa: E402
import low_data_verdicts as verdicts  # noqa: E402

CPU = plan_module.PLANS["cpu"]
PLAN = replace(CPU, finetune_iterations=48, val_every=4)  # a fixed budget: 12 validations
T_975_DF2 = 4.302652729911275  # scipy.stats.t.ppf(0.975, 2)


def _fake_data(root: Path, plan: plan_module.Plan) -> protocol.Data:
    """The synthetic splits' shape without volumes: training pool, validation, in-domain and shifted pools."""
    def items(folder: str, n: int) -> list[dict]:
        return [{"image": f"{folder}/imagesTr/case_{i:03d}.nii.gz", "label": f"{folder}/labelsTr/case_{i:03d}.nii.gz"} for i in range(n)]

    labeled = items("labeled", plan.training_pool + plan.num_validation + plan.in_domain_pool)
    unlabeled = root / "unlabeled" / "dataset.json"
    unlabeled.parent.mkdir(parents=True, exist_ok=True)
    unlabeled.write_text(json.dumps({"training": [{"image": "a.nii.gz"}], "validation": [{"image": "b.nii.gz"}]}))
    pool, val = plan.training_pool, plan.num_validation
    return protocol.Data(root, labeled[:pool], labeled[pool : pool + val], labeled[pool + val :], items("shifted", plan.shifted_pool),
                         ["background", "spleen"], unlabeled)  # fmt: skip


# ----------------------------------------------------------------------------------------------------------- the data

def test_training_volumes_are_distinct_across_seeds_at_each_k_and_nested_within_a_seed(tmp_path):
    plan = replace(PLAN, ks=(1, 2, 4), finetune_seeds=3, pretrainings=1, max_pretrainings=1)
    data = _fake_data(tmp_path, plan)
    volumes = {(k, f): [i["image"] for i in plan_module.training_volumes(data, k, f, plan)] for k in plan.ks for f in range(3)}
    for k in plan.ks:
        every = [v for f in range(3) for v in volumes[(k, f)]]
        assert len(every) == len(set(every)) == 3 * k, k  # no two seeds share a training volume at this k
    for f in range(3):
        assert set(volumes[(1, f)]) < set(volumes[(2, f)]) < set(volumes[(4, f)])  # nested within a seed
    pool = {i["image"] for i in data.pool}
    assert {v for vs in volumes.values() for v in vs} == pool  # 3 seeds x 4 = the whole training pool
    other = replace(plan, data_seed=1)
    assert plan_module.training_volumes(data, 2, 1, plan) != plan_module.training_volumes(data, 2, 1, other)  # the data seed draws
    with pytest.raises(plan_module.PlanError, match="seeds 0-2"):
        plan_module.training_volumes(data, 1, 3, plan)


def test_each_pretraining_seed_has_its_own_block_of_finetuning_seeds_volumes_and_draws(tmp_path):
    assert [plan_module.finetune_block(p, CPU) for p in (0, 1, 4)] == [[0, 1, 2], [3, 4, 5], [12, 13, 14]]
    assert (CPU.seeds, CPU.training_pool) == (15, 30)  # 5 pretraining seeds at most x 3, each seed 2 volumes of its own
    data = _fake_data(tmp_path, PLAN)
    training = [v["image"] for f in range(PLAN.seeds) for v in plan_module.training_volumes(data, 2, f, PLAN)]
    assert len(training) == len(set(training)) == 30  # no two seeds of any blocks share a training volume
    for h in ("in_domain", "shifted"):
        sets = {tuple(i["image"] for i in getattr(plan_module.seed_data(data, f, PLAN), h)) for f in range(PLAN.seeds)}
        assert len(sets) == 15, h  # 15 distinct held-out draws of 4 of 8


def test_held_out_sets_are_drawn_per_seed_from_the_fixed_pools_and_differ_across_seeds(tmp_path):
    data = _fake_data(tmp_path, PLAN)
    drawn = [plan_module.seed_data(data, f, PLAN) for f in range(PLAN.seeds)]
    for h, pool in (("in_domain", data.in_domain), ("shifted", data.shifted)):
        sets = [tuple(i["image"] for i in getattr(d, h)) for d in drawn]
        assert all(len(s) == len(set(s)) == PLAN.held_out for s in sets)
        assert all(set(s) <= {i["image"] for i in pool} for s in sets)  # from the fixed pool
        assert len(set(sets)) == PLAN.seeds  # every seed draws another set
    assert [d.validation for d in drawn] == [data.validation] * PLAN.seeds and len(data.validation) == 2  # 2 volumes select
    assert sorted(plan_module.held_out_draws(3, 2, 3, [0, 4000])) == [[0, 1], [0, 2], [1, 2]]  # a repeated draw is drawn again
    # a seed's draw does not depend on how many seeds follow it
    assert plan_module.held_out_draws(8, 4, 5, [0, 4000])[:3] == plan_module.held_out_draws(8, 4, 3, [0, 4000])
    datalist = json.loads(plan_module.write_seed_datalist(data, 2, 1, PLAN).read_text())
    assert len(datalist["training"]) == 2 and len(datalist["validation"]) == 2 and len(datalist["heldout"]) == 2 * PLAN.held_out
    heldout = {Path(i["image"]).as_posix().split("../")[-1] for i in datalist["heldout"]}
    assert heldout == {i["image"] for i in drawn[1].in_domain + drawn[1].shifted}
    training = {Path(i["image"]).as_posix().split("../")[-1] for i in datalist["training"]}
    assert not training & (heldout | {i["image"] for i in data.validation})


def test_plans_that_cannot_serve_the_rules_are_named_before_any_run():
    with pytest.raises(plan_module.PlanError, match=r"shifted_pool \(5\) gives 5 distinct draws of 4, fewer than the 15 finetuning seeds"):
        plan_module.check_plan(replace(PLAN, shifted_pool=5))
    with pytest.raises(plan_module.PlanError, match="finetuning budget .* is not fixed: run the pilot"):
        plan_module.check_plan(replace(CPU, finetune_iterations=None))
    plan_module.check_plan(replace(CPU, finetune_iterations=None), pilot=True)  # the pilot needs no fixed budget
    plan_module.check_plan(CPU)  # fixed from the pilot: 480 iterations
    plan_module.check_pilot(CPU)  # the committed pilot's answer
    with pytest.raises(plan_module.PlanError, match=r"finetune_iterations \(41\) must be a multiple of every k"):
        plan_module.check_plan(replace(PLAN, finetune_iterations=41))
    with pytest.raises(plan_module.PlanError, match=r"gives 5 validations; .* at least 8, a multiple of 4"):
        plan_module.check_plan(replace(PLAN, finetune_iterations=20))
    with pytest.raises(plan_module.PlanError, match=r"finetune_iterations \(40\) gives 10 validations"):
        plan_module.check_plan(replace(PLAN, finetune_iterations=40))  # quarters of 2.5 validations
    with pytest.raises(plan_module.PlanError, match=r"pilot budget \(200\) gives 10 validations"):
        plan_module.check_plan(replace(CPU, pilot_iterations=(200, 240)), pilot=True)
    short = protocol.Data(Path("."), [{}] * 6, [{}] * 2, [{}] * 8, [{}] * 8, [], Path("."))
    with pytest.raises(plan_module.PlanError, match="the data cannot serve the plan: training pool has 6, the plan needs 30"):
        plan_module.check_data(short, PLAN)


def test_the_pretraining_budget_is_the_demos_cpu_budget_of_1003_iterations():
    from components.data.synthetic import split_sizes
    from components.demo.run import BUDGETS

    budget, demo = plan_module.PROTOCOL_BUDGET, BUDGETS["cpu"]
    pretraining = ("num_unlabeled", "ssl_epochs", "ssl_batch", "ssl_learning_rate", "ssl_warmup_iterations", "feature_size")
    assert {f: getattr(budget, f) for f in pretraining} == {f: getattr(demo, f) for f in pretraining}
    assert budget.ssl_epochs * (split_sizes(budget.num_unlabeled)[0] // budget.ssl_batch) == 1003
    assert plan_module.MATCHED_OVERRIDES == {"intensity_range": [-175, 250]}


# ------------------------------------------------------------------------------------------------- the statistics

def test_the_verdict_rules_at_their_boundaries():
    margin = 0.02
    assert verdicts.verdict([-0.02, 0.02], margin) == "equivalent"  # bounds included
    assert verdicts.verdict([0.001, 0.019], margin) == "equivalent"  # equivalence is checked first
    assert verdicts.verdict([0.001, 0.0201], margin) == "better"
    assert verdicts.verdict([0.0, 0.05], margin) == "inconclusive"  # a lower bound of 0 is not above 0
    assert verdicts.verdict([-0.05, -1e-9], margin) == "worse"
    assert verdicts.verdict([-0.0201, 0.0], margin) == "inconclusive"
    assert verdicts.verdict([-0.03, 0.03], margin) == "inconclusive"


GAIN = {"ssl": 1.0, "dino": -1.0, "mim": 2.0, "ssl_matched": 1.5}


def _dice(arm: str, p: int | None, k: int, f: int, h: str, model: str) -> float:
    """A known Dice per run: the baselines about 0.5 (+0.01 per seed), a recipe's gain a multiple (:data:`GAIN`) of
    0.03 + 0.002 p + 0.005 j (j the finetuning seed's place in p's block, 0-2), the shifted set 0.1 lower, the last
    model 0.02 lower than the selected."""
    base = 0.5 + 0.01 * f - 0.1 * (h == "shifted") - 0.02 * (model == "last") + 0.003 * k
    gain = 0.0 if p is None else GAIN[arm.removeprefix("probe_")] * (0.03 + 0.002 * p + 0.005 * (f % PLAN.finetune_seeds))
    return base + gain


def _record(arm: str, p: int | None, k: int, f: int, curve: list | None = None) -> dict:
    return {"arm": arm, "k": k, "seed": f, "pretraining_seed": p, "commit": "c",
            "dice": {m: {h: {"mean": _dice(arm, p, k, f, h, m)} for h in protocol.HELD_OUT_SETS} for m in protocol.MODELS},
            "validation_curve": curve or [[4 * i, 0.5] for i in range(1, 13)], "selected_iteration": 4}  # fmt: skip


def _records(plan, passing: dict[str, list[int]]) -> list[dict]:
    """The runs of a plan whose recipes' pretrainings ``passing`` passed: each finetuned over its own block, the
    baselines at every block one of them (or a first try) uses."""
    blocks = sorted(set(range(plan.pretrainings)).union(*passing.values()))
    runs = [_record(a, None, k, f) for a in ("scratch", "probe_random") for k in plan.ks for b in blocks
            for f in plan_module.finetune_block(b, plan)]  # fmt: skip
    runs += [_record(a, p, k, f) for r, ps in passing.items() for p in ps for a in (r, f"probe_{r}") for k in plan.ks
             for f in plan_module.finetune_block(p, plan)]  # fmt: skip
    return runs


def _g(gain: float, p: int) -> float:
    """The pretraining mean of a recipe's gain (:func:`_dice`) over the finetuning seeds of p's block."""
    return gain * (0.035 + 0.002 * p)


def test_the_primary_statistic_is_the_mean_over_finetuning_seeds_per_pretraining_then_a_t_interval():
    runs = _records(PLAN, {"mim": [0, 2, 3]})
    entry = verdicts.family(runs, "mim", {"mim": [0, 2, 3]}, PLAN)["primary"]
    # by hand: g_p = mean over p's block, k and sets of (mim - scratch) = 2 (0.03 + 0.002 p + 0.005 mean(j))
    g = [0.07 + 0.004 * p for p in (0, 2, 3)]
    assert entry["per_pretraining"] == pytest.approx({"0": g[0], "2": g[1], "3": g[2]})
    half = T_975_DF2 * statistics.stdev(g) / math.sqrt(3)
    assert entry["mean"] == pytest.approx(statistics.fmean(g)) and entry["df"] == 2 and entry["level"] == 0.95
    assert entry["interval"] == pytest.approx([statistics.fmean(g) - half, statistics.fmean(g) + half])
    assert entry["verdict"] == verdicts.verdict(entry["interval"], 0.02) == "better"
    assert (entry["contrast"], entry["model"], entry["ks"]) == ("mim - scratch", "selected", [1, 2])


def test_secondary_cells_get_the_bonferroni_level_of_their_recipes_family():
    runs = _records(PLAN, {"ssl": [0, 1, 2], "ssl_matched": [0, 1, 4]})
    ssl = verdicts.family(runs, "ssl", {"ssl": [0, 1, 2]}, PLAN)["secondary"]
    # per recipe: 2 k x 2 sets (selected models) for the finetuned arm and for the probe, and the probe pooled: 9
    assert (ssl["correction"], ssl["m"], ssl["level"]) == ("Bonferroni", 9, pytest.approx(1 - 0.05 / 9))
    assert not [name for name in ssl["cells"] if "last" in name]
    cell = ssl["cells"]["ssl - scratch, k=2, shifted, selected"]
    values = list(cell["per_pretraining"].values())
    half = verdicts.t_quantile(1 - 0.05 / 9, 2) * statistics.stdev(values) / math.sqrt(3)
    assert cell["interval"][1] - cell["mean"] == pytest.approx(half) and half > T_975_DF2 * statistics.stdev(values) / math.sqrt(3)
    assert ssl["cells"]["probe_ssl - probe_random, pooled, selected"]["kind"] == "probe"
    matched = verdicts.family(runs, "ssl_matched", {"ssl": [0, 1, 2], "ssl_matched": [0, 1, 4]}, PLAN)["secondary"]
    assert matched["m"] == 10 and matched["level"] == pytest.approx(1 - 0.05 / 10)
    against = matched["cells"]["ssl_matched - ssl, pooled, selected"]
    # paired by block: the blocks both passed (0 and 1), where both pair with the same scratch runs
    differences = [_g(1.5, p) - _g(1.0, p) for p in (0, 1)]
    assert against["blocks"] == [0, 1] and (against["n"], against["df"]) == (2, 1)
    assert against["mean"] == pytest.approx(statistics.fmean(differences))
    half = verdicts.t_quantile(1 - 0.05 / 10, 1) * statistics.stdev(differences) / math.sqrt(2)
    assert against["half_width"] == pytest.approx(half)


def test_the_convergence_rule_compares_the_last_two_quarters_and_withholds_the_verdicts():
    assert verdicts.quarter_gain([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]) == pytest.approx(0.75 - 0.55)
    assert verdicts.quarter_gain([0.1] * 3) is None
    rising = [[4 * i, 0.05 * i] for i in range(1, 13)]  # the last 3 validations gain 0.15 over the 3 before
    runs = [r if not (r["arm"] == "scratch" and r["k"] == 2) else {**r, "validation_curve": rising}
            for r in _records(PLAN, {"mim": [0, 1, 2]})]  # fmt: skip
    pretrainings = {r: {} for r in PLAN.recipes}
    pretrainings["mim"] = {p: {"key": f"k{p}", "health": {"verdict": "learning"}} for p in range(3)}
    summary = schedule.summarise(PLAN, runs, pretrainings, set())
    assert summary["convergence"]["scratch"]["1"]["converged"] and not summary["convergence"]["scratch"]["2"]["converged"]
    assert summary["convergence"]["scratch"]["2"]["last_quarter_gain"] == pytest.approx(0.15)
    assert summary["withheld"] == {"finetune": "budget not converged at k=2", "probe": None, "probe_heads": {"mim": None},
                                   "registration": None, "analysis_code": None, "records": None, "failed_runs": {"mim": None}}  # fmt: skip
    mim = summary["recipes"]["mim"]
    assert mim["primary"]["verdict"] is None and mim["primary"]["withheld"] == "budget not converged at k=2"
    assert mim["primary"]["interval"] is not None  # the interval is still reported
    assert mim["secondary"]["cells"]["probe_mim - probe_random, pooled, selected"]["verdict"] == "better"  # the probes converged
    converged = schedule.summarise(PLAN, _records(PLAN, {"mim": [0, 1, 2]}), pretrainings, set())
    assert converged["recipes"]["mim"]["primary"]["verdict"] == "better" and converged["withheld"]["finetune"] is None
    # the recipe's own probe heads are checked too: a probe_mim still rising withholds the probe verdicts only
    runs = [r if r["arm"] != "probe_mim" else {**r, "validation_curve": rising} for r in _records(PLAN, {"mim": [0, 1, 2]})]
    summary = schedule.summarise(PLAN, runs, pretrainings, set())
    assert summary["withheld"]["probe_heads"] == {"mim": "budget not converged at k=1,2"}
    mim = summary["recipes"]["mim"]
    assert mim["primary"]["verdict"] == "better" and mim["secondary"]["cells"]["mim - scratch, k=1, in_domain, selected"]["verdict"]
    probe = mim["secondary"]["cells"]["probe_mim - probe_random, pooled, selected"]
    assert probe["verdict"] is None and probe["withheld"] == "its probe's budget not converged at k=1,2"


def test_coverage_is_simulated_from_the_fitted_variance_components_per_cell_kind():
    constant = np.full((3, 3), 0.04)
    assert verdicts.simulated_coverage([(constant, 0.95)], draws=200)["normal"]["mean"] == 1.0
    rng = np.random.default_rng(3)
    spread = 0.03 * rng.normal(size=(3, 1)) + 0.05 * rng.normal(size=(3, 3))  # pretraining and finetuning variance
    result = verdicts.simulated_coverage([(spread, 0.95)], draws=20000, seed=1)
    # normal draws of independent pretraining means: the t-interval's coverage is its level, up to 1.96 x 0.0015
    assert abs(result["normal"]["mean"] - 0.95) < 0.005 and result["nominal"] == [0.95]
    assert 0.85 < result["resampled"]["mean"] <= 1.0  # the data's own residuals and row effects
    # two-point finetuning residuals (+-0.1 in every pretraining, no pretraining variance), 2 pretrainings: a resampled
    # pretraining mean is -c, 0 or +c (1/4, 1/2, 1/4); the interval misses only when both are the same c != 0: 1/8
    two_point = np.array([[-0.1, 0.1], [-0.1, 0.1]])
    result = verdicts.simulated_coverage([(two_point, 0.95)], draws=20000)
    assert abs(result["resampled"]["mean"] - 7 / 8) < 0.01 and abs(result["normal"]["mean"] - 0.95) < 0.005
    assert verdicts.simulated_coverage([(spread[:1], 0.95)]) is None  # one pretraining: no interval
    runs = _records(PLAN, {"ssl": [0, 1, 2], "ssl_matched": [0, 1, 3]})
    cover = verdicts.coverage_by_kind(runs, {"ssl": [0, 1, 2], "ssl_matched": [0, 1, 3]}, PLAN, draws=200)
    # primary: ssl, ssl_matched; secondary: 9 cells each and ssl_matched's paired comparison with ssl
    assert cover["primary"]["populations"] == 2 and cover["secondary (Bonferroni)"]["populations"] == 19
    assert cover["secondary (Bonferroni)"]["nominal"] == [pytest.approx(1 - 0.05 / 9), pytest.approx(1 - 0.05 / 10)]


def test_the_power_stated_before_the_runs_is_the_plans():
    """low_data.py states what the plan can detect: the numbers are the functions' at the CPU plan's sizes."""
    import low_data

    doc = " ".join(low_data.__doc__.split())
    p, level = CPU.pretrainings, CPU.level
    factor = verdicts.detectable_gain(p, 1.0, level)
    assert f"{factor:.2f} SD(g)" in doc and abs(factor - (T_975_DF2 + 1.0606601717798) / math.sqrt(3)) < 1e-9
    assert all(f"{verdicts.detectable_gain(p, sd, level):.3f} at" in doc for sd in (0.02, 0.03))
    assert f"below {verdicts.equivalence_sd(p, level, CPU.margin):.3f}" in doc
    assert "about 0.05 at SD(g) = 0.03" in doc and round(verdicts.detectable_gain(5, 0.03, level), 2) == 0.05
    m, secondary = verdicts.bonferroni_level(CPU, "ssl")
    assert m == 9 and f"detects about {verdicts.detectable_gain(p, 1.0, secondary):.1f} SD(g)" in doc


# ------------------------------------------------------------------------------------------ the gate and the runs

def test_seeds_are_scheduled_until_three_pass_or_five_were_tried():
    assert schedule.seeds_to_run([], PLAN) == [0, 1, 2]
    assert schedule.seeds_to_run([True, False, True], PLAN) == [3]
    assert schedule.seeds_to_run([True, False, True, False], PLAN) == [4]
    assert schedule.seeds_to_run([True, False, True, False, False], PLAN) == []  # 5 tried
    assert schedule.seeds_to_run([True, True, True], PLAN) == []
    assert schedule.seeds_to_run([True, False, True, True], PLAN) == []


def _registered_at(monkeypatch, head: str) -> None:
    """The plan pre-registered at commit "r", this checkout at ``head``; of the commits only "c" (the stand-in
    records' commit) and "head" descend from "r"; no analysis code changed since "r". ``machine.descends_from`` and
    ``machine.changed_since`` themselves are tested on a real repository."""
    monkeypatch.setattr(plan_module, "PREREGISTRATION", "r")
    monkeypatch.setattr(plan_module, "descends_from", lambda commit, ancestor: ancestor == "r" and commit in ("c", "head"))
    monkeypatch.setattr(plan_module, "changed_since", lambda commit, paths: [])
    monkeypatch.setattr(schedule, "git_commit", lambda: head)


def _write_pilot(path: Path, plan: plan_module.Plan, **fields) -> None:
    """A pilot summary of ``plan``'s settings whose smallest converged budget is the plan's (``fields`` change it)."""
    settings = json.loads(json.dumps({**asdict(plan), "finetune_iterations": None, "device": "cpu"}))
    path.write_text(json.dumps({"benchmark": "low_data_pilot", "protocol": 3, "settings": settings, "complete": True, "missing_runs": [],
                                "smallest_converged_budget": plan.finetune_iterations, **fields}))  # fmt: skip


@pytest.fixture
def fake_runs(monkeypatch, tmp_path):
    """run() with the bundle runs replaced: a pretraining's health verdict is ``verdicts[(recipe, seed)]`` (default
    learning); a finetuning returns the Dice of :func:`_dice` (and the count of finetuning calls as its seconds, so that
    a run made again writes other bytes). Each writes its record where the real one does and reuses it as the real one
    does; a run whose stem is in ``calls["crashes"]`` raises the bundle's error that many times first. The calls
    (every try) are recorded. The plan is pre-registered (:func:`_registered_at`) with :data:`PLAN`'s pilot."""
    calls = {"pretrain": [], "finetune": [], "crashes": {}}
    health = {}
    _registered_at(monkeypatch, "head")
    _write_pilot(tmp_path / "pilot_summary.json", PLAN)
    monkeypatch.setattr(plan_module, "PILOT_SUMMARY", tmp_path / "pilot_summary.json")
    monkeypatch.setattr(schedule, "synthetic_data", _fake_data)
    monkeypatch.setattr(schedule, "matched_corpus", lambda data: data.unlabeled)
    monkeypatch.setattr(schedule, "training_class_weights", lambda datalist, names=None: [0.1, 1.0])

    def crash(stem: str) -> None:
        if calls["crashes"].get(stem, 0) > 0:
            calls["crashes"][stem] -= 1
            raise RuntimeError("bundle run failed (exit 1): python -m monai.bundle run ...\nTraceback (most recent call last):")

    def write(path: Path, record: dict) -> dict:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2))
        return record

    def pretrain(recipe, key, overrides, results, threads, report_only=False, *, bundle=None, stem=None, collapse_fails=False):
        assert collapse_fails  # a run the collapse guard stops is a failing pretraining, not the plan's end
        path = schedule.record_file(results, stem, key)
        if path.is_file():
            return json.loads(path.read_text())
        if report_only:
            raise FileNotFoundError(recipe)
        seed = overrides["training#seed"]
        calls["pretrain"].append((recipe, seed, key, bundle, overrides))
        crash(stem)
        report = {"verdict": health.get((recipe, seed), "learning"), "signals": {}}
        return write(path, {"recipe": recipe, "key": key, "sha256": f"w-{recipe}-{seed}", "commit": "c", "model": f"/w/{recipe}{seed}.pt",
                            "seed": seed, "health": report})  # fmt: skip

    def finetune(arm, k, seed, key, overrides, data, results, threads, report_only=False, *, stem=None, fields=None, pretrained=None):
        path = schedule.record_file(results, stem, key)
        if path.is_file():
            return json.loads(path.read_text())
        if report_only:
            return None
        datalist = json.loads(Path(overrides["datalist"]).read_text())
        calls["finetune"].append({"arm": arm, "k": k, "seed": seed, "key": key, "stem": stem, "overrides": overrides,
                                  "datalist": datalist, "fields": fields, "held_out": [i["image"] for i in data.in_domain + data.shifted]})  # fmt: skip
        crash(stem)
        record = {**_record(arm, fields["pretraining_seed"], k, seed), "key": key, "seconds": float(len(calls["finetune"])), **fields}
        return write(path, record)

    monkeypatch.setattr(schedule, "run_pretraining", pretrain)
    monkeypatch.setattr(schedule, "run_finetuning", finetune)
    return calls, health


def test_the_health_gate_excludes_a_failing_pretraining_reports_it_and_schedules_the_next_seed(fake_runs, tmp_path):
    calls, health = fake_runs
    health.update({("dino", 1): "at baseline", ("mim", 0): "collapsed", ("mim", 2): "at baseline", ("mim", 3): "at baseline"})
    result = schedule.run(PLAN, tmp_path, "cpu")
    tried = {r: [s for rr, s, *_ in calls["pretrain"] if rr == r] for r in PLAN.recipes}
    assert tried == {"ssl": [0, 1, 2], "dino": [0, 1, 2, 3], "mim": [0, 1, 2, 3, 4], "ssl_matched": [0, 1, 2]}
    dino, mim = result["recipes"]["dino"], result["recipes"]["mim"]
    assert dino["status"] == "evaluated" and dino["passing_seeds"] == [0, 2, 3]
    assert [(p["seed"], p["passed"], p["verdict"]) for p in dino["pretrainings"]] == [
        (0, True, "learning"), (1, False, "at baseline"), (2, True, "learning"), (3, True, "learning")]  # reported, not dropped
    assert mim["status"] == "not evaluated: 2 of 5 encoders passed health" and "primary" not in mim
    finetuned = {(c["fields"]["recipe"], c["fields"]["pretraining_seed"]) for c in calls["finetune"] if c["fields"]["recipe"]}
    assert not finetuned & {("dino", 1), ("mim", 0), ("mim", 2), ("mim", 3)}  # a failing encoder is never finetuned
    assert sorted(p for r, p in finetuned if r == "dino") == [0, 2, 3]
    # unit by unit: a passing pretraining is finetuned as soon as it passed, its recipe's verdict still needs 3
    assert sorted(p for r, p in finetuned if r == "mim") == [1, 4]
    order = [c["fields"]["pretraining_seed"] for c in calls["finetune"] if c["fields"]["recipe"] == "ssl"]
    assert order == sorted(order)  # seed 0's unit before seed 1's
    assert dino["primary"]["per_pretraining"].keys() == {"0", "2", "3"} and dino["primary"]["verdict"] == "worse"
    blocks = [c["seed"] // 3 for c in calls["finetune"] if c["arm"] == "scratch"]
    assert set(blocks) == {0, 1, 2, 3, 4} and len(blocks) == 5 * 2 * 3  # first tries' blocks, dino's 3, mim's 4; once each
    # ks x seeds of a block x (2 baselines x 5 blocks + 2 arms x 11 passing pretrainings)
    assert result["complete"] and len(calls["finetune"]) == 2 * 3 * (2 * 5 + 2 * 11)
    units = {(u["recipe"], u["seed"]): u for u in result["units"]}
    assert units[("dino", 1)] == {"recipe": "dino", "seed": 1, "verdict": "at baseline", "passed": False, "runs_done": 0,
                                  "runs_needed": 0, "complete": True}  # a failed pretraining is a done unit
    assert units[("dino", 3)]["runs_needed"] == 2 * 2 * 3 * 2
    assert all(u["complete"] for u in units.values())
    assert len(units) == 3 + 4 + 5 + 3
    assert {c["seed"] for c in calls["finetune"] if c["fields"]["pretraining_seed"] == 3} == {9, 10, 11}  # its own block


def test_baselines_run_once_per_seed_and_k_and_pair_with_every_pretraining(fake_runs, tmp_path):
    calls, _ = fake_runs
    schedule.run(replace(PLAN, recipes=("ssl", "ssl_matched")), tmp_path, "cpu")
    scratch = [(c["k"], c["seed"]) for c in calls["finetune"] if c["arm"] == "scratch"]
    assert sorted(scratch) == sorted({(k, f) for k in PLAN.ks for f in range(9)})  # once each, shared by the block's pretrainings
    for c in calls["finetune"]:  # pretraining p finetunes over its block only
        assert c["fields"]["pretraining_seed"] in (None, c["seed"] // 3)
    by_pair = {}
    for c in calls["finetune"]:
        by_pair.setdefault((c["k"], c["seed"]), set()).add(json.dumps([c["datalist"], c["held_out"]]))
    assert all(len(v) == 1 for v in by_pair.values())  # every arm of a (k, seed) trains and is scored on the same volumes
    stems = {c["stem"] for c in calls["finetune"]}
    assert "ssl_p2_k1_f6" in stems and "scratch_k2_f1" in stems and "probe_ssl_matched_p0_k2_f2" in stems
    keys = {c["key"] for c in calls["finetune"]}
    assert len(keys) == len(calls["finetune"])  # the pretraining seed is part of the key
    pre = [c for c in calls["pretrain"] if c[0] == "ssl_matched"]
    assert all(c[3] == "swin_unetr_ssl_pretrain" and c[4]["intensity_range"] == [-175, 250] for c in pre)
    ssl = [c for c in calls["pretrain"] if c[0] == "ssl"]
    assert all("intensity_range" not in c[4] for c in ssl) and {c[2] for c in ssl}.isdisjoint({c[2] for c in pre})
    own = {"output_dir", "ckpt_dir"}  # each run's own folders
    arms = {(c["arm"], c["fields"]["pretraining_seed"], c["seed"]): {k: v for k, v in c["overrides"].items() if k not in own}
            for c in calls["finetune"] if c["k"] == 2 and c["seed"] % 3 == 1}  # fmt: skip

    def differing(a: tuple, b: tuple) -> set[str]:
        return {k for k in arms[a].keys() | arms[b].keys() if arms[a].get(k) != arms[b].get(k)}

    assert differing(("ssl", 0, 1), ("scratch", None, 1)) == {"pretrained_path"} == differing(("ssl_matched", 2, 7), ("ssl", 2, 7))
    assert differing(("probe_ssl", 1, 4), ("probe_random", None, 4)) == {"pretrained_path"}
    assert differing(("probe_random", None, 1), ("scratch", None, 1)) == {"network_def#network"}
    assert arms[("probe_ssl", 1, 4)]["network_def#network"] == "$components.LinearProbe"
    assert arms[("ssl", 1, 4)]["pretrained_path"] == "/w/ssl1.pt"
    assert differing(("scratch", None, 1), ("scratch", None, 4)) >= {"datalist", "training#seed"}  # blocks differ


def test_a_time_limited_piece_lists_the_missing_runs_and_report_only_runs_nothing(fake_runs, tmp_path):
    calls, _ = fake_runs
    result = schedule.run(PLAN, tmp_path, "cpu", stop_after_s=0.0)
    assert not calls["pretrain"] and not calls["finetune"] and result["complete"] is False
    assert "pretraining ssl seed 0" in result["missing_runs"] and result["recipes"]["ssl"]["status"].startswith("incomplete")
    assert "scratch_k1_f0" in result["missing_runs"] and result["units"] == []
    # a unit is complete once its pretraining's runs and its block's baselines are all there
    pretrainings = {"ssl": {p: {"health": {"verdict": "learning"}} for p in range(3)}}
    runs = [r for r in _records(PLAN, {"ssl": [0, 1, 2]}) if (r["arm"], r["k"], r["seed"]) != ("probe_random", 2, 4)]
    units = schedule.units(PLAN, runs, pretrainings)
    assert [(u["seed"], u["runs_done"], u["runs_needed"], u["complete"]) for u in units] == [
        (0, 24, 24, True), (1, 23, 24, False), (2, 24, 24, True)]  # seed 4 is in block 1


def test_the_pilot_runs_scratch_and_probe_random_from_the_smallest_budget_until_one_converges(fake_runs, tmp_path, monkeypatch):
    calls, _ = fake_runs
    rising = [[4 * i, 0.05 * i] for i in range(1, 13)]
    real = schedule.run_finetuning

    def rising_at_48(arm, k, seed, key, overrides, data, results, threads, report_only=False, **kwargs):
        record = real(arm, k, seed, key, overrides, data, results, threads, report_only, **kwargs)
        return {**record, "validation_curve": rising} if record and kwargs["fields"]["finetune_iterations"] == 48 and k == 2 else record

    monkeypatch.setattr(schedule, "run_finetuning", rising_at_48)
    result = schedule.pilot(replace(CPU, pilot_iterations=(96, 48, 192), val_every=4), tmp_path, "cpu")
    assert not calls["pretrain"] and {c["arm"] for c in calls["finetune"]} == {"scratch", "probe_random"}
    assert len(calls["finetune"]) == 2 * 2 * 2 * 3  # budgets run x arms x ks x the seeds of block 0
    assert {c["seed"] for c in calls["finetune"]} == {0, 1, 2}
    assert {c["overrides"]["max_epochs"] for c in calls["finetune"] if c["k"] == 2} == {24, 48}  # from the smallest up
    assert set(result["convergence"]) == {"48", "96"} and not result["convergence"]["48"]["scratch"]["2"]["converged"]
    assert result["smallest_converged_budget"] == 96 and result["not_run"] == [192]  # flat curves at 96: stop there
    # a pilot run's key is never the plan's: the plan's records all follow the pre-registration
    calls["finetune"].clear()
    schedule.run(replace(CPU, finetune_iterations=48, val_every=4, recipes=("ssl",)), tmp_path, "cpu")
    pilot_keys = {c["key"] for c in result["runs"]}
    assert pilot_keys and not pilot_keys & {c["key"] for c in calls["finetune"]}


def test_a_plan_runs_only_after_its_pre_registration_and_a_record_made_before_withholds_every_verdict(fake_runs, tmp_path, monkeypatch):
    import low_data_docs as docs

    calls, _ = fake_runs
    plan = replace(PLAN, recipes=("ssl",))
    monkeypatch.setattr(plan_module, "PREREGISTRATION", None)
    with pytest.raises(plan_module.PlanError, match="not pre-registered: fix its finetuning budget from the pilot"):
        schedule.run(plan, tmp_path, "cpu")
    _registered_at(monkeypatch, "head+changes")
    with pytest.raises(plan_module.PlanError, match=r"this checkout \(head\+changes\) is not the pre-registration commit r"):
        schedule.run(plan, tmp_path, "cpu")
    assert not calls["pretrain"] and not calls["finetune"]  # refused before any run
    small = replace(plan_module.PLANS["small"], recipes=("ssl",))
    assert small.trial and schedule.run(small, tmp_path / "small", "cpu")["preregistration"] is None  # CI's mechanics

    _registered_at(monkeypatch, "head")
    result = schedule.run(plan, tmp_path / "a", "cpu")
    assert result["preregistration"] == {"commit": "r", "records_after": True, "not_after": [], "analysis_changed": []}
    assert result["recipes"]["ssl"]["primary"]["verdict"] == "better"
    monkeypatch.setattr(plan_module, "descends_from", lambda commit, ancestor: commit == "head")  # records made before "r"
    result = schedule.run(plan, tmp_path / "b", "cpu")
    assert result["preregistration"] == {"commit": "r", "records_after": False, "not_after": ["c"], "analysis_changed": []}
    cells = [result["recipes"]["ssl"]["primary"], *result["recipes"]["ssl"]["secondary"]["cells"].values()]
    assert all(c["verdict"] is None and c["withheld"].endswith("do not follow the pre-registration: c") for c in cells)
    assert docs.protocol3_markdown(result).startswith("Pre-registered at commit r; records made at c do not follow it: "
                                                      "every verdict is withheld.\n\nPretrainings and the health gate")  # fmt: skip


def test_the_finetuning_budget_must_be_the_committed_pilots_answer(fake_runs, tmp_path, monkeypatch):
    calls, _ = fake_runs
    path = tmp_path / "pilot.json"
    monkeypatch.setattr(plan_module, "PILOT_SUMMARY", path)
    with pytest.raises(plan_module.PlanError, match=f"no pilot summary {path}: run the pilot"):
        plan_module.check_pilot(PLAN)
    with pytest.raises(plan_module.PlanError, match="no pilot summary"):  # before any run
        schedule.run(PLAN, tmp_path / "out", "cpu")
    assert not calls["pretrain"] and not calls["finetune"]
    plan_module.check_pilot(plan_module.PLANS["small"])  # a trial plan needs none
    _write_pilot(path, PLAN)
    plan_module.check_pilot(PLAN)
    plan_module.check_preregistered(PLAN, "head")
    _write_pilot(path, replace(PLAN, recipes=("ssl",), margin=0.05, pretrainings=2))  # fields that do not define the pilot
    plan_module.check_pilot(PLAN)
    _write_pilot(path, PLAN, complete=False, missing_runs=["scratch_k1_f0 at 48 iterations"] * 2)
    with pytest.raises(plan_module.PlanError, match=r"pilot summary .*pilot.json is not complete \(2 runs missing\)"):
        plan_module.check_pilot(PLAN)
    _write_pilot(path, replace(PLAN, val_every=2, pilot_iterations=(48,)))
    with pytest.raises(plan_module.PlanError, match=r"other settings than the plan's: val_every 2 \(the plan: 4\); "
                                                    r"pilot_iterations \[48\] \(the plan: \[480, 960\]\)\.$"):  # fmt: skip
        plan_module.check_pilot(PLAN)
    for field, value in (("ks", (1,)), ("finetune_seeds", 2), ("num_validation", 3), ("in_domain_pool", 9), ("shifted_pool", 9),
                         ("held_out", 3), ("min_validations", 12), ("convergence_gain", 0.02), ("data_seed", 1),
                         ("budget", replace(PLAN.budget, feature_size=24))):  # fmt: skip
        _write_pilot(path, replace(PLAN, **{field: value}))
        with pytest.raises(plan_module.PlanError, match=f"other settings than the plan's: {field} "):
            plan_module.check_pilot(PLAN)
    _write_pilot(path, PLAN, smallest_converged_budget=None)
    with pytest.raises(plan_module.PlanError, match="^no pilot budget converged: add a larger budget to pilot_iterations and run "
                                                    "the pilot again before the pre-registration"):  # fmt: skip
        plan_module.check_preregistered(PLAN, "head")
    _write_pilot(path, PLAN, smallest_converged_budget=96)
    with pytest.raises(plan_module.PlanError, match=r"finetune_iterations \(48\) is not the pilot's smallest converged budget \(96, "):
        plan_module.check_pilot(PLAN)
    plan_module.check_pilot(replace(PLAN, finetune_iterations=96))
    path.write_text("{")
    with pytest.raises(plan_module.PlanError, match="is not JSON"):
        plan_module.check_pilot(PLAN)


def test_analysis_code_changed_since_the_pre_registration_withholds_every_verdict(fake_runs, tmp_path, monkeypatch):
    import low_data_docs as docs

    assert set(plan_module.ANALYSIS_CODE) == {f"benchmarks/low_data_{m}.py" for m in ("plan", "schedule", "verdicts", "stats", "runs", "protocol")}
    assert all((REPO / path).is_file() for path in plan_module.ANALYSIS_CODE)
    asked = []

    def changed(commit, paths):
        asked.append((commit, tuple(paths)))
        return ["benchmarks/low_data_verdicts.py"]

    monkeypatch.setattr(plan_module, "changed_since", changed)
    result = schedule.run(replace(PLAN, recipes=("ssl",)), tmp_path, "cpu")
    assert asked == [("r", plan_module.ANALYSIS_CODE)]  # against the pre-registration commit
    assert result["preregistration"]["analysis_changed"] == ["benchmarks/low_data_verdicts.py"]
    assert result["preregistration"]["records_after"]  # the records alone would give verdicts
    reason = "analysis code changed since the pre-registration: benchmarks/low_data_verdicts.py"
    assert result["withheld"]["analysis_code"] == reason
    cells = [result["recipes"]["ssl"]["primary"], *result["recipes"]["ssl"]["secondary"]["cells"].values()]
    assert all(c["verdict"] is None and c["withheld"] == reason for c in cells)
    assert result["recipes"]["ssl"]["primary"]["interval"] is not None  # the interval is still reported
    assert docs.protocol3_markdown(result).startswith("Pre-registered at commit r: every record was made at it or a commit after "
                                                      "it. The analysis code changed since (benchmarks/low_data_verdicts.py): "
                                                      "every verdict is withheld.\n\n")  # fmt: skip
    small = replace(plan_module.PLANS["small"], recipes=("ssl",))
    assert schedule.run(small, tmp_path / "small", "cpu")["withheld"]["analysis_code"] is None  # a trial plan is not frozen
    assert len(asked) == 1


def test_a_record_deleted_or_changed_since_written_withholds_every_verdict(fake_runs, tmp_path):
    calls, _ = fake_runs
    plan = replace(PLAN, recipes=("ssl",))
    first = schedule.run(plan, tmp_path, "cpu")
    results = tmp_path / "results"
    lines = (results / "ledger.jsonl").read_text().splitlines()
    files = sorted(p.name for p in results.glob("*.json"))
    assert len(files) == len(calls["pretrain"]) + len(calls["finetune"]) == 3 + 2 * 2 * 9 + 2 * 2 * 9  # every record, once
    assert sorted(json.loads(line)["file"] for line in lines) == files
    assert json.loads(lines[0])["sha256"] == protocol.sha256_file(results / json.loads(lines[0])["file"])
    assert first["records_changed"] == [] and first["withheld"]["records"] is None  # an untouched plan
    assert first["recipes"]["ssl"]["primary"]["verdict"] == "better"
    assert schedule.run(plan, tmp_path, "cpu", report_only=True)["records_changed"] == []
    assert (results / "ledger.jsonl").read_text().splitlines() == lines  # reused records add no line
    deleted, altered = next(results.glob("scratch_k1_f0_*.json")), next(results.glob("ssl_p1_k2_f4_*.json"))
    deleted.unlink()
    record = json.loads(altered.read_text())
    record["dice"]["selected"]["in_domain"]["mean"] += 0.1
    altered.write_text(json.dumps(record, indent=2))
    result = schedule.run(plan, tmp_path, "cpu", report_only=True)
    assert sorted(result["records_changed"]) == sorted([f"{deleted.name} (deleted)", f"{altered.name} (changed)"])
    reason = f"records deleted or changed since written: {', '.join(result['records_changed'])}"
    assert result["withheld"]["records"] == reason and "scratch_k1_f0" in result["missing_runs"]
    cells = [result["recipes"]["ssl"]["primary"], *result["recipes"]["ssl"]["secondary"]["cells"].values()]
    assert all(c["verdict"] is None and c["withheld"] == reason for c in cells)
    made = len(calls["finetune"])
    again = schedule.run(plan, tmp_path, "cpu")  # the deleted run is made again (other bytes: its seconds differ)
    assert len(calls["finetune"]) == made + 1 and deleted.is_file()
    assert sorted(again["records_changed"]) == sorted([f"{deleted.name} (changed)", f"{altered.name} (changed)"])  # old lines flag them
    now = (results / "ledger.jsonl").read_text().splitlines()
    assert now[: len(lines)] == lines and len(now) == len(lines) + 2  # appended, never rewritten
    assert again["recipes"]["ssl"]["primary"]["verdict"] is None


def test_a_run_that_fails_runs_once_more_and_failing_again_is_recorded_reported_and_withholds_its_recipes(fake_runs, tmp_path):
    calls, _ = fake_runs
    calls["crashes"].update({"pretrain_ssl_s0": 1, "pretrain_mim_s1": 2, "scratch_k1_f1": 1, "ssl_p2_k2_f7": 2, "scratch_k2_f10": 2})
    result = schedule.run(PLAN, tmp_path, "cpu")
    tried = {r: [s for rr, s, *_ in calls["pretrain"] if rr == r] for r in PLAN.recipes}
    assert tried["ssl"] == [0, 0, 1, 2] and tried["mim"] == [0, 1, 1, 2, 3]  # once more from its start; mim's next seed
    message = "bundle run failed (exit 1): python -m monai.bundle run ..."
    mim = result["recipes"]["mim"]
    assert [(p["seed"], p["passed"], p["verdict"]) for p in mim["pretrainings"]][1] == (1, False, "crashed")  # reported
    assert mim["pretrainings"][1]["health"]["message"] == message and mim["passing_seeds"] == [0, 2, 3]
    assert json.loads(next((tmp_path / "results").glob("pretrain_mim_s1_*.json")).read_text())["failed"] == message
    stems = [c["stem"] for c in calls["finetune"]]
    assert stems.count("scratch_k1_f1") == 2 and stems.count("ssl_p2_k2_f7") == 2 and stems.count("scratch_k2_f10") == 2
    assert result["complete"] and result["failed_runs"] == [{"run": "scratch_k2_f10", "failed": message},
                                                            {"run": "ssl_p2_k2_f7", "failed": message}]  # fmt: skip
    assert result["withheld"]["failed_runs"] == {"ssl": "failed runs: ssl_p2_k2_f7", "dino": None,
                                                 "mim": "failed runs: scratch_k2_f10",  # block 3: only mim's seed 3 uses it
                                                 "ssl_matched": "failed runs: ssl_p2_k2_f7"}  # compared with ssl  # fmt: skip
    failed = [(r["arm"], r["k"], r["seed"]) for r in result["runs"] if r.get("failed") and "dice" not in r]
    assert sorted(failed) == [("scratch", 2, 10), ("ssl", 2, 7)]  # recorded without Dice, kept among the runs
    for recipe in ("ssl", "mim", "ssl_matched"):
        cells = [result["recipes"][recipe]["primary"], *result["recipes"][recipe]["secondary"]["cells"].values()]
        assert all(c["verdict"] is None and c["withheld"] == result["withheld"]["failed_runs"][recipe] for c in cells), recipe
    assert result["recipes"]["ssl"]["primary"]["per_pretraining"].keys() == {"0", "1"}  # its interval lacks p2: withheld, not silent
    assert result["recipes"]["dino"]["primary"]["verdict"] == "worse"  # no failed run in its cells
    made = (len(calls["pretrain"]), len(calls["finetune"]))
    again = schedule.run(PLAN, tmp_path, "cpu")  # the failures are records: reused, not run again
    assert (len(calls["pretrain"]), len(calls["finetune"])) == made and again["failed_runs"] == result["failed_runs"]
    calls["crashes"]["scratch_k1_f0"] = 1
    with pytest.raises(RuntimeError, match="bundle run failed"):  # the pilot still stops at a failed run
        schedule.pilot(replace(CPU, pilot_iterations=(48,), val_every=4), tmp_path / "pilot", "cpu")


def test_a_finetuning_whose_selected_dice_is_nan_is_a_failed_run():
    runs = _records(PLAN, {"mim": [0, 1, 2]})
    nan = next(r for r in runs if (r["arm"], r["k"], r["seed"]) == ("scratch", 1, 4))
    nan["dice"]["selected"]["shifted"]["mean"] = float("nan")
    pretrainings = {r: {} for r in PLAN.recipes}
    pretrainings["mim"] = {p: {"key": f"k{p}", "health": {"verdict": "learning"}} for p in range(3)}
    summary = schedule.summarise(PLAN, runs, pretrainings, set())
    assert summary["failed_runs"] == [{"run": "scratch_k1_f4", "failed": "the selected model's Dice is NaN on shifted"}]
    mim = summary["recipes"]["mim"]
    assert mim["primary"]["verdict"] is None and mim["primary"]["withheld"] == "failed runs: scratch_k1_f4"
    assert mim["primary"]["per_pretraining"].keys() == {"0", "2"} and summary["convergence"]["scratch"]["1"]["runs"] == 8
    assert schedule.summarise(PLAN, _records(PLAN, {"mim": [0, 1, 2]}), pretrainings, set())["failed_runs"] == []


# ------------------------------------------------------------------------------------------------------ the docs

def test_the_docs_blocks_say_not_run_yet_without_a_summary(tmp_path):
    import low_data_docs as docs

    summary = tmp_path / "low_data_cpu_protocol3.json"
    doc = tmp_path / "README.md"
    answers, tables = (docs.BLOCKS[kind].format(summary=summary.as_posix()) for kind in ("answers", "protocol3"))
    doc.write_text(f"## What pretraining buys\n\n{answers}\nold\n{docs.block_end('answers')}\n\n{tables}\nold\n{docs.block_end('protocol3')}\n")
    assert docs.write_doc_tables(doc, summary)
    text = doc.read_text()
    assert text.count(f"\n\n{docs.not_run_yet(summary.as_posix())}\n\n") == 2 and "old" not in text
    assert docs.not_run_yet("x.json").startswith("Protocol v3 has not run yet:")
    for path in ("README.md", "docs/measuring.md"):  # the shipped docs: blocks of the CPU plan's summary, not run yet
        shipped = (REPO / path).read_text()
        assert docs.ANSWERS_BLOCK.format(summary="benchmarks/results/low_data_cpu_protocol3.json") in shipped, path
        assert docs.not_run_yet("benchmarks/results/low_data_cpu_protocol3.json") in shipped, path


def test_the_answer_sentences_are_generated_from_the_summary(fake_runs, tmp_path):
    import low_data_docs as docs

    _, health = fake_runs
    health.update({("dino", 0): "at baseline", ("dino", 1): "collapsed", ("dino", 3): "at baseline", ("dino", 4): "learning"})
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps(schedule.run(PLAN, tmp_path / "out", "cpu"), allow_nan=False))  # strict JSON
    doc = tmp_path / "README.md"
    begin = docs.ANSWERS_BLOCK.format(summary=summary.as_posix())
    doc.write_text(f"{begin}\n{docs.not_run_yet('x')}\n{docs.block_end('answers')}\n")
    assert docs.write_doc_tables(doc, summary)
    lines = doc.read_text().splitlines()
    g = [_g(2.0, p) for p in (0, 1, 2)]  # masked image: the pretraining means of its gain over scratch
    half = T_975_DF2 * statistics.stdev(g) / math.sqrt(3)
    mean = statistics.fmean(g)
    mim = next(line for line in lines if line.startswith("- masked image:"))
    assert mim.startswith(f"- masked image: +{mean:.3f} [+{mean - half:.3f}, +{mean + half:.3f}] over scratch (better) on 3 "
                          f"pretrainings x 3 finetuning seeds of their own x 2 k x 2 held-out sets, among pretrainings that "
                          f"passed the health check (3 of 3 tried); its linear probe +{mean:.3f} [")  # fmt: skip
    assert "over a random encoder's (secondary, 99.44 % Bonferroni interval: better)" in mim
    assert "- self-distillation: not evaluated: 2 of 5 encoders passed health." in lines
    matched = next(line for line in lines if line.startswith("- SSL in the finetuning's window and spacing:"))
    against = json.loads(summary.read_text())["recipes"]["ssl_matched"]["secondary"]["cells"]["ssl_matched - ssl, pooled, selected"]
    assert against["mean"] == pytest.approx(statistics.fmean(_g(0.5, p) for p in (0, 1, 2)))  # paired by block
    assert f"; against SSL {against['mean']:+.3f} [" in matched
    assert lines[-3].startswith("Data, budgets and machine: [summary.json](summary.json) (pretraining 1,003 iterations, "
                                "finetuning 48;")  # fmt: skip  # linked relative to the document
    nested = tmp_path / "docs" / "measuring.md"
    nested.parent.mkdir()
    nested.write_text(f"{begin}\n{docs.block_end('answers')}\n")
    docs.write_doc_tables(nested, summary)
    assert "[summary.json](../summary.json)" in nested.read_text()
    tables = docs.protocol3_markdown(json.loads(summary.read_text()))
    assert tables.startswith("Pre-registered at commit r: every record was made at it or a commit after it.\n\n")
    assert "| self-distillation | 1 | collapsed | no | - |" in tables and f"| masked image | evaluated | +{mean:.3f} [" in tables
    assert "Secondary cells of masked image (9 cells, Bonferroni: each interval at 99.44 %):" in tables
    assert f"| mim - scratch, k=2, shifted, selected | +{mean:.3f} [" in tables
    for block in tables.split("\n\n"):  # every row of a table has its header's columns
        rows = [line for line in block.splitlines() if line.startswith("|")]
        assert len({row.count("|") for row in rows}) <= 1, rows[:3]


def test_the_pilots_table_names_the_smallest_converged_budget(fake_runs, tmp_path):
    import low_data_docs as docs

    result = schedule.pilot(replace(CPU, pilot_iterations=(48,), val_every=4), tmp_path, "cpu")
    text = docs.pilot_markdown(json.loads(json.dumps(result)))
    assert "| 48 | scratch | 2 | +0.0000 | yes |" in text and "| 48 | probe_random | 1 | +0.0000 | yes |" in text
    assert text.rstrip().endswith("Smallest budget at which both converged at every k: 48.")


def test_a_matched_recipe_without_its_demo_recipe_has_no_comparison_with_it():
    runs = _records(PLAN, {"ssl_matched": [0, 1, 2]})
    family = verdicts.family(runs, "ssl_matched", {"ssl_matched": [0, 1, 2]}, PLAN)
    against = family["secondary"]["cells"]["ssl_matched - ssl, pooled, selected"]
    assert (against["mean"], against["interval"], against["verdict"]) == (None, None, None)
    assert family["primary"]["verdict"] == "better"
    json.dumps(family, allow_nan=False)  # strict JSON: no NaN anywhere


def test_the_matched_corpus_is_the_corpus_at_the_finetunings_spacing(tmp_path):
    """ssl_matched's corpus: every training and validation volume of the unlabeled corpus, resampled to 1 x 1 x 2 mm
    (RAS, as the finetuning resamples), listed alike; written once."""
    import nibabel as nib

    from components import write_dataset

    corpus = write_dataset(tmp_path / "unlabeled", num=3, seed=0, varied=True, labels=False)
    data = protocol.Data(tmp_path, [], [], [], [], [], corpus)
    datalist = plan_module.matched_corpus(data)
    source, matched = json.loads(corpus.read_text()), json.loads(datalist.read_text())
    assert [len(matched[key]) for key in ("training", "validation")] == [len(source[key]) for key in ("training", "validation")]
    for item in matched["training"] + matched["validation"]:
        image = nib.load(str(datalist.parent / item["image"]))
        assert np.allclose(image.header.get_zooms()[:3], [1.0, 1.0, 2.0]) and nib.aff2axcodes(image.affine) == ("R", "A", "S")
    first = (datalist.parent / matched["training"][0]["image"]).stat().st_mtime_ns
    assert plan_module.matched_corpus(data) == datalist
    assert (datalist.parent / matched["training"][0]["image"]).stat().st_mtime_ns == first  # not written again


def test_a_pretraining_stopped_by_the_collapse_guard_is_a_failed_pretraining(tmp_path, monkeypatch):
    """A self-distillation run that its collapse guard stops is recorded as failed (verdict collapsed) and reused as
    such; any other failure of a run still stops the plan."""
    import low_data_runs as runner

    calls = []

    def collapsing(bundle, configs=("train.json",), overrides=None, log=None, echo=True, threads=None):
        calls.append(bundle)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("ERROR StopOnCollapse: ...\ncomponents.recipes.self_distillation.collapse.TeacherCollapseError: the "
                       "teacher has collapsed (the output is uniform): entropy 0.9998\n")  # fmt: skip
        raise RuntimeError("bundle run failed (exit 1)")

    monkeypatch.setattr(runner, "run_bundle", collapsing)
    run_dir = tmp_path / "run"
    overrides = {"output_dir": str(run_dir / "eval"), "ckpt_dir": str(run_dir / "models"), "training#seed": 1}
    record = runner.run_pretraining("dino", "k", overrides, tmp_path / "results", None, stem="pretrain_dino_s1", collapse_fails=True)
    assert record["failed"] == "the teacher has collapsed (the output is uniform): entropy 0.9998" and record["model"] is None
    assert record["health"]["verdict"] == "collapsed" and not schedule.passes(record, PLAN)
    assert json.loads((tmp_path / "results" / "pretrain_dino_s1_k.json").read_text())["failed"] == record["failed"]
    assert runner.run_pretraining("dino", "k", overrides, tmp_path / "results", None, stem="pretrain_dino_s1", collapse_fails=True) == record
    assert len(calls) == 1  # reused, not run again
    with pytest.raises(RuntimeError, match="bundle run failed"):
        runner.run_pretraining("dino", "other", overrides, tmp_path / "results", None)  # protocol 2: a failure stops the plan
