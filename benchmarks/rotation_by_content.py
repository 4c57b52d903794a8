"""The health signals of the demo's SSL encoders by crop content: crops with little body against crops inside it.

A rotation head can learn the rotation of a crop from the outline of the body alone, and a crop inside the body
has none; read on all crops together, a head that learned the edges may stay within its line. This reads the heads
on crops binned by how much of them the body fills.

For each demo seed N of a ``benchmarks/demo_seeds.py`` work folder, its pretrained encoder
(``<work>/seed<N>/ssl_pretrain/models/model.pt``, read by :func:`components.release.health.checkpoint_network`) is
read on crops of that run's own unlabeled lists (``<work>/seed<N>/data/unlabeled/dataset.json``, the training and the
validation list), drawn as the pretraining bundles draw them (:func:`components.release.health.datalist_crops`):

- **what it measures**: each crop's body fraction, the share of its voxels above HU :data:`BODY_HU` once the window
  has scaled them to [0, 1]; the crops sorted by it and split into 4 quartiles of equal count; for each quartile and
  for all crops, the health report (:func:`components.recipe_health`: rotation accuracy and loss, contrastive
  accuracy and loss, inpainting L1, the embedding's spread), each signal beside its trivial answer on those crops;
- **settings**: ``--crops`` crops a list (256 by default, a multiple of 4), the crop size the runs pretrained with
  (their ``summary.json``: ``settings.pretraining_roi_size``, ``ssl_roi_size`` before 0.5.0), the pretraining bundles' window (HU [-1000, 1000]), the seed N as the
  crops' and the views' seed, 4 crops a batch, on the CPU.

    python benchmarks/rotation_by_content.py --work /tmp/demo_seeds --seeds 0,1,2,3,4

The results go to ``benchmarks/results/rotation_by_content.json`` under ``seeds``, then the seed, then the list, each
seed with the commit and the machine that measured it. A seed already in the file is skipped, so a stopped
measurement resumes; a file written with other settings is refused (give another ``--out``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from machine import REPO, git_commit, machine_info

from components.errors import ConfigError, MissingFileError

RESULTS = REPO / "benchmarks" / "results" / "rotation_by_content.json"
LISTS = ("training", "validation")
INTENSITY_RANGE = (-1000.0, 1000.0)
#: a voxel above this many Hounsfield units is inside the body (fat is about -100, lung about -800 to -500)
BODY_HU = -400.0
QUARTILES = 4
BATCH_SIZE = 4


def seed_paths(work: Path, seed: int) -> tuple[Path, Path, Path]:
    """The SSL checkpoint, the unlabeled datalist and the summary of the demo run of ``seed`` under ``work``."""
    run = work / f"seed{seed}"
    return run / "ssl_pretrain" / "models" / "model.pt", run / "data" / "unlabeled" / "dataset.json", run / "summary.json"


def pretraining_roi_size(work: Path, seeds: list[int]) -> list[int]:
    """The crop size the demo runs of ``seeds`` pretrained with, read from their summaries.

    Raises:
        ConfigError: the runs pretrained with different crop sizes (one results file holds one).
    """
    sizes = {}
    for seed in seeds:
        settings = json.loads(seed_paths(work, seed)[2].read_text())["settings"]
        sizes[seed] = settings.get("pretraining_roi_size", settings.get("ssl_roi_size"))
    if len({tuple(size) for size in sizes.values()}) > 1:
        raise ConfigError(f"the demo runs under {work} pretrained with different crop sizes ({sizes}); read them into "
                          "different --out files")  # fmt: skip
    return list(next(iter(sizes.values())))


def scaled_threshold(hu: float, intensity_range: Sequence[float]) -> float:
    """``hu`` as the window ``intensity_range`` (HU mapped linearly to [0, 1]) scales it."""
    low, high = float(intensity_range[0]), float(intensity_range[1])
    return (float(hu) - low) / (high - low)


def body_fraction(crop: torch.Tensor, threshold: float) -> float:
    """The share of the crop's voxels above ``threshold`` (all channels together)."""
    return float((crop > threshold).float().mean())


def health_by_content(recipe: Any, network: torch.nn.Module, crops: list[torch.Tensor], seed: int) -> dict:
    """The health report of the crops of each body-fraction quartile and of all crops.

    Returns:
        ``{"quartiles": [...], "all": {...}}``; each entry holds its body fractions' ``[least, most]``, its number of
        crops, the report's verdict and each signal's value, baseline and verdict.
    """
    from components import recipe_health

    threshold = scaled_threshold(BODY_HU, INTENSITY_RANGE)
    fractions = [body_fraction(crop, threshold) for crop in crops]
    order = sorted(range(len(crops)), key=lambda i: fractions[i])
    size = len(crops) // QUARTILES

    def entry(indices: list[int]) -> dict:
        report = recipe_health(recipe, network, [crops[i] for i in indices], BATCH_SIZE, seed).as_dict()
        signals = {name: {key: signal[key] for key in ("value", "baseline", "verdict")}
                   for name, signal in report["signals"].items()}  # fmt: skip
        chosen = sorted(fractions[i] for i in indices)
        return {"body_fraction": [chosen[0], chosen[-1]], "crops": len(indices),
                "verdict": report["verdict"], "signals": signals}  # fmt: skip

    quartiles = [entry(order[q * size : (q + 1) * size]) for q in range(QUARTILES)]
    return {"quartiles": quartiles, "all": entry(order)}


def settings(crops: int, roi_size: list[int]) -> dict:
    """What the measurement is made with (a results file holds one set of them)."""
    return {"crops": crops, "roi_size": roi_size, "intensity_range": list(INTENSITY_RANGE),
            "body_hu": BODY_HU, "body_threshold": scaled_threshold(BODY_HU, INTENSITY_RANGE), "quartiles": QUARTILES,
            "batch_size": BATCH_SIZE, "lists": list(LISTS)}  # fmt: skip


def demo_seeds(work: Path) -> list[int]:
    """The seeds of the demo runs under ``work`` (its ``seed<N>`` folders)."""
    found = (re.fullmatch(r"seed(\d+)", path.name) for path in work.iterdir() if path.is_dir()) if work.is_dir() else ()
    return sorted(int(match.group(1)) for match in found if match)


def load_networks(work: Path, seeds: list[int]) -> dict[int, tuple[torch.nn.Module, Any]]:
    """Each seed's SSL network and recipe, every file checked before any network is read.

    Raises:
        MissingFileError: a seed's checkpoint or datalist is missing (the first one, named).
        ConfigError: a checkpoint without the SSL heads.
    """
    from components.release.health import checkpoint_network

    for seed in seeds:
        for path in seed_paths(work, seed):
            if not path.is_file():
                raise MissingFileError(f"demo seed {seed}: {path} is missing (is {work} the --work folder of "
                                       "benchmarks/demo_seeds.py?)")  # fmt: skip
    networks = {}
    for seed in seeds:
        checkpoint = seed_paths(work, seed)[0]
        kind, network, recipe = checkpoint_network(checkpoint)
        if kind != "ssl":
            raise ConfigError(f"demo seed {seed}: {checkpoint} holds no SSL heads (its heads: {kind!r}); this "
                              "measurement reads the SSL bundle's model.pt (rotation, contrastive and inpainting "
                              "heads)")  # fmt: skip
        networks[seed] = (network, recipe)
    return networks


def run_seed(work: Path, seed: int, network: torch.nn.Module, recipe: Any, crops: int, roi_size: list[int]) -> dict:
    """One seed: each list's crops of ``roi_size``, by body-fraction quartile."""
    from components.release.health import datalist_crops

    datalist = seed_paths(work, seed)[1]
    record = {"commit": git_commit(), "machine": machine_info()}
    for list_name in LISTS:
        drawn = datalist_crops(datalist, list_name, roi_size, INTENSITY_RANGE, crops, seed)
        record[list_name] = health_by_content(recipe, network, drawn, seed)
    return record


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="the --work folder of benchmarks/demo_seeds.py")
    parser.add_argument("--seeds", default=None, help="comma-separated demo seeds (default: every seed<N> of --work)")
    parser.add_argument("--crops", type=int, default=256, help="crops a list, a multiple of 4 (at least 8)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.crops < 2 * QUARTILES or args.crops % QUARTILES:
        parser.error(f"--crops must be a multiple of {QUARTILES} and at least {2 * QUARTILES}, got {args.crops}")
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else demo_seeds(args.work)
    if not seeds:
        raise MissingFileError(f"{args.work} holds no seed<N> folder of benchmarks/demo_seeds.py")
    recorded = json.loads(args.out.read_text()) if args.out.is_file() else {"seeds": {}}
    todo = [seed for seed in seeds if str(seed) not in recorded["seeds"]]
    networks = load_networks(args.work, todo)
    roi_size = pretraining_roi_size(args.work, todo) if todo else recorded["settings"]["roi_size"]
    results = {"benchmark": "rotation_by_content", "settings": settings(args.crops, roi_size), **recorded}
    if results["settings"] != settings(args.crops, roi_size):
        raise ConfigError(f"{args.out} was written with other settings ({results['settings']}); give another --out")
    for seed in todo:
        results["seeds"][str(seed)] = run_seed(args.work, seed, *networks[seed], args.crops, roi_size)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        quartiles = results["seeds"][str(seed)]["training"]["quartiles"]
        accuracies = [round(q["signals"]["rotation_accuracy"]["value"], 3) for q in quartiles]
        print(f"seed {seed}: training rotation accuracy by quartile {accuracies}", file=sys.stderr, flush=True)
    print(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
