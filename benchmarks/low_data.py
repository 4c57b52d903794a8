"""What each pretraining recipe buys when labels are few: protocol v3, fixed here before any of its runs.

Protocol v3 (issue 44) is stated here and in docs/measuring.md ("Protocol v3 (pre-registered)"), and fixed by
``low_data_plan.PLANS["cpu"]``. The pre-registration commit (the one that fixes the plan, its finetuning budget the
pilot's answer below, and its analysis code) precedes every record of the plan: a later commit names it in ``low_data_plan.PREREGISTRATION``; the plan
refuses to run before that or from a checkout that is not that commit or a descendant with no uncommitted change, and
the summary checks that every record's commit descends from it (otherwise every verdict is withheld). Protocol 2 (one pretraining
per recipe, 204 pretraining iterations at which no encoder had learned) is superseded; its summaries and records
stay in benchmarks/results/ as history.

- **The unit is the pretraining run.** Recipes ``ssl``, ``dino``, ``mim`` (each the demo's pretraining,
  ``components.demo.recipes.RECIPES``: SSL on 32x64x64 crops with the rotation weighted 3, self-distillation with the
  teacher at 0.04, masked image on 64x32x32) and ``ssl_matched`` (below), each at the demo's CPU pretraining budget
  (``low_data_plan.PROTOCOL_BUDGET``: 59 epochs of 34 volumes, 2 per iteration: 1,003 iterations, on a 48-volume
  varied synthetic corpus). Pretraining seeds 0, 1, 2 per recipe. Pretraining p is finetuned and probed over a block
  of finetuning seeds of its own (``low_data_plan.finetune_block``: seeds 3p, 3p + 1, 3p + 2) at k = 1 and 2 labeled
  volumes; every recipe's pretraining p uses block p. ``scratch`` (finetuned from a random encoder) and
  ``probe_random`` (the linear probe of a random encoder) run once per finetuning seed and k of every block in use and
  are shared by the recipes' pretrainings of that block: every arm of a (finetuning seed, k) trains on the same
  volumes, selects on the same validation volumes and is scored on the same held-out sets, with the same training
  seed.
- **Health gate, fixed in advance.** A pretraining enters the comparison only if the last health report of its run
  (``eval/health.json``, written by the bundle's ``components.HealthHandler`` on 256 validation crops at its end)
  has the verdict ``learning``: every pretext signal beyond its trivial answer by its margin and no collapse signal
  crossed (``components.training.health``); a run that the self-distillation bundle's collapse guard stopped fails
  it as "collapsed". A failing pretraining is recorded with its report and shown in the summary
  and the docs' table, never dropped silently; the plan then pretrains the next seed (3, then 4) until 3 have passed
  or 5 have been tried. Only the passing pretrainings are finetuned, each as soon as it passed: the plan runs unit by
  unit (a pretraining, then its runs over its block with the block's baselines), in rounds of one seed per recipe, so
  that the summary's "units" say which are done as it goes. A recipe with fewer than 3 passing is "not
  evaluated: N of M encoders passed health".
- **One primary contrast per recipe.** For each passing pretraining p, g_p = the mean over finetuning seeds f,
  k in {1, 2} and both held-out sets of Dice(recipe p, f, k, set) - Dice(scratch, f, k, set), selected models; then the
  95 % Student t-interval over the P values g_p (P - 1 degrees of freedom). This is the mean over finetuning seeds per
  pretraining, then an interval over pretrainings, not a mixed model: with 3 pretrainings a mixed model's variance
  components are barely estimable, while the t-interval over pretraining means is exact (under normality of g_p) for
  the mean of pretraining means and needs no variance-component estimate. Its scope: as each pretraining has its own
  finetuning seeds, training volumes and held-out draws, the g_p are independent draws of (pretraining, finetuning),
  so the interval covers both (the recipe x finetuning-seed interaction enters through the spread of g_p; with seeds
  shared by every pretraining it would not). Equivalence margin delta = 0.02 Dice. The verdict, in this order: "equivalent" if the
  interval lies inside [-delta, +delta] (bounds included; two one-sided tests at 2.5 % each, stricter than the usual
  90 % interval); "better" if its lower bound > 0; "worse" if its upper bound < 0; otherwise "inconclusive". Each
  recipe's primary contrast is its own pre-registered question: no correction across the four recipes.
- **What the plan can detect, stated before the runs.** With P = 3 pretraining means of standard deviation SD(g),
  the primary interval puts a true gain above 0 with 80 % power from about (t_0.975,2 + t_0.8,2) SD(g) / sqrt(3) =
  3.10 SD(g) (``low_data_verdicts.detectable_gain``): 0.062 at SD(g) = 0.02, 0.093 at 0.03, 0.124 at 0.04. SD(g) is
  at least the finetuning's spread over 3 seeds: protocol 2's per-seed gains had SDs of 0.04-0.07 (one pretraining,
  fixed held-out sets), so SD(g) >= 0.023-0.040 before any pretraining-to-pretraining spread; a gain smaller than
  about 0.07-0.12 Dice will most likely read "inconclusive". "Equivalent" needs the interval inside +-0.02, an
  SD(g) below 0.008 (``equivalence_sd``): not expected, so a null result will read "inconclusive", not "no effect".
  Five pretrainings would detect about 0.05 at SD(g) = 0.03, at about 5/3 of the pretraining and finetuning time;
  the plan keeps the 3 the issue asks for, and this is its power.- **Secondary cells** (reported as secondary; named correction: Bonferroni, each interval at level 1 - 0.05 / m, m
  the number of the recipe's secondary cells): the recipe - scratch gain per k and held-out set, the representation
  test ``probe_<recipe> - probe_random`` pooled as the primary and per k and set, selected models only, each by the
  same machinery (means per pretraining, t-interval over pretrainings) and the same verdict rule; m = 9, and 10 for
  ``ssl_matched`` with its comparison to ``ssl`` (the t-interval of the differences of the two recipes' pretraining
  means, paired by block: the same finetuning seeds and baselines, which cancel). Bonferroni, not Holm: the verdicts
  read intervals, and Holm's step-down gives no simultaneous intervals. At 99.44 % with 2 degrees of freedom a cell
  detects about 8.3 SD(g) with 80 % power: the secondary cells describe, they will rarely decide.
- **Finetuning convergence.** The plan fixes the finetuning budget (``finetune_iterations``, one labeled volume per
  iteration, validated every ``val_every`` = 20 iterations on the validation volumes, a multiple of 4 validations so
  that quarters are whole) and a rule checked on ``scratch`` at every k: the mean validation Dice (over the runs)
  gains less than 0.01 in the last quarter of the validations over the quarter before. If scratch has not converged
  at some k, the finetuning verdicts (primary and secondary) are withheld ("budget not converged at k=.."), their
  intervals still reported; the same rule on ``probe_random`` and on the recipe's own probe withholds that recipe's
  probe verdicts. Protocol 2's records do not give a budget that converges (its k = 2 still gained +0.039 to +0.075
  in the last quarter of 200 iterations), so the budget is fixed by a pilot before the pre-registration: ``--pilot``
  runs ``scratch`` and ``probe_random`` only, at k = 1 and 2 over block 0's finetuning seeds, for the budgets of
  ``pilot_iterations`` (480, then 960: a pilot of the plan before the seeds were nested, kept in
  ``benchmarks/results/low_data_cpu_protocol3_pilot_9d4d81b/``, found scratch at k = 2 still gaining +0.043 at 400
  iterations) from the smallest up until both arms converged at every k, and writes the convergence table and that
  budget (a larger one is not run: the rule takes the smallest converged budget). The pilot reads no pretrained encoder (its records hold scratch's held-out
  Dice too, which the rule does not read), and the plan never reuses a pilot run (their keys are marked). Until the
  budget is fixed in ``PLANS["cpu"]`` the plan refuses to run.
- **Data.** Labeled synthetic CT (five organs), split by index: a training pool, 2 validation volumes (model
  selection on their mean Dice, the same for every run), an in-domain pool of 8; a shifted pool of 8 volumes of
  another scanner contrast, noise, fields of view and lesions. Each finetuning seed trains on volumes of its own:
  no two seeds share a training volume at any k, and within a seed the k = 1 volume is among its k = 2 volumes (so the
  training pool holds 5 blocks x 3 seeds x max(k) = 30 volumes). Each seed draws 4 of the 8 in-domain and 4 of the 8
  shifted volumes as its held-out sets, no two of the 15 seeds the same set, so the spread over seeds covers the
  held-out draw. The data seed is part of the plan (``Plan.data_seed``). The
  sizes these rules need are checked before any run (``low_data_plan.check_plan``), with one line naming the rule.
  With ``--labeled`` / ``--unlabeled`` / ``--shifted`` the same splits are drawn from a user's lists, none of whose
  validation or held-out volumes may be pretrained on or be in another split.
- **Window and spacing.** Pretraining reads HU [-1000, 1000] at native spacing, finetuning HU [-175, 250] at
  1 x 1 x 2 mm: a mismatch, stated and measured as the arm ``ssl_matched``: the SSL pretraining with the finetuning's
  window (``intensity_range``) on the corpus resampled to 1 x 1 x 2 mm (the pretraining bundle has no spacing
  transform: ``low_data_plan.matched_corpus`` resamples it as the finetuning does), the same seeds and health gate; its
  own primary contrast against scratch and a secondary one against ``ssl``.
- **Coverage.** The summary states, per cell kind (primary: intervals over P pretraining means at 95 %; secondary:
  the Bonferroni cells at their level, the paired comparison included), the simulated coverage of its interval on
  this plan's own structure (``low_data_verdicts.simulated_coverage``): each cell's (pretraining x finetuning seed of
  its block) matrix of gains is fitted as a one-way random-effects model (moments), and 2,000 matrices of its shape
  are drawn from it, once with normal pretraining effects and finetuning residuals, once with the residuals resampled
  from the cell's own (their tails and skew). Under the nested design the normal coverage is the nominal level up to
  the simulation's error; the resampled one is the check. (The crossed resampling of the plan before nesting could
  not exceed 8/9 with 3 pretrainings and did not track the real coverage.)
- **Records and resumability.** Every run writes its record when it finishes, under a key of its settings (overrides,
  datalist or corpus, for a finetuning the pretraining's recipe, seed, key and weights' sha256), the code that ran
  (``low_data_protocol.code_state``) and its numerics (``low_data_runs.run_numerics``): pretrainings as
  ``pretrain_<recipe>_s<seed>_<key>.json`` (with their weights and last health report), finetunings as
  ``<arm>_k<k>_f<seed>_<key>.json`` and ``<arm>_p<pretraining seed>_k<k>_f<seed>_<key>.json``. A re-run reuses
  finished runs only; a killed run leaves no record and runs again; ``--stop_after_s`` starts no run after its limit,
  and the same command continues. The pre-registration commit fixes the analysis code too
  (``low_data_plan.ANALYSIS_CODE``): if any of those files differs from it in the checkout that summarises, every
  verdict is withheld and the files are listed (``preregistration.analysis_changed``). Before any run the plan's
  ``finetune_iterations`` must be the smallest converged budget of the committed, complete pilot summary of the same
  pilot settings (``low_data_plan.check_pilot``). Each record the plan obtains is entered once in the results folder's
  append-only ``ledger.jsonl`` (file, sha256): a record deleted or changed since (``records_changed``) withholds every
  verdict. A run that fails runs once more from its start; failing again it is recorded as failed (a pretraining with
  health verdict "crashed", failing the gate; a finetuning without Dice, like one whose selected model's Dice is NaN):
  the summary lists the failed finetuning runs (``failed_runs``) and withholds the verdicts of every recipe whose cells
  would read one. The summary's tables and one-sentence answers per recipe are generated from its JSON
  (``--markdown``/``--write_docs``) into README's "What pretraining buys" and docs/measuring.md.

**Time of the CPU plan, an estimate per candidate budget** from the pilot's own records at 480 iterations
(``benchmarks/results/low_data_cpu_protocol3_pilot/``, each record's ``seconds``; two runs side by side, one thread
each, on a 2-vCPU VM, beside test processes part of the time: an upper estimate, not an idle measurement): a
finetuned run (scratch) took 986-1,511 s, median 1,097 s at k = 1 and 1,301 s at k = 2; a probe run 238-432 s. The
plan at P = 3 has 90 finetuned and 90 probe runs (3 blocks of baselines and 12 pretrainings, each over 3 seeds x
2 k): about 107,900 + 25,200 s of run time (medians 1,199 s and 281 s) at 480 iterations, twice that at 960 (the time is per iteration). Its 12
pretrainings (1,003 iterations) add about 10,400 s: SSL and ``ssl_matched`` about 1,250 s each (the demo's SSL
pretraining took 624 s on 2 threads alone, ``benchmarks/results/demo_cpu.json``, assumed twice on one), masked image
456 s and self-distillation 509 s (``benchmarks/results/pretrain_curve/``, a shared VM). Wall time with two side by
side: about 71,800 s (20 h) at 480 iterations, 138,300 s (38 h) at 960; each pretraining seed beyond the third adds
its recipe's pretraining and, if it passes, 6 finetuned and 6 probe runs. In resumable pieces (``--stop_after_s``) in
the background, across sessions.

    python benchmarks/low_data.py --pilot --stop_after_s 3000 --out runs/low_data_pilot \\
        --results benchmarks/results/low_data_cpu_protocol3_pilot --json benchmarks/results/low_data_cpu_protocol3_pilot.json
                                            # before the pre-registration: fixes finetune_iterations
    python benchmarks/low_data.py --stop_after_s 3000 --out runs/low_data_cpu_protocol3 \\
        --results benchmarks/results/low_data_cpu_protocol3 --json benchmarks/results/low_data_cpu_protocol3.json
                                            # a CPU piece: repeat (nohup ... &) until "complete"
    python benchmarks/low_data.py --report_only ...   # the summary of the finished runs, running nothing
    python benchmarks/low_data.py --small             # CI: one k, one seed, a few iterations; its gate admits any verdict
    python benchmarks/low_data.py --markdown SUMMARY.json --write_docs README.md docs/measuring.md  # the docs' blocks
    python benchmarks/low_data.py --coverage SUMMARY.json --results RECORDS/  # protocol 1-2 history: add its coverage

Prints one JSON object (also written to ``--json``). The code: ``low_data_plan`` (plan, data, draws),
``low_data_schedule`` (gate, runs, pilot, summary), ``low_data_verdicts`` (statistics), ``low_data_runs`` (the bundle
runs), ``low_data_docs`` (the docs' blocks); ``low_data_protocol``, ``low_data_arms``, ``low_data_stats`` and
``low_data_rankme`` also hold protocol 2's parts, which ``low_data_lever.py`` still runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's components, without PYTHONPATH


class _OneLineParser(argparse.ArgumentParser):
    """Errors in one line (``low_data.py: error: ...``), without the usage block."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


ARMS_HELP = ("arms: scratch, probe_random, and per recipe (ssl, dino, mim, ssl_matched) the finetuned arm and its "
             "probe_<recipe>, e.g. probe_mim")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser and the parsed arguments; nothing heavy is imported here, so ``--help`` answers at once."""
    parser = _OneLineParser(prog="low_data.py", description=__doc__.split("\n\n")[0], epilog=ARMS_HELP)
    parser.add_argument("--small", action="store_true", help="the CI plan: one k, one seed, a few iterations (learns nothing)")
    parser.add_argument("--pilot", action="store_true", help="scratch and probe_random only, at each pilot budget: the convergence table")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: CUDA where present")
    parser.add_argument("--out", default="runs/low_data", help="folder for the data and the runs")
    parser.add_argument("--results", default=None, help="folder of the per-run records (default: <out>/results)")
    parser.add_argument("--json", default=None, help="also write the summary to this file")
    parser.add_argument("--parallel", type=int, default=None, help="runs side by side (default: 2 on CPU, 1 on CUDA)")
    parser.add_argument("--labeled", default=None, help="a user's labeled datalist (Decathlon style)")
    parser.add_argument("--unlabeled", default=None, help="a user's unlabeled corpus (Decathlon style, labels not needed)")
    parser.add_argument("--shifted", default=None, help="with --labeled: a labeled datalist of another site (the shifted pool)")
    parser.add_argument("--report_only", action="store_true", help="run nothing: summarise the finished runs, list the missing")
    parser.add_argument("--stop_after_s", type=float, default=None, help="start no run after this many seconds; run again to continue")
    parser.add_argument("--markdown", default=None, help="print the generated blocks of this summary (or the pilot's table) and exit")
    parser.add_argument("--write_docs", nargs="+", default=None, help="with --markdown: rewrite these files' blocks of it")
    parser.add_argument("--coverage", default=None,
                        help="protocol 1-2 history: add the intervals' coverage to this summary JSON from its records in --results")
    args = parser.parse_args(argv)
    if (args.labeled is None) != (args.unlabeled is None):
        parser.error("--labeled and --unlabeled go together (a labeled list and an unlabeled corpus).")
    if args.shifted is not None and args.labeled is None:
        parser.error("--shifted needs --labeled and --unlabeled.")
    if args.coverage and not args.results:
        parser.error("--coverage needs --results, the folder of the summary's run records.")
    return parser, args


def main(argv: list[str] | None = None) -> None:
    """Runs the plan or its pilot (or prints or writes a summary's blocks, or adds an old summary's coverage) and prints
    the summary. The arguments, the plan and a user's lists are checked before torch or MONAI is imported, so that a
    refusal answers at once."""
    parser, args = parse_args(argv)
    if args.coverage:
        from low_data_stats import coverage, summary_populations

        path = Path(args.coverage)
        summary = json.loads(path.read_text())
        summary["coverage"] = coverage(summary_populations(summary, Path(args.results)))
        path.write_text(json.dumps(summary, indent=2) + "\n")
        print(json.dumps(summary["coverage"], indent=2))
        return
    if args.markdown:
        path = Path(args.markdown)
        missing = [doc for doc in args.write_docs or () if not Path(doc).is_file()]
        if missing:
            parser.error(f"--write_docs: no such file: {', '.join(missing)}")
        from low_data_docs import block_content, pilot_markdown, write_doc_tables

        try:
            for doc in args.write_docs or ():
                print(f"{doc}: {'updated' if write_doc_tables(Path(doc), path) else 'unchanged'}")
            if not args.write_docs:
                result = json.loads(path.read_text()) if path.is_file() else {"protocol": 3}
                if result.get("benchmark") == "low_data_pilot":
                    print(pilot_markdown(result), end="")
                    return
                kinds = ("answers", "protocol3") if result.get("protocol") == 3 else ("findings", "tables")
                print("\n".join(block_content(kind, path, args.markdown).rstrip("\n") for kind in kinds))
        except ValueError as err:
            parser.error(str(err))
        return
    from low_data_plan import PLANS, PlanError, check_data, check_plan, check_preregistered, users_data
    from low_data_protocol import DatalistError
    from machine import git_commit

    plan = PLANS["small" if args.small else "cpu"]
    lists = {name: Path(getattr(args, name)).resolve() if getattr(args, name) else None for name in ("labeled", "unlabeled", "shifted")}
    data = None
    try:
        check_plan(plan, pilot=args.pilot)
        if not (args.pilot or args.report_only):
            check_preregistered(plan, git_commit())
        if lists["labeled"]:
            root = Path(args.out).resolve() / "data"
            data = users_data(root, plan, lists["labeled"], lists["unlabeled"], lists["shifted"])
            check_data(data, plan)
    except (PlanError, DatalistError) as err:
        parser.error(str(err))
    import torch

    from low_data_schedule import pilot, run

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    parallel = args.parallel or (2 if device == "cpu" else 1)
    try:
        result = (pilot if args.pilot else run)(plan, Path(args.out), device, parallel,
                                                Path(args.results) if args.results else None, args.report_only,
                                                args.stop_after_s, data=data, **lists)  # fmt: skip
    except (PlanError, DatalistError) as err:
        parser.error(str(err))
    text = json.dumps(result, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
