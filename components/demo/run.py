"""The demo: pretraining on unlabeled synthetic CT (SSL by default; self-distillation or masked image modelling by
``recipe``), then finetuning a segmentation from those weights.

Every training, evaluation and inference step is a real ``python -m monai.bundle run`` of the shipped bundles
with command-line overrides only (:mod:`components.demo.runner`), sized for a CPU by :mod:`components.demo.recipes`.
This module holds what is the demo's alone: its budgets, the split of its labeled set, its steps and summary. The
unlabeled pretraining set is larger and more varied than the labeled one (fields of view, contrast, noise,
lesions). Mean Dice is measured on held-out volumes (the datalist's ``test`` list) that neither training nor
model selection saw; they and the validation volumes lie inside the training volumes' body sizes
(:func:`split_by_body_size`).

On a CPU the demo finetunes from the pretrained weights only: a one-seed comparison with random initialisation at a
few minutes' budget is noise. ``compare=True`` adds the from-scratch arm with the same budget; on CUDA both arms
run, with a larger budget. ``benchmarks/low_data.py`` measures each recipe's effect over seeds and label counts.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import torch

from ..data import synthetic
from .plots import last_image, plot_dice_curves, plot_losses, plot_segmentations, plot_views
from .recipes import (
    CT_BUNDLE, LABEL_NAMES, NO_MIRRORING, RECIPES, ROI_SIZE, SPACING, WINDOW_SIZE, DemoBudget,
    finetune_overrides, inference_overrides, pretraining_overrides, training_class_weights,
)  # fmt: skip
from .runner import bundle_command, fresh_run_dir, read_scalars, run_bundle

__all__ = ["BUDGETS", "body_area_mm2", "run_demo", "split_by_body_size"]

BUDGETS: dict[str, DemoBudget] = {
    "cpu": DemoBudget(num_labeled=24, ssl_epochs=59, finetune_epochs=36),
    "cuda": DemoBudget(num_unlabeled=48, ssl_epochs=60, ssl_batch=4, finetune_epochs=150, finetune_crops=2, val_interval=10),
    "quick": DemoBudget(num_labeled=4, num_unlabeled=6, ssl_epochs=1, finetune_epochs=1, val_interval=1),
}
"""Budgets by name: ``cpu`` (the default on a CPU), ``cuda`` (the default where CUDA is present), ``quick`` (the
test suite's smoke run, which learns nothing). The CPU budget pretrains for 1,003 iterations (59 epochs of 17), the
smallest of the pretraining curve's budgets at which the recipes left their trivial answers (docs/measuring.md, "Does
each recipe learn?"); it synthesises 24 labeled volumes (16 train, 4 validate, 4 are held out:
:func:`~components.data.synthetic.split_sizes`) and finetunes for 576 iterations; the budgets tried before it are in
benchmarks/README.md ("What a CPU budget can learn")."""


# The synthetic bodies fill fields of view of 34-120 mm in-plane (components.data.synthetic.write_dataset), a wider
# spread than adult abdomens after resampling. A held-out body wider or narrower than every training body tests
# extrapolation, which a CPU budget does not teach (seeds 3 and 4 of the trials in benchmarks/README.md, "What a CPU
# budget can learn"). The demo shows what training teaches, so its held-out and validation bodies lie inside the
# training sizes; benchmarks/low_data.py tests shifted volumes on purpose. The split reads the images only.

#: voxels above this many Hounsfield units are the body (fat is about -100, air -1000)
BODY_HU = -500.0


def body_area_mm2(image: str | Path, body_hu: float = BODY_HU) -> float:
    """Mean axial cross-section (mm^2) of the body in a CT volume: voxels above ``body_hu``, on the slices that hold
    any, in the volume's closest RAS orientation (the synthetic sets store LPS, RAS and permuted axes)."""
    volume = nib.as_closest_canonical(nib.load(str(image)))
    body = np.asarray(volume.dataobj) > body_hu
    per_slice = body.sum(axis=(0, 1))
    pixel = float(np.prod(volume.header.get_zooms()[:2]))
    return float(per_slice[per_slice > 0].mean() * pixel) if per_slice.any() else 0.0


def interior_positions(num: int, count: int) -> list[int]:
    """``count`` distinct positions spread evenly over ``1 .. num - 2`` of a sorted list of ``num``: never its first
    or last. Raises ValueError when they do not fit (``num < count + 2``)."""
    if num < count + 2:
        raise ValueError(f"{count} interior positions need at least {count + 2} volumes, got {num}.")
    positions = [round((i + 1) * (num - 1) / (count + 1)) for i in range(count)]
    if len(set(positions)) != count:  # only when count is close to num - 2: take the interior in order
        positions = list(range(1, count + 1))
    return positions


def split_by_body_size(datalist: str | Path) -> dict[str, list[float]]:
    """Rewrites ``datalist`` (a :func:`~components.data.synthetic.write_dataset` ``dataset.json``, paths relative to
    its folder) so that its validation and test volumes lie strictly inside the training volumes' range of body
    sizes (:func:`body_area_mm2`); the lists keep their lengths, and the volumes that train keep their order. Sorted
    by size, the held-out volumes take evenly spread interior positions, alternately test and validation; the smallest
    and the largest body always train. Returns each list's body areas (mm^2) in its new order.

    Example::

        path = synthetic.write_dataset("data/labeled", num=20, seed=3, organs=synthetic.DEMO_ORGANS)
        areas = split_by_body_size(path)   # min(areas["training"]) < every test area < max(areas["training"])
    """
    path = Path(datalist)
    data = json.loads(path.read_text())
    items = [*data["training"], *data["validation"], *data["test"]]
    areas = [body_area_mm2(path.parent / item["image"]) for item in items]
    order = sorted(range(len(items)), key=lambda i: (areas[i], i))
    held = interior_positions(len(items), len(data["validation"]) + len(data["test"]))
    test = [order[p] for p in held[0::2]][: len(data["test"])]
    validation = [order[p] for p in held if order[p] not in test]
    held_out = {*test, *validation}
    training = [i for i in range(len(items)) if i not in held_out]
    lists = {"training": training, "validation": validation, "test": test}
    data.update({name: [items[i] for i in chosen] for name, chosen in lists.items()})
    data["split"] = "components.demo.run.split_by_body_size: validation and test inside the training body sizes"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return {name: [round(areas[i], 1) for i in chosen] for name, chosen in lists.items()}


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = " | ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), "-+-".join("-" * w for w in widths)] + [fmt.format(*r) for r in rows])


def run_demo(
    out: str | Path = "demo_out",
    seed: int = 0,
    compare: bool = False,
    device: str | None = None,
    budget: str | DemoBudget | None = None,
    recipe: str = "ssl",
) -> dict[str, Any]:
    """Runs the demo and returns its summary (also written to ``out/summary.json``).

    Steps: synthesise a labeled five-organ CT set and a larger, varied unlabeled set; pretrain the Swin ViT
    encoder with the recipe's bundle on the unlabeled set; finetune the CT bundle from those weights (and, with
    ``compare`` or on CUDA, from scratch with the same budget and seed); evaluate each on the held-out ``test``
    list; segment one held-out volume; draw the pictures. ``out`` receives ``summary.txt``, ``summary.json``,
    ``segmentations.png``, ``<recipe>_losses.png``, ``<recipe>_views.png`` (SSL and masked image),
    ``dice_curves.png`` and one folder per step.

    Args:
        out: output folder (created).
        seed: changes every random draw: the data, the initialisations, crops and views.
        compare: add the from-scratch arm on a CPU (always on with CUDA).
        device: ``"cuda"`` or ``"cpu"``; default CUDA where present.
        budget: a name of :data:`BUDGETS` or a :class:`DemoBudget`; default by device.
        recipe: the pretraining recipe, a name of :data:`RECIPES`: ``ssl`` (default), ``dino``, ``mim``.

    Raises:
        ValueError: for an unknown device, budget or recipe name; RuntimeError when a bundle run fails (with its log).
    """
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {sorted(RECIPES)}, got {recipe!r}.")
    chosen = RECIPES[recipe]
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}.")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but torch sees no CUDA device.")
    if budget is None or isinstance(budget, str):
        name = budget or device
        if name not in BUDGETS:
            raise ValueError(f"budget must be one of {sorted(BUDGETS)} or a DemoBudget, got {name!r}.")
        budget = BUDGETS[name]
    compare = bool(compare) or device == "cuda"
    out_dir = Path(out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    pretrained_arm = f"{chosen.name} init"
    arms = {pretrained_arm: f"finetune_{recipe}", **({"random init": "finetune_scratch"} if compare else {})}
    titles: list[str] = []
    steps: list[dict[str, Any]] = []

    def announce(title: str) -> None:
        titles.append(title)
        print(f"[{len(titles)}/{3 + len(arms)}] {title}", flush=True)

    def bundle_step(name: str, bundle: str, configs: tuple[str, ...], overrides: dict, log: Path) -> float:
        seconds = run_bundle(bundle, configs, overrides, log=log)
        steps.append({"step": name, "seconds": round(seconds, 1), "command": bundle_command(bundle, configs, overrides)})
        return seconds

    labeled, unlabeled = out_dir / "data" / "labeled", out_dir / "data" / "unlabeled"
    announce(f"synthesising {budget.num_labeled} labeled ({', '.join(synthetic.DEMO_ORGANS)}) and "
             f"{budget.num_unlabeled} unlabeled CT volumes under {out_dir / 'data'}")
    start = time.perf_counter()
    datalist = synthetic.write_dataset(labeled, num=budget.num_labeled, seed=seed, organs=synthetic.DEMO_ORGANS)
    body_areas = split_by_body_size(datalist)
    synthetic.write_dataset(unlabeled, num=budget.num_unlabeled, seed=seed, varied=True, labels=False)
    steps.append({"step": "synthesise", "seconds": round(time.perf_counter() - start, 1)})

    pretrain_dir = fresh_run_dir(out_dir / f"{recipe}_pretrain")
    announce(f"{chosen.name} pretraining ({chosen.bundle}), {budget.ssl_epochs} epochs on {device} -> {pretrain_dir}")
    pretraining = pretraining_overrides(recipe, budget, unlabeled, pretrain_dir, device, seed)
    bundle_step(f"{chosen.name} pretraining", chosen.bundle, ("train.json",), pretraining, pretrain_dir / "train.log")

    # one finetuning seed for both arms: the same decoder initialisation, crops and order; only the encoder's
    # starting weights differ (and it differs from the seed that initialised the pretrained encoder)
    finetune_seed = seed + 1
    class_weights = training_class_weights(datalist)
    results: dict[str, dict[str, Any]] = {}
    for arm, folder in arms.items():
        run_dir = fresh_run_dir(out_dir / folder)
        pretrained = pretrain_dir / "models" / "model.pt" if arm == pretrained_arm else None
        overrides = finetune_overrides(budget, datalist, run_dir, device, finetune_seed, pretrained, class_weights)
        announce(f"finetuning {CT_BUNDLE}, {arm}, {budget.finetune_epochs} epochs; held-out evaluation -> {run_dir}")
        seconds = bundle_step(f"finetune, {arm}", CT_BUNDLE, ("train.json",), overrides, run_dir / "train.log")
        bundle_step(f"evaluate on held-out, {arm}", CT_BUNDLE, ("train.json", "evaluate.json"),
                    {**overrides, "eval_list": "test"}, run_dir / "evaluate.log")
        bundle_step(f"segment held-out, {arm}", CT_BUNDLE, ("inference.json",), inference_overrides(overrides, run_dir),
                    run_dir / "inference.log")
        metrics = json.loads((run_dir / "eval" / "metrics.json").read_text())
        results[arm] = {"folder": folder, "seconds": round(seconds, 1), "mean_dice": metrics["mean"],
                        "per_class_dice": metrics["per_class"], "num_images": metrics["num_images"]}

    announce("pictures")
    start = time.perf_counter()
    plot_losses(read_scalars(pretrain_dir / "eval"), chosen.losses, out_dir / f"{recipe}_losses.png",
                f"{chosen.name} pretraining on unlabeled synthetic CT")
    grid = last_image(pretrain_dir / "eval", chosen.views_tag) if chosen.views_tag else None
    if grid is not None:
        plot_views(grid, chosen.view_columns, chosen.views_title, out_dir / f"{recipe}_views.png")
    curves = {}
    for arm, r in results.items():
        scalars = read_scalars(out_dir / r["folder"] / "eval")
        curves[arm] = {"mean": scalars.get("val_mean_dice", []),
                       **{o: scalars.get(f"val_dice_{o.replace(' ', '_')}", []) for o in synthetic.DEMO_ORGANS}}
    plot_dice_curves(curves, out_dir / "dice_curves.png")
    test_case = json.loads(datalist.read_text())["test"][0]
    image = labeled / test_case["image"]
    stem = image.name.split(".")[0]
    predictions = {arm: next((out_dir / r["folder"] / "segmentations").rglob(f"{stem}*seg*.nii.gz")) for arm, r in results.items()}
    plot_segmentations(image, labeled / test_case["label"], predictions, LABEL_NAMES, out_dir / "segmentations.png")
    steps.append({"step": "pictures", "seconds": round(time.perf_counter() - start, 1)})

    health = json.loads((pretrain_dir / "eval" / "health.json").read_text())["reports"][-1]
    summary = {
        "device": device,
        "seed": seed,
        "recipe": recipe,
        "pretraining_health": health,
        "total_seconds": round(time.perf_counter() - started, 1),
        "settings": {"budget": asdict(budget), "organs": list(synthetic.DEMO_ORGANS), "roi_size": ROI_SIZE,
                     "spacing": SPACING, "pretraining_roi_size": pretraining["roi_size"], "window_size": WINDOW_SIZE,
                     "class_weights": class_weights, **NO_MIRRORING, "finetune_seed": finetune_seed,
                     "held_out": "the datalist's test list, inside the training body sizes (split_by_body_size)",
                     "body_area_mm2": body_areas},
        "steps": steps,
        "arms": results,
        "pictures": sorted(p.name for p in out_dir.glob("*.png")),
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    rows = [(s["step"], f"{s['seconds']:.1f}", "") for s in steps]
    failing = [f"{name} {entry['value']:.3g} vs trivial {entry['baseline']:.3g}" for name, entry in health["signals"].items()
               if entry["verdict"] in ("at baseline", "collapsed")]  # fmt: skip
    rows.insert(2, (f"{chosen.name} pretraining health", "", health["verdict"] + (f" ({'; '.join(failing)})" if failing else "")))
    for arm, r in results.items():
        per_class = ", ".join(f"{k} {v:.2f}" for k, v in r["per_class_dice"].items() if v is not None)
        rows.append((f"held-out Dice, {arm}", "", f"mean {r['mean_dice']:.3f} ({per_class})"))
    rows.append(("total", f"{summary['total_seconds']:.1f}", ""))
    table = _table(("step", "seconds", "result"), rows)
    (out_dir / "summary.txt").write_text(table + "\n")
    print(f"\n{table}\n\npictures: {', '.join(str(out_dir / p) for p in summary['pictures'])}", flush=True)
    if len(results) == 1:
        print("Pretrained vs random initialisation is measured over seeds and label counts by benchmarks/low_data.py "
              "(--compare adds a one-seed scratch arm here).", flush=True)
    return summary
