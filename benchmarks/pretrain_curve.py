"""At which budget does each pretraining recipe learn? Its health signals against their trivial answers, by budget and seed.

Each point is a real run of the recipe's bundle at the CPU sizes the demo and the low-data plan use
(:mod:`components.demo.recipes`: 64x32x32 crops, feature size 12, 2 volumes per iteration, the demo's unlabeled
synthetic CT), for a budget of iterations and a pretraining seed; only ``max_epochs`` (and with it the schedules'
length) and the seed change between the points of a recipe. Every run reports its health
(:class:`components.HealthHandler`) on the same 64 validation crops four times along the run and at its end; the
record keeps every report and the last training losses.

    nice -n 19 python benchmarks/pretrain_curve.py run --work /work/bench-data/curve --budgets 200,1000,4000
    python benchmarks/pretrain_curve.py summarise

``run`` is resumable: a finished run's record (``benchmarks/results/pretrain_curve/<recipe>_<iterations>_seed<s>.json``)
is kept and the run skipped; an unfinished one continues from its ``checkpoint.pt`` under ``--work`` (the bundles'
auto-resume replays the uninterrupted run). Runs go budget by budget, smallest first, so that a stopped session leaves
whole budgets. A record names the commit and the digest of ``components/`` and ``bundles/`` it ran with; ``summarise``
refuses records of different code, so a curve is one code's. ``summarise`` writes
``benchmarks/results/pretrain_curve.json`` (per recipe and budget: each signal's mean and standard deviation over the
seeds, its baseline's, and whether the value beats the baseline beyond the seeds' spread) and the plot
``docs/images/pretrain_curve.png``, and writes its table into ``docs/measuring.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import curve_probe
import curve_reread
from machine import REPO, git_commit, machine_info

RESULTS = REPO / "benchmarks" / "results"
RECORDS = RESULTS / "pretrain_curve"
SUMMARY = RESULTS / "pretrain_curve.json"
PLOT = REPO / "docs" / "images" / "pretrain_curve.png"
DOC = REPO / "docs" / "measuring.md"
BLOCK_BEGIN = "<!-- pretrain_curve table: python benchmarks/pretrain_curve.py summarise -->"
BLOCK_END = "<!-- /pretrain_curve table -->"
RECIPES = ("ssl", "mim", "dino")
#: validation crops of every report (the demo's RankMe crops): the same crops at every budget, so that RankMe and the
#: spreads compare
CROPS = 64
#: reports along a run (and one at its end)
REPORTS = 4
DATA_SEED = 0


def code_digest() -> str:
    """sha256 over the files of ``components/`` and ``bundles/`` (paths and contents, sorted): what a run executed."""
    digest = hashlib.sha256()
    for root in ("components", "bundles"):
        for path in sorted((REPO / root).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(REPO)).encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def corpus(work: Path) -> Path:
    """The demo's unlabeled synthetic CT (its CPU budget's volume count, data seed 0), written once under ``work``."""
    from components.data import synthetic
    from components.demo.run import BUDGETS

    folder = work / "data" / "unlabeled"
    datalist = folder / "dataset.json"
    if not datalist.is_file():
        synthetic.write_dataset(folder, num=BUDGETS["cpu"].num_unlabeled, seed=DATA_SEED, varied=True, labels=False)
    return folder


def epochs_for(iterations: int, iterations_per_epoch: int) -> int:
    """The whole epochs closest to ``iterations`` (at least one)."""
    return max(1, round(iterations / iterations_per_epoch))


def run_overrides(recipe: str, epochs: int, data: Path, run_dir: Path, seed: int) -> dict:
    """The demo's overrides of ``recipe``'s bundle for ``epochs`` epochs, with reports along the run and resume on."""
    from components.demo.recipes import pretraining_overrides
    from components.demo.run import BUDGETS

    budget = replace(BUDGETS["cpu"], ssl_epochs=epochs)
    overrides = pretraining_overrides(recipe, budget, data, run_dir, "cpu", seed)
    overrides.update({"training#val_interval": max(1, epochs // REPORTS), "training#rankme_crops": CROPS,
                      "checkpointing#auto_resume": True, "training#log_interval": 10})  # fmt: skip
    return overrides


def arm_name(recipe: str, lever: dict | None) -> str:
    """``recipe``, or with a lever ``recipe+<group.id>=<value>...`` (``#`` would be read by MONAI in a folder path).

    Example:
        >>> arm_name("dino", {"training#teacher_temperature": 0.04})
        'dino+training.teacher_temperature=0.04'
    """
    return recipe + "".join(f"+{key.replace('#', '.')}={value}" for key, value in sorted((lever or {}).items()))


def run_name(arm: str, iterations: int, seed: int) -> str:
    """A run's name: its record's file stem and its folder under ``--work``'s ``runs``."""
    return f"{arm}_{iterations}_seed{seed}"


def run_point(recipe: str, budget: int, seed: int, work: Path, code: str, lever: dict | None = None) -> Path:
    """Runs (or resumes, or reuses) one point; returns its record's path. ``lever``: overrides tried against the
    shipped settings (a suspect of a recipe that stays at its baseline); its runs are recorded apart
    (``<recipe>+<group.id>=<value>...``) and summarised as a row of their own."""
    from components.demo.recipes import RECIPES as DEMO_RECIPES
    from components.demo.runner import read_scalars, run_bundle

    data = corpus(work)
    per_epoch = math.ceil(len(json.loads((data / "dataset.json").read_text())["training"]) / 2)
    epochs = epochs_for(budget, per_epoch)
    iterations = epochs * per_epoch
    arm = arm_name(recipe, lever)
    record_path = RECORDS / f"{run_name(arm, iterations, seed)}.json"
    if record_path.is_file():
        return record_path
    run_dir = work / "runs" / run_name(arm, iterations, seed)
    overrides = {**run_overrides(recipe, epochs, data, run_dir, seed), **(lever or {})}
    started = time.time()
    seconds = run_bundle(DEMO_RECIPES[recipe].bundle, ("train.json",), overrides, log=run_dir / "train.log")
    scalars = read_scalars(run_dir / "eval")
    losses = {tag: points[-1][1] for tag, points in scalars.items() if tag.startswith("loss")}
    record = {
        "recipe": arm, "lever": lever or {}, "budget": budget, "iterations": iterations, "epochs": epochs, "seed": seed,
        "commit": git_commit(), "code": code, "seconds": round(seconds, 1), "finished": time.strftime("%Y-%m-%d %H:%M"),
        "started": time.strftime("%Y-%m-%d %H:%M", time.localtime(started)), "machine": machine_info(),
        "overrides": {k: v for k, v in overrides.items() if k not in ("output_dir", "ckpt_dir", "dataset_dir")},
        "last_losses": losses, "health": json.loads((run_dir / "eval" / "health.json").read_text())["reports"],
    }  # fmt: skip
    RECORDS.mkdir(parents=True, exist_ok=True)
    record_path.write_text(json.dumps(record, indent=1) + "\n")
    return record_path


def run(
    work: str, budgets: str = "200,1000,4000", seeds: str = "0,1,2", recipes: str = ",".join(RECIPES),
    lever: dict | None = None,
) -> None:
    """Runs every (budget, recipe, seed) point not yet recorded, budget by budget (with ``lever``'s overrides)."""
    work_dir = Path(work).resolve()
    code = code_digest()
    for budget in (int(b) for b in budgets.split(",")):
        for seed in (int(s) for s in seeds.split(",")):
            for recipe in recipes.split(","):
                path = run_point(recipe, budget, seed, work_dir, code, lever)
                print(f"{recipe} budget {budget} seed {seed}: {path.relative_to(REPO)}", flush=True)


def _judge(values: list[float], baselines: list[float], better: str, margin: float) -> dict:
    """Mean and standard deviation of a signal and of its baseline over seeds; ``beyond_spread``: the mean gap to the
    baseline (in the better direction) exceeds the signal's ``margin`` (what counts as learning, or the collapse
    line) by more than two standard deviations of the per-seed gaps (at least 2 seeds)."""
    gaps = [(b - v) if better == "lower" else (v - b) for v, b in zip(values, baselines)]
    spread = statistics.stdev(gaps) if len(gaps) > 1 else float("nan")
    return {
        "value_mean": statistics.fmean(values), "value_sd": statistics.stdev(values) if len(values) > 1 else None,
        "baseline_mean": statistics.fmean(baselines), "margin": margin, "gap_mean": statistics.fmean(gaps),
        "gap_sd": None if math.isnan(spread) else spread, "seeds": len(values),
        "beyond_spread": bool(len(gaps) > 1 and statistics.fmean(gaps) - 2 * spread > margin),
    }  # fmt: skip


def _probe_point(runs: list[dict], probes: dict[str, dict]) -> dict | None:
    """The standardised probe's held-out Dice of a point's encoders against the random encoder of each one's seed
    (:mod:`curve_probe`), judged as a signal; None until every encoder and its random baseline are probed."""
    names = [run_name(run["recipe"], run["iterations"], run["seed"]) for run in runs]
    randoms = [f"random_seed{run['seed']}" for run in runs]
    if not all(name in probes for name in names + randoms):
        return None
    dice = [probes[name]["mean_dice"] for name in names]
    return {"dice": dice, "random": [probes[name]["mean_dice"] for name in randoms],
            "converged": all(probes[name]["fit"]["converged"] for name in names + randoms),
            "commits": sorted({probes[name]["commit"] for name in names + randoms}),
            **_judge(dice, [probes[name]["mean_dice"] for name in randoms], "higher", 0.0)}  # fmt: skip


def _signals(reports: list[dict]) -> dict:
    """Each signal of a point's reports (one per seed) judged over the seeds (:func:`_judge`), with their verdicts."""
    signals = {}
    for name in reports[0]["signals"]:
        entries = [report["signals"][name] for report in reports]
        signals[name] = {"kind": entries[0]["kind"], "better": entries[0]["better"],
                         "verdicts": [e["verdict"] for e in entries],
                         **_judge([e["value"] for e in entries], [e["baseline"] for e in entries], entries[0]["better"],
                                  statistics.fmean(e["margin"] for e in entries))}  # fmt: skip
    return signals


def _reread_point(runs: list[dict], rereads: dict[str, dict]) -> dict | None:
    """The re-read of a point's final encoders on the same crops (:mod:`curve_reread`): each seed's verdict and each
    signal judged over the seeds; None until every run of the point is re-read."""
    names = [run_name(run["recipe"], run["iterations"], run["seed"]) for run in runs]
    if not all(name in rereads for name in names):
        return None
    reports = [rereads[name] for name in names]
    return {"verdicts": [report["verdict"] for report in reports], "crops": reports[0]["settings"]["crops"],
            "commits": sorted({report["commit"] for report in reports}), "signals": _signals(reports)}  # fmt: skip


def summarise() -> dict:
    """Writes the summary JSON and the plot from every record; returns the summary.

    Raises:
        ValueError: records of different code (``code``) in the results folder.
    """
    records = [json.loads(p.read_text()) for p in sorted(RECORDS.glob("*.json"))]
    codes = {r["code"] for r in records}
    if len(codes) > 1:
        raise ValueError(f"the records in {RECORDS} come from different code {sorted(codes)}: re-run the stale ones.")
    points: dict[str, dict[int, list[dict]]] = {}
    for r in records:
        points.setdefault(r["recipe"], {}).setdefault(r["iterations"], []).append(r)
    probes = {window: curve_probe.load_records(window) for window in curve_probe.WINDOWS}
    rereads = curve_reread.load_records()
    table = {}
    for recipe, by_budget in sorted(points.items()):
        table[recipe] = {}
        for iterations, runs in sorted(by_budget.items()):
            finals = [run["health"][-1] for run in runs]
            table[recipe][str(iterations)] = {
                "seeds": [run["seed"] for run in runs], "verdicts": [f["verdict"] for f in finals],
                "signals": _signals(finals), "rankme": [f["extra"]["rankme"] for f in finals],
                "mean_share": [f["extra"]["mean_share"] for f in finals],
                "seconds": [run["seconds"] for run in runs],
                "probe": {window: _probe_point(runs, records) for window, records in probes.items()},
                "reread": _reread_point(runs, rereads),
            }  # fmt: skip
    summary = {
        "what": "health of each recipe's final encoder against each signal's trivial answer, by pretraining budget",
        "settings": {"crops": CROPS, "reports_per_run": REPORTS, "data_seed": DATA_SEED,
                     "sizes": "the demo's CPU pretraining overrides (components.demo.recipes), max_epochs by budget"},
        "code": next(iter(codes), None), "commits": sorted({r["commit"] for r in records}),
        "machine": records[0]["machine"] if records else None, "table": table,
    }  # fmt: skip
    SUMMARY.write_text(json.dumps(summary, indent=1) + "\n")
    if records:
        plot(table, PLOT)
        write_block(DOC, markdown(summary))
    return summary


def write_block(doc: Path, table: str) -> None:
    """Replaces what lies between :data:`BLOCK_BEGIN` and :data:`BLOCK_END` in ``doc`` by ``table``.

    Raises:
        ValueError: ``doc`` has no such block.
    """
    text = doc.read_text()
    if BLOCK_BEGIN not in text or BLOCK_END not in text:
        raise ValueError(f"{doc} has no block {BLOCK_BEGIN!r} ... {BLOCK_END!r}.")
    head, rest = text.split(BLOCK_BEGIN, 1)
    _, tail = rest.split(BLOCK_END, 1)
    doc.write_text(f"{head}{BLOCK_BEGIN}\n\n{table.rstrip()}\n\n{BLOCK_END}{tail}")


def markdown(summary: dict) -> str:
    """The summary as the docs show it: per recipe and budget, the verdicts of the seeds, then each signal's mean
    value against its trivial value's, the mean gap in the better direction +- its sd over seeds, and ``beyond`` when
    the gap exceeds the signal's margin by more than twice that sd (see :func:`_judge`)."""
    lines = [f"Measured at code {summary['code']} (commits {', '.join(summary['commits'])}) on "
             f"{summary['machine']['cpu_model']}, torch {summary['machine']['torch']}: the final report of each run, "
             f"{summary['settings']['crops']} validation crops.", ""]  # fmt: skip
    windows = list(curve_probe.WINDOWS)
    lines += ["| recipe | iterations | verdicts (seeds) | signal: value vs trivial, gap +- sd | "
              + " | ".join(f"probe Dice vs random encoder, {w} window" for w in windows) + " |",
              "| --- | --- | --- | --- | " + " | ".join("---" for _ in windows) + " |"]  # fmt: skip
    for recipe, by_budget in summary["table"].items():
        for iterations, point in sorted(by_budget.items(), key=lambda item: int(item[0])):
            verdicts = ", ".join(f"{v} ({seed})" for v, seed in zip(point["verdicts"], point["seeds"]))
            probes = " | ".join(_probe_cell((point.get("probe") or {}).get(window)) for window in windows)
            lines.append(f"| {recipe} | {iterations} | {verdicts} | {_signal_cells(point['signals'])} | {probes} |")
    reread = [(recipe, iterations, point) for recipe, by_budget in summary["table"].items()
              for iterations, point in sorted(by_budget.items(), key=lambda item: int(item[0])) if point.get("reread")]  # fmt: skip
    if reread:
        lines += ["", f"The same final encoders read again on {reread[0][2]['reread']['crops']} validation crops, the same for "
                  "every run of a recipe (`benchmarks/curve_reread.py`; commits "
                  f"{', '.join(sorted({c for *_, point in reread for c in point['reread']['commits']}))}):", "",
                  "| recipe | iterations | verdicts (seeds) | signal: value vs trivial, gap +- sd |", "| --- | --- | --- | --- |"]  # fmt: skip
        for recipe, iterations, point in reread:
            verdicts = ", ".join(f"{v} ({seed})" for v, seed in zip(point["reread"]["verdicts"], point["seeds"]))
            lines.append(f"| {recipe} | {iterations} | {verdicts} | {_signal_cells(point['reread']['signals'])} |")
    return "\n".join(lines) + "\n"


def _signal_cells(signals: dict) -> str:
    """Each signal's mean value against its trivial value's, the mean gap +- its sd over seeds, ``beyond``."""
    cells = []
    for name, s in signals.items():
        sd = f" +- {s['gap_sd']:.3g}" if s["gap_sd"] is not None else ""
        cells.append(f"{name} {s['value_mean']:.3g} vs {s['baseline_mean']:.3g}, {s['gap_mean']:+.3g}{sd}"
                     + (" beyond" if s["beyond_spread"] else ""))  # fmt: skip
    return "; ".join(cells)


def _probe_cell(probe: dict | None) -> str:
    """A point's probe Dice against the random encoders' (mean gap +- its sd over seeds, ``beyond`` as a signal's)."""
    if probe is None:
        return "not probed"
    sd = f" +- {probe['gap_sd']:.3f}" if probe["gap_sd"] is not None else ""
    beyond = " beyond" if probe["beyond_spread"] else ""
    return f"{probe['value_mean']:.3f} vs {probe['baseline_mean']:.3f}, {probe['gap_mean']:+.3f}{sd}{beyond}"


def plot(table: dict, path: Path) -> None:
    """One panel per recipe: each pretext signal's value over its baseline (mean and seeds' range) by budget; the
    dashed line at 1 is the trivial answer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(table), figsize=(5 * len(table), 4), squeeze=False)
    for ax, (recipe, by_budget) in zip(axes[0], table.items()):
        budgets = sorted(by_budget, key=int)
        names = [n for n, s in by_budget[budgets[0]]["signals"].items() if s["kind"] == "pretext"]
        for name in names:
            ratios = [by_budget[b]["signals"][name]["value_mean"] / by_budget[b]["signals"][name]["baseline_mean"] for b in budgets]
            ax.plot([int(b) for b in budgets], ratios, marker="o", label=name)
        ax.axhline(1.0, color="k", linestyle="--", linewidth=1, label="trivial answer")
        ax.set_xscale("log")
        ax.set_xlabel("pretraining iterations")
        ax.set_ylabel("value / trivial value")
        ax.set_title(recipe)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="run every point not yet recorded")
    run_parser.add_argument("--work", required=True, help="folder for the corpus and the runs (outside the repository)")
    run_parser.add_argument("--budgets", default="200,1000,4000")
    run_parser.add_argument("--seeds", default="0,1,2")
    run_parser.add_argument("--recipes", default=",".join(RECIPES))
    run_parser.add_argument("--lever", action="append", default=[], metavar="ID=VALUE",
                            help="an override tried against the shipped settings (JSON value), recorded apart")
    commands.add_parser("summarise", help="write the summary JSON and the plot; print the table the docs show")
    args = parser.parse_args(argv)
    if args.command == "run":
        lever = {key: json.loads(value) for key, value in (item.split("=", 1) for item in args.lever)}
        run(args.work, args.budgets, args.seeds, args.recipes, lever)
    else:
        print(markdown(summarise()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
