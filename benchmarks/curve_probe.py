"""The standardised linear probe of each encoder of ``pretrain_curve.py``, beside the same probe of random encoders.

A pretext signal says that an encoder solves its own task; the probe says whether what it learned is linearly
readable for the demo's segmentation task. The probe is :class:`components.LinearProbe` (the frozen encoder's five
feature maps, each standardised by a batch norm without affine parameters, one 1x1x1 convolution per map, upsampled
and summed), trained here to convergence on cached features instead of by SGD on crops, so that a point costs
seconds and its Dice does not depend on a schedule:

- **data**: the demo's labeled synthetic CT (its CPU budget's 24 volumes, data seed 0, the demo's split by body
  size), through the CT bundle's own validation transforms at the demo's overrides (1 x 1 x 2 mm, HU [-175, 250]),
  each volume padded to a multiple of 32 and seen whole; ``--window pretraining`` maps HU [-1000, 1000] instead, the
  window the encoders were pretrained on, so that the two columns measure what the finetuning window costs them;
- **training**: from every training volume, up to ``POINTS[c]`` voxels of each class ``c`` drawn at random (seeded);
  their features read from each feature map at the voxel's position with the interpolation the probe uses
  (``grid_sample``, trilinear, border); the probe's batch norms set to the statistics of all points (what training
  mode would give them on one full batch), the heads fitted to the standardised points by full-batch L-BFGS on the cross-entropy plus ``L2`` times the squared weights, until the loss changes by less
  than ``TOLERANCE`` (``converged``) or after ``MAX_ROUNDS`` rounds;
- **evaluation**: the probe in eval mode on each whole validation and test volume (8 volumes the probe never saw),
  the mean Dice over the five organs of each volume.

A random encoder with seed ``s`` (``LinearProbe``'s initialisation after ``torch.manual_seed(s)``) is the probe's
trivial answer: an encoder is worth its pretraining only where its probe beats the random encoders' beyond their
spread.

    python benchmarks/curve_probe.py --work /work/bench-data/curve   # probes every finished curve run, resumable

Records go to ``benchmarks/results/pretrain_curve_probe/<run>.json`` (``random_seed<s>.json`` for the baselines;
``pretrain_curve_probe_pretraining_window/`` for ``--window pretraining``),
each naming the encoder file's sha256 and the commit of the probe's code; ``pretrain_curve.py summarise`` puts
them beside the health signals.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from machine import REPO, git_commit, machine_info

RESULTS = REPO / "benchmarks" / "results"
#: the probe's input windows (Hounsfield units mapped to [0, 1]): the finetuning bundle's own, and the pretraining
#: bundles' (the window every curve encoder was pretrained on), each with its records folder
WINDOWS = {"finetuning": None, "pretraining": (-1000, 1000)}
RECORDS = {name: RESULTS / ("pretrain_curve_probe" if name == "finetuning" else f"pretrain_curve_probe_{name}_window")
           for name in WINDOWS}  # fmt: skip
DATA_SEED = 0
#: voxels drawn per class from each training volume: background, then each organ
POINTS = (768, 256, 256, 256, 256, 256)
L2 = 1e-3
TOLERANCE = 1e-5
MAX_ROUNDS = 20
RANDOM_SEEDS = (0, 1, 2)


def labeled(work: Path) -> Path:
    """The demo's labeled synthetic CT at its CPU budget, split as the demo splits it, written once under ``work``."""
    from components.data import synthetic
    from components.demo.run import BUDGETS, split_by_body_size

    datalist = work / "data" / "labeled" / "dataset.json"
    if not datalist.is_file():
        synthetic.write_dataset(datalist.parent, num=BUDGETS["cpu"].num_labeled, seed=DATA_SEED, organs=synthetic.DEMO_ORGANS)
        split_by_body_size(datalist)
    return datalist


def volumes(work: Path, window: str = "finetuning") -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Each list's ``(image, label)`` pairs after the CT bundle's validation transforms at the demo's overrides and
    the ``window`` of :data:`WINDOWS` (cached under ``work``): image ``(1, X, Y, Z)`` float, label ``(1, X, Y, Z)``
    integer classes."""
    cache = work / f"probe_volumes_{window}.pt"
    if cache.is_file():
        return torch.load(cache, weights_only=True)
    from monai.bundle import ConfigParser

    from components.data.datalists import load_split
    from components.demo.recipes import CT_BUNDLE, DemoBudget, finetune_overrides
    from components.config.running import run_config_files
    from components.demo.runner import BUNDLES_DIR

    datalist = labeled(work)
    parser = ConfigParser()
    parser.read_config([str(f) for f in run_config_files(BUNDLES_DIR / CT_BUNDLE, ["train.json"])])
    parser.update(finetune_overrides(DemoBudget(), datalist, work / "probe_unused", "cpu", 0, None))
    if WINDOWS[window] is not None:
        parser.update({"intensity_range": list(WINDOWS[window])})
    parser.get_parsed_content("imports")
    transform = parser.get_parsed_content("validate#preprocessing")
    lists = {}
    for name in ("training", "validation", "test"):
        items = [transform(item) for item in load_split(str(datalist), name)]
        lists[name] = [(item["image"].as_tensor().float(), item["label"].as_tensor().round().long()) for item in items]
    torch.save(lists, cache)
    return lists


def padded(tensor: torch.Tensor) -> torch.Tensor:
    """``(C, *spatial)`` zero-padded at the end of each axis to a multiple of 32 (the Swin ViT's input grid)."""
    pads = [(0, -size % 32) for size in tensor.shape[1:]]
    return F.pad(tensor, [p for pair in reversed(pads) for p in pair])


def new_probe(checkpoint: Path | None, seed: int):
    """A :class:`components.LinearProbe` for the demo's six classes holding ``checkpoint``'s encoder, or a random one."""
    import components
    from components.checkpoint.architecture import infer_architecture
    from components.demo.recipes import LABEL_NAMES, WINDOW_SIZE

    torch.manual_seed(seed)
    if checkpoint is None:
        return components.LinearProbe(1, len(LABEL_NAMES), feature_size=12, window_size=WINDOW_SIZE)
    architecture = {k: v for k, v in infer_architecture(checkpoint).as_dict().items() if k not in ("patch_size", "in_channels")}
    probe = components.LinearProbe(1, len(LABEL_NAMES), **architecture)
    report = components.load_pretrained(probe, str(checkpoint))
    if report.encoder_missing:
        raise RuntimeError(f"{checkpoint}: encoder tensors not loaded: {report.encoder_missing[:5]}")
    return probe


def point_features(features: list[torch.Tensor], points: torch.Tensor, size: tuple[int, ...]) -> list[torch.Tensor]:
    """Each feature map ``(1, C, *grid)`` read at ``points`` (``(N, 3)`` voxel indices of an input of ``size``) as
    ``F.interpolate(..., size, mode="trilinear", align_corners=False)`` would give them: ``(N, C)`` per map."""
    # align_corners=False: voxel i of the input sits at (2 i + 1) / size - 1 in grid_sample's normalised coordinates,
    # whose last axis indexes the tensor's last spatial dimension first
    normalised = (2 * points.float() + 1) / torch.tensor(size, dtype=torch.float32) - 1
    grid = normalised.flip(-1).view(1, -1, 1, 1, 3)
    return [F.grid_sample(f, grid, mode="bilinear", padding_mode="border", align_corners=False)[0, :, :, 0, 0].T
            for f in features]  # fmt: skip


def training_points(probe, pairs: list[tuple[torch.Tensor, torch.Tensor]], seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Up to ``POINTS[c]`` voxels of each class from every training volume: their features per map and their classes."""
    generator = torch.Generator().manual_seed(seed)
    per_map: list[list[torch.Tensor]] = [[] for _ in probe.heads]
    classes = []
    for image, label in pairs:
        image = padded(image)
        with torch.no_grad():
            features = probe.swinViT(image[None], normalize=True)
        grid = label[0]
        for value, count in enumerate(POINTS):
            where = (grid == value).nonzero()
            chosen = where[torch.randperm(len(where), generator=generator)[:count]]
            for store, values in zip(per_map, point_features(features, chosen, tuple(image.shape[1:]))):
                store.append(values)
            classes.append(torch.full((len(chosen),), value))
    return [torch.cat(values) for values in per_map], torch.cat(classes)


def fit_heads(probe, features: list[torch.Tensor], classes: torch.Tensor) -> dict:
    """The probe's norms set to the points' statistics and its heads fitted to the standardised points by full-batch
    L-BFGS (see the module's docstring). The five heads' sum is one linear map of the concatenated features, fitted as
    such and then split into the heads (the first holds the bias)."""
    standardised = []
    for norm, f in zip(probe.norms, features):
        mean, variance = f.mean(0), f.var(0, unbiased=False)
        norm.running_mean.copy_(mean)
        norm.running_var.copy_(variance)
        norm.num_batches_tracked.fill_(1)
        standardised.append((f - mean) / torch.sqrt(variance + norm.eps))
    points = torch.cat(standardised, 1)
    linear = torch.nn.Linear(points.shape[1], len(probe.heads[0].weight))
    torch.nn.init.zeros_(linear.weight)
    torch.nn.init.zeros_(linear.bias)
    optimizer = torch.optim.LBFGS(linear.parameters(), lr=1, max_iter=50, history_size=20, line_search_fn="strong_wolfe",
                                  tolerance_grad=1e-7, tolerance_change=1e-10)  # fmt: skip

    def loss_now() -> torch.Tensor:
        return F.cross_entropy(linear(points), classes) + L2 * linear.weight.square().sum()

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = loss_now()
        loss.backward()
        return loss

    losses = []
    for _ in range(MAX_ROUNDS):
        optimizer.step(closure)
        with torch.no_grad():
            losses.append(float(loss_now()))
        if len(losses) > 1 and abs(losses[-2] - losses[-1]) < TOLERANCE * max(1.0, abs(losses[-1])):
            break
    converged = len(losses) > 1 and abs(losses[-2] - losses[-1]) < TOLERANCE * max(1.0, abs(losses[-1]))
    with torch.no_grad():
        start = 0
        for index, head in enumerate(probe.heads):
            width = head.weight.shape[1]
            head.weight.copy_(linear.weight[:, start:start + width].reshape(head.weight.shape))
            head.bias.copy_(linear.bias if index == 0 else torch.zeros_like(head.bias))
            start += width
    return {"loss": losses[-1], "rounds": len(losses), "converged": converged, "points": len(classes)}


def held_out_dice(probe, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """Each volume's mean Dice over the organs (background excluded), the probe in eval mode on the whole volume."""
    from monai.metrics import compute_dice

    probe.eval()
    classes = len(probe.heads[0].weight)
    scores = []
    for image, label in pairs:
        with torch.no_grad():
            logits = probe(padded(image)[None])
        crop = tuple(slice(0, s) for s in image.shape[1:])
        prediction = logits.argmax(1)[(slice(None), *crop)]
        one_hot = [F.one_hot(x, classes).movedim(-1, 1) for x in (prediction, label[None, 0])]
        dice = compute_dice(one_hot[0], one_hot[1], include_background=False, ignore_empty=True)
        scores.append(float(dice.nanmean()))
    return scores


def probe_point(checkpoint: Path | None, seed: int, lists: dict) -> dict:
    """One encoder's probe: the fit and each held-out volume's Dice."""
    started = time.perf_counter()
    probe = new_probe(checkpoint, seed)
    features, classes = training_points(probe, lists["training"], seed)
    fit = fit_heads(probe, features, classes)
    dice = {name: held_out_dice(probe, lists[name]) for name in ("validation", "test")}
    every = dice["validation"] + dice["test"]
    return {"fit": fit, "dice": dice, "mean_dice": sum(every) / len(every), "seconds": round(time.perf_counter() - started, 1)}


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    digest.update(path.read_bytes())
    return digest.hexdigest()


def run(work: Path, window: str = "finetuning") -> list[Path]:
    """Probes every finished run under ``work / "runs"`` and the random encoders on inputs of ``window``, skipping
    records already written."""
    lists, records = volumes(work, window), RECORDS[window]
    records.mkdir(parents=True, exist_ok=True)
    jobs = [(f"random_seed{seed}", None, seed) for seed in RANDOM_SEEDS]
    for model in sorted((work / "runs").glob("*/models/model.pt")):
        name = model.parent.parent.name
        jobs.append((name, model, int(name.rsplit("seed", 1)[1])))
    written = []
    for name, model, seed in jobs:
        path = records / f"{name}.json"
        if path.is_file() or (model is not None and not (REPO / "benchmarks" / "results" / "pretrain_curve" / f"{name}.json").is_file()):
            continue  # done, or the curve run has not finished
        result = probe_point(model, seed, lists)
        record = {"run": name, "seed": seed, "encoder_sha256": None if model is None else file_sha256(model),
                  "commit": git_commit(), "settings": {"window": window, "intensity_range": WINDOWS[window], "points": POINTS, "l2": L2, "tolerance": TOLERANCE,
                  "max_rounds": MAX_ROUNDS, "data_seed": DATA_SEED}, "machine": machine_info(), **result}  # fmt: skip
        path.write_text(json.dumps(record, indent=1) + "\n")
        print(f"{name}: probe Dice {result['mean_dice']:.3f} ({result['fit']['rounds']} rounds, converged "
              f"{result['fit']['converged']})", flush=True)
        written.append(path)
    return written


def load_records(window: str = "finetuning") -> dict[str, dict]:
    """The probe records of ``window`` by run name."""
    return {path.stem: json.loads(path.read_text()) for path in sorted(RECORDS[window].glob("*.json"))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="pretrain_curve.py's --work folder")
    parser.add_argument("--window", choices=sorted(WINDOWS), default="finetuning", help="the probe's input window")
    args = parser.parse_args(argv)
    run(args.work, args.window)
    return 0


if __name__ == "__main__":
    sys.exit(main())
