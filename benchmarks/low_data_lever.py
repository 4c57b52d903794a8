"""The next lever after the CPU plan: a longer SSL pretraining on a larger unlabeled corpus, by the plan's protocol.

Declared again for the protocol of ``low_data.py`` (t-intervals, linear probes, keys holding the code), before any of
its runs; the old protocol's lever runs are superseded with its plan:

- **Lever.** The SSL bundle pretrains on a synthetic unlabeled corpus of ``LEVER_UNLABELED`` = 192 volumes (134 in
  its training list, 3.9x the plan's 34) for the plan's 12 epochs: 804 iterations instead of 204. Nothing else
  changes: the bundle's defaults, the learning rate and warm-up, the batch, the seeds (0-8), the labeled pools, the
  validation volume and both held-out sets (the labeled and shifted volumes do not depend on the corpus's size).
- **Runs.** The arms ``ssl`` and ``probe_ssl`` at k = 1 and 2 with seeds 0-8 (36 finetuning runs). The plan's
  ``scratch`` and ``probe_random`` runs are reused from its records (``--results``): their keys hold their
  datalists, overrides, code and configs, none of which involves the corpus.
- **Contrasts**, paired per (k, seed): the lever's ``ssl - scratch`` and ``probe_ssl - probe_random``, and the lever
  against the plan's encoder, ``ssl - ssl (plan)`` and ``probe_ssl - probe_ssl (plan)``; both held-out sets, the
  selected and the last models, t-intervals (``low_data_stats.paired_entry``).
- **Reading.** The lever helps at a k when the t-interval of ``ssl - ssl (plan)`` (in-domain) lies above zero for the
  selected and for the last models, hurts when it lies below for both, and otherwise has no measurable effect;
  ``probe_ssl - probe_ssl (plan)`` says whether the encoder itself learned more. No other lever setting is run after
  these results are seen.

    python benchmarks/low_data_lever.py   # after the CPU plan; resumable; writes low_data_cpu_protocol2_lever.json

The summary has the layout of ``low_data.py``'s (so ``low_data.py --markdown`` prints and writes its tables, both
models) with the plan-versus-lever contrasts added to ``paired`` and a ``lever`` entry naming the baseline summary.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's components, without PYTHONPATH
import low_data_protocol as protocol  # noqa: E402
import low_data_runs as runner  # noqa: E402
import low_data_stats as stats  # noqa: E402

LEVER_UNLABELED = 192
LEVER_ARMS = ("scratch", "ssl", "probe_random", "probe_ssl")
VERSUS_PLAN = {"ssl - ssl (plan)": "ssl", "probe_ssl - probe_ssl (plan)": "probe_ssl"}


def lever_plan(plan: protocol.Plan) -> protocol.Plan:
    """``plan`` with the lever's corpus and arms; every finetuning setting stays the plan's."""
    return replace(plan, budget=replace(plan.budget, num_unlabeled=LEVER_UNLABELED), arms=LEVER_ARMS)


def check_same_protocol(plan: protocol.Plan, baseline: dict) -> None:
    """Raises ValueError naming the settings in which ``plan`` (before the lever), run on this machine's numerics,
    differs from the baseline's: the plan's records could not be reused or paired then."""
    settings = runner.plan_settings(plan, baseline["settings"]["data_seed"], runner.run_numerics("cpu"), protocol.code_state())
    differ = sorted(name for name, value in settings.items() if baseline["settings"].get(name) != value)
    if differ:
        raise ValueError(f"the CPU plan differs from the baseline summary's in {differ}: re-run the plan first.")


def versus_plan(lever: dict, baseline: dict) -> dict:
    """Per held-out set, model, contrast of :data:`VERSUS_PLAN` and k: the differences lever run minus plan run of
    the same arm, k and seed, as ``low_data_stats.paired`` lays them out (:func:`low_data_stats.paired_entry`).

    Raises:
        ValueError: for a pair whose runs were trained or scored on other files: they would not be paired.
    """
    base = {(r["arm"], r["k"], r["seed"]): r for r in baseline["runs"]}
    out: dict = {}
    for contrast, arm in VERSUS_PLAN.items():
        pairs = sorted(((r, base[(arm, r["k"], r["seed"])]) for r in lever["runs"] if r["arm"] == arm and (arm, r["k"], r["seed"]) in base),
                       key=lambda p: (p[0]["k"], p[0]["seed"]))  # fmt: skip
        for run, plan_run in pairs:
            for files in ("training_files", "validation_files", "held_out_files"):
                if run[files] != plan_run[files]:
                    raise ValueError(f"{arm} k={run['k']} seed={run['seed']}: the lever's {files} differ from the plan's; not a pair.")
        for held_out in protocol.HELD_OUT_SETS:
            for model in protocol.MODELS:
                for k in sorted({run["k"] for run, _ in pairs}):
                    entry = stats.paired_entry([r["dice"][model][held_out]["mean"] - p["dice"][model][held_out]["mean"]
                                                for r, p in pairs if r["k"] == k])  # fmt: skip
                    if entry is not None:
                        out.setdefault(held_out, {}).setdefault(model, {}).setdefault(contrast, {})[str(k)] = entry
    return out


def with_versus_plan(lever: dict, baseline: dict, baseline_path: str) -> dict:
    """The lever's summary with :func:`versus_plan`'s contrasts added to ``paired`` and a ``lever`` entry."""
    for held_out, per_model in versus_plan(lever, baseline).items():
        for model, contrasts in per_model.items():
            lever["paired"].setdefault(held_out, {}).setdefault(model, {}).update(contrasts)
    lever["lever"] = {
        "what": f"SSL pretraining on {LEVER_UNLABELED} unlabeled volumes (the plan: "
                f"{baseline['settings']['budget']['num_unlabeled']}) for the plan's {baseline['settings']['budget']['ssl_epochs']} epochs",
        "baseline": baseline_path, "baseline_settings_hash": baseline["settings_hash"],
        "versus_plan": {contrast: arm for contrast, arm in VERSUS_PLAN.items()},
    }  # fmt: skip
    return lever


def main() -> None:
    """Runs the lever against the plan's committed summary and writes its own."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="benchmarks/results/low_data_cpu_protocol2.json", help="the plan's committed summary")
    parser.add_argument("--results", default="benchmarks/results/low_data_cpu_protocol2", help="per-run records (the plan's are reused)")
    parser.add_argument("--out", default="runs/low_data_lever", help="folder for the lever's data and runs")
    parser.add_argument("--json", default="benchmarks/results/low_data_cpu_protocol2_lever.json", help="where the summary goes")
    parser.add_argument("--parallel", type=int, default=2, help="runs side by side (one thread each on 2 cores)")
    args = parser.parse_args()
    baseline = json.loads(Path(args.baseline).read_text())
    if baseline["settings"]["device"] != "cpu" or not baseline["complete"]:
        raise ValueError(f"--baseline {args.baseline!r} is not a complete CPU plan summary.")
    started = time.perf_counter()
    check_same_protocol(protocol.PLANS["cpu"], baseline)
    plan = lever_plan(protocol.PLANS["cpu"])
    summary = runner.run(plan, Path(args.out), "cpu", baseline["settings"]["data_seed"], args.parallel, Path(args.results))
    summary = with_versus_plan(summary, baseline, args.baseline)
    summary["total_seconds"] = round(time.perf_counter() - started, 1)
    text = json.dumps(summary, indent=2)
    Path(args.json).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
