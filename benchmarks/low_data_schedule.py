"""Protocol v3's runs: the pretrainings seed by seed behind the health gate, the finetuning of every pretraining that
passed it over the finetuning seeds, the shared baselines, the summary (:func:`run`), and the scratch-only pilot that
fixes the finetuning budget (:func:`pilot`). ``low_data.py`` is their command line.

Every pretraining and finetuning is a real bundle run (``low_data_runs.run_pretraining`` / ``run_finetuning``), its
record written as it finishes under a key of its settings, the code that ran and its numerics; a re-run reuses the
finished runs, and a killed run leaves no record and runs again from its start. A plan's run that fails runs once
more from its start, and is recorded as failed if it fails again (:func:`crash_rule`); every record the plan obtains
is entered in its results folder's append-only ledger (:func:`ledger_add`), so that a record deleted or changed later
is found (:func:`ledger_changes`).
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

from components import sha256_file
from components.demo.recipes import CT_BUNDLE, RECIPES as DEMO_RECIPES, SPACING, finetune_overrides, training_class_weights
from low_data_arms import PROBE_NETWORK
from low_data_plan import (
    MATCHED, MATCHED_OVERRIDES, PROBE_RANDOM, RECIPE_NAMES, SCRATCH, Plan, check_data, check_plan,
    check_preregistered, finetune_block, matched_corpus, preregistration_status, seed_data, synthetic_data,
    training_volumes, users_data, write_seed_datalist,
)
from low_data_protocol import HELD_OUT_SETS, Data, code_state, digest, run_code, write_json
from low_data_runs import _portable, record_file, run_finetuning, run_numerics, run_pretraining
from low_data_verdicts import convergence, coverage_by_kind, family, not_converged
from machine import git_commit, machine_info

RESULT_KEYS = ("a result's key is the sha256 of its run's overrides, datalist (or corpus, and its spacing), the "
               "pretraining's recipe, seed, key and weights' sha256 (finetuning), the code that ran (the components "
               "package's source digest less demo/run.py, and the sha256 of every bundle config the run reads) and its "
               "numerics (device, torch and MONAI version, the CPU's vector instructions); the pilot's keys are marked "
               "so that the plan never reuses a pilot run; a record of other settings, code or numerics is never reused")


def passes(record: dict, plan: Plan) -> bool:
    """The health gate: the pretraining's last health report has a verdict of ``plan.passing``."""
    return bool(record.get("health")) and record["health"]["verdict"] in plan.passing


def seeds_to_run(passed: list[bool], plan: Plan) -> list[int]:
    """The pretraining seeds to run next, given whether seeds 0, 1, ... (``passed``, in order) passed the gate: seeds
    up to ``plan.pretrainings`` - 1 first, then one more at a time while fewer than ``plan.pretrainings`` passed and
    fewer than ``plan.max_pretrainings`` were tried; none once either is reached."""
    tried, good = len(passed), sum(passed)
    if good >= plan.pretrainings or tried >= plan.max_pretrainings:
        return []
    return list(range(tried, plan.pretrainings)) if tried < plan.pretrainings else [tried]


def recipe_status(recipe: str, records: dict[int, dict], plan: Plan, incomplete: bool) -> str:
    """``evaluated``, ``incomplete: ...`` (a pretraining of the recipe not run yet) or ``not evaluated: N of M encoders
    passed health``."""
    good = sum(passes(r, plan) for r in records.values())
    if good >= plan.pretrainings:
        return "evaluated"
    if incomplete:
        return f"incomplete: {good} of {len(records)} pretrainings run so far passed health"
    return f"not evaluated: {good} of {len(records)} encoders passed health"


def pretraining_job(recipe: str, seed: int, plan: Plan, corpus: Path, out: Path, numerics: dict, code: dict) -> tuple[str, dict, str]:
    """(key, overrides, bundle) of pretraining ``seed`` of ``recipe``: the demo's overrides of its recipe (a matched
    recipe: its demo recipe's, with :data:`~low_data_plan.MATCHED_OVERRIDES`) on ``corpus`` at the plan's budget; its
    folder is ``out/pretrain/<recipe>_s<seed>_<key>``."""
    demo = DEMO_RECIPES[MATCHED.get(recipe, recipe)]
    overrides = {**demo.overrides(plan.budget, corpus.parent, Path("."), numerics["device"], seed), "datalist": str(corpus),
                 **(MATCHED_OVERRIDES if recipe in MATCHED else {}),
                 **({"training#rankme_crops": plan.health_crops} if plan.health_crops else {})}  # fmt: skip
    key = digest({"protocol": 3, "recipe": recipe, "pretraining_seed": seed, "overrides": _portable(overrides, out),
                  "corpus": corpus.read_text(), "corpus_spacing": SPACING if recipe in MATCHED else "native",
                  "code": run_code(code, demo.bundle), "numerics": numerics})  # fmt: skip
    run_dir = out / "pretrain" / f"{recipe}_s{seed}_{key}"
    overrides.update(output_dir=str(run_dir / "eval"), ckpt_dir=str(run_dir / "models"))
    return key, overrides, demo.bundle


def run_stem(arm: str, k: int, seed: int, pretraining_seed: int | None) -> str:
    """A finetuning record's file name without its key: ``scratch_k1_f0``, ``mim_p2_k1_f0``."""
    return f"{arm}_k{k}_f{seed}" if pretraining_seed is None else f"{arm}_p{pretraining_seed}_k{k}_f{seed}"


def finetune_job(
    arm: str, k: int, seed: int, plan: Plan, data: Data, datalist: Path, out: Path, numerics: dict, code: dict,
    pretraining: dict | None, pilot: bool = False,
) -> tuple[str, dict]:
    """(key, overrides) of one finetuning run: the CT bundle at the plan's budget from the pretraining's encoder
    (``pretraining``: its record, None for a random encoder), a probe arm (``probe_*``) with the linear probe network;
    the arms of one (k, seed) differ in nothing else. ``pilot`` marks a pilot run's key."""
    epochs = plan.finetune_iterations // k
    budget = replace(plan.budget, finetune_epochs=epochs, val_interval=plan.val_every // k)
    weights = Path(pretraining["model"]) if pretraining else None
    overrides = finetune_overrides(budget, datalist, Path("."), numerics["device"], 1000 + seed, weights,
                                   training_class_weights(datalist, data.label_names))  # fmt: skip
    overrides.update({"label_names": data.label_names, "training#freeze_encoder_iterations": 0,
                      **({"network_def#network": PROBE_NETWORK} if arm.startswith("probe_") else {})})  # fmt: skip
    source = None if pretraining is None else {f: pretraining[f] for f in ("recipe", "seed", "key", "sha256")}
    key = digest({"protocol": 3, "arm": arm, "k": k, "finetune_seed": seed, "pretraining": source, "overrides": _portable(overrides, out),
                  "datalist": datalist.read_text(), "code": run_code(code, CT_BUNDLE), "numerics": numerics,
                  **({"pilot": True} if pilot else {})})  # fmt: skip
    run_dir = out / "runs" / f"{run_stem(arm, k, seed, source and source['seed'])}_{key}"
    overrides.update(output_dir=str(run_dir / "eval"), ckpt_dir=str(run_dir / "models"))
    return key, overrides


def plan_settings(plan: Plan, numerics: dict, code: dict, data: str = "synthetic") -> dict:
    """What a summary records of its plan (hashed into ``settings_hash``), as JSON values."""
    settings = {**asdict(plan), "training_pool": plan.training_pool, "device": numerics["device"],
                "numerics": numerics, "code": code, "result_keys": RESULT_KEYS, "data": data}  # fmt: skip
    return json.loads(json.dumps(settings))


def draws(data: Data, plan: Plan, seeds: list[int]) -> dict:
    """Per finetuning seed of ``seeds`` its training volumes at each k and its held-out draws (paths as in the
    datalists)."""
    out = {}
    for f in seeds:
        drawn = seed_data(data, f, plan)
        out[str(f)] = {"training": {str(k): [i["image"] for i in training_volumes(data, k, f, plan)] for k in plan.ks},
                       **{h: [i["image"] for i in getattr(drawn, h)] for h in HELD_OUT_SETS}}  # fmt: skip
    return out


def units(plan: Plan, runs: list[dict], pretrainings: dict[str, dict[int, dict]]) -> list[dict]:
    """Which pretraining units are done: per recipe and pretraining seed run so far, its health verdict and, when it
    passed the gate, how many of its runs exist (its finetuned and probe runs over its block at every k, and the
    block's baselines); a unit is complete when it failed the gate or has every run."""
    have = {(r["arm"], r.get("pretraining_seed"), r["k"], r["seed"]) for r in runs}
    out = []
    for recipe, records in pretrainings.items():
        for p, record in sorted(records.items()):
            block = [(k, f) for k in plan.ks for f in finetune_block(p, plan)]
            needed = [(arm, p, k, f) for arm in (recipe, f"probe_{recipe}") for k, f in block]
            needed += [(arm, None, k, f) for arm in (SCRATCH, PROBE_RANDOM) for k, f in block]
            needed = needed if passes(record, plan) else []
            done = sum(n in have for n in needed)
            out.append({"recipe": recipe, "seed": p, "verdict": (record.get("health") or {}).get("verdict"),
                        "passed": passes(record, plan), "runs_done": done, "runs_needed": len(needed),
                        "complete": done == len(needed)})  # fmt: skip
    return out


def failure(record: dict) -> str | None:
    """Why a finetuning record is a failed run: its ``failed`` message (:func:`crash_rule`), or the held-out sets on
    which its selected model's Dice is NaN (no class present scored); None for a run that counts."""
    if record.get("failed"):
        return record["failed"]
    nan = [h for h in HELD_OUT_SETS if math.isnan(record["dice"]["selected"][h]["mean"])]
    return f"the selected model's Dice is NaN on {', '.join(nan)}" if nan else None


def uses(recipe: str, record: dict, passing: dict[str, list[int]], plan: Plan) -> bool:
    """Whether a cell of ``recipe``'s family (:func:`~low_data_verdicts.family`) reads finetuning ``record``: a run of
    the recipe's arms, of the finetuned arm of the recipe it is matched with, or a baseline run of a block that a passing
    pretraining (``passing``: per recipe its seeds) of either uses."""
    other = MATCHED.get(recipe)
    if record.get("pretraining_seed") is not None:
        return record["arm"] in (recipe, f"probe_{recipe}", other)
    seeds = passing.get(recipe, []) + (passing.get(other, []) if other else [])
    return any(record["seed"] in finetune_block(p, plan) for p in seeds)


def summarise(plan: Plan, runs: list[dict], pretrainings: dict[str, dict[int, dict]], incomplete: set[str],
              unregistered: Sequence[str] = (), analysis_changed: Sequence[str] = (), records_changed: Sequence[str] = ()) -> dict:  # fmt: skip
    """The statistics of a plan's records: per recipe its pretrainings (seed, key, verdict, whether it passed, the
    health report), its status (:func:`recipe_status`), its primary contrast and secondary cells
    (:func:`~low_data_verdicts.family`) with the finetuning verdicts withheld where ``scratch`` did not converge at
    every k, the probe verdicts where ``probe_random`` or the recipe's own probe did not, and all of them where a
    record was made at a commit that does not follow the pre-registration (``unregistered``), the analysis code
    differs from the pre-registered one (``analysis_changed``: its files) or a record was deleted or changed since
    written (``records_changed``: :func:`ledger_changes`); a recipe's verdicts where one of its cells would read a
    failed run (:func:`failure`, :func:`uses`: the failed runs are listed, and left out of every statistic, never
    taken as simply missing); the convergence tables; the coverage per cell kind."""
    failed = sorted(((run_stem(r["arm"], r["k"], r["seed"], r.get("pretraining_seed")), why, r) for r in runs if (why := failure(r))),
                    key=lambda entry: entry[0])  # fmt: skip
    counted = [r for r in runs if not failure(r)]
    passing = {r: sorted(s for s, rec in records.items() if passes(rec, plan))[: plan.pretrainings] for r, records in pretrainings.items()}
    evaluated = {r: passing[r] for r in plan.recipes if recipe_status(r, pretrainings[r], plan, r in incomplete) == "evaluated"}
    hit = {r: [stem for stem, _, record in failed if uses(r, record, evaluated, plan)] for r in evaluated}
    arms = (SCRATCH, PROBE_RANDOM, *(f"probe_{r}" for r in evaluated))
    table = {arm: convergence(counted, arm, plan.ks, plan.convergence_gain) for arm in arms}
    withheld = {"finetune": not_converged(table[SCRATCH]), "probe": not_converged(table[PROBE_RANDOM]),
                "probe_heads": {r: not_converged(table[f"probe_{r}"]) for r in evaluated},
                "registration": f"records made at commits that do not follow the pre-registration: {', '.join(unregistered)}"
                if unregistered else None,
                "analysis_code": f"analysis code changed since the pre-registration: {', '.join(analysis_changed)}"
                if analysis_changed else None,
                "records": f"records deleted or changed since written: {', '.join(records_changed)}" if records_changed else None,
                "failed_runs": {r: f"failed runs: {', '.join(stems)}" if stems else None for r, stems in hit.items()}}  # fmt: skip
    everything = "; ".join(filter(None, (withheld["registration"], withheld["analysis_code"], withheld["records"])))  # every verdict
    recipes = {}
    for recipe in plan.recipes:
        records = pretrainings[recipe]
        entry = {"name": RECIPE_NAMES[recipe], "status": recipe_status(recipe, records, plan, recipe in incomplete),
                 "passing_seeds": passing[recipe],
                 "pretrainings": [{"seed": s, "key": r["key"], "passed": passes(r, plan), "verdict": (r.get("health") or {}).get("verdict"),
                                   "health": r.get("health"), "seconds": r.get("seconds"), "commit": r.get("commit")}
                                  for s, r in sorted(records.items())]}  # fmt: skip
        if recipe in evaluated:
            entry.update(family(counted, recipe, evaluated, plan))
            probe = "; ".join(filter(None, (withheld["probe"], withheld["probe_heads"][recipe] and
                                            f"its probe's {withheld['probe_heads'][recipe]}")))  # fmt: skip
            own = "; ".join(filter(None, (everything, withheld["failed_runs"][recipe])))
            for cell in [entry["primary"], *entry["secondary"]["cells"].values()]:
                reason = own or (probe if cell.get("kind") == "probe" else withheld["finetune"])
                if reason:
                    cell.update(verdict=None, withheld=reason)
        recipes[recipe] = entry
    return {"recipes": recipes, "units": units(plan, runs, pretrainings), "convergence": table,
            "withheld": withheld, "failed_runs": [{"run": stem, "failed": why} for stem, why, _ in failed],
            "coverage": coverage_by_kind(counted, evaluated, plan)}  # fmt: skip


#: a plan's ledger, in its results folder: one JSON line ``{"file", "sha256"}`` per record file and content obtained
LEDGER = "ledger.jsonl"
_LEDGER_LOCK = threading.Lock()  # the runs side by side add to it


def _ledger(results: Path) -> list[dict]:
    path = results / LEDGER
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def ledger_add(results: Path, record: Path) -> None:
    """Makes sure the ledger of ``results`` (:data:`LEDGER`) has the line of record file ``record`` as its bytes are
    now: appended once, never rewritten, so that a record deleted or changed later is still found
    (:func:`ledger_changes`), even one made again."""
    entry = {"file": record.name, "sha256": sha256_file(record)}
    with _LEDGER_LOCK:
        if entry not in _ledger(results):
            with (results / LEDGER).open("a") as f:
                f.write(json.dumps(entry) + "\n")


def ledger_changes(results: Path) -> list[str]:
    """The record files of the ledger of ``results`` that are gone (``<file> (deleted)``) or whose bytes no longer
    match one of its lines (``<file> (changed)``), each once, in the ledger's order."""
    changes: list[str] = []
    for entry in _ledger(results):
        path = results / entry["file"]
        change = "deleted" if not path.is_file() else "changed" if sha256_file(path) != entry["sha256"] else None
        if change and f"{entry['file']} ({change})" not in changes:
            changes.append(f"{entry['file']} ({change})")
    return changes


def crash_rule(what: str, call: Callable[[], dict | None], path: Path, failed: Callable[[str], dict]) -> dict | None:
    """Protocol v3's rule for a run that fails: ``call`` (one bundle run, or its reuse) that raises ``RuntimeError``
    (``run_bundle``'s failed run, a finetuning that logged no validation) runs once more from its start; if it fails
    again, ``failed(message)`` (the first line of the second error) is written as the run's record at ``path`` and
    returned, reused as such by a re-run. A failed run is reported, never dropped silently. Protocol 2
    (``low_data_lever.py``) and the pilot still stop at a failed run."""
    for attempt in (1, 2):
        try:
            return call()
        except RuntimeError as err:
            message = (str(err).splitlines() or [type(err).__name__])[0]
            then = "running it once more from its start" if attempt == 1 else "recorded as failed"
            print(f"{what} failed ({message}): {then}", file=sys.stderr, flush=True)
    record = failed(message)
    write_json(path, record)
    return record


class _Clock:
    """Whether a piece is past its ``stop_after_s``: no run starts after it."""

    def __init__(self, stop_after_s: float | None) -> None:
        self.started, self.stop_after_s = time.perf_counter(), stop_after_s

    def late(self) -> bool:
        return self.stop_after_s is not None and time.perf_counter() - self.started > self.stop_after_s

    def seconds(self) -> float:
        return round(time.perf_counter() - self.started, 1)


def _prepare(plan: Plan, out: Path, device: str, parallel: int, results: Path | None, pilot: bool, lists: dict,
             data: Data | None, report_only: bool = False):  # fmt: skip
    """Checks the plan (and, for a plan's runs, its pre-registration) and builds its data (unless ``data`` is given,
    checked already) before any run; returns (out, results, data, threads per run, numerics, code)."""
    check_plan(plan, pilot=pilot)
    if not (pilot or report_only):
        check_preregistered(plan, git_commit())
    out = out.resolve()
    if data is None and (lists.get("labeled") or lists.get("unlabeled")):
        if not (lists.get("labeled") and lists.get("unlabeled")):
            raise ValueError("--labeled and --unlabeled go together (a labeled list and an unlabeled corpus).")
        data = users_data(out / "data", plan, lists["labeled"], lists["unlabeled"], lists.get("shifted"))
    elif data is None:
        data = synthetic_data(out / "data", plan)
    check_data(data, plan)
    return out, (results or out / "results").resolve(), data, max(1, (os.cpu_count() or 1) // parallel), run_numerics(device), code_state()


def _finetune(job: tuple, plan: Plan, data: Data, out: Path, results: Path, numerics: dict, code: dict,
              threads: int, skip: bool, pilot: bool = False) -> tuple[dict | None, Path]:  # fmt: skip
    """Runs (or reuses; with ``skip`` only reuses) one finetuning ``job``: (arm, k, seed, pretraining record or None);
    returns its record (None: not run) and the record's file. A plan's run (not the ``pilot``'s) follows
    :func:`crash_rule`: failing twice, it is recorded as failed (``failed``: the message, no Dice)."""
    arm, k, seed, pretraining = job
    datalist = write_seed_datalist(data, k, seed, plan)
    key, overrides = finetune_job(arm, k, seed, plan, data, datalist, out, numerics, code, pretraining, pilot)
    p = pretraining["seed"] if pretraining else None
    stem = run_stem(arm, k, seed, p)
    fields = {"pretraining_seed": p, "recipe": pretraining["recipe"] if pretraining else None, "finetune_iterations": plan.finetune_iterations}

    def call() -> dict | None:
        return run_finetuning(arm, k, seed, key, overrides, seed_data(data, seed, plan), results, threads, skip, stem=stem,
                              pretrained=pretraining is not None, fields=fields)  # fmt: skip

    path = record_file(results, stem, key)
    record = call() if pilot else crash_rule(stem, call, path, lambda message: {"arm": arm, "k": k, "seed": seed, "key": key,
                                                                                "commit": git_commit(), "failed": message, **fields})  # fmt: skip
    if record is not None and record.get("failed"):
        print(f"{stem}: failed ({record['failed']})", file=sys.stderr, flush=True)
    elif record is not None:
        sel = record["dice"]["selected"]
        print(f"{run_stem(arm, k, seed, p)}: selected (iteration {record['selected_iteration']}) in-domain "
              f"{sel['in_domain']['mean']:.4f}, shifted {sel['shifted']['mean']:.4f}", file=sys.stderr, flush=True)  # fmt: skip
    return record, path


def run(
    plan: Plan, out: Path, device: str, parallel: int = 1, results: Path | None = None,
    report_only: bool = False, stop_after_s: float | None = None, labeled: Path | None = None, unlabeled: Path | None = None,
    shifted: Path | None = None, data: Data | None = None,
) -> dict:
    """Runs (or completes) protocol v3's plan and returns its summary, unit by unit: in rounds of one pretraining seed
    per recipe (the lowest :func:`seeds_to_run` gives), the round's pretrainings behind the gate (:func:`passes`), then
    each passing one's finetuned and probe arms over its block (:func:`~low_data_plan.finetune_block`) at every k,
    with ``scratch`` and ``probe_random`` of that block once (:func:`units` says which are done). A passing
    pretraining is finetuned at once, even if its recipe ends with too few passing for a verdict. With ``report_only``
    nothing runs; with ``stop_after_s`` no run starts after that many seconds: the summary lists the missing runs
    (``complete`` false) and the same command continues.

    ``labeled`` / ``unlabeled`` / ``shifted``: a user's datalists instead of the synthetic sets
    (:func:`~low_data_plan.users_data`); ``data``: those lists' data already built and checked (``low_data.py`` checks
    them before it imports torch).

    Raises:
        PlanError: a plan or data that cannot serve the rules (:func:`~low_data_plan.check_plan`), or a plan not
            pre-registered at this checkout's commit (:func:`~low_data_plan.check_preregistered`), before any run.
        DatalistError: a user's list that cannot serve it, before any run.
    """
    clock = _Clock(stop_after_s)
    lists = {"labeled": labeled, "unlabeled": unlabeled, "shifted": shifted}
    out, results, data, threads, numerics, code = _prepare(plan, out, device, parallel, results, False, lists, data,
                                                           report_only)  # fmt: skip
    corpora = {r: matched_corpus(data) if r in MATCHED else data.unlabeled for r in plan.recipes}
    missing: list[str] = []
    pretrainings: dict[str, dict[int, dict]] = {r: {} for r in plan.recipes}
    incomplete: set[str] = set()

    def pretrain(job: tuple[str, int]) -> dict | None:
        recipe, seed = job
        key, overrides, bundle = pretraining_job(recipe, seed, plan, corpora[recipe], out, numerics, code)
        stem, skip = f"pretrain_{recipe}_s{seed}", report_only or clock.late()
        path = record_file(results, stem, key)

        def crashed(message: str) -> dict:  # a failed pretraining, as one its collapse guard stopped: it fails the gate
            return {"recipe": recipe, "key": key, "sha256": None, "seconds": None, "commit": git_commit(), "seed": seed, "failed": message,
                    "health": {"verdict": "crashed", "stopped_by": "two failed runs", "message": message, "signals": {}}}  # fmt: skip

        try:
            record = crash_rule(f"pretraining {recipe} seed {seed}", lambda: run_pretraining(
                recipe, key, overrides, results, threads, skip, bundle=bundle, stem=stem, collapse_fails=True), path, crashed)  # fmt: skip
        except FileNotFoundError:
            missing.append(f"pretraining {recipe} seed {seed}")
            return None
        ledger_add(results, path)
        print(f"pretraining {recipe} seed {seed}: {(record.get('health') or {}).get('verdict')}", file=sys.stderr, flush=True)
        return {"model": None, **record, "recipe": recipe, "seed": seed}

    def one(job: tuple) -> dict | None:
        record, path = _finetune(job, plan, data, out, results, numerics, code, threads, report_only or clock.late())
        if record is None:
            missing.append(run_stem(job[0], job[1], job[2], job[3]["seed"] if job[3] else None))
        else:
            ledger_add(results, path)
        return record

    runs: list[dict] = []
    baselines: set[int] = set()
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        # unit by unit, in rounds of one pretraining seed per recipe (its lowest still to try): the round's
        # pretrainings, then the finetuned and probe runs of each that passed over its block, with the block's
        # baselines (blocks 0 .. pretrainings - 1 always, as every recipe's first tries use them, and any other block
        # a passing pretraining uses), so that units complete as the plan goes
        while jobs := [(r, tries[0]) for r in plan.recipes if r not in incomplete
                       if (tries := seeds_to_run([passes(pretrainings[r][i], plan) for i in sorted(pretrainings[r])], plan))]:  # fmt: skip
            for (recipe, seed), record in zip(jobs, pool.map(pretrain, jobs)):
                if record is None:
                    incomplete.add(recipe)
                else:
                    pretrainings[recipe][seed] = record
            passed = [(r, s) for r, s in jobs if s in pretrainings[r] and passes(pretrainings[r][s], plan)]
            blocks = sorted(({s for _, s in jobs if s < plan.pretrainings} | {s for _, s in passed}) - baselines)
            baselines.update(blocks)
            finetunes = [(arm, k, f, None) for b in blocks for f in finetune_block(b, plan) for k in plan.ks for arm in (SCRATCH, PROBE_RANDOM)]
            finetunes += [(arm, k, f, pretrainings[r][p]) for r, p in passed for f in finetune_block(p, plan) for k in plan.ks
                          for arm in (r, f"probe_{r}")]  # fmt: skip
            runs += [r for r in pool.map(one, finetunes) if r is not None]
    settings = plan_settings(plan, numerics, code, "user datalists" if labeled else "synthetic")
    commits = sorted({r["commit"] for r in runs} | {p["commit"] for recs in pretrainings.values() for p in recs.values()})
    registration = None if plan.trial else preregistration_status(commits)
    changed = ledger_changes(results)
    return {
        "benchmark": "low_data", "protocol": 3, "settings": settings, "settings_hash": digest(settings),
        "data": {**data.files(), "per_seed": draws(data, plan, sorted({r["seed"] for r in runs}))},
        **summarise(plan, runs, pretrainings, incomplete, registration["not_after"] if registration else [],
                    (registration["analysis_changed"] or []) if registration else [], changed),
        "records_changed": changed,
        "complete": not missing, "missing_runs": sorted(missing),
        "runs": sorted(runs, key=lambda r: (r["seed"], r["k"], r["arm"], r.get("pretraining_seed") or 0)),
        "commits": commits, "preregistration": registration,
        "machine": {**machine_info(), "threads_per_run": threads, "parallel_runs": parallel}, "total_seconds": clock.seconds(),
    }  # fmt: skip


def pilot(
    plan: Plan, out: Path, device: str, parallel: int = 1, results: Path | None = None,
    report_only: bool = False, stop_after_s: float | None = None, labeled: Path | None = None, unlabeled: Path | None = None,
    shifted: Path | None = None, data: Data | None = None,
) -> dict:
    """The pilot that fixes the finetuning budget before the pre-registration: ``scratch`` and ``probe_random`` only (no
    pretrained encoder is read) at every k over block 0's finetuning seeds, for the budgets of
    ``plan.pilot_iterations`` from the smallest up, until one has all its runs and both arms converged at every k
    (the larger ones are then not run: the rule takes the smallest converged budget). Returns per budget run the
    convergence table of both arms (:func:`~low_data_verdicts.convergence`) and that budget (None while none did).
    Its runs' keys are marked: the plan never reuses them.
    ``labeled`` / ``unlabeled`` / ``shifted`` / ``data``: as for :func:`run`."""
    clock = _Clock(stop_after_s)
    lists = {"labeled": labeled, "unlabeled": unlabeled, "shifted": shifted}
    out, results, data, threads, numerics, code = _prepare(plan, out, device, parallel, results, True, lists, data)
    missing: list[str] = []
    table, runs, converged = {}, [], None
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        for iterations in sorted(plan.pilot_iterations):
            budget = replace(plan, finetune_iterations=iterations)
            jobs = [(arm, k, f, None) for f in finetune_block(0, plan) for k in plan.ks for arm in (SCRATCH, PROBE_RANDOM)]

            def one(job: tuple, budget: Plan = budget) -> dict | None:
                record, _ = _finetune(job, budget, data, out, results, numerics, code, threads,
                                      report_only or clock.late(), pilot=True)  # fmt: skip
                if record is None:
                    missing.append(f"{run_stem(*job[:3], None)} at {budget.finetune_iterations} iterations")
                return record

            done = [r for r in pool.map(one, jobs) if r is not None]
            runs += done
            table[str(iterations)] = {arm: convergence(done, arm, plan.ks, plan.convergence_gain) for arm in (SCRATCH, PROBE_RANDOM)}
            if len(done) == len(jobs) and all(e["converged"] for per_k in table[str(iterations)].values() for e in per_k.values()):
                converged = iterations
                break
    settings = plan_settings(plan, numerics, code, "user datalists" if labeled else "synthetic")
    return {
        "benchmark": "low_data_pilot", "protocol": 3, "settings": settings, "settings_hash": digest(settings),
        "rule": f"converged: the last quarter of the validations gains less than {plan.convergence_gain} over the quarter before",
        "convergence": table, "smallest_converged_budget": converged,
        "not_run": [b for b in sorted(plan.pilot_iterations) if str(b) not in table],
        "complete": not missing, "missing_runs": sorted(missing), "runs": runs,
        "machine": {**machine_info(), "threads_per_run": threads, "parallel_runs": parallel}, "total_seconds": clock.seconds(),
    }  # fmt: skip
