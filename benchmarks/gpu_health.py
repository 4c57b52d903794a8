"""Does each pretraining recipe learn at its own sizes? One command for a lent GPU (H100 / H200): the SSL,
self-distillation and masked image bundles pretrained at the sizes their ``train.json`` ships, each for a share of a
wall-clock budget, with every health report kept, written to one JSON named after the device.

The data: unlabeled synthetic CT written on the fly by ``components.data.synthetic.write_dataset`` (varied
subjects, data seed 0, its test split trained on too), every axis shorter than 160 voxels stretched to 160
(:func:`enlarge`): the writer's 40-120 voxels an axis are fewer than the recipes' crops (96^3; the self-distillation's
128^3 context), which would cut padding rather than anatomy.

Each recipe runs in its own process (a recipe that hangs or crashes costs only its share), in two bundle runs
(``components.demo.runner.run_bundle``, as a user runs the bundle):

1. the calibration: the bundle for a few epochs, validated and reported once, at its end; it measures seconds per
   iteration, a report's seconds and the start-up (``gpu_health_plan``);
2. the run that is read: the longest whole number of epochs predicted to end inside what is left of the share,
   with the schedule compressed into them (``gpu_health_plan.schedule_overrides``) and a health report every
   quarter of the run and at its end.

Only data paths, output folders, ``max_epochs``, the schedule and the validation interval are overridden: crop sizes,
feature size 48, batch, AMP, attention, checkpointing and loader workers are the bundle's own. With ``--small`` the
runs take the demo's CPU sizes instead (``components.demo.recipes``: its crops, feature size 12, no workers, no
AMP, 8 health crops) and at most a few epochs.

A recipe that fails, does not fit its share, or is still running at its end is recorded with its status and reason
(and the reports it had written), never as a result. The JSON is rewritten after every recipe and printed at the end;
each run's ``health.json`` and ``train.log`` are copied beside it.

    GPU_CHECK_SCRIPT=gpu_health GPU_CHECK_BUDGET_S=480 bash benchmarks/gpu_check.sh --commit <sha>  # the device call
    python benchmarks/gpu_health.py --budget_s 480    # the recipes' sizes, with MONAI installed
    python benchmarks/gpu_health.py --small           # CPU: the demo's sizes, a few iterations
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from gpu_health_plan import (
    Calibration, calibrate, plan_epochs, predicted_seconds, schedule_overrides, share,
)
from gpu_timing import Record, budget_parser, chosen, one_line, run_header, run_in_share
from machine import REPO, device_facts, device_slug

sys.path.insert(0, str(REPO))  # this checkout's components, whatever else is installed
RECIPES = ("ssl", "dino", "mim")
DATA_SEED = 0
#: per size: the corpus (subjects written, the shortest axis after :func:`enlarge`), the calibration's epochs, the most
#: epochs a run may have (None: what the share allows), the least share a recipe starts with; ``--small``: the health
#: crops (at the recipe's sizes the bundle's own, "auto")
SETTINGS = {
    "recipe": {"subjects": 40, "min_size": 160, "calibration_epochs": 3, "max_epochs": None, "min_share_s": 90.0},
    "small": {"subjects": 5, "min_size": 64, "calibration_epochs": 2, "max_epochs": 3, "min_share_s": 20.0,
              "health_crops": 8},
}  # fmt: skip
#: seconds kept at the end of the budget to write the JSON
END_S = 2.0
#: what a run changes in its bundle at the recipe's sizes
OVERRIDDEN = ("dataset_dir", "output_dir", "ckpt_dir", "max_epochs", "training#val_interval",
              "the schedule: training#warmup_iterations, training#warmup_epochs, training#teacher_temperature_warmup_epochs, "
              "training#freeze_last_layer_epochs, masking#teacher_temperature_warmup_epochs (those the bundle has)")  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# the corpus
# ---------------------------------------------------------------------------------------------------------------
def enlarge(source: Path, target: Path, min_size: int) -> list[int]:
    """``source``'s volume with every axis shorter than ``min_size`` voxels stretched to it (trilinear), written
    uncompressed to ``target``; its affine's spacing shrinks alike and its field of view stays. Returns the shape."""
    import nibabel as nib
    import numpy as np

    image = nib.load(str(source))
    array = np.asarray(image.dataobj)
    shape = [max(int(n), min_size) for n in array.shape]
    if shape != list(array.shape):
        volume = torch.from_numpy(array.astype(np.float32))[None, None]
        stretched = torch.nn.functional.interpolate(volume, size=shape, mode="trilinear", align_corners=False)
        array = stretched[0, 0].round().numpy().astype(array.dtype)
    step = np.array(image.shape, dtype=np.float64) / np.array(shape)  # a new voxel, in old voxels along each axis
    affine = image.affine.copy()
    affine[:3, :3] = image.affine[:3, :3] * step
    affine[:3, 3] = image.affine[:3, :3] @ ((step - 1.0) / 2.0) + image.affine[:3, 3]  # the first voxel's centre
    out = nib.Nifti1Image(array, affine)
    out.set_sform(affine, code=1)
    out.set_qform(affine, code=1)
    out.header.set_xyzt_units(xyz="mm")
    nib.save(out, str(target))
    return shape


def write_corpus(folder: Path, subjects: int, min_size: int) -> dict:
    """The runs' unlabeled CT in ``folder`` (``dataset.json``, ``imagesTr/``): ``write_dataset``'s varied subjects,
    its test split added to the training list (the bundles read training and validation only), each volume
    :func:`enlarge`-d to ``min_size``. Returns what was written."""
    from components.data import synthetic

    started = time.perf_counter()
    written = synthetic.write_dataset(folder / "written", num=subjects, seed=DATA_SEED, varied=True, labels=False)
    datalist = json.loads(written.read_text())
    datalist["training"] += datalist.pop("test")
    (folder / "imagesTr").mkdir(parents=True, exist_ok=True)
    shapes = []
    for split in ("training", "validation"):
        for item in datalist[split]:
            name = Path(item["image"]).name.replace(".nii.gz", ".nii")
            shapes.append(enlarge(written.parent / item["image"], folder / "imagesTr" / name, min_size))
            item["image"] = f"imagesTr/{name}"
    (folder / "dataset.json").write_text(json.dumps(datalist, indent=1))
    shutil.rmtree(folder / "written")
    return {
        "writer": f"components.data.synthetic.write_dataset(num={subjects}, seed={DATA_SEED}, varied=True, "
                  f"labels=False), every axis under {min_size} voxels stretched to {min_size} (trilinear)",
        "training": len(datalist["training"]), "validation": len(datalist["validation"]),
        "shape_min": [min(s[a] for s in shapes) for a in range(3)],
        "shape_max": [max(s[a] for s in shapes) for a in range(3)], "seconds": round(time.perf_counter() - started, 1),
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# one recipe (its own process)
# ---------------------------------------------------------------------------------------------------------------
def run_overrides(recipe: str, small: bool, corpus: Path, run_dir: Path, epochs: int, interval: int, schedule: dict) -> dict:
    """A run's overrides: the data, its folders, ``epochs``, ``interval`` and ``schedule`` on the bundle's own
    settings (``--small``: on the demo's CPU settings, with a few health crops)."""
    base = {}
    if small:
        from components.demo.recipes import DemoBudget, pretraining_overrides

        base = pretraining_overrides(recipe, DemoBudget(ssl_epochs=epochs), corpus, run_dir, "cpu", DATA_SEED)
        base["training#rankme_crops"] = SETTINGS["small"]["health_crops"]
    folders = {"dataset_dir": str(corpus), "output_dir": str(run_dir / "eval"), "ckpt_dir": str(run_dir / "models")}
    return {**base, **folders, "max_epochs": epochs, "training#val_interval": interval, **schedule}


def scalars(events_dir: Path) -> dict[str, list[tuple[int, float, float]]]:
    """Every scalar a run logged to TensorBoard: tag -> [(step, wall time, value)] by step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, tuple[int, float, float]]] = {}
    for events in sorted(events_dir.glob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: (e.step, e.wall_time, e.value) for e in accumulator.Scalars(tag)})
    return {tag: sorted(points.values()) for tag, points in out.items()}


def health_reports(run_dir: Path) -> list[dict]:
    """The health reports a run wrote (``eval/health.json``), oldest first.

    Raises:
        RuntimeError: the run wrote none.
    """
    path = run_dir / "eval" / "health.json"
    reports = json.loads(path.read_text())["reports"] if path.is_file() else []
    if not reports:
        raise RuntimeError(f"the run wrote no health report ({path})")
    return reports


def _bundle_run(bundle: Path, overrides: dict, run_dir: Path, what: str) -> float:
    """``run_bundle`` of ``bundle``'s train.json; a failure named by ``what`` and the run's last output line."""
    from components.demo.runner import run_bundle

    try:
        return run_bundle(bundle, ("train.json",), overrides, log=run_dir / "train.log")
    except RuntimeError as err:
        head, *output = str(err).splitlines()
        last = next((line.strip() for line in reversed(output) if line.strip()), "(no output)")
        raise RuntimeError(f"{what}: {head.split(':')[0]}; its last line: {last}") from None


def _shown(overrides: dict, work: Path) -> dict:
    """The overrides as the JSON keeps them: paths under the temporary ``work`` folder written from ``<work>``."""
    return {key: value.replace(str(work), "<work>") if isinstance(value, str) else value for key, value in overrides.items()}


def _report(report: dict) -> dict:
    """A report's verdict and each signal's value, trivial baseline, margin, direction and verdict."""
    keys = ("value", "baseline", "margin", "better", "kind", "verdict")
    signals = {name: {key: signal[key] for key in keys} for name, signal in report["signals"].items()}
    return {"epoch": report["epoch"], "iteration": report["iteration"], "verdict": report["verdict"], "signals": signals,
            "extra": report["extra"], "crops": report["embedded"], "seconds": report["seconds"]}  # fmt: skip


def recipe_part(recipe: str, small: bool, work: Path, record: Record, deadline: float) -> None:
    """Calibrates ``recipe``'s bundle, plans the run that fits before ``deadline`` (``time.time()``), runs it and
    records its reports; raises when a run fails or the plan does not fit."""
    from components import health_crops
    from components.demo.recipes import RECIPES as DEMO_RECIPES
    from components.demo.runner import bundle_dir

    settings = SETTINGS["small" if small else "recipe"]
    corpus = work / "corpus"
    bundle = bundle_dir(DEMO_RECIPES[recipe].bundle)
    config = json.loads((bundle / "configs" / "train.json").read_text())
    record["bundle"] = bundle.name
    sizes = run_overrides(recipe, small, corpus, work, 1, 1, {})  # what the runs set of the sizes the plan needs
    batch = sizes.get("batch_size", config["batch_size"])
    crops_per_iteration = batch * sizes.get("training#num_samples", config["training"]["num_samples"])
    requested_crops = sizes.get("training#rankme_crops", config["training"]["rankme_crops"])
    epoch_length = math.ceil(len(json.loads((corpus / "dataset.json").read_text())["training"]) / batch)

    epochs = settings["calibration_epochs"]
    run_dir = work / f"{recipe}_calibration"
    overrides = run_overrides(recipe, small, corpus, run_dir, epochs, epochs, schedule_overrides(config, epochs, epoch_length))
    record["calibration"] = {"overrides": _shown(overrides, work)}
    wall = _bundle_run(bundle, overrides, run_dir, "calibration")
    final, events = health_reports(run_dir)[-1], scalars(run_dir / "eval")
    calibration = calibrate([(s, w) for s, w, _ in events["loss"]], events["health"][-1][1], final["iteration"], epochs,
                            wall, final["seconds"], final["embedded"])  # fmt: skip
    record["calibration"] = {"overrides": _shown(overrides, work), **calibration.as_dict(), "report": _report(final)}

    def crops_for(interval: int) -> int:
        return health_crops(requested_crops, calibration.epoch_length, crops_per_iteration, interval)

    plan = plan_epochs(calibration, deadline - time.time(), crops_for, settings["max_epochs"])
    if plan is None:
        raise RuntimeError(_no_fit(calibration, deadline - time.time(), crops_for))
    run_dir = work / f"{recipe}_main"
    schedule = schedule_overrides(config, plan.max_epochs, calibration.epoch_length)
    overrides = run_overrides(recipe, small, corpus, run_dir, plan.max_epochs, plan.val_interval, schedule)
    record["plan"] = plan.as_dict()
    record["overrides"] = _shown(overrides, work)
    wall = _bundle_run(bundle, overrides, run_dir, "the run")
    reports, events = health_reports(run_dir), scalars(run_dir / "eval")
    if reports[-1]["iteration"] != plan.iterations:
        raise RuntimeError(f"the run's last report is at iteration {reports[-1]['iteration']}, not at its end "
                           f"({plan.iterations})")  # fmt: skip
    final = _report(reports[-1])
    record["iterations"], record["seconds"] = plan.iterations, round(wall, 1)
    record["verdict"], record["signals"], record["extra"] = final["verdict"], final["signals"], final["extra"]
    record["last_losses"] = {tag: points[-1][2] for tag, points in events.items() if tag.startswith("loss")}
    record["history"] = [_report(report) for report in reports]


def _no_fit(calibration: Calibration, available_s: float, crops_for: Callable[[int], int]) -> str:
    """Why no run fits: one epoch's predicted seconds and what makes them, against the seconds left."""
    one = predicted_seconds(calibration, 1, crops_for)
    return (f"does not fit: one epoch is predicted at {one:.0f} s ({calibration.startup_s:.0f} s of start-up, "
            f"{calibration.iteration_s:.3f} s per iteration x {calibration.epoch_length}) and {available_s:.0f} s "
            "of the share are left")  # fmt: skip


def run_child(recipe: str, small: bool, partial: Path, deadline: float, work: Path) -> None:
    """Recipe ``recipe`` in this process; what fails is recorded in one line and the exit code says so."""
    logging.basicConfig(stream=sys.stderr, level=logging.INFO)
    record = Record(partial)
    try:
        recipe_part(recipe, small, work, record, deadline)
    except Exception as err:
        record.fail(one_line(err))
        raise


# ---------------------------------------------------------------------------------------------------------------
# the budget and the JSON
# ---------------------------------------------------------------------------------------------------------------
def run_recipe(recipe: str, share_s: float, small: bool, work: Path, log: Path, artefacts: Path) -> dict:
    """Runs ``recipe`` in a child process for at most ``share_s`` seconds; copies its runs' ``health.json`` and
    ``train.log`` under ``artefacts``; a recipe that did not finish keeps the reports its run had written."""
    partial = work / f"{recipe}.json"
    tail = min(10.0, 0.05 * share_s)  # to read and record the run's results after it ends
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_recipe", recipe, "--_partial", str(partial),
           "--_deadline", str(time.time() + share_s - tail), "--_work", str(work), *(["--small"] if small else [])]  # fmt: skip
    entry = run_in_share(cmd, partial, share_s, log, recipe, work)
    if entry["status"] != "done":
        entry["verdict"] = None
        reports = work / f"{recipe}_main" / "eval" / "health.json"
        entry["history"] = [_report(r) for r in json.loads(reports.read_text())["reports"]] if reports.is_file() else []
    for kind in ("calibration", "main"):
        for name in ("eval/health.json", "train.log"):
            source = work / f"{recipe}_{kind}" / name
            if source.is_file():
                target = artefacts / f"{recipe}_{kind}" / source.name
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, target)
    entry["artefacts"] = f"{artefacts.name}/{recipe}_*"
    return entry


def result_path(out_dir: Path, device: str, small: bool) -> Path:
    """``gpu_health_<device slug>[_small].json``."""
    return out_dir / f"gpu_health_{device_slug(device)}{'_small' if small else ''}.json"


def _write(result: dict, path: Path) -> None:
    from components import atomic_write

    with atomic_write(path, "w") as f:
        f.write(json.dumps(result, indent=2) + "\n")


def run_all(recipes: list[str], started: float, small: bool, path: Path, log: Path, header: dict) -> dict:
    """Writes the corpus, then runs ``recipes`` in order within ``header["budget_s"]`` seconds from ``started``
    (``time.perf_counter``), each with an equal share of what is left, rewriting the JSON at ``path`` after each."""
    settings = SETTINGS["small" if small else "recipe"]
    artefacts = path.with_suffix("")
    result = {**header, "log": str(log), "artefacts": artefacts.name, "corpus": None, "recipes": {}}
    _write(result, path)
    with tempfile.TemporaryDirectory(prefix="gpu_health_") as tmp:
        work = Path(tmp)
        try:
            result["corpus"] = write_corpus(work / "corpus", settings["subjects"], settings["min_size"])
        except Exception as err:
            result["corpus"] = {"status": "failed", "reason": one_line(err)}
        for index, recipe in enumerate(recipes):
            left = header["budget_s"] - (time.perf_counter() - started) - END_S
            share_s = share(left, len(recipes) - index)
            if "status" in result["corpus"]:
                entry = {"status": "skipped", "verdict": None, "reason": f"no corpus: {result['corpus']['reason']}"}
            elif share_s < settings["min_share_s"]:
                entry = {"status": "skipped", "verdict": None, "reason": f"needs at least {settings['min_share_s']:.0f} s; its share of "
                         f"the {max(left, 0):.0f} s left is {share_s:.0f} s"}  # fmt: skip
            else:
                entry = run_recipe(recipe, share_s, small, work, log, artefacts)
            result["recipes"][recipe] = entry
            result["wall_s"] = round(time.perf_counter() - started, 1)
            print(f"gpu_health: {recipe} {entry['status']} ({entry.get('wall_s', 0)} s) verdict {entry.get('verdict')} "
                  f"{entry.get('reason', '')}", file=sys.stderr, flush=True)  # fmt: skip
            _write(result, path)
    result["complete"] = all(entry["status"] == "done" for entry in result["recipes"].values())
    result["machine"]["load_avg_1_5_15_at_end"] = [round(v, 2) for v in os.getloadavg()]
    result["wall_s"] = round(time.perf_counter() - started, 1)
    _write(result, path)
    return result


def main(argv: list[str] | None = None) -> dict | None:
    parser = budget_parser(__doc__.split("\n\n")[0], "recipe", RECIPES,
                           "the demo's CPU sizes (its crops, feature 12), a few epochs",
                           "the runs' output (default: beside the JSON)")  # fmt: skip
    parser.add_argument("--_work", dest="work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.recipe:
        run_child(args.recipe, args.small, args.partial, args.deadline, args.work)
        return None
    started = time.perf_counter()
    recipes = chosen(parser, "recipe", args.recipes, RECIPES)
    device = device_facts()
    path = result_path(args.out_dir, device["name"], args.small)
    path.parent.mkdir(parents=True, exist_ok=True)
    log = args.log or path.with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    settings = SETTINGS["small" if args.small else "recipe"]
    header = {**run_header("gpu_health", device, args.small, args.budget_s, args.commit),
              "settings": {**settings, "sizes": "the demo's CPU sizes (components.demo.recipes)" if args.small else
                           "each bundle's train.json", "overridden": list(OVERRIDDEN), "data_seed": DATA_SEED}}  # fmt: skip
    result = run_all(recipes, started, args.small, path, log, header)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
