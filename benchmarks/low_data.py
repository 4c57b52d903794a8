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
import hashlib
import json
import math
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from machine import git_commit, machine_info

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from components import atomic_write, synthetic  # noqa: E402
from components.demo import (  # noqa: E402
    CT_BUNDLE, SSL_BUNDLE, DemoBudget, finetune_overrides, pyplot, save_plot, ssl_overrides, training_class_weights,
)
from components.runner import BUNDLES_DIR, fresh_run_dir, read_scalars, run_bundle  # noqa: E402

DINO_BUNDLE = "swin_unetr_dino_pretrain"
HELD_OUT_SETS = ("in_domain", "shifted")
MODELS = ("selected", "last")
SHIFTED_SEED_OFFSET = 7919  # the shifted held-out subjects: another seed than the labeled and unlabeled sets


class Arm(NamedTuple):
    """An arm: the recipe whose encoder it starts from (None: random initialisation) and whether it stays frozen."""

    recipe: str | None
    frozen: bool


ARMS: dict[str, Arm] = {
    "scratch": Arm(None, False),
    "ssl": Arm("ssl", False),
    "dino": Arm("dino", False),
    "frozen_random": Arm(None, True),
    "frozen_ssl": Arm("ssl", True),
    "frozen_dino": Arm("dino", True),
}
CONTRASTS: dict[str, tuple[str, str]] = {
    "ssl - scratch": ("ssl", "scratch"),
    "dino - scratch": ("dino", "scratch"),
    "frozen_ssl - frozen_random": ("frozen_ssl", "frozen_random"),
    "frozen_dino - frozen_random": ("frozen_dino", "frozen_random"),
}


@dataclass(frozen=True)
class Plan:
    """The protocol's sizes. ``pool_size`` fixes the candidate pool (so the pools do not depend on ``ks``);
    ``min_seeds`` seeds run at every k, more are added at ``narrow_ks`` up to ``max_seeds`` while a paired interval
    there is wider than ``target_half_width``; ``finetune_iterations`` and ``val_every`` must be multiples of every
    k (one volume per iteration: k iterations make an epoch); ``budget`` sizes the pretraining (and the demo's
    finetuning settings: crop, feature size, learning rate)."""

    ks: tuple[int, ...] = (1, 2, 4)
    pool_size: int = 8
    num_in_domain: int = 4
    num_shifted: int = 4
    min_seeds: int = 3
    max_seeds: int = 3
    narrow_ks: tuple[int, ...] = (1, 2)
    target_half_width: float = 0.03
    finetune_iterations: int = 200
    val_every: int = 20
    rankme_crops_per_volume: int = 16
    budget: DemoBudget = DemoBudget()
    arms: tuple[str, ...] = tuple(ARMS)
    pretrain_overrides: dict = field(default_factory=dict)
    finetune_overrides: dict = field(default_factory=dict)


PLANS = {
    # 2 cores, at most 3 hours: 6 arms x k = 1, 2 x 3 seeds of 200 iterations, two runs side by side (one thread each)
    "cpu": Plan(ks=(1, 2), val_every=40),
    # one GPU: more seeds where the interval is wide, a longer budget and k = 8
    "cuda": Plan(ks=(1, 2, 4, 8), max_seeds=10, finetune_iterations=400, val_every=40,
                 budget=DemoBudget(num_unlabeled=64, ssl_epochs=60, ssl_batch=4, finetune_crops=2)),
    "small": Plan(ks=(1,), pool_size=2, num_in_domain=1, num_shifted=1, min_seeds=1, max_seeds=1, finetune_iterations=2,
                  val_every=1, rankme_crops_per_volume=2, budget=DemoBudget(num_unlabeled=6, ssl_epochs=1)),
}  # fmt: skip


def digest(value: Any) -> str:
    """A short sha256 of a JSON-able value (keys sorted): the key of a result."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _bundle_hash(bundle: str, configs: tuple[str, ...]) -> str:
    """The bundle's shipped defaults: a change of a config changes every result key that uses it."""
    return digest({name: (BUNDLES_DIR / bundle / "configs" / name).read_text() for name in configs})


# ----------------------------------------------------------------------------------------------------------- data


@dataclass
class Data:
    """The fixed splits: ``pool`` (ordered candidates), ``validation``, ``in_domain``, ``shifted`` (datalist items
    with paths relative to ``root`` or absolute), the label names and the unlabeled corpus's datalist."""

    root: Path
    pool: list[dict]
    validation: list[dict]
    in_domain: list[dict]
    shifted: list[dict]
    label_names: list[str]
    unlabeled: Path

    def files(self) -> dict:
        unlabeled = json.loads(self.unlabeled.read_text())
        return {
            "pool": [i["image"] for i in self.pool], "validation": [i["image"] for i in self.validation],
            "in_domain": [i["image"] for i in self.in_domain], "shifted": [i["image"] for i in self.shifted],
            "unlabeled": {key: [i["image"] for i in unlabeled[key]] for key in ("training", "validation")},
            "label_names": self.label_names,
        }  # fmt: skip


def synthetic_data(root: Path, plan: Plan, seed: int) -> Data:
    """Synthesises the labeled, shifted and unlabeled sets (skipped when a manifest of the same settings exists: the
    generator is deterministic) and fixes the splits by index: the first ``pool_size`` labeled subjects are the
    pool, the next one validates, the rest are the in-domain held-out set."""
    root.mkdir(parents=True, exist_ok=True)
    sizes = {"labeled": plan.pool_size + 1 + plan.num_in_domain, "shifted": max(3, plan.num_shifted),
             "unlabeled": plan.budget.num_unlabeled, "seed": seed, "organs": list(synthetic.DEMO_ORGANS)}  # fmt: skip
    manifest = root / "manifest.json"
    if not manifest.is_file() or json.loads(manifest.read_text()) != sizes:
        synthetic.write_dataset(root / "labeled", num=sizes["labeled"], seed=seed, organs=synthetic.DEMO_ORGANS)
        synthetic.write_dataset(root / "shifted", num=sizes["shifted"], seed=seed + SHIFTED_SEED_OFFSET,
                                organs=synthetic.DEMO_ORGANS, varied=True)  # fmt: skip
        synthetic.write_dataset(root / "unlabeled", num=sizes["unlabeled"], seed=seed, varied=True, labels=False)
        manifest.write_text(json.dumps(sizes, indent=2) + "\n")

    def items(folder: str) -> list[dict]:
        content = json.loads((root / folder / "dataset.json").read_text())
        return [{key: f"{folder}/{value}" for key, value in item.items()}
                for item in content["training"] + content["validation"] + content["test"]]  # fmt: skip

    labeled = items("labeled")
    pool_end = plan.pool_size
    return Data(root, labeled[:pool_end], labeled[pool_end : pool_end + 1], labeled[pool_end + 1 :],
                items("shifted")[: plan.num_shifted], ["background", *synthetic.DEMO_ORGANS], root / "unlabeled" / "dataset.json")  # fmt: skip


def _entries(datalist: Path, require_label: bool) -> list[dict]:
    """Every entry of a Decathlon-style datalist (``training``, ``validation``, ``test``; MSD's test lists of plain
    path strings included) with absolute paths; with ``require_label`` only entries with a label."""
    try:
        content = json.loads(datalist.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"datalist {str(datalist)!r} cannot be read as JSON: {err}") from err
    out = []
    for key in ("training", "validation", "test"):
        for item in content.get(key, []):
            item = {"image": item} if isinstance(item, str) else dict(item)
            if "image" not in item or (require_label and "label" not in item):
                continue
            out.append({k: str((datalist.parent / v).resolve()) for k, v in item.items() if k in ("image", "label")})
    missing = [p for item in out for p in item.values() if not Path(p).exists()]
    if missing:
        raise FileNotFoundError(f"datalist {str(datalist)!r} names {len(missing)} missing files, e.g. {missing[0]!r}.")
    return out


def user_data(root: Path, plan: Plan, seed: int, labeled: Path, unlabeled: Path, shifted: Path | None) -> Data:
    """The protocol on a user's datalists. The labeled entries (every list, those with a label) are permuted by
    ``seed``: the first ``num_in_domain`` are the in-domain held-out set, the next one validates, the rest (at most
    ``pool_size``) are the pool; ``shifted`` entries are the shifted held-out set (none without it). The unlabeled
    corpus (every entry of every list) is split 85/15 into the pretraining bundles' training and validation lists.

    Raises:
        ValueError / FileNotFoundError: a list that cannot be read, names missing files, or is too short for the
            plan (before any run starts).
    """
    entries = _entries(labeled, require_label=True)
    needed = plan.num_in_domain + 1 + max(plan.ks)
    if len(entries) < needed:
        raise ValueError(f"--labeled {str(labeled)!r} has {len(entries)} labeled volumes; the plan needs at least "
                         f"{needed} ({plan.num_in_domain} held out, 1 for validation, k up to {max(plan.ks)}).")  # fmt: skip
    order = np.random.default_rng([seed, 1]).permutation(len(entries))
    entries = [entries[i] for i in order]
    held, val, pool = entries[: plan.num_in_domain], entries[plan.num_in_domain : plan.num_in_domain + 1], entries[plan.num_in_domain + 1 :]
    corpus = _entries(unlabeled, require_label=False)
    if len(corpus) < 2:
        raise ValueError(f"--unlabeled {str(unlabeled)!r} has {len(corpus)} images; pretraining needs at least 2.")
    corpus = [{"image": item["image"]} for item in corpus]
    order = np.random.default_rng([seed, 2]).permutation(len(corpus))
    num_val = max(1, round(0.15 * len(corpus)))
    root.mkdir(parents=True, exist_ok=True)
    pretraining = root / "unlabeled.json"
    pretraining.write_text(json.dumps({"training": [corpus[i] for i in order[num_val:]],
                                       "validation": [corpus[i] for i in order[:num_val]]}, indent=2) + "\n")  # fmt: skip
    names = json.loads(labeled.read_text()).get("labels")
    if not isinstance(names, dict) or not names:
        raise ValueError(f"--labeled {str(labeled)!r} has no 'labels' dict (e.g. {{\"0\": \"background\", \"1\": \"liver\"}}).")
    label_names = [names[k] for k in sorted(names, key=int)]
    return Data(root, pool[: plan.pool_size], val, held, _entries(shifted, True) if shifted else [], label_names, pretraining)


def pool_for(data: Data, k: int, seed: int, data_seed: int) -> list[dict]:
    """The k training volumes of ``seed``: the first k of a permutation of the pool drawn from (data seed, seed), so
    the pools of one seed are nested and independent of which ks run."""
    if not 1 <= k <= len(data.pool):
        raise ValueError(f"k = {k} is outside 1..{len(data.pool)} (the pool's size).")
    order = np.random.default_rng([data_seed, 1000 + seed]).permutation(len(data.pool))
    return [data.pool[i] for i in order[:k]]


def write_datalist(data: Data, k: int, seed: int, data_seed: int) -> Path:
    """The datalist of a (k, seed) pair: ``training`` (its pool), ``validation`` (model selection), ``heldout``
    (in-domain then shifted: scored once per model) and the MSD ``labels``. Written atomically: the arms of a pair
    write and read it side by side, and a read of a half-written list gave a run another result key."""
    path = data.root / "lists" / f"k{k}_seed{seed}.json"

    def rel(items: list[dict]) -> list[dict]:  # paths relative to the datalist's folder
        return [{key: os.path.relpath(data.root / value, path.parent) for key, value in item.items()} for item in items]

    content = {"labels": {str(i): n for i, n in enumerate(data.label_names)}, "training": rel(pool_for(data, k, seed, data_seed)),
               "validation": rel(data.validation), "heldout": rel(data.in_domain + data.shifted)}  # fmt: skip
    text = json.dumps(content, indent=2) + "\n"
    if not path.is_file() or path.read_text() != text:
        _write_text(path, text)
    return path


# ----------------------------------------------------------------------------------------------------------- runs


def dino_overrides(budget: DemoBudget, data_dir: Path, run_dir: Path, device: str, seed: int) -> dict:
    """Command-line overrides of the self-distillation bundle for a run of the SSL arm's size: the SSL arm's data,
    device, volumes per iteration, epochs, feature size, attention window and folders; 32^3 global and local crops
    from 64^3 regions and a small head."""
    ssl = ssl_overrides(budget, data_dir, run_dir, device, seed)
    shared = ("dataset_dir", "device", "feature_size", "network_def#window_size", "batch_size", "loader#num_workers", "speed#amp",
              "speed#use_checkpoint", "training#seed", "training#log_interval", "max_epochs", "output_dir", "ckpt_dir",
              "checkpointing#auto_resume")  # fmt: skip
    return {
        **{key: ssl[key] for key in shared}, "roi_size": [32, 32, 32], "training#context_size": [64, 64, 64],
        "training#local_size": [32, 32, 32], "training#num_local_crops": 2, "training#prototypes": 1024,
        "training#head_hidden_dim": 256, "training#head_bottleneck_dim": 64, "training#warmup_epochs": 1,
        "training#teacher_temperature_warmup_epochs": 1,
        "training#val_interval": ssl["training#val_interval"], "training#num_samples": 2,
    }  # fmt: skip


PRETRAINING = {"ssl": (SSL_BUNDLE, ssl_overrides), "dino": (DINO_BUNDLE, dino_overrides)}


def _portable(overrides: dict, out: Path) -> dict:
    """Overrides without the run's own folders and with paths relative to ``out``: what a result's key covers."""
    skip = ("output_dir", "ckpt_dir", "pretrained_path")
    return {k: (v.replace(str(out), "<out>") if isinstance(v, str) else v) for k, v in overrides.items() if k not in skip}


def run_numerics(device: str) -> dict:
    """What a run's floating-point results depend on besides its settings, part of every result's key: the device,
    torch's version and, on the CPU, the vector instructions its kernels dispatch to
    (``torch.backends.cpu.get_cpu_capability()``). A CPU run repeats bit for bit on one machine, but one finetuning
    run of the plan, same settings and seed, selected a model of held-out Dice 0.600 on an AVX2 VM and 0.652 on an
    AVX-512 one: results of other numerics are neither reused nor paired. On CUDA, whose kernels do not repeat bit
    for bit anyway, the GPU's model is left out, so that pieces of the GPU plan may run on different GPUs."""
    numerics = {"device": device, "torch": torch.__version__}
    if device == "cpu":
        numerics["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return numerics


def pretraining_job(recipe: str, plan: Plan, data: Data, out: Path, numerics: dict, seed: int) -> tuple[str, dict]:
    """(key, overrides) of a recipe's pretraining run on ``numerics`` (:func:`run_numerics`); its folder is
    ``out/pretrain/<recipe>_<key>``."""
    bundle, make = PRETRAINING[recipe]
    overrides = {**make(plan.budget, data.unlabeled.parent, Path("."), numerics["device"], seed), "datalist": str(data.unlabeled),
                 **plan.pretrain_overrides}  # fmt: skip
    key = digest({"recipe": recipe, "overrides": _portable(overrides, out), "corpus": data.unlabeled.read_text(),
                  "bundle": _bundle_hash(bundle, ("train.json",)), "numerics": numerics})  # fmt: skip
    run_dir = out / "pretrain" / f"{recipe}_{key}"
    overrides.update(output_dir=str(run_dir / "eval"), ckpt_dir=str(run_dir / "models"))
    return key, overrides


def finetune_job(
    arm: str, k: int, seed: int, plan: Plan, data: Data, datalist: Path, out: Path, numerics: dict, weights: dict[str, dict],
) -> tuple[str, dict]:
    """(key, overrides) of one finetuning run on ``numerics`` (:func:`run_numerics`). The arms of a (k, seed) pair get
    the same overrides but for ``pretrained_path`` (the arm's encoder) and, for the frozen arms,
    ``training#freeze_encoder_iterations`` (the whole run). ``weights``: per recipe the finished pretraining's record
    (``model``, ``sha256``)."""
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {list(ARMS)}, got {arm!r}.")
    recipe, frozen = ARMS[arm]
    for name in ("finetune_iterations", "val_every"):
        if getattr(plan, name) % k:
            raise ValueError(f"{name} ({getattr(plan, name)}) must be a multiple of k = {k} (one volume per iteration).")
    epochs = plan.finetune_iterations // k
    budget = replace(plan.budget, finetune_epochs=epochs, val_interval=plan.val_every // k)
    pretrained = Path(weights[recipe]["model"]) if recipe else None
    overrides = finetune_overrides(budget, datalist, Path("."), numerics["device"], 1000 + seed, pretrained,
                                   training_class_weights(datalist, data.label_names))  # fmt: skip
    overrides.update({"label_names": data.label_names,
                      "training#freeze_encoder_iterations": plan.finetune_iterations if frozen else 0, **plan.finetune_overrides})  # fmt: skip
    key = digest({"arm": arm, "k": k, "seed": seed, "overrides": _portable(overrides, out), "datalist": datalist.read_text(),
                  "weights": weights[recipe]["sha256"] if recipe else None,
                  "bundle": _bundle_hash(CT_BUNDLE, ("train.json", "evaluate.json")), "numerics": numerics})  # fmt: skip
    run_dir = out / "runs" / f"{arm}_k{k}_seed{seed}_{key}"
    overrides.update(output_dir=str(run_dir / "eval"), ckpt_dir=str(run_dir / "models"))
    return key, overrides


def _per_image_dice(csv: Path, data_root: Path) -> dict[str, float]:
    """Mean Dice over the classes present (NaN: a class absent from image and label) per held-out image, from the
    evaluation's ``val_mean_dice_raw.csv``; keys are paths relative to the data root where possible."""
    out = {}
    for line in csv.read_text().splitlines()[1:]:
        name, *values = line.split(",")
        scores = [float(v) for v in values[:-1] if v.strip().lower() != "nan"]
        path = Path(name)
        key = os.path.relpath(path, data_root) if path.is_relative_to(data_root) else name
        out[key] = statistics.fmean(scores) if scores else float("nan")
    return out


def run_pretraining(recipe: str, key: str, overrides: dict, results: Path, threads: int | None, report_only: bool = False) -> dict:
    """Runs (or reuses) one pretraining; returns its record (model path and sha256, final losses, last RankMe). With
    ``report_only`` the recorded run is used as it is (its weights may be absent: no RankMe then).

    The weights are kept beside the record, ``<results>/pretrain_<recipe>_<key>.pt``, and reused from there when the
    run's folder is gone: a piece of the plan on a fresh machine (a GPU lent for one call) continues from the results
    folder alone, carried there with its weights (git ignores them). Retraining would not do: a CUDA pretraining need
    not repeat bit for bit (the SSL recipe's did not on an H200), and the finetuning keys hold the weights' sha256.

    Raises:
        FileNotFoundError: with ``report_only``, for a pretraining that has no record.
    """
    run_dir = Path(overrides["ckpt_dir"]).parent
    record_path = results / f"pretrain_{recipe}_{key}.json"
    kept = record_path.with_suffix(".pt")
    model = run_dir / "models" / "model.pt"
    if record_path.is_file():
        record = json.loads(record_path.read_text())
        for weights in (model, kept):
            if weights.is_file() and file_sha256(weights) == record["sha256"]:
                return {**record, "model": str(weights)}
        if report_only:
            return {**record, "model": str(model)}
    if report_only:
        raise FileNotFoundError(f"no record of the {recipe} pretraining with these settings ({record_path}): nothing to report.")
    fresh_run_dir(run_dir)  # a killed run's events or checkpoints must not mix into the new one
    seconds = run_bundle(PRETRAINING[recipe][0], overrides=overrides, log=run_dir / "train.log", echo=False, threads=threads)
    scalars = read_scalars(run_dir / "eval")
    record = {"recipe": recipe, "key": key, "sha256": file_sha256(model), "seconds": round(seconds, 1), "commit": git_commit(),
              "final_losses": {t: v[-1][1] for t, v in scalars.items() if t.startswith("loss")},
              "logged_rankme": scalars["val_rankme"][-1][1] if scalars.get("val_rankme") else None}  # fmt: skip
    if record_path.is_file() and json.loads(record_path.read_text())["sha256"] != record["sha256"]:
        print(f"WARNING: pretraining {recipe} {key} gave other weights than its recorded run: the finetuning results "
              "of the recorded weights are not reused (their keys hold the weights' hash)", file=sys.stderr, flush=True)  # fmt: skip
    with atomic_write(kept) as f, model.open("rb") as weights:  # first: a record never names weights not there
        shutil.copyfileobj(weights, f)
    _write_json(record_path, record)
    return {**record, "model": str(model)}


def _write_text(path: Path, text: str) -> None:
    with atomic_write(path, "w") as f:
        f.write(text)


def _write_json(path: Path, value: Any) -> None:
    _write_text(path, json.dumps(value, indent=2) + "\n")


def run_finetuning(
    arm: str, k: int, seed: int, key: str, overrides: dict, data: Data, results: Path, threads: int | None, report_only: bool = False,
) -> dict | None:
    """Runs (or reuses) one finetuning run and scores its selected and last models on both held-out sets; with
    ``report_only`` a run without a result is not run (None)."""
    record_path = results / f"{arm}_k{k}_seed{seed}_{key}.json"
    if record_path.is_file():
        return json.loads(record_path.read_text())
    if report_only:
        return None
    run_dir = Path(overrides["ckpt_dir"]).parent
    fresh_run_dir(run_dir)  # a killed run's events or checkpoints must not mix into the new one
    seconds = run_bundle(CT_BUNDLE, overrides=overrides, log=run_dir / "train.log", echo=False, threads=threads)
    # one volume per iteration: epoch e ends at iteration e * k
    curve = [[epoch * k, value] for epoch, value in read_scalars(run_dir / "eval").get("val_mean_dice", [])]
    if not curve:
        raise RuntimeError(f"finetuning run {run_dir} logged no validation Dice (see {run_dir / 'train.log'}).")
    best = max(value for _, value in curve)
    selected_iteration = next(i for i, value in curve if value == best)
    models = {"selected": run_dir / "models" / "model.pt", "last": run_dir / "models" / "checkpoint.pt"}
    dice: dict[str, dict] = {}
    for name, model in models.items():
        if name == "last" and selected_iteration == curve[-1][0]:
            dice[name] = dice["selected"]  # the same weights: the best validation was the last one
            continue
        eval_dir = run_dir / f"heldout_{name}"
        seconds += run_bundle(CT_BUNDLE, ("train.json", "evaluate.json"), {**overrides, "eval_list": "heldout", "checkpoint": str(model),
                              "output_dir": str(eval_dir)}, log=run_dir / f"heldout_{name}.log", echo=False, threads=threads)  # fmt: skip
        per_image = _per_image_dice(eval_dir / "val_mean_dice_raw.csv", data.root)
        dice[name] = {}
        for held_out in HELD_OUT_SETS:
            files = [_rel(item["image"], data.root) for item in getattr(data, held_out)]
            scores = [per_image[f] for f in files]
            dice[name][held_out] = {"mean": _nanmean(scores), "per_image": dict(zip(files, scores))}
    log = (run_dir / "train.log").read_text()
    loaded = _loaded_count(log) if ARMS[arm].recipe else None
    datalist = json.loads(Path(overrides["datalist"]).read_text())
    record = {
        "arm": arm, "k": k, "seed": seed, "key": key, "commit": git_commit(), "seconds": round(seconds, 1),
        "training_files": [_rel(str((Path(overrides["datalist"]).parent / i["image"]).resolve()), data.root) for i in datalist["training"]],
        "validation_files": [_rel(item["image"], data.root) for item in data.validation],
        "held_out_files": {h: [_rel(item["image"], data.root) for item in getattr(data, h)] for h in HELD_OUT_SETS},
        "validation_curve": curve, "selected_iteration": selected_iteration, "dice": dice,
        "encoder_tensors_loaded": loaded,
    }  # fmt: skip
    _write_json(record_path, record)
    return record


def _rel(path: str, root: Path) -> str:
    p = Path(path)
    p = p if p.is_absolute() else (root / p)
    p = p.resolve()
    return os.path.relpath(p, root.resolve()) if p.is_relative_to(root.resolve()) else str(p)


def _nanmean(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.fmean(finite) if finite else float("nan")


def _loaded_count(log: str) -> list[int] | None:
    import re

    found = re.search(r"loaded (\d+)/(\d+) encoder tensors", log)
    return [int(found[1]), int(found[2])] if found else None


# ----------------------------------------------------------------------------------------------------------- statistics


def bootstrap_interval(differences: list[float], seed: int = 0, resamples: int = 10_000) -> tuple[float, float] | None:
    """95 % percentile bootstrap interval of the mean of ``differences`` (resampled with replacement); None for
    fewer than 2 values."""
    if len(differences) < 2:
        return None
    values = np.asarray(differences, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), size=(resamples, len(values)))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(low), float(high)


def paired(runs: list[dict], plan: Plan, seed: int) -> dict:
    """Per held-out set, model, contrast and k: the paired differences over the seeds that both arms finished, their
    mean, the bootstrap interval and its half-width."""
    dice = {(r["arm"], r["k"], r["seed"]): r["dice"] for r in runs}
    out: dict = {}
    for held_out in HELD_OUT_SETS:
        for model in MODELS:
            for contrast, (arm, base) in CONTRASTS.items():
                if arm not in plan.arms or base not in plan.arms:
                    continue
                for k in plan.ks:
                    seeds = sorted(s for (a, kk, s) in dice if a == arm and kk == k and (base, k, s) in dice)
                    entry = paired_entry([dice[(arm, k, s)][model][held_out]["mean"] - dice[(base, k, s)][model][held_out]["mean"]
                                          for s in seeds], seed)  # fmt: skip
                    if entry is not None:
                        out.setdefault(held_out, {}).setdefault(model, {}).setdefault(contrast, {})[str(k)] = entry
    return out


def paired_entry(differences: list[float], seed: int) -> dict | None:
    """The paired differences without NaNs (a class absent everywhere), their mean, 95 % bootstrap interval and
    its half-width; None when no difference is left."""
    diffs = [d for d in differences if not math.isnan(d)]
    if not diffs:
        return None
    interval = bootstrap_interval(diffs, seed)
    half_width = None if interval is None else (interval[1] - interval[0]) / 2
    return {"mean": statistics.fmean(diffs), "ci95": interval, "n": len(diffs), "differences": diffs, "half_width": half_width}


def seeds_for_half_width(differences: list[float], target: float) -> int | None:
    """About how many seeds make the 95 % interval of the mean paired difference at most ``target`` wide on either
    side: ``(1.96 sd / target)^2`` rounded up (at least 2), with ``sd`` the sample sd of ``differences``; None for
    fewer than 2. A planning figure: the sd of a few differences is itself rough.

    Example: differences 0.00, 0.04, 0.08 (sd 0.04) need 7 seeds for +-0.03.
    """
    if len(differences) < 2:
        return None
    return max(2, math.ceil((1.96 * statistics.stdev(differences) / target) ** 2))


def table(runs: list[dict], plan: Plan) -> dict:
    """Per held-out set, model, arm and k: mean and sd over seeds of the held-out mean Dice."""
    out: dict = {}
    for held_out in HELD_OUT_SETS:
        for model in MODELS:
            for arm in plan.arms:
                for k in plan.ks:
                    values = [r["dice"][model][held_out]["mean"] for r in runs if r["arm"] == arm and r["k"] == k]
                    values = [v for v in values if not math.isnan(v)]
                    if values:
                        out.setdefault(held_out, {}).setdefault(model, {}).setdefault(arm, {})[str(k)] = {
                            "mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
                            "n": len(values)}  # fmt: skip
    return out


def needs_more_seeds(intervals: dict, plan: Plan) -> bool:
    """True while a paired interval at ``narrow_ks`` (any set, model, contrast) is unknown or wider than the target."""
    for per_model in intervals.values():
        for per_contrast in per_model.values():
            for per_k in per_contrast.values():
                for k in plan.narrow_ks:
                    entry = per_k.get(str(k))
                    if entry is not None and (entry["half_width"] is None or entry["half_width"] > plan.target_half_width):
                        return True
    return False


def convergence(runs: list[dict], plan: Plan) -> dict:
    """Per arm and k, the validation curve averaged over seeds, and the gain of its last quarter (mean of the
    validations in the last quarter of the budget minus the mean of those in the quarter before): near 0 once the
    arm has converged."""
    out: dict = {}
    for arm in plan.arms:
        for k in plan.ks:
            curves = [dict(r["validation_curve"]) for r in runs if r["arm"] == arm and r["k"] == k]
            if not curves:
                continue
            steps = sorted(set.intersection(*(set(c) for c in curves)))
            mean = [(s, statistics.fmean(c[s] for c in curves)) for s in steps]
            q = plan.finetune_iterations / 4
            last = [v for s, v in mean if s > 3 * q]
            before = [v for s, v in mean if 2 * q < s <= 3 * q]
            out.setdefault(arm, {})[str(k)] = {"mean_curve": mean, "last_quarter_gain":
                                               statistics.fmean(last) - statistics.fmean(before) if last and before else None}  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------------------------- RankMe


def encoder_rankme(data: Data, weights: dict[str, dict], plan: Plan, seed: int) -> dict:
    """RankMe (``components.effective_rank``) of the random, SSL and self-distillation encoders on the same crops:
    ``rankme_crops_per_volume`` crops of the finetuning size from every held-out volume, preprocessed as the CT
    bundle validates; next to it, what each pretraining bundle logged at its last validation."""
    from monai.transforms import RandSpatialCropSamples, SpatialPad

    from components import effective_rank, load_pretrained, swin_embeddings
    from machine import bundle_parser

    datalist = write_datalist(data, 1, 0, seed)
    parser = bundle_parser(BUNDLES_DIR / CT_BUNDLE, {**finetune_overrides(plan.budget, datalist, data.root / "rankme", "cpu", seed, None),
                                                     "label_names": data.label_names,
                                                     **plan.finetune_overrides})  # fmt: skip
    preprocessing = parser.get_parsed_content("validate#preprocessing")
    pad = SpatialPad(parser["roi_size"])
    cropper = RandSpatialCropSamples(parser["roi_size"], num_samples=plan.rankme_crops_per_volume, random_size=False)
    cropper.set_random_state(seed)
    crops = []
    for item in data.in_domain + data.shifted:
        image = preprocessing({key: str(data.root / value) for key, value in item.items()})["image"]
        crops += [c.as_tensor() if hasattr(c, "as_tensor") else c for c in cropper(pad(image))]
    batch = torch.stack(crops)
    out = {"crops": len(crops), "encoders": {}}
    for name, recipe in (("random", None), ("ssl", "ssl"), ("dino", "dino")):
        if recipe is not None and (recipe not in weights or not Path(weights[recipe]["model"]).is_file()):
            continue
        torch.manual_seed(1000)
        network = parser.get_parsed_content("network_def", instantiate=True, lazy=False)
        if recipe is not None:
            load_pretrained(network, weights[recipe]["model"])
        network.eval()
        with torch.no_grad():
            embeddings = torch.cat([swin_embeddings(network, chunk) for chunk in batch.split(16)])
        out["encoders"][name] = {"rankme": effective_rank(embeddings), "dims": embeddings.shape[1],
                                 "logged_by_bundle": weights[recipe].get("logged_rankme") if recipe else None}  # fmt: skip
    return out


def rankme_agreement(rankme: dict, intervals: dict, plan: Plan) -> dict:
    """Whether RankMe orders the encoders (random, SSL, self-distillation) as the frozen arms' in-domain Dice of the
    selected models does, per k: {k: {"rankme_order", "frozen_dice_order", "agrees"}}."""
    scores = {name: e["rankme"] for name, e in rankme["encoders"].items()}
    out = {}
    contrasts = intervals.get("in_domain", {}).get("selected", {})
    for k in plan.ks:
        dice = {"random": 0.0}
        for name, contrast in (("ssl", "frozen_ssl - frozen_random"), ("dino", "frozen_dino - frozen_random")):
            entry = contrasts.get(contrast, {}).get(str(k))
            if entry is not None and name in scores:
                dice[name] = entry["mean"]
        if len(dice) < 2:
            continue
        names = sorted(dice)
        by_rank = sorted(names, key=lambda n: -scores[n])
        by_dice = sorted(names, key=lambda n: -dice[n])
        out[str(k)] = {"rankme_order": by_rank, "frozen_dice_order": by_dice, "agrees": by_rank == by_dice}
    return out


# ----------------------------------------------------------------------------------------------------------- tables


def _signed(value: float) -> str:
    return f"{value:+.3f}"


def markdown_tables(result: dict, model: str = "selected") -> str:
    """The result's tables in Markdown, as README.md and benchmarks/README.md show them (a test compares them):
    held-out mean Dice per arm and k (mean +- sd, seeds), then the paired differences with their 95 % bootstrap
    interval and the seeds the target half-width would take (:func:`seeds_for_half_width`), for both held-out sets,
    for ``model`` ("selected" or "last")."""
    ks = [str(k) for k in result["settings"]["ks"]]
    target = result["settings"]["target_half_width"]
    header = "| " + " | ".join(["", *(f"k = {k}" for k in ks)]) + " |\n| " + " | ".join(["---"] * (len(ks) + 1)) + " |"
    lines = []
    for held_out in HELD_OUT_SETS:
        lines += [f"Held-out mean Dice, {held_out.replace('_', '-')} set, {model} models (mean +- sd over seeds, n seeds):", "",
                  header.replace("|  |", f"| {held_out.replace('_', '-')} |", 1)]  # fmt: skip
        for arm, per_k in result["table"].get(held_out, {}).get(model, {}).items():
            cells = [f"{per_k[k]['mean']:.3f} +- {per_k[k]['sd']:.3f} ({per_k[k]['n']})" if k in per_k else "not run" for k in ks]
            lines.append("| " + " | ".join([arm, *cells]) + " |")
        lines += ["", f"Paired differences, {held_out.replace('_', '-')} set, {model} models: mean [95 % bootstrap interval] "
                      f"(n pairs; ~ the seeds a half-width of {target} would take):", "",
                  header.replace("|  |", "| contrast |", 1)]  # fmt: skip
        for contrast, per_k in result["paired"].get(held_out, {}).get(model, {}).items():
            cells = []
            for k in ks:
                entry = per_k.get(k)
                if entry is None:
                    cells.append("not run")
                elif entry["ci95"] is None:
                    cells.append(f"{_signed(entry['mean'])} (n = {entry['n']}: no interval)")
                else:
                    low, high = entry["ci95"]
                    need = seeds_for_half_width(entry["differences"], target)
                    cells.append(f"{_signed(entry['mean'])} [{_signed(low)}, {_signed(high)}] ({entry['n']}; ~{need})")
            lines.append("| " + " | ".join([contrast, *cells]) + " |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


DOC_BLOCK = "<!-- low_data {model} tables: python benchmarks/low_data.py --markdown {summary} --write_docs ... -->"
DOC_BLOCK_END = "<!-- /low_data {model} tables -->"


def write_doc_tables(doc: Path, summary: Path) -> bool:
    """Replaces the generated table blocks of ``doc`` (between :data:`DOC_BLOCK` and :data:`DOC_BLOCK_END` markers,
    one per model) by the tables of ``summary``; True when the file changed.

    Raises:
        ValueError: for a document without any block of this summary.
    """
    text = original = doc.read_text()
    result = json.loads(summary.read_text())
    name = summary.resolve().relative_to(REPO).as_posix() if summary.resolve().is_relative_to(REPO) else summary.as_posix()
    found = False
    for model in MODELS:
        begin, end = DOC_BLOCK.format(model=model, summary=name), DOC_BLOCK_END.format(model=model)
        if begin in text:
            head, rest = text.split(begin, 1)
            _, tail = rest.split(end, 1)
            text = f"{head}{begin}\n\n{markdown_tables(result, model)}\n{end}{tail}"
            found = True
    if not found:
        raise ValueError(f"{doc} has no block of {name} (a line {DOC_BLOCK.format(model='selected', summary=name)!r}).")
    doc.write_text(text)
    return text != original


# ----------------------------------------------------------------------------------------------------------- plots


def _plots(tables: dict, intervals: dict, curves: dict, out: Path) -> None:
    fig, axes = pyplot().subplots(1, 2, figsize=(11, 4))
    for ax, held_out in zip(axes, HELD_OUT_SETS):
        for arm, per_k in tables.get(held_out, {}).get("selected", {}).items():
            ks = sorted(per_k, key=int)
            ax.errorbar([int(k) for k in ks], [per_k[k]["mean"] for k in ks], yerr=[per_k[k]["sd"] for k in ks],
                        marker="o", capsize=3, label=arm)  # fmt: skip
        ax.set_xscale("log", base=2)
        save_plot(fig, ax, out / "low_data.png", "labeled training volumes (k)", "held-out mean Dice",
                  f"{held_out} held-out set (selected models; mean, sd)", fontsize=7)  # fmt: skip
    fig, ax = pyplot().subplots(figsize=(6, 4))
    for k, entry in sorted(curves.get("scratch", {}).items(), key=lambda kv: int(kv[0])):
        ax.plot(*zip(*entry["mean_curve"]), marker="o", label=f"scratch, k = {k}")
    for k, entry in sorted(curves.get("ssl", {}).items(), key=lambda kv: int(kv[0])):
        ax.plot(*zip(*entry["mean_curve"]), "--", label=f"ssl, k = {k}")
    save_plot(fig, ax, out / "curves.png", "finetuning iteration", "validation mean Dice (mean over seeds)",
              "the finetuning budget: validation curves", fontsize=7)  # fmt: skip


# ----------------------------------------------------------------------------------------------------------- driver


def plan_settings(plan: Plan, seed: int, numerics: dict, data: str = "synthetic") -> dict:
    """The settings a summary records (and hashes into ``settings_hash``): the plan, its data seed, the device and
    the numerics of its runs (:func:`run_numerics`), and the kind of data (``"synthetic"`` or ``"user datalists"``),
    as JSON values."""
    settings = {**{k: v for k, v in asdict(plan).items() if k != "budget"}, "budget": asdict(plan.budget), "data_seed": seed,
                "device": numerics["device"], "numerics": numerics, "data": data}  # fmt: skip
    return json.loads(json.dumps(settings))


def run(
    plan: Plan, out: Path, device: str, seed: int = 0, parallel: int = 1, results: Path | None = None,
    labeled: Path | None = None, unlabeled: Path | None = None, shifted: Path | None = None, report_only: bool = False,
    stop_after_s: float | None = None,
) -> dict:
    """Runs (or completes) the protocol and returns its summary; see the module's docstring. With ``report_only``
    nothing runs; with ``stop_after_s`` no run starts after that many seconds (the runs under way finish): the
    summary then covers the finished runs and lists the missing ones (``missing_runs``, ``complete`` false), and the
    same command run again continues."""
    unknown = [a for a in plan.arms if a not in ARMS]
    if unknown or "scratch" not in plan.arms and "frozen_random" not in plan.arms:
        raise ValueError(f"arms must be a subset of {list(ARMS)} with a baseline (scratch or frozen_random), got {list(plan.arms)}.")
    if (labeled is None) != (unlabeled is None):
        raise ValueError("--labeled and --unlabeled go together (a labeled list and an unlabeled corpus).")
    if shifted is not None and labeled is None:
        raise ValueError("--shifted needs --labeled and --unlabeled.")
    started = time.perf_counter()
    out = out.resolve()
    results = (results or out / "results").resolve()
    data = user_data(out / "data", plan, seed, labeled, unlabeled, shifted) if labeled else synthetic_data(out / "data", plan, seed)
    for k in plan.ks:  # every k fits the pool and the budget, before any run
        pool_for(data, k, 0, seed)
        for name in ("finetune_iterations", "val_every"):
            if getattr(plan, name) % k:
                raise ValueError(f"{name} ({getattr(plan, name)}) must be a multiple of every k, got k = {k}.")
    threads = max(1, (os.cpu_count() or 1) // parallel) if device == "cpu" else None
    recipes = sorted({ARMS[a].recipe for a in plan.arms if ARMS[a].recipe})
    numerics = run_numerics(device)
    jobs = {recipe: pretraining_job(recipe, plan, data, out, numerics, seed) for recipe in recipes}
    with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(jobs)))) as pool:
        weights = dict(zip(jobs, pool.map(lambda r: run_pretraining(r, *jobs[r], results, threads, report_only), jobs)))
    missing: list[str] = []

    def one(job: tuple[str, int, int]) -> dict | None:
        arm, k, s = job
        key, overrides = finetune_job(arm, k, s, plan, data, write_datalist(data, k, s, seed), out, numerics, weights)
        late = stop_after_s is not None and time.perf_counter() - started > stop_after_s
        record = run_finetuning(arm, k, s, key, overrides, data, results, threads, report_only or late)
        if record is None:
            missing.append(f"{arm} k={k} seed={s}")
            return None
        sel = record["dice"]["selected"]
        print(f"k={k} seed={s} {arm}: selected (iteration {record['selected_iteration']}) in-domain {sel['in_domain']['mean']:.4f}"
              f", shifted {sel['shifted']['mean']:.4f}", file=sys.stderr, flush=True)  # fmt: skip
        return record

    runs: list[dict] = []
    seeds_run = {k: 0 for k in plan.ks}
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        for s in range(plan.max_seeds):
            if s < plan.min_seeds:
                ks = plan.ks
            elif needs_more_seeds(paired(runs, replace(plan, ks=tuple(k for k in plan.ks if k in plan.narrow_ks)), seed), plan):
                ks = tuple(k for k in plan.ks if k in plan.narrow_ks)
            else:
                break
            runs += [r for r in pool.map(one, [(arm, k, s) for k in ks for arm in plan.arms]) if r is not None]
            for k in ks:
                seeds_run[k] = s + 1
    intervals = paired(runs, plan, seed)
    tables = table(runs, plan)
    curves = convergence(runs, plan)
    rankme = encoder_rankme(data, weights, plan, seed)
    _plots(tables, intervals, curves, out)
    settings = plan_settings(plan, seed, numerics, "user datalists" if labeled else "synthetic")
    return {
        "benchmark": "low_data",
        "settings": settings,
        "settings_hash": digest(settings),
        "data": data.files(),
        "pretraining": {r: {k: v for k, v in w.items() if k != "model"} for r, w in weights.items()},
        "seeds_run": {str(k): n for k, n in seeds_run.items()},
        "half_width_target_met": not needs_more_seeds(intervals, plan),
        "complete": not missing,
        "missing_runs": sorted(missing),
        "table": tables,
        "paired": intervals,
        "convergence": curves,
        "rankme": {**rankme, "agreement_with_frozen_arms": rankme_agreement(rankme, intervals, plan)},
        "runs": sorted(runs, key=lambda r: (r["seed"], r["k"], list(ARMS).index(r["arm"]))),
        "commits": sorted({r["commit"] for r in runs} | {w["commit"] for w in weights.values()}),
        "machine": {**machine_info(), "threads_per_run": threads, "parallel_runs": parallel},
        "total_seconds": round(time.perf_counter() - started, 1),
        "plots": [str(out / "low_data.png"), str(out / "curves.png")],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="the CI size: one k, one seed, a few iterations")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: CUDA where present")
    parser.add_argument("--ks", default=None, help="label counts, comma-separated (a subset of the plan's pool)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds at every k (min and max; default: the plan's)")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=None, help="default: all six")
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
    parser.add_argument("--write_docs", nargs="+", default=None, help="with --markdown: rewrite these files' table blocks")
    args = parser.parse_args()
    if args.markdown:
        if args.write_docs:
            for doc in args.write_docs:
                print(f"{doc}: {'updated' if write_doc_tables(Path(doc), Path(args.markdown)) else 'unchanged'}")
            return
        summary = json.loads(Path(args.markdown).read_text())
        print(markdown_tables(summary, "selected") + "\n" + markdown_tables(summary, "last"), end="")
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
    result = run(plan, Path(args.out), device, args.seed, parallel, Path(args.results) if args.results else None, **paths,
                 report_only=args.report_only, stop_after_s=stop_after_s)
    text = json.dumps(result, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
