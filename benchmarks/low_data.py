"""What each pretraining recipe buys when labels are few, by a protocol fixed before any result.

The protocol (all of it decided by the plan and its data seed, never by ``--ks`` or ``--seeds``):

- **Data.** A labeled pool of ``pool_size`` candidate volumes, one validation volume (model selection) and two
  held-out sets: *in-domain* (drawn like the labeled volumes) and *shifted* (the scanner contrast, noise, fields of
  view and lesions of the unlabeled corpus, on subjects of their own). The unlabeled corpus is larger and varied
  (``components.write_dataset(varied=True)``). With ``--labeled`` / ``--unlabeled`` (and optionally ``--shifted``)
  the same protocol runs on a user's datalists: the held-out, validation and pool volumes are then drawn from the
  labeled list by the data seed.
- **Pools.** For seed ``s`` the k training volumes are the first k of one permutation of the pool drawn from
  (data seed, s): nested (the k = 1 volume is among the k = 2 volumes, and so on) and the same whatever ``--ks``.
- **Arms.** ``scratch``; ``ssl`` and ``dino`` (finetuned from the SSL and self-distillation bundles' encoders);
  and the representation test, a frozen encoder (decoder trained, ``swinViT`` never updated):
  ``frozen_random``, ``frozen_ssl``, ``frozen_dino``. The arms of a (k, seed) pair run the same command but for
  the encoder's starting weights (and, between the finetuned and frozen families, the freeze).
- **Budget.** ``finetune_iterations`` for every k and arm (one crop per iteration), validated every ``val_every``
  iterations on the validation volume. Both the *last* model and the *selected* one (best validation Dice, the
  earliest on ties) are scored on both held-out sets. The scratch arm's validation curves, written to the JSON and
  ``curves.png``, show whether the budget lets it converge.
- **Statistics.** Per contrast (``ssl - scratch``, ``dino - scratch``, ``frozen_ssl - frozen_random``,
  ``frozen_dino - frozen_random``), k, held-out set and model: the paired differences over seeds, their mean and a
  95 % percentile bootstrap interval. Seeds are added at ``narrow_ks`` (k = 1, 2) until every interval there is at
  most ``target_half_width`` wide on either side, up to ``max_seeds``; the JSON says how many it took.
- **Records.** Every run writes its result as soon as it finishes, to ``<results>/<arm>_k<k>_seed<s>_<hash>.json``
  where the hash covers every setting of the run (its overrides, its datalist, the bundle configs, the pretrained
  weights' sha256) and the numerics it runs on (device, torch, the CPU's vector instructions: ``run_numerics``). A
  re-run skips finished runs and never reads a result of other settings or numerics; a killed run leaves no result
  and is run again from its start. Each pretraining keeps its weights beside its record (git-ignored), so the
  results folder alone, carried to another machine, continues the plan there.
- **RankMe.** The effective rank of each encoder's embeddings of held-out crops (``components.effective_rank``),
  computed here for the random, SSL and self-distillation encoders, next to the value each pretraining bundle
  logged at its last validation; the JSON says whether RankMe orders the encoders as the frozen arms do.

Every training and evaluation step is a real ``python -m monai.bundle run`` with command-line overrides.

    python benchmarks/low_data.py                        # the device's plan (cpu or cuda), resumable
    python benchmarks/low_data.py --device cuda          # pieces of at most ~9 min: repeat until "complete": true
    python benchmarks/low_data.py --device cuda --results benchmarks/results/low_data_cuda  # the GPU plan's records
    python benchmarks/low_data.py --report_only          # the summary of the finished runs, running nothing
    python benchmarks/low_data.py --small                # CI: one k, one seed, a few iterations (learns nothing)
    python benchmarks/low_data.py --labeled my_labeled.json --unlabeled my_corpus.json [--shifted other_site.json]

Prints one JSON object (also written to ``--json``): the settings and their hash, the data (every file of every
split), per run its training and held-out files and Dice, the tables and paired intervals, RankMe, the machine and
the commits; writes ``low_data.png`` and ``curves.png`` under ``--out``.
"""


from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's components, without PYTHONPATH
from low_data_arms import ARMS  # noqa: E402 (standard library only: --help imports neither torch nor MONAI)


class _OneLineParser(argparse.ArgumentParser):
    """Errors in one line (``low_data.py: error: ...``), without the usage block."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser and the parsed arguments; nothing heavy is imported here, so ``--help`` answers at once."""
    parser = _OneLineParser(prog="low_data.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="the CI size: one k, one seed, a few iterations")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: CUDA where present")
    parser.add_argument("--ks", default=None, help="label counts, comma-separated (a subset of the plan's pool)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds at every k (min and max; default: the plan's)")
    parser.add_argument("--arms", nargs="+", default=None, help=f"default: the plan's; any of {', '.join(ARMS)}")
    parser.add_argument("--seed", type=int, default=0, help="the data seed: fixes the data, pools and held-out sets")
    parser.add_argument("--out", default="runs/low_data", help="folder for the data, the runs and the plots")
    parser.add_argument("--results", default=None, help="folder of the per-run result files (default: <out>/results)")
    parser.add_argument("--json", default=None, help="also write the summary to this file")
    parser.add_argument("--parallel", type=int, default=None, help="runs side by side (default: 2 on CPU, 1 on CUDA)")
    parser.add_argument("--labeled", default=None, help="a user's labeled datalist (Decathlon style)")
    parser.add_argument("--unlabeled", default=None, help="a user's unlabeled corpus (Decathlon style, labels not needed)")
    parser.add_argument("--shifted", default=None, help="optional: a labeled datalist of another site (shifted held-out set)")
    parser.add_argument("--pretrain_overrides", type=json.loads, default={}, help="JSON overrides of the pretraining runs")
    parser.add_argument("--finetune_overrides", type=json.loads, default={}, help="JSON overrides of every finetuning run")
    parser.add_argument("--report_only", action="store_true", help="run nothing: summarise the finished runs, list the missing")
    parser.add_argument("--stop_after_s", type=float, default=None,
                        help="start no run after this many seconds (default: the cuda plan's 420, none on CPU); run again to continue")
    parser.add_argument("--markdown", default=None, help="print the Markdown tables of this summary JSON and exit")
    parser.add_argument("--write_docs", nargs="+", default=None, help="with --markdown: rewrite these files' blocks of it")
    parser.add_argument("--coverage", default=None,
                        help="add the intervals' simulated coverage to this summary JSON, from its records in --results, and exit")
    args = parser.parse_args(argv)
    unknown = [arm for arm in args.arms or () if arm not in ARMS]
    if unknown:
        parser.error(f"unknown arms {unknown}: the arms are {', '.join(ARMS)}.")
    if (args.labeled is None) != (args.unlabeled is None):
        parser.error("--labeled and --unlabeled go together (a labeled list and an unlabeled corpus).")
    if args.shifted is not None and args.labeled is None:
        parser.error("--shifted needs --labeled and --unlabeled.")
    if args.coverage and not args.results:
        parser.error("--coverage needs --results, the folder of the summary's run records.")
    return parser, args


def main(argv: list[str] | None = None) -> None:
    parser, args = parse_args(argv)
    from dataclasses import replace

    import torch

    from low_data_docs import block_content, write_doc_tables
    from low_data_protocol import PLANS, DatalistError
    from low_data_runs import run
    from low_data_stats import coverage, summary_populations

    if args.coverage:
        path = Path(args.coverage)
        summary = json.loads(path.read_text())
        summary["coverage"] = coverage(summary_populations(summary, Path(args.results)))
        path.write_text(json.dumps(summary, indent=2) + "\n")
        print(json.dumps(summary["coverage"], indent=2))
        return
    if args.markdown:
        path = Path(args.markdown)
        try:
            for doc in args.write_docs or ():
                print(f"{doc}: {'updated' if write_doc_tables(Path(doc), path) else 'unchanged'}")
            if not args.write_docs:
                print(block_content("tables", path, args.markdown), end="")
        except ValueError as err:
            parser.error(str(err))
        return
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    plan = PLANS["small" if args.small else device]
    if args.ks:
        plan = replace(plan, ks=tuple(int(k) for k in args.ks.split(",")))
    if args.seeds:
        plan = replace(plan, min_seeds=args.seeds, max_seeds=args.seeds)
    if args.arms:
        plan = replace(plan, arms=tuple(args.arms))
    plan = replace(plan, pretrain_overrides=args.pretrain_overrides, finetune_overrides=args.finetune_overrides)
    parallel = args.parallel or (2 if device == "cpu" else 1)
    paths = {name: Path(getattr(args, name)).resolve() if getattr(args, name) else None for name in ("labeled", "unlabeled", "shifted")}
    stop_after_s = args.stop_after_s if args.stop_after_s is not None else (420.0 if device == "cuda" else None)
    try:
        result = run(plan, Path(args.out), device, args.seed, parallel, Path(args.results) if args.results else None, **paths,
                     report_only=args.report_only, stop_after_s=stop_after_s)
    except DatalistError as err:
        parser.error(str(err))
    text = json.dumps(result, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
