"""The low-data protocol's runs: each pretraining and finetuning as a real bundle run keyed by its settings, code and
numerics, and :func:`run`, which completes a plan and summarises it (``low_data.py`` is its command line).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

import monai
import torch

from components import atomic_write
from components.demo.recipes import CT_BUNDLE, RECIPES, finetune_overrides, training_class_weights
from components.demo.runner import fresh_run_dir, read_scalars, run_bundle
from low_data_arms import ARMS, BASELINES, PROBE_NETWORK, plan_contrasts
from low_data_docs import plots
from low_data_rankme import encoder_rankme, rankme_agreement
from low_data_protocol import (
    HELD_OUT_SETS, Data, Plan, code_state, digest, sha256_file, pool_for, run_code, synthetic_data,
    user_data, write_datalist, write_json,
)
from low_data_stats import convergence, coverage, needs_more_seeds, paired, populations, table
from machine import git_commit, machine_info


# each recipe's pretraining bundle and the overrides of its run, as the demo runs it (the plan's budget sizes it)
PRETRAINING = {recipe: (spec.bundle, spec.overrides) for recipe, spec in RECIPES.items()}


def _portable(overrides: dict, out: Path) -> dict:
    """Overrides without the run's own folders and with paths relative to ``out``: what a result's key covers."""
    skip = ("output_dir", "ckpt_dir", "pretrained_path")
    return {k: (v.replace(str(out), "<out>") if isinstance(v, str) else v) for k, v in overrides.items() if k not in skip}


def run_numerics(device: str) -> dict:
    """What a run's floating-point results depend on besides its settings and code, part of every result's key: the
    device, the torch and MONAI versions and, on the CPU, the vector instructions its kernels dispatch to
    (``torch.backends.cpu.get_cpu_capability()``). A CPU run repeats bit for bit on one machine, but one finetuning
    run of the plan, same settings and seed, selected a model of held-out Dice 0.600 on an AVX2 VM and 0.652 on an
    AVX-512 one: results of other numerics are neither reused nor paired. On CUDA, whose kernels do not repeat bit
    for bit anyway, the GPU's model is left out, so that pieces of the GPU plan may run on different GPUs."""
    numerics = {"device": device, "torch": torch.__version__, "monai": monai.__version__}
    if device == "cpu":
        numerics["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return numerics


def pretraining_job(recipe: str, plan: Plan, data: Data, out: Path, numerics: dict, code: dict, seed: int) -> tuple[str, dict]:
    """(key, overrides) of a recipe's pretraining run on ``numerics`` (:func:`run_numerics`) and ``code``
    (:func:`~low_data_protocol.code_state`); its folder is ``out/pretrain/<recipe>_<key>``."""
    bundle, make = PRETRAINING[recipe]
    overrides = {**make(plan.budget, data.unlabeled.parent, Path("."), numerics["device"], seed), "datalist": str(data.unlabeled),
                 "training#rankme_crops": plan.rankme_crops, **plan.pretrain_overrides}  # fmt: skip
    key = digest({"recipe": recipe, "overrides": _portable(overrides, out), "corpus": data.unlabeled.read_text(),
                  "code": run_code(code, bundle), "numerics": numerics})  # fmt: skip
    run_dir = out / "pretrain" / f"{recipe}_{key}"
    overrides.update(output_dir=str(run_dir / "eval"), ckpt_dir=str(run_dir / "models"))
    return key, overrides


def finetune_job(
    arm: str, k: int, seed: int, plan: Plan, data: Data, datalist: Path, out: Path, numerics: dict, code: dict,
    weights: dict[str, dict],
) -> tuple[str, dict]:
    """(key, overrides) of one finetuning run on ``numerics`` (:func:`run_numerics`) and ``code``
    (:func:`~low_data_protocol.code_state`). The arms of a (k, seed) pair get the same overrides but for
    ``pretrained_path`` (the arm's encoder) and their kind's: a probe arm's ``network_def#network``
    (:data:`~low_data_arms.PROBE_NETWORK`), a frozen-swinViT arm's ``training#freeze_encoder_iterations`` (the whole
    run). ``weights``: per recipe the finished pretraining's record (``model``, ``sha256``)."""
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {list(ARMS)}, got {arm!r}.")
    recipe, kind = ARMS[arm]
    for name in ("finetune_iterations", "val_every"):
        if getattr(plan, name) % k:
            raise ValueError(f"{name} ({getattr(plan, name)}) must be a multiple of k = {k} (one volume per iteration).")
    epochs = plan.finetune_iterations // k
    budget = replace(plan.budget, finetune_epochs=epochs, val_interval=plan.val_every // k)
    pretrained = Path(weights[recipe]["model"]) if recipe else None
    overrides = finetune_overrides(budget, datalist, Path("."), numerics["device"], 1000 + seed, pretrained,
                                   training_class_weights(datalist, data.label_names))  # fmt: skip
    overrides.update({"label_names": data.label_names,
                      "training#freeze_encoder_iterations": plan.finetune_iterations if kind == "frozen_swinvit" else 0,
                      **({"network_def#network": PROBE_NETWORK} if kind == "probe" else {}), **plan.finetune_overrides})  # fmt: skip
    key = digest({"arm": arm, "k": k, "seed": seed, "overrides": _portable(overrides, out), "datalist": datalist.read_text(),
                  "weights": weights[recipe]["sha256"] if recipe else None,
                  "code": run_code(code, CT_BUNDLE), "numerics": numerics})  # fmt: skip
    run_dir = out / "runs" / f"{arm}_k{k}_seed{seed}_{key}"
    overrides.update(output_dir=str(run_dir / "eval"), ckpt_dir=str(run_dir / "models"))
    return key, overrides


def _per_image_dice(csv: Path, data_root: Path) -> dict[str, float]:
    """Mean Dice over the classes present (NaN: a class absent from image and label) per held-out image, from the
    evaluation's ``val_mean_dice_raw.csv``; keys are paths relative to the data root where possible."""
    out = {}
    for line in csv.read_text().splitlines()[1:]:
        name, *values = line.split(",")
        scores = [float(v) for v in values[:-1] if v.strip().lower() != "nan"]
        path = Path(name)
        key = os.path.relpath(path, data_root) if path.is_relative_to(data_root) else name
        out[key] = statistics.fmean(scores) if scores else float("nan")
    return out


def record_file(results: Path, stem: str, key: str) -> Path:
    """The record of a run: ``<results>/<stem>_<key>.json`` (where :func:`run_pretraining` and :func:`run_finetuning`
    write it)."""
    return results / f"{stem}_{key}.json"


def run_pretraining(
    recipe: str, key: str, overrides: dict, results: Path, threads: int | None, report_only: bool = False, *,
    bundle: str | None = None, stem: str | None = None, collapse_fails: bool = False,
) -> dict:
    """Runs (or reuses) one pretraining; returns its record (model path and sha256, final losses, last RankMe, the
    run's last health report, ``eval/health.json``, None when the bundle wrote none). With ``report_only`` the
    recorded run is used as it is (its weights may be absent: no RankMe then). ``bundle``: the bundle to run (default:
    the recipe's, :data:`PRETRAINING`); ``stem``: the record's file name without ``_<key>.json`` (default
    ``pretrain_<recipe>``). With ``collapse_fails``, a run that the self-distillation bundle's collapse guard stopped
    (``TeacherCollapseError`` in its log) is recorded as a failed pretraining: no weights, ``failed`` its message and a
    health report of verdict ``collapsed`` (the gate of protocol v3 reports it and runs the next seed).

    The weights are kept beside the record, ``<results>/pretrain_<recipe>_<key>.pt``, and reused from there when the
    run's folder is gone: a piece of the plan on a fresh machine (a GPU lent for one call) continues from the results
    folder alone, carried there with its weights (git ignores them). Retraining would not do: a CUDA pretraining need
    not repeat bit for bit (the SSL recipe's did not on an H200), and the finetuning keys hold the weights' sha256.

    Raises:
        FileNotFoundError: with ``report_only``, for a pretraining that has no record.
    """
    run_dir = Path(overrides["ckpt_dir"]).parent
    record_path = record_file(results, stem or f"pretrain_{recipe}", key)
    kept = record_path.with_suffix(".pt")
    model = run_dir / "models" / "model.pt"
    if record_path.is_file():
        record = json.loads(record_path.read_text())
        if record.get("failed"):
            return {**record, "model": None}
        for weights in (model, kept):
            if weights.is_file() and sha256_file(weights) == record["sha256"]:
                return {**record, "model": str(weights)}
        if report_only:
            return {**record, "model": str(model)}
    if report_only:
        raise FileNotFoundError(f"no record of the {recipe} pretraining with these settings ({record_path}): nothing to report.")
    fresh_run_dir(run_dir)  # a killed run's events or checkpoints must not mix into the new one
    try:
        seconds = run_bundle(bundle or PRETRAINING[recipe][0], overrides=overrides, log=run_dir / "train.log", echo=False, threads=threads)
    except RuntimeError:
        collapse = _collapse_message(run_dir / "train.log") if collapse_fails else None
        if collapse is None:
            raise
        record = {"recipe": recipe, "key": key, "sha256": None, "seconds": None, "commit": git_commit(),
                  "seed": overrides.get("training#seed"), "failed": collapse,
                  "health": {"verdict": "collapsed", "stopped_by": "the bundle's collapse guard", "message": collapse, "signals": {}}}  # fmt: skip
        write_json(record_path, record)
        return {**record, "model": None}
    scalars = read_scalars(run_dir / "eval")
    health = run_dir / "eval" / "health.json"
    record = {"recipe": recipe, "key": key, "sha256": sha256_file(model), "seconds": round(seconds, 1), "commit": git_commit(),
              "final_losses": {t: v[-1][1] for t, v in scalars.items() if t.startswith("loss")},
              "logged_rankme": scalars["val_rankme"][-1][1] if scalars.get("val_rankme") else None,
              "logged_rankme_crops": overrides.get("training#rankme_crops"), "seed": overrides.get("training#seed"),
              "health": json.loads(health.read_text())["reports"][-1] if health.is_file() else None}  # fmt: skip
    if record_path.is_file() and json.loads(record_path.read_text())["sha256"] != record["sha256"]:
        print(f"WARNING: pretraining {recipe} {key} gave other weights than its recorded run: the finetuning results "
              "of the recorded weights are not reused (their keys hold the weights' hash)", file=sys.stderr, flush=True)  # fmt: skip
    with atomic_write(kept) as f, model.open("rb") as weights:  # first: a record never names weights not there
        shutil.copyfileobj(weights, f)
    write_json(record_path, record)
    return {**record, "model": str(model)}


def _collapse_message(log: Path) -> str | None:
    """The collapse guard's message in a run's log (the line after ``TeacherCollapseError:``), None without one."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    found = re.search(r"TeacherCollapseError: (.+)", text)
    return found[1].strip() if found else None


def run_finetuning(
    arm: str, k: int, seed: int, key: str, overrides: dict, data: Data, results: Path, threads: int | None, report_only: bool = False,
    *, stem: str | None = None, fields: dict | None = None, pretrained: bool | None = None,
) -> dict | None:
    """Runs (or reuses) one finetuning run and scores its selected and last models on both held-out sets (``data``'s
    ``in_domain`` and ``shifted``); with ``report_only`` a run without a result is not run (None). ``stem``: the
    record's file name without ``_<key>.json`` (default ``<arm>_k<k>_seed<seed>``); ``fields``: added to the record;
    ``pretrained``: whether the arm starts from a pretrained encoder (default: the arm's in :data:`ARMS`)."""
    record_path = record_file(results, stem or f"{arm}_k{k}_seed{seed}", key)
    if record_path.is_file():
        return json.loads(record_path.read_text())
    if report_only:
        return None
    run_dir = Path(overrides["ckpt_dir"]).parent
    fresh_run_dir(run_dir)  # a killed run's events or checkpoints must not mix into the new one
    seconds = run_bundle(CT_BUNDLE, overrides=overrides, log=run_dir / "train.log", echo=False, threads=threads)
    # one volume per iteration: epoch e ends at iteration e * k
    curve = [[epoch * k, value] for epoch, value in read_scalars(run_dir / "eval").get("val_mean_dice", [])]
    if not curve:
        raise RuntimeError(f"finetuning run {run_dir} logged no validation Dice (see {run_dir / 'train.log'}).")
    best = max(value for _, value in curve)
    selected_iteration = next(i for i, value in curve if value == best)
    models = {"selected": run_dir / "models" / "model.pt", "last": run_dir / "models" / "checkpoint.pt"}
    dice: dict[str, dict] = {}
    for name, model in models.items():
        if name == "last" and selected_iteration == curve[-1][0]:
            dice[name] = dice["selected"]  # the same weights: the best validation was the last one
            continue
        eval_dir = run_dir / f"heldout_{name}"
        seconds += run_bundle(CT_BUNDLE, ("train.json", "evaluate.json"), {**overrides, "eval_list": "heldout", "checkpoint": str(model),
                              "output_dir": str(eval_dir)}, log=run_dir / f"heldout_{name}.log", echo=False, threads=threads)  # fmt: skip
        per_image = _per_image_dice(eval_dir / "val_mean_dice_raw.csv", data.root)
        dice[name] = {}
        for held_out in HELD_OUT_SETS:
            files = [_rel(item["image"], data.root) for item in getattr(data, held_out)]
            scores = [per_image[f] for f in files]
            dice[name][held_out] = {"mean": _nanmean(scores), "per_image": dict(zip(files, scores))}
    log = (run_dir / "train.log").read_text()
    loaded = _loaded_count(log) if (ARMS[arm].recipe if pretrained is None else pretrained) else None
    datalist = json.loads(Path(overrides["datalist"]).read_text())
    record = {
        "arm": arm, "k": k, "seed": seed, "key": key, "commit": git_commit(), "seconds": round(seconds, 1),
        "training_files": [_rel(str((Path(overrides["datalist"]).parent / i["image"]).resolve()), data.root) for i in datalist["training"]],
        "validation_files": [_rel(item["image"], data.root) for item in data.validation],
        "held_out_files": {h: [_rel(item["image"], data.root) for item in getattr(data, h)] for h in HELD_OUT_SETS},
        "validation_curve": curve, "selected_iteration": selected_iteration, "dice": dice,
        "encoder_tensors_loaded": loaded, **(fields or {}),
    }  # fmt: skip
    write_json(record_path, record)
    return record


def _rel(path: str, root: Path) -> str:
    p = Path(path)
    p = p if p.is_absolute() else (root / p)
    p = p.resolve()
    return os.path.relpath(p, root.resolve()) if p.is_relative_to(root.resolve()) else str(p)


def _nanmean(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.fmean(finite) if finite else float("nan")


def _loaded_count(log: str) -> list[int] | None:
    found = re.search(r"loaded (\d+)/(\d+) encoder tensors", log)
    return [int(found[1]), int(found[2])] if found else None


RESULT_KEYS = ("a result's key is the sha256 of its run's overrides, datalist (or unlabeled corpus), pretrained "
               "weights' sha256, the code that ran (the components package's source digest less the demo's driver, "
               "demo/run.py, and the sha256 of every bundle config the run reads: settings.code) and its numerics "
               "(device, torch and MONAI version, the CPU's vector instructions: settings.numerics); a record of other "
               "code or numerics is never reused")


def plan_settings(plan: Plan, seed: int, numerics: dict, code: dict, data: str = "synthetic") -> dict:
    """The settings a summary records (and hashes into ``settings_hash``): the plan, its data seed, the device, the
    numerics of its runs (:func:`run_numerics`), the code they ran (:func:`~low_data_protocol.code_state`), what a
    result's key covers (:data:`RESULT_KEYS`) and the kind of data (``"synthetic"`` or ``"user datalists"``), as JSON
    values."""
    settings = {**{k: v for k, v in asdict(plan).items() if k != "budget"}, "budget": asdict(plan.budget), "data_seed": seed,
                "device": numerics["device"], "numerics": numerics, "code": code, "result_keys": RESULT_KEYS, "data": data}  # fmt: skip
    return json.loads(json.dumps(settings))


def run(
    plan: Plan, out: Path, device: str, seed: int = 0, parallel: int = 1, results: Path | None = None,
    labeled: Path | None = None, unlabeled: Path | None = None, shifted: Path | None = None, report_only: bool = False,
    stop_after_s: float | None = None,
) -> dict:
    """Runs (or completes) the protocol and returns its summary; see the module's docstring. With ``report_only``
    nothing runs; with ``stop_after_s`` no run starts after that many seconds (the runs under way finish): the
    summary then covers the finished runs and lists the missing ones (``missing_runs``, ``complete`` false), and the
    same command run again continues."""
    unknown = [a for a in plan.arms if a not in ARMS]
    if unknown or not set(plan.arms) & set(BASELINES.values()):
        raise ValueError(f"arms must be a subset of {list(ARMS)} with a baseline ({', '.join(BASELINES.values())}), got {list(plan.arms)}.")
    if (labeled is None) != (unlabeled is None):
        raise ValueError("--labeled and --unlabeled go together (a labeled list and an unlabeled corpus).")
    if shifted is not None and labeled is None:
        raise ValueError("--shifted needs --labeled and --unlabeled.")
    started = time.perf_counter()
    out = out.resolve()
    results = (results or out / "results").resolve()
    data = user_data(out / "data", plan, seed, labeled, unlabeled, shifted) if labeled else synthetic_data(out / "data", plan, seed)
    for k in plan.ks:  # every k fits the pool and the budget, before any run
        pool_for(data, k, 0, seed)
        for name in ("finetune_iterations", "val_every"):
            if getattr(plan, name) % k:
                raise ValueError(f"{name} ({getattr(plan, name)}) must be a multiple of every k, got k = {k}.")
    threads = max(1, (os.cpu_count() or 1) // parallel)
    recipes = sorted({ARMS[a].recipe for a in plan.arms if ARMS[a].recipe})
    numerics = run_numerics(device)
    code = code_state()
    jobs = {recipe: pretraining_job(recipe, plan, data, out, numerics, code, seed) for recipe in recipes}
    with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(jobs)))) as pool:
        weights = dict(zip(jobs, pool.map(lambda r: run_pretraining(r, *jobs[r], results, threads, report_only), jobs)))
    missing: list[str] = []

    def one(job: tuple[str, int, int]) -> dict | None:
        arm, k, s = job
        key, overrides = finetune_job(arm, k, s, plan, data, write_datalist(data, k, s, seed), out, numerics, code, weights)
        late = stop_after_s is not None and time.perf_counter() - started > stop_after_s
        record = run_finetuning(arm, k, s, key, overrides, data, results, threads, report_only or late)
        if record is None:
            missing.append(f"{arm} k={k} seed={s}")
            return None
        sel = record["dice"]["selected"]
        print(f"k={k} seed={s} {arm}: selected (iteration {record['selected_iteration']}) in-domain {sel['in_domain']['mean']:.4f}"
              f", shifted {sel['shifted']['mean']:.4f}", file=sys.stderr, flush=True)  # fmt: skip
        return record

    runs: list[dict] = []
    seeds_run = {k: 0 for k in plan.ks}
    narrow = tuple(k for k in plan.ks if k in plan.narrow_ks)
    contrasts = plan_contrasts(plan.arms)
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        for s in range(plan.max_seeds):
            if s < plan.min_seeds:
                ks = plan.ks
            elif needs_more_seeds(paired(runs, narrow, contrasts), plan.narrow_ks, plan.target_half_width):
                ks = narrow
            else:
                break
            runs += [r for r in pool.map(one, [(arm, k, s) for k in ks for arm in plan.arms]) if r is not None]
            for k in ks:
                seeds_run[k] = s + 1
    intervals = paired(runs, plan.ks, contrasts)
    tables = table(runs, plan)
    curves = convergence(runs, plan)
    rankme = encoder_rankme(data, weights, plan, seed, device)
    plots(tables, curves, out)
    settings = plan_settings(plan, seed, numerics, code, "user datalists" if labeled else "synthetic")
    return {
        "benchmark": "low_data",
        "settings": settings,
        "settings_hash": digest(settings),
        "data": data.files(),
        "pretraining": {r: {k: v for k, v in w.items() if k != "model"} for r, w in weights.items()},
        "seeds_run": {str(k): n for k, n in seeds_run.items()},
        "half_width_target_met": not needs_more_seeds(intervals, plan.narrow_ks, plan.target_half_width),
        "complete": not missing,
        "missing_runs": sorted(missing),
        "table": tables,
        "paired": intervals,
        "coverage": coverage(populations(intervals)),
        "convergence": curves,
        "rankme": {**rankme, "agreement_with_probe_arms": rankme_agreement(rankme, intervals, plan.ks)},
        "runs": sorted(runs, key=lambda r: (r["seed"], r["k"], list(ARMS).index(r["arm"]))),
        "commits": sorted({r["commit"] for r in runs} | {w["commit"] for w in weights.values()}),
        "machine": {**machine_info(), "threads_per_run": threads, "parallel_runs": parallel},
        "total_seconds": round(time.perf_counter() - started, 1),
        "plots": [str(out / "low_data.png"), str(out / "curves.png")],
    }
