"""What each pretraining recipe buys when labels are few, by a protocol fixed before any of its runs.

The protocol (fixed here and in ``low_data_protocol.PLANS`` in the commit that wrote it, before any run; decided by
the plan and its data seed, never by ``--ks`` or ``--seeds``):

- **Data.** A labeled pool of ``pool_size`` candidate volumes, one validation volume (model selection) and two
  held-out sets: *in-domain* (drawn like the labeled volumes) and *shifted* (the scanner contrast, noise, fields of
  view and lesions of the unlabeled corpus, on subjects of their own). The unlabeled corpus is larger and varied
  (``components.write_dataset(varied=True)``). With ``--labeled`` / ``--unlabeled`` (and optionally ``--shifted``)
  the same protocol runs on a user's datalists: the held-out, validation and pool volumes are drawn from the labeled
  list by the data seed, and no validation or held-out volume may be in the unlabeled corpus or the shifted list, nor
  a pool volume in the shifted list, by path or by content (sha256): otherwise one line names both lists and the
  file, before any run.
- **Pools.** For seed ``s`` the k training volumes are the first k of one permutation of the pool drawn from
  (data seed, s): nested (the k = 1 volume is among the k = 2 volumes, and so on) and the same whatever ``--ks``.
- **Pretraining.** Once per recipe on the unlabeled corpus, sized by the plan's budget: ``ssl`` (the SSL bundle),
  ``dino`` (the self-distillation bundle: the SSL run's data, epochs, batch and network, 32^3 crops), ``mim`` (the
  masked image bundle with the SSL run's overrides and its own masking defaults).
- **Arms.** Finetuned: ``scratch``, ``ssl``, ``dino``, ``mim`` (from each recipe's encoder). The representation test,
  linear probes: ``probe_random``, ``probe_ssl``, ``probe_dino``, ``probe_mim`` (the CT bundle with
  ``network_def#network`` = ``$components.LinearProbe``: ``swinViT`` frozen, one 1x1x1 convolution per multi-scale
  feature trains). Optional, in no plan unless ``--arms`` names them: ``frozen_swinvit_random``, ``..._ssl``,
  ``..._dino``, ``..._mim`` (``swinViT`` frozen for the whole run while the decoder and the convolutional encoder
  blocks train). The arms of one kind and (k, seed) run the same command but for the encoder's starting weights.
- **Budget.** ``finetune_iterations`` for every k and arm (one crop per iteration), validated every ``val_every``
  iterations on the validation volume. Both the *last* model and the *selected* one (best validation Dice, the
  earliest on ties) are scored on both held-out sets, and every table shows both. The scratch arm's validation
  curves, in the JSON and ``curves.png``, show whether the budget lets it converge.
- **Statistics.** Per contrast (each pretrained arm against its kind's random-encoder arm: ``ssl - scratch``,
  ``dino - scratch``, ``mim - scratch``, ``probe_ssl - probe_random``, ``probe_dino - probe_random``,
  ``probe_mim - probe_random``), k, held-out set and model: the paired differences over seeds, their mean and, from 5
  pairs on, the 95 % Student t-interval of the mean (n - 1 degrees of freedom); below 5 pairs the range [min, max],
  never called 95 %. Seeds are added at ``narrow_ks`` until every t-interval there is at most
  ``target_half_width`` wide on either side, up to ``max_seeds``. The summary holds the intervals' coverage simulated
  on its own pairs (``low_data_stats.coverage``); on the old protocol's 9-seed pairs the t-interval covered the mean
  0.90, 0.91 and 0.93 of the time at n = 3, 5 and 9, the percentile bootstrap it replaces 0.71, 0.81 and 0.89.
- **Records.** Every run writes its result as soon as it finishes, to ``<results>/<arm>_k<k>_seed<s>_<hash>.json``
  where the hash covers every setting of the run (its overrides, its datalist, the pretrained weights' sha256), the
  code that ran (the ``components`` package's source digest, less the demo's driver ``demo/run.py``, which no
  process of the protocol imports, and the sha256 of every bundle config the run reads:
  ``low_data_protocol.code_state``) and its numerics (device, torch and MONAI versions, the CPU's vector
  instructions: ``low_data_runs.run_numerics``). A re-run skips finished runs and never reads a result of other
  settings, code or numerics; a killed run leaves no result and is run again from its start. Each pretraining keeps
  its weights beside its record (git-ignored), so the results folder alone, carried to another machine, continues
  the plan there.
- **RankMe.** The effective rank of each encoder's embeddings (random, SSL, self-distillation, masked image) of the
  same ``rankme_crops`` held-out crops, the number every pretraining is told to log RankMe on
  (``training#rankme_crops``): at most min(N, D), 192 at feature size 12 and 256 crops; the JSON says whether RankMe
  orders the encoders as the probe arms do.

**The CPU plan** (``PLANS["cpu"]``): k = 1 and 2; the eight finetuned and probe arms; seeds 0-8 at both k (the seed
rule adds none: the target half-width is reported, not pursued); 200 iterations validated every 40; the demo's
pretraining budget (48 unlabeled volumes, 12 epochs): 144 finetuning runs and 3 pretrainings, two runs side by side.
Time, estimated before any run for the 2-vCPU AVX-512 VM of the old records (benchmarks/README.md has the details):
a finetuned run took a median 199 s there, two side by side (72 runs: 7,160 s); a probe run, which backpropagates
through nothing but its 1x1x1 convolutions, took 0.35 of a finetuned run's CPU time at the plan's own settings
(measured on a 2-vCPU AVX-512 AMD EPYC VM like it: 52.8 s against 150.2 s, two interleaved pairs, one thread each, with a stand-in built to the
LinearProbe interface; 72 runs: 2,510 s); the pretrainings take about 150 s side by side (SSL 87 s and
self-distillation 146 s in the records, the masked image run measured at 0.71 of the SSL run's time); RankMe of four
encoders at most 190 s. About 10,000 s (2.8 h) in all: within 6 hours of the VM, in resumable pieces
(``--stop_after_s``) that run in the background. The frozen-swinViT arms would add about 6,400 s.

**The GPU plan** (``PLANS["cuda"]``): k = 1, 2, 4, 8; the eight arms; 9 seeds, up to 20 at k = 1, 2 by the seed rule;
400 iterations of 2 crops; pretraining on 64 volumes for 60 epochs; 4 runs side by side, in pieces that start no run
after 7 minutes. Its first piece (``--ks 1 --seeds 1 --parallel 8``) pretrains the three recipes side by side and
finetunes (k = 1, seed 0) of all eight arms at once: 297 s on an H100 (benchmarks/README.md); its records are the
GPU plan's, which later pieces continue. The device tool returns a few files a call: write the results folder, with
the pretrained weights, into one archive under ``$OUT``.

Every training and evaluation step is a real ``python -m monai.bundle run`` with command-line overrides.

    python benchmarks/low_data.py --device cpu --stop_after_s 3000 --out runs/low_data_cpu_protocol2 \\
        --results benchmarks/results/low_data_cpu_protocol2 --json benchmarks/results/low_data_cpu_protocol2.json
                                                         # a CPU piece of ~1 h: repeat (nohup ... &) until "complete"
    python benchmarks/low_data.py --device cuda --ks 1 --seeds 1 --parallel 8 --results benchmarks/results/low_data_cuda_protocol2
                                                         # the GPU plan's first piece: every arm in 9 minutes
    python benchmarks/low_data.py --device cuda --results benchmarks/results/low_data_cuda_protocol2  # the next pieces
    python benchmarks/low_data.py --report_only          # the summary of the finished runs, running nothing
    python benchmarks/low_data.py --small                # CI: one k, one seed, a few iterations (learns nothing)
    python benchmarks/low_data.py --labeled my_labeled.json --unlabeled my_corpus.json [--shifted other_site.json]
    python benchmarks/low_data.py --markdown SUMMARY.json --write_docs docs/measuring.md ...  # the docs' generated blocks
    python benchmarks/low_data.py --coverage SUMMARY.json --results RECORDS/  # add the intervals' coverage to a summary

Prints one JSON object (also written to ``--json``): the settings (with the code and numerics) and their hash, the
data (every file of every split), per run its training and held-out files and Dice, the tables, the paired
differences and their intervals, the intervals' coverage, RankMe, the machine and the commits; writes
``low_data.png`` and ``curves.png`` under ``--out``. The code: ``low_data_arms`` (arms, contrasts),
``low_data_protocol`` (plans, data, keys), ``low_data_runs`` (the bundle runs and :func:`run`), ``low_data_stats``,
``low_data_rankme``, ``low_data_docs`` (tables, the docs' blocks, plots).
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
    parser.add_argument("--markdown", default=None, help="print the findings and Markdown tables of this summary JSON and exit")
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
    """Runs the plan (or prints or writes a summary's tables, or adds its coverage) and prints the summary."""
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
        missing = [doc for doc in args.write_docs or () if not Path(doc).is_file()]
        if missing:
            parser.error(f"--write_docs: no such file: {', '.join(missing)}")
        try:
            for doc in args.write_docs or ():
                print(f"{doc}: {'updated' if write_doc_tables(Path(doc), path) else 'unchanged'}")
            if not args.write_docs:
                kinds = ("findings", "tables") if path.is_file() else ("tables",)  # else one not-measured line
                print("\n".join(block_content(kind, path, args.markdown) for kind in kinds), end="")
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
    parallel = args.parallel or (2 if device == "cpu" else 4)
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
