"""The demo: pretraining on unlabeled synthetic CT (SSL by default; self-distillation or masked image modelling by
``recipe``), then finetuning a segmentation from those weights.

Every training, evaluation and inference step is a real ``python -m monai.bundle run`` of the shipped bundles
with command-line overrides only (:mod:`components.demo.runner`). The task is made small enough for a CPU: five
large organs (:data:`~components.data.synthetic.DEMO_ORGANS`), 1x1x2 mm voxels, 64x64x32 crops, feature size 12 and
4^3 attention windows (the recipe's 7^3 would pad the first stage's tokens by half again). The finetuning loss is
weighted by :func:`training_class_weights` and the crops are not mirrored (the kidneys differ only by side).
The unlabeled pretraining set is larger and more varied than the labeled one (fields of view, contrast, noise,
lesions). Mean Dice is measured on held-out volumes (the datalist's ``test`` list) that neither training nor
model selection saw.

On a CPU the demo finetunes from the pretrained weights only: a one-seed comparison with random initialisation at a
few minutes' budget is noise. ``compare=True`` adds the from-scratch arm with the same budget; on CUDA both arms
run, with a larger budget. ``benchmarks/low_data.py`` measures each recipe's effect over seeds and label counts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..data import synthetic
from ..config.overrides import defined_overrides
from .runner import BUNDLES_DIR, bundle_command, fresh_run_dir, read_scalars, run_bundle
from ..training.segmentation import balanced_class_weights
from .plots import last_image, plot_dice_curves, plot_losses, plot_segmentations, plot_views

__all__ = [
    "DemoBudget", "BUDGETS", "DemoRecipe", "RECIPES", "SSL_BUNDLE", "DINO_BUNDLE", "MIM_BUNDLE", "CT_BUNDLE",
    "dino_overrides", "finetune_overrides", "inference_overrides", "pretraining_overrides", "ssl_overrides",
    "training_class_weights", "run_demo",
]

SSL_BUNDLE = "swin_unetr_ssl_pretrain"
DINO_BUNDLE = "swin_unetr_dino_pretrain"
MIM_BUNDLE = "swin_unetr_mim_pretrain"
CT_BUNDLE = "swin_unetr_btcv_finetune"


@dataclass(frozen=True)
class DemoBudget:
    """How much the demo trains. ``ssl_epochs`` are epochs over the unlabeled training list (``ssl_batch``
    volumes x 1 crop per iteration); ``finetune_epochs`` are epochs over the labeled training list (1 volume x
    ``finetune_crops`` crops per iteration), validated every ``val_interval`` epochs. Pretraining uses the recipe's
    rate, 4e-4, after a short warm-up: at 1e-3 after 2 warm-up iterations the rotation loss jumped to 3.8 in the
    first epoch and the contrastive loss stayed at ln 3 (identical embeddings) from the third epoch on. The CPU
    budget trains on 10 labeled volumes (2 more validate, 2 are held out) for 420 iterations: with 6 for 420 the
    held-out Dice of seed 2 was 0.754 (the stomach 0.56); README.md gives seeds 0-4 at this budget."""

    num_labeled: int = 14
    num_unlabeled: int = 48
    ssl_epochs: int = 10
    ssl_batch: int = 2
    ssl_learning_rate: float = 4e-4
    ssl_warmup_iterations: int = 20
    finetune_epochs: int = 42
    finetune_crops: int = 1
    finetune_learning_rate: float = 3e-3
    val_interval: int = 6
    feature_size: int = 12


BUDGETS: dict[str, DemoBudget] = {
    "cpu": DemoBudget(),
    "cuda": DemoBudget(num_unlabeled=48, ssl_epochs=60, ssl_batch=4, finetune_epochs=150, finetune_crops=2, val_interval=10),
    "quick": DemoBudget(num_labeled=4, num_unlabeled=6, ssl_epochs=1, finetune_epochs=1, val_interval=1),
}
"""Budgets by name: ``cpu`` (the default on a CPU), ``cuda`` (the default where CUDA is present), ``quick`` (the
test suite's smoke run, which learns nothing)."""

_ROI = [64, 64, 32]
_SPACING = [1.0, 1.0, 2.0]
_SSL_ROI = [64, 32, 32]  # the smallest SSLHead input: the rotation views need the last two axes equal
# a 4^3 attention window tiles the first stage's 32x32x16 (and the SSL crops' 32x16x16) tokens without padding;
# the recipe's 7^3 pads them to 35x35x21 and costs about twice the time per iteration here
_WINDOW = 4
# the recipe's random flips and 90-degree rotations swap left and right, which tell the kidneys apart
_NO_MIRRORING = {"training#flip_prob": 0.0, "training#rotate90_prob": 0.0}
_LABEL_NAMES = ["background", *synthetic.DEMO_ORGANS]
# the pretrainings log RankMe of the encoder on this many validation crops (the bundles' 256 would cost a pretraining
# of this size about a tenth of its time; RankMe is bounded by the crops and by the embedding size, 192 at feature 12)
_RANKME_CROPS = 64
# every run starts fresh: a demo run again into the same folder must not resume the last one
_FRESH_RUN = {"checkpointing#auto_resume": False}


def ssl_overrides(budget: DemoBudget, data_dir: Path, run_dir: Path, device: str, seed: int) -> dict[str, Any]:
    """Command-line overrides of the SSL pretraining bundle for a demo-sized run."""
    return {
        "dataset_dir": str(data_dir), "device": device, "feature_size": budget.feature_size, "network_def#window_size": _WINDOW,
        "roi_size": _SSL_ROI,
        "batch_size": budget.ssl_batch, "training#num_samples": 1, "loader#num_workers": 0, "speed#amp": device == "cuda",
        "speed#use_checkpoint": False, "training#seed": seed, "training#log_interval": 1, "max_epochs": budget.ssl_epochs,
        "learning_rate": budget.ssl_learning_rate, "training#warmup_iterations": budget.ssl_warmup_iterations,
        "training#val_interval": budget.ssl_epochs, "training#rankme_crops": _RANKME_CROPS,
        "output_dir": str(run_dir / "eval"), "ckpt_dir": str(run_dir / "models"), **_FRESH_RUN,
    }


def dino_overrides(budget: DemoBudget, data_dir: Path, run_dir: Path, device: str, seed: int) -> dict[str, Any]:
    """Command-line overrides of the self-distillation bundle for a run of the SSL run's size: its data, device,
    volumes per iteration, epochs, feature size, attention window and folders; 32^3 global and local crops from 64^3
    regions and a small head."""
    ssl = ssl_overrides(budget, data_dir, run_dir, device, seed)
    shared = ("dataset_dir", "device", "feature_size", "network_def#window_size", "batch_size", "loader#num_workers", "speed#amp",
              "speed#use_checkpoint", "training#seed", "training#log_interval", "max_epochs", "training#rankme_crops",
              "output_dir", "ckpt_dir", "checkpointing#auto_resume")  # fmt: skip
    return {
        **{key: ssl[key] for key in shared}, "roi_size": [32, 32, 32], "training#context_size": [64, 64, 64],
        "training#local_size": [32, 32, 32], "training#num_local_crops": 2, "training#prototypes": 1024,
        "training#head_hidden_dim": 256, "training#head_bottleneck_dim": 64, "training#warmup_epochs": 1,
        "training#teacher_temperature_warmup_epochs": 1,
        "training#val_interval": ssl["training#val_interval"], "training#num_samples": 2,
    }  # fmt: skip


@dataclass(frozen=True)
class DemoRecipe:
    """A pretraining recipe as the demo runs and draws it: its bundle, the overrides of a demo-sized run, the name
    of its arm, its loss parts (scalar tag -> legend) and its validation picture (TensorBoard tag, column titles,
    title; no picture when ``views_tag`` is None)."""

    bundle: str
    overrides: Callable[[DemoBudget, Path, Path, str, int], dict[str, Any]]
    name: str
    losses: Mapping[str, str]
    views_tag: str | None = None
    view_columns: tuple[str, ...] = ()
    views_title: str = ""


RECIPES: dict[str, DemoRecipe] = {
    "ssl": DemoRecipe(
        SSL_BUNDLE, ssl_overrides, "SSL",
        {"loss": "total", "loss_rot": "rotation (CE)", "loss_contrast": "contrastive (NT-Xent)", "loss_recon": "reconstruction (L1)"},
        "ssl_views", ("clean crop", "view 1 (rotated, cut out)", "view 2", "reconstruction 1", "reconstruction 2"),
        "What SSL learns: restore cut-out boxes (validation crops after pretraining)",
    ),
    "dino": DemoRecipe(
        DINO_BUNDLE, dino_overrides, "self-distillation",
        {"loss": "total", "loss_dino": "self-distillation (CE)", "loss_koleo": "KoLeo"},
    ),
    # the SSL run's overrides are all ids of the masked image bundle, whose 16^3 mask blocks tile the 64x32x32 crop
    "mim": DemoRecipe(
        MIM_BUNDLE, ssl_overrides, "masked image",
        {"loss": "total", "loss_recon": "masked voxels (L1)", "loss_distill": "masked-token distillation"},
        "masked_views", ("crop", "masked input", "reconstruction", "target"),
        "What masked image modelling learns: restore the masked blocks (validation crops after pretraining)",
    ),
}  # fmt: skip
"""The recipes ``run_demo(recipe=...)`` pretrains with: ``ssl`` (the default), ``dino``, ``mim``."""


def pretraining_overrides(recipe: str, budget: DemoBudget, data_dir: Path, run_dir: Path, device: str, seed: int) -> dict[str, Any]:
    """Command-line overrides of ``recipe``'s pretraining bundle (:data:`RECIPES`) for a demo-sized run."""
    return RECIPES[recipe].overrides(budget, data_dir, run_dir, device, seed)


def finetune_overrides(
    budget: DemoBudget, datalist: Path, run_dir: Path, device: str, seed: int, pretrained: Path | None,
    class_weights: list[float] | None = None,
) -> dict[str, Any]:
    """Command-line overrides of the CT finetuning bundle for the demo's five-organ task."""
    return {
        "dataset_dir": str(datalist.parent), "datalist": str(datalist), "device": device,
        "feature_size": budget.feature_size, "network_def#window_size": _WINDOW, "training#class_weights": class_weights,
        **_NO_MIRRORING, "label_names": _LABEL_NAMES,
        "roi_size": _ROI, "spacing": _SPACING, "training#num_samples": budget.finetune_crops, "loader#num_workers": 0,
        "speed#amp": device == "cuda", "speed#use_checkpoint": False, "training#seed": seed, "training#log_interval": 5,
        "max_epochs": budget.finetune_epochs, "training#val_interval": budget.val_interval, "training#warmup_epochs": 1,
        "learning_rate": budget.finetune_learning_rate, "pretrained_path": None if pretrained is None else str(pretrained),
        "ckpt_dir": str(run_dir / "models"), "output_dir": str(run_dir / "eval"), **_FRESH_RUN,
    }


def training_class_weights(datalist: Path, label_names: list[str] | None = None) -> list[float]:
    """The finetuning loss's class weights from the labels of the datalist's ``training`` list
    (:func:`~components.training.segmentation.balanced_class_weights`) for ``label_names`` (default: the demo's): the organs
    are 0.1-2 % of a volume each and the small ones stay at Dice 0 for the first hundreds of iterations with an
    unweighted loss."""
    items = json.loads(datalist.read_text())["training"]
    return balanced_class_weights([datalist.parent / item["label"] for item in items], len(label_names or _LABEL_NAMES))


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = " | ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), "-+-".join("-" * w for w in widths)] + [fmt.format(*r) for r in rows])



def inference_overrides(finetune: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The overrides of a finetuning run that the CT bundle's ``inference.json`` defines (its network, data and
    checkpoint folder; not the training knobs, which that config would refuse), writing under ``run_dir``."""
    inference = defined_overrides(finetune, [BUNDLES_DIR / CT_BUNDLE / "configs" / "inference.json"])
    return {**inference, "output_dir": str(run_dir / "segmentations")}


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
    synthetic.write_dataset(unlabeled, num=budget.num_unlabeled, seed=seed, varied=True, labels=False)
    steps.append({"step": "synthesise", "seconds": round(time.perf_counter() - start, 1)})

    pretrain_dir = fresh_run_dir(out_dir / f"{recipe}_pretrain")
    announce(f"{chosen.name} pretraining ({chosen.bundle}), {budget.ssl_epochs} epochs on {device} -> {pretrain_dir}")
    bundle_step(f"{chosen.name} pretraining", chosen.bundle, ("train.json",),
                pretraining_overrides(recipe, budget, unlabeled, pretrain_dir, device, seed), pretrain_dir / "train.log")

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
    plot_segmentations(image, labeled / test_case["label"], predictions, _LABEL_NAMES, out_dir / "segmentations.png")
    steps.append({"step": "pictures", "seconds": round(time.perf_counter() - start, 1)})

    summary = {
        "device": device,
        "seed": seed,
        "recipe": recipe,
        "total_seconds": round(time.perf_counter() - started, 1),
        "settings": {"budget": asdict(budget), "organs": list(synthetic.DEMO_ORGANS), "roi_size": _ROI,
                     "spacing": _SPACING, "ssl_roi_size": _SSL_ROI, "window_size": _WINDOW,
                     "class_weights": class_weights, **_NO_MIRRORING, "finetune_seed": finetune_seed,
                     "held_out": "the datalist's test list"},
        "steps": steps,
        "arms": results,
        "pictures": sorted(p.name for p in out_dir.glob("*.png")),
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    rows = [(s["step"], f"{s['seconds']:.1f}", "") for s in steps]
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
