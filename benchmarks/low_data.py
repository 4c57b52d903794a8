"""What SSL pretraining buys when labels are few: finetuning from pretrained weights against from scratch.

Pretrains the Swin ViT encoder once per recipe (``--recipes``: ``ssl``, the rotation/contrastive/inpainting bundle,
and optionally ``dino``, the self-distillation bundle) on an unlabeled synthetic CT set (larger and more varied
than the labeled one: ``components.write_dataset(varied=True)``), then finetunes the CT bundle on the demo's
five-organ task (``components.synthetic.DEMO_ORGANS``) with k labeled volumes, from each recipe's weights and from
random initialisation, n seeds each. All arms of a (k, seed) pair get the same training volumes, the same seed
(decoder initialisation, crops, order) and the same budget in iterations; only the encoder's starting weights
differ. Every model is scored once, after its last iteration, on one fixed held-out set (no model selection).
Every step is a real ``python -m monai.bundle run`` with command-line overrides (``components.runner``).

    python benchmarks/low_data.py                     # k = 1, 2, 4, 8; 3 seeds; the device's budget
    python benchmarks/low_data.py --ks 1,2 --seeds 2
    python benchmarks/low_data.py --small             # CI: k = 1, 2; 2 seeds; a few iterations (learns nothing)
    python benchmarks/low_data.py --recipes ssl dino  # a third arm: the self-distillation bundle's teacher encoder
    python benchmarks/low_data.py --pretrained_arm_overrides '{"encoder_lr_decay": 0.5}'  # a finetuning lever

Prints one JSON object: per arm and k the mean and standard deviation over seeds of the held-out mean Dice, each
recipe's difference to scratch (``<recipe>_minus_scratch``) and the paired differences per (k, seed)
(``paired_differences``: mean, sd), every run (Dice per organ, seconds, what the SSL weights loaded), the settings
and the machine; writes ``low_data.png`` (Dice against k, both arms) and the runs' folders under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from machine import machine_info

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from components import synthetic  # noqa: E402
from components.demo import (  # noqa: E402
    CT_BUNDLE, SSL_BUNDLE, DemoBudget, finetune_overrides, pyplot, save_plot, ssl_overrides, training_class_weights,
)
from components.runner import read_scalars, run_bundle  # noqa: E402

DINO_BUNDLE = "swin_unetr_dino_pretrain"
RECIPES = ("ssl", "dino")
LABELS = {"ssl": "SSL init", "dino": "DINO init", "scratch": "random init"}


@dataclass(frozen=True)
class Plan:
    """The experiment's size: label counts, seeds, the held-out set, the finetuning budget in iterations (the same
    for every k and both arms) and the pretraining budget (``budget``: SSL epochs, batch, learning rates).
    ``pretrain_overrides`` change the pretraining runs (e.g. their learning rate) and ``pretrained_arm_overrides``
    the finetuning runs that start from pretrained weights (e.g. ``encoder_lr_decay``); the scratch arm keeps the
    plain finetuning settings."""

    ks: tuple[int, ...] = (1, 2, 4, 8)
    seeds: int = 3
    num_eval: int = 4
    finetune_iterations: int = 120
    budget: DemoBudget = DemoBudget()
    pretrain_overrides: dict = field(default_factory=dict)
    pretrained_arm_overrides: dict = field(default_factory=dict)


PLANS = {
    "cpu": Plan(),
    "cuda": Plan(finetune_iterations=400, budget=DemoBudget(num_unlabeled=64, ssl_epochs=60, ssl_batch=4, finetune_crops=2)),
    "small": Plan(ks=(1, 2), seeds=2, num_eval=1, finetune_iterations=2, budget=DemoBudget(num_unlabeled=6, ssl_epochs=1)),
}

_LOADED = re.compile(r"loaded (\d+)/(\d+) encoder tensors")


def _write_datalists(root: Path, plan: Plan, seed: int) -> tuple[Path, dict[tuple[int, int], Path]]:
    """Synthesises the labeled pool (max k training candidates + the held-out set) and the unlabeled set, and
    writes one datalist per (k, seed): k training volumes drawn from the pool by the seed, the held-out set as
    ``validation`` (scored once, at the end) and ``test``."""
    pool_size = max(plan.ks) + plan.num_eval
    pool = synthetic.write_dataset(root / "labeled", num=max(pool_size, 3), seed=seed, organs=synthetic.DEMO_ORGANS)
    content = json.loads(pool.read_text())
    cases = content["training"] + content["validation"] + content["test"]
    held_out, candidates = cases[-plan.num_eval :], cases[: max(plan.ks)]
    unlabeled = synthetic.write_dataset(root / "unlabeled", num=plan.budget.num_unlabeled, seed=seed, varied=True, labels=False)
    datalists = {}
    for k in plan.ks:
        for s in range(plan.seeds):
            picked = np.random.default_rng([seed, k, s]).choice(len(candidates), size=k, replace=False)
            path = root / "labeled" / f"datalist_k{k}_seed{s}.json"
            path.write_text(json.dumps({**content, "training": [candidates[i] for i in sorted(picked)],
                                        "validation": held_out, "test": held_out}, indent=2))
            datalists[(k, s)] = path
    return unlabeled, datalists


def dino_overrides(budget: DemoBudget, data_dir: Path, run_dir: Path, device: str, seed: int) -> dict:
    """Command-line overrides of the self-distillation bundle for a run of the SSL arm's size: the SSL arm's data,
    device, volumes per iteration, epochs, feature size, attention window and folders; 32^3 global and local crops
    from 64^3 regions and a small head."""
    ssl = ssl_overrides(budget, data_dir, run_dir, device, seed)
    shared = ("dataset_dir", "device", "feature_size", "window_size", "batch_size", "num_workers", "amp", "use_checkpoint",
              "seed", "log_interval", "max_epochs", "output_dir", "ckpt_dir", "auto_resume")  # fmt: skip
    return {
        **{key: ssl[key] for key in shared}, "roi_size": [32, 32, 32], "context_size": [64, 64, 64],
        "local_size": [32, 32, 32], "num_local_crops": 2, "prototypes": 1024, "head_hidden_dim": 256,
        "head_bottleneck_dim": 64, "warmup_epochs": 1, "teacher_temperature_warmup_epochs": 1,
    }  # fmt: skip


PRETRAINING = {"ssl": (SSL_BUNDLE, ssl_overrides), "dino": (DINO_BUNDLE, dino_overrides)}


def _finetune(
    plan: Plan, k: int, seed: int, arm: str, datalist: Path, run_dir: Path, device: str, model: Path | None,
    threads: int | None,
) -> dict:
    """One finetuning run of ``plan.finetune_iterations`` iterations (batch 1: one volume per iteration), scored on
    the held-out set after the last one; ``model`` is the arm's pretrained encoder (None: from scratch)."""
    epochs = -(-plan.finetune_iterations // k)
    budget = replace(plan.budget, finetune_epochs=epochs, val_interval=epochs)
    overrides = finetune_overrides(budget, datalist, run_dir, device, 1000 + seed, model, training_class_weights(datalist))
    if model is not None:
        overrides.update(plan.pretrained_arm_overrides)
    seconds = run_bundle(CT_BUNDLE, overrides=overrides, log=run_dir / "train.log", echo=False, threads=threads)
    scalars = read_scalars(run_dir / "eval")
    per_class = {name: scalars[f"val_dice_{name.replace(' ', '_')}"][-1][1] for name in synthetic.DEMO_ORGANS}
    loaded = _LOADED.search((run_dir / "train.log").read_text()) if model is not None else None
    return {
        "k": k, "seed": seed, "arm": arm, "iterations": epochs * k, "seconds": round(seconds, 1),
        "mean_dice": scalars["val_mean_dice"][-1][1], "per_class_dice": per_class,
        "encoder_tensors_loaded": None if loaded is None else [int(loaded[1]), int(loaded[2])],
    }


def _paired(runs: list[dict], arm: str, plan: Plan) -> dict:
    """Per k: the differences ``arm - scratch`` of the (k, seed) pairs (same volumes, seed and budget), their mean
    and standard deviation: the pairing removes the spread that the drawn volumes cause in both arms alike."""
    dice = {(r["arm"], r["k"], r["seed"]): r["mean_dice"] for r in runs}
    paired = {}
    for k in plan.ks:
        differences = [dice[(arm, k, s)] - dice[("scratch", k, s)] for s in range(plan.seeds)]
        paired[str(k)] = {"mean": statistics.fmean(differences), "differences": differences,
                          "std": statistics.stdev(differences) if len(differences) > 1 else 0.0}  # fmt: skip
    return paired


def _plot(table: dict, path: Path) -> None:
    fig, ax = pyplot().subplots(figsize=(6, 4))
    for arm in table:
        ks, label = sorted(table[arm], key=int), LABELS[arm]
        ax.errorbar([int(k) for k in ks], [table[arm][k]["mean"] for k in ks], yerr=[table[arm][k]["std"] for k in ks],
                    marker="o", capsize=4, label=label)
    ax.set_xscale("log", base=2)
    ticks = sorted(next(iter(table.values())), key=int)
    ax.set_xticks([int(k) for k in ticks], ticks)
    save_plot(fig, ax, path, "labeled training volumes (k)", "held-out mean Dice (5 organs)",
              "pretrained vs random init with few labels (mean, sd over seeds)")


def run(plan: Plan, out: Path, device: str, seed: int, parallel: int = 1, recipes: tuple[str, ...] = ("ssl",)) -> dict:
    unknown = [r for r in recipes if r not in PRETRAINING]
    if unknown or not recipes:
        raise ValueError(f"recipes must be a non-empty subset of {sorted(PRETRAINING)}, got {list(recipes)}.")
    machine = machine_info()
    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    unlabeled, datalists = _write_datalists(out / "data", plan, seed)
    pretraining, models = {}, {}
    for recipe in recipes:
        bundle, overrides = PRETRAINING[recipe]
        run_dir = out / f"{recipe}_pretrain"
        settings = {**overrides(plan.budget, unlabeled.parent, run_dir, device, seed), **plan.pretrain_overrides}
        seconds = run_bundle(bundle, overrides=settings, log=run_dir / "train.log", echo=False)
        losses = {tag: values[-1][1] for tag, values in read_scalars(run_dir / "eval").items() if tag.startswith("loss")}
        pretraining[recipe] = {"seconds": round(seconds, 1), "final_losses": losses}
        models[recipe] = run_dir / "models" / "model.pt"
    arms = (*recipes, "scratch")
    jobs = [(k, s, arm, datalist) for (k, s), datalist in datalists.items() for arm in arms]
    threads = max(1, (os.cpu_count() or 1) // parallel) if parallel > 1 and device == "cpu" else None

    def one(job: tuple) -> dict:
        k, s, arm, datalist = job
        result = _finetune(plan, k, s, arm, datalist, out / f"k{k}_seed{s}_{arm}", device, models.get(arm), threads)
        print(f"k={k} seed={s} {arm}: mean Dice {result['mean_dice']:.4f} ({result['seconds']:.0f} s)", file=sys.stderr, flush=True)
        return result

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        runs = list(pool.map(one, jobs))
    table: dict = {arm: {} for arm in arms}
    for arm in arms:
        for k in plan.ks:
            dice = [r["mean_dice"] for r in runs if r["arm"] == arm and r["k"] == k]
            table[arm][str(k)] = {"mean": statistics.fmean(dice), "std": statistics.stdev(dice) if len(dice) > 1 else 0.0,
                                  "dice": dice}
    _plot(table, out / "low_data.png")
    return {
        "benchmark": "low_data",
        "device": device,
        "machine": {**machine, "load_avg_1_5_15_at_end": machine_info()["load_avg_1_5_15"]},
        "settings": {**{k: v for k, v in asdict(plan).items() if k != "budget"}, "budget": asdict(plan.budget),
                     "organs": list(synthetic.DEMO_ORGANS), "seed": seed, "parallel_runs": parallel,
                     "threads_per_run": threads or torch.get_num_threads()},
        "pretraining": pretraining,
        "table": table,
        **{f"{r}_minus_scratch": {k: table[r][k]["mean"] - table["scratch"][k]["mean"] for k in table[r]} for r in recipes},
        "paired_differences": {r: _paired(runs, r, plan) for r in recipes},
        "runs": runs,
        "plot": str(out / "low_data.png"),
        "total_seconds": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="the CI size: k = 1, 2; 2 seeds; a few iterations")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: CUDA where present")
    parser.add_argument("--ks", default=None, help="label counts, comma-separated (default: the plan's)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per k (default: the plan's)")
    parser.add_argument("--iterations", type=int, default=None, help="finetuning iterations per run (default: the plan's)")
    parser.add_argument("--ssl_epochs", type=int, default=None, help="pretraining epochs (default: the plan's)")
    parser.add_argument("--seed", type=int, default=0, help="the data's seed")
    parser.add_argument("--out", default="runs/low_data", help="folder for the runs and low_data.png")
    parser.add_argument("--parallel", type=int, default=1, help="finetuning runs side by side (CPU: threads split)")
    parser.add_argument("--recipes", nargs="+", choices=RECIPES, default=["ssl"], help="pretraining arms (default: ssl)")
    parser.add_argument("--pretrain_overrides", type=json.loads, default={}, help="JSON overrides of the pretraining runs")
    parser.add_argument("--pretrained_arm_overrides", type=json.loads, default={},
                        help='JSON overrides of the finetuning runs from pretrained weights, e.g. \'{"encoder_lr_decay": 0.5}\'')
    args = parser.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    plan = PLANS["small" if args.small else device]
    if args.ks:
        plan = replace(plan, ks=tuple(int(k) for k in args.ks.split(",")))
    if args.seeds:
        plan = replace(plan, seeds=args.seeds)
    if args.iterations:
        plan = replace(plan, finetune_iterations=args.iterations)
    plan = replace(plan, pretrain_overrides=args.pretrain_overrides, pretrained_arm_overrides=args.pretrained_arm_overrides)
    if args.ssl_epochs:
        plan = replace(plan, budget=replace(plan.budget, ssl_epochs=args.ssl_epochs))
    print(json.dumps(run(plan, Path(args.out).resolve(), device, args.seed, args.parallel, tuple(args.recipes)), indent=2))


if __name__ == "__main__":
    main()
