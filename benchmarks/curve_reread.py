"""The health of each final encoder of ``pretrain_curve.py`` read again on more crops, the same for every run.

A run's own reports read its pretext on ``pretrain_curve.CROPS`` validation crops drawn with the run's seed, so two
seeds of a point are read on different crops, and a rotation head of modest accuracy may read "at baseline" on one
draw and "learning" on the next. This script reads every finished run's final weights (``models/checkpoint.pt``)
with :func:`components.release.health.checkpoint_health` (what ``python -m components health`` prints) on
:data:`CROPS` validation crops drawn with :data:`CROP_SEED`, the same crops and views for every run of a recipe:

- **what it reads**: the recipes whose checkpoints hold their pretext heads (SSL: rotation, contrastive and
  inpainting; masked image: the masked-voxel loss and the reconstruction's spread), beside each signal's trivial
  answer on those crops, and the embedding collapse signals; self-distillation's signals need its teacher and
  prototypes, which its checkpoint's reader does not rebuild, so its runs keep the verdicts of their own reports;
- **settings**: each run's crop size (its record's ``roi_size``), the pretraining bundles' window (HU
  [-1000, 1000]), the validation list of the curve's corpus.

    python benchmarks/curve_reread.py --work /work/bench-data/curve   # every finished SSL and masked image run, resumable

Records go to ``benchmarks/results/pretrain_curve_reread/<run>.json``, each naming the checkpoint's sha256 and the
commit of the reading code; ``pretrain_curve.py summarise`` puts their verdicts beside the runs' own.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from curve_probe import file_sha256
from machine import REPO, git_commit, machine_info

CURVE_RECORDS = REPO / "benchmarks" / "results" / "pretrain_curve"
RECORDS = REPO / "benchmarks" / "results" / "pretrain_curve_reread"
#: the recipes whose checkpoints hold their pretext heads (``checkpoint_health``'s "ssl" and "mim")
RECIPES = ("ssl", "mim")
CROPS = 256
CROP_SEED = 0
BATCH_SIZE = 4
INTENSITY_RANGE = (-1000.0, 1000.0)


def reread(checkpoint: Path, datalist: Path, roi_size: list[int]) -> dict:
    """The health report of ``checkpoint`` on the fixed crops: its kind of heads, verdict and signals."""
    from components.release.health import checkpoint_health

    started = time.perf_counter()
    kind, report = checkpoint_health(checkpoint, datalist, "validation", roi_size, INTENSITY_RANGE, CROPS, BATCH_SIZE,
                                     CROP_SEED)  # fmt: skip
    return {"heads": kind, **report.as_dict(), "seconds": round(time.perf_counter() - started, 1)}


def run(work: Path) -> list[Path]:
    """Reads every finished curve run of :data:`RECIPES` under ``work / "runs"``, skipping records already written.

    Raises:
        FileNotFoundError: a finished run (its curve record written) whose checkpoint is not under ``work``.
    """
    datalist = work / "data" / "unlabeled" / "dataset.json"
    RECORDS.mkdir(parents=True, exist_ok=True)
    written = []
    for curve_record in sorted(CURVE_RECORDS.glob("*.json")):
        name, curve = curve_record.stem, json.loads(curve_record.read_text())
        path = RECORDS / f"{name}.json"
        if path.is_file() or curve["recipe"].split("+")[0] not in RECIPES:
            continue
        checkpoint = work / "runs" / name / "models" / "checkpoint.pt"
        if not checkpoint.is_file():
            raise FileNotFoundError(f"{curve_record.name}: its run's final checkpoint {checkpoint} is missing")
        result = reread(checkpoint, datalist, curve["overrides"]["roi_size"])
        record = {"run": name, "seed": curve["seed"], "checkpoint_sha256": file_sha256(checkpoint), "commit": git_commit(),
                  "settings": {"crops": CROPS, "crop_seed": CROP_SEED, "batch_size": BATCH_SIZE, "list": "validation",
                               "roi_size": curve["overrides"]["roi_size"], "intensity_range": list(INTENSITY_RANGE)},
                  "machine": machine_info(), **result}  # fmt: skip
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"{name}: {result['verdict']} ({result['seconds']} s)", flush=True)
        written.append(path)
    return written


def load_records() -> dict[str, dict]:
    """The re-read records by run name."""
    return {path.stem: json.loads(path.read_text()) for path in sorted(RECORDS.glob("*.json"))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="pretrain_curve.py's --work folder")
    run(parser.parse_args(argv).work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
