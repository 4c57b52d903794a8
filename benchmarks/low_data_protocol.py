"""The low-data protocol's fixed parts: the plans, the data and its splits, and what a result's key holds.

``low_data.py``'s docstring states the protocol; this module holds what it fixes before any run: which volumes train,
select and score every run (the same whatever ``--ks`` or ``--seeds``; a user's lists checked for shared volumes),
and the code and settings a result's key is hashed from. The arms and contrasts are in ``low_data_arms``.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from components import atomic_write, sha256_file
from components.config.running import run_config_files
from components.data import synthetic
from components.demo.recipes import CT_BUNDLE, DINO_BUNDLE, MIM_BUNDLE, SSL_BUNDLE, DemoBudget
from components.release.origin import PACKAGE_DIR, source_digest
from components.demo.runner import BUNDLES_DIR
from low_data_arms import DEFAULT_ARMS

REPO = Path(__file__).resolve().parents[1]
# the configs each bundle run of the protocol reads (--config_file): the finetuning trains and then evaluates
BUNDLE_CONFIGS = {CT_BUNDLE: ("train.json", "evaluate.json"), SSL_BUNDLE: ("train.json",), DINO_BUNDLE: ("train.json",),
                  MIM_BUNDLE: ("train.json",)}  # fmt: skip
HELD_OUT_SETS = ("in_domain", "shifted")
MODELS = ("selected", "last")
SHIFTED_SEED_OFFSET = 7919  # the shifted held-out subjects: another seed than the labeled and unlabeled sets


# the groups of a user's volumes that must not share one (by path or content): what validates or is held out is
# neither pretrained on nor in another held-out set, and no training volume is held out
DISJOINT = (("val", "corpus"), ("held", "corpus"), ("shifted", "corpus"), ("pool", "shifted"), ("val", "shifted"),
            ("held", "shifted"), ("pool", "val"), ("pool", "held"), ("val", "held"))  # fmt: skip


class DatalistError(ValueError):
    """A user's datalist that cannot serve the protocol (unreadable, missing files, too short, overlapping another):
    raised before any run, its message one line."""


#: the package's files that no process of the protocol imports (tests/test_low_data.py checks): the demo's driver, its
#: budgets, labeled-set split and steps (components.demo.run); the demo-sized runs it shares with the protocol are
#: components.demo.recipes
NOT_RUN = ("demo/run.py",)

#: the pretraining and finetuning sizes of the protocol, fixed here: the demo's defaults when the protocol was fixed,
#: written out so that tuning the demo (components.demo.run.BUDGETS) leaves the protocol as it is
PROTOCOL_BUDGET = DemoBudget(num_labeled=10, num_unlabeled=48, ssl_epochs=12, ssl_batch=2, ssl_learning_rate=4e-4,
                             ssl_warmup_iterations=20, finetune_epochs=70, finetune_crops=1, finetune_learning_rate=3e-3,
                             val_interval=10, feature_size=12)  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """The protocol's sizes (the defaults are the CPU plan's). ``pool_size`` fixes the candidate pool (so the pools do
    not depend on ``ks``); seeds 0 to ``min_seeds`` - 1 run at every k, more are added at ``narrow_ks`` up to
    ``max_seeds`` while a paired t-interval there is wider than ``target_half_width``; ``finetune_iterations`` and
    ``val_every`` must be multiples of every k (one volume per iteration: k iterations make an epoch);
    ``rankme_crops`` is the number of crops every RankMe is computed on; ``budget`` sizes the pretraining (and the
    demo's finetuning settings: crop, feature size, learning rate)."""

    ks: tuple[int, ...] = (1, 2)
    pool_size: int = 8
    num_in_domain: int = 4
    num_shifted: int = 4
    min_seeds: int = 9
    max_seeds: int = 9
    narrow_ks: tuple[int, ...] = (1, 2)
    target_half_width: float = 0.03
    finetune_iterations: int = 200
    val_every: int = 40
    rankme_crops: int = 256
    budget: DemoBudget = PROTOCOL_BUDGET
    arms: tuple[str, ...] = DEFAULT_ARMS
    pretrain_overrides: dict = field(default_factory=dict)
    finetune_overrides: dict = field(default_factory=dict)


PLANS = {
    # a 2-vCPU VM, about 3 h of its 6 (low_data.py's docstring): 8 arms x k = 1, 2 x seeds 0-8, two runs side by side
    "cpu": Plan(),
    # one GPU: seeds added up to 20 where the t-interval is wide, a longer budget and k up to 8
    "cuda": Plan(ks=(1, 2, 4, 8), max_seeds=20, finetune_iterations=400,
                 budget=replace(PROTOCOL_BUDGET, num_unlabeled=64, ssl_epochs=60, ssl_batch=4, finetune_crops=2)),
    "small": Plan(ks=(1,), pool_size=2, num_in_domain=1, num_shifted=1, min_seeds=1, max_seeds=1, finetune_iterations=2,
                  val_every=1, rankme_crops=8, budget=replace(PROTOCOL_BUDGET, num_unlabeled=6, ssl_epochs=1)),
}  # fmt: skip


def digest(value: Any) -> str:
    """A short sha256 of a JSON-able value (keys sorted): the key of a result."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def code_state(package_dir: Path = PACKAGE_DIR) -> dict:
    """The code the runs execute besides their settings: the ``components`` package's source digest
    (:func:`components.release.origin.source_digest`) less :data:`NOT_RUN`, and the sha256 of every bundle config a
    run of the protocol reads (:data:`BUNDLE_CONFIGS`, with the shared config a train.json is read with). Part of
    every result's key (:func:`run_code`), so that a changed loss, recipe or config never reuses a record of the code
    before."""
    files = [(bundle, f) for bundle, names in BUNDLE_CONFIGS.items() for f in run_config_files(BUNDLES_DIR / bundle, names)]
    return {"components": source_digest(package_dir, exclude=NOT_RUN),
            "configs": {f"{bundle}/{path.name}": sha256_file(path) for bundle, path in files}}


def run_code(code: dict, bundle: str) -> dict:
    """What of :func:`code_state` a run of ``bundle`` executes: the package's digest and that bundle's configs."""
    return {"components": code["components"], "configs": {k: v for k, v in code["configs"].items() if k.startswith(f"{bundle}/")}}


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


def synthetic_sets(root: Path, seed: int, labeled: int, shifted: int, unlabeled: int) -> tuple[list[dict], list[dict]]:
    """Synthesises ``labeled`` labeled, ``shifted`` shifted (at least 3) and ``unlabeled`` unlabeled volumes under
    ``root`` (skipped when a manifest of the same sizes exists: the generator is deterministic); returns the labeled and
    the shifted subjects, in order, their paths relative to ``root``. The unlabeled corpus is ``root/unlabeled``."""
    root.mkdir(parents=True, exist_ok=True)
    sizes = {"labeled": labeled, "shifted": max(3, shifted), "unlabeled": unlabeled, "seed": seed,
             "organs": list(synthetic.DEMO_ORGANS)}  # fmt: skip
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

    return items("labeled"), items("shifted")


def synthetic_data(root: Path, plan: Plan, seed: int) -> Data:
    """Protocol 2's sets (:func:`synthetic_sets`) and splits by index: the first ``pool_size`` labeled subjects are the
    pool, the next one validates, the rest are the in-domain held-out set."""
    labeled, shifted = synthetic_sets(root, seed, plan.pool_size + 1 + plan.num_in_domain, plan.num_shifted, plan.budget.num_unlabeled)
    pool_end = plan.pool_size
    return Data(root, labeled[:pool_end], labeled[pool_end : pool_end + 1], labeled[pool_end + 1 :],
                shifted[: plan.num_shifted], ["background", *synthetic.DEMO_ORGANS], root / "unlabeled" / "dataset.json")  # fmt: skip


def _entries(datalist: Path, require_label: bool) -> list[dict]:
    """Every entry of a Decathlon-style datalist (``training``, ``validation``, ``test``; MSD's test lists of plain
    path strings included) with absolute paths; with ``require_label`` only entries with a label."""
    try:
        content = json.loads(datalist.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise DatalistError(f"datalist {str(datalist)!r} cannot be read as JSON: {err}") from err
    out = []
    for key in ("training", "validation", "test"):
        for item in content.get(key, []):
            item = {"image": item} if isinstance(item, str) else dict(item)
            if "image" not in item or (require_label and "label" not in item):
                continue
            out.append({k: str((datalist.parent / v).resolve()) for k, v in item.items() if k in ("image", "label")})
    missing = [p for item in out for p in item.values() if not Path(p).exists()]
    if missing:
        raise DatalistError(f"datalist {str(datalist)!r} names {len(missing)} missing files, e.g. {missing[0]!r}.")
    return out


def user_data(
    root: Path, plan: Any, seed: int, labeled: Path, unlabeled: Path, shifted: Path | None,
    sizes: tuple[int, int, int] | None = None, shifted_size: int | None = None,
) -> Data:
    """The protocol on a user's datalists. The labeled entries (every list, those with a label) are permuted by
    ``seed``: the first ``num_in_domain`` are the in-domain held-out set, the next one validates, the rest (at most
    ``pool_size``) are the pool; ``shifted`` entries are the shifted held-out set (none without it). The unlabeled
    corpus (every entry of every list) is split 85/15 into the pretraining bundles' training and validation lists.
    ``sizes`` (protocol v3): (in-domain, validation, training pool) volumes instead of the plan's, all needed;
    ``shifted_size``: that many shifted entries, drawn by ``seed``, all needed.

    Raises:
        DatalistError: a list that cannot be read, names missing files, or is too short for the plan; a validation or
            held-out volume that the unlabeled corpus or the shifted list also holds, or a pool volume in the shifted
            list, by path or content (:func:`check_disjoint`). Before any run starts.
    """
    entries = _entries(labeled, require_label=True)
    num_in, num_val, pool_size = sizes or (plan.num_in_domain, 1, plan.pool_size)
    needed = num_in + num_val + (pool_size if sizes else max(plan.ks))
    if len(entries) < needed:
        what = (f"{num_in} in-domain, {num_val} for validation, {pool_size} to train" if sizes else
                f"{num_in} held out, 1 for validation, k up to {max(plan.ks)}")  # fmt: skip
        raise DatalistError(f"--labeled {str(labeled)!r} has {len(entries)} labeled volumes; the plan needs at least "
                            f"{needed} ({what}).")  # fmt: skip
    order = np.random.default_rng([seed, 1]).permutation(len(entries))
    entries = [entries[i] for i in order]
    held, val, pool = entries[:num_in], entries[num_in : num_in + num_val], entries[num_in + num_val :]
    corpus = _entries(unlabeled, require_label=False)
    if len(corpus) < 2:
        raise DatalistError(f"--unlabeled {str(unlabeled)!r} has {len(corpus)} images; pretraining needs at least 2.")
    corpus = [{"image": item["image"]} for item in corpus]
    other_site = _entries(shifted, True) if shifted else []
    if shifted_size is not None:
        if len(other_site) < shifted_size:
            raise DatalistError(f"--shifted {str(shifted)!r} has {len(other_site)} labeled volumes; the plan needs {shifted_size}.")
        other_site = [other_site[i] for i in np.random.default_rng([seed, 3]).permutation(len(other_site))[:shifted_size]]
    pool = pool[:pool_size]
    lists = {"pool": f"--labeled {str(labeled)!r} (training pool)", "val": f"--labeled {str(labeled)!r} (validation)",
             "held": f"--labeled {str(labeled)!r} (in-domain held-out)", "shifted": f"--shifted {str(shifted)!r}",
             "corpus": f"--unlabeled {str(unlabeled)!r}"}  # fmt: skip
    images = {name: [item["image"] for item in items] for name, items in
              (("pool", pool), ("val", val), ("held", held), ("shifted", other_site), ("corpus", corpus))}  # fmt: skip
    check_disjoint({lists[name]: paths for name, paths in images.items()},
                   [(lists[a], lists[b]) for a, b in DISJOINT if images[a] and images[b]])  # fmt: skip
    order = np.random.default_rng([seed, 2]).permutation(len(corpus))
    num_val = max(1, round(0.15 * len(corpus)))
    root.mkdir(parents=True, exist_ok=True)
    pretraining = root / "unlabeled.json"
    pretraining.write_text(json.dumps({"training": [corpus[i] for i in order[num_val:]],
                                       "validation": [corpus[i] for i in order[:num_val]]}, indent=2) + "\n")  # fmt: skip
    names = json.loads(labeled.read_text()).get("labels")
    if not isinstance(names, dict) or not names:
        raise DatalistError(f"--labeled {str(labeled)!r} has no 'labels' dict (e.g. {{\"0\": \"background\", \"1\": \"liver\"}}).")
    label_names = [names[k] for k in sorted(names, key=int)]
    return Data(root, pool, val, held, other_site, label_names, pretraining)


def check_disjoint(groups: dict[str, list[str]], pairs: list[tuple[str, str]]) -> None:
    """Raises :class:`DatalistError`, one line naming both groups and the file, for the first volume two groups of
    ``pairs`` share: the same path, or two files of the same content (sha256; only files of equal size are read).

    Example: ``check_disjoint({"a": ["x.nii.gz"], "b": ["y.nii.gz"]}, [("a", "b")])`` passes unless the two files hold
    the same bytes.
    """
    digests: dict[str, str] = {}

    def sha(path: str) -> str:
        if path not in digests:
            digests[path] = sha256_file(Path(path))
        return digests[path]

    for first, second in pairs:
        same_path = sorted(set(groups[first]) & set(groups[second]))
        if same_path:
            raise DatalistError(f"{first} and {second} share a volume: {same_path[0]}.")
        by_size: dict[int, list[str]] = {}
        for path in groups[second]:
            by_size.setdefault(os.path.getsize(path), []).append(path)
        for path in groups[first]:
            for other in by_size.get(os.path.getsize(path), []):
                if sha(path) == sha(other):
                    raise DatalistError(f"{first} and {second} share a volume: {path} and {other} have the same content "
                                        f"(sha256 {sha(path)[:16]}...).")  # fmt: skip


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
        write_text(path, text)
    return path


def write_text(path: Path, text: str) -> None:
    """Writes ``text`` atomically: a reader sees the old file or the new one, never a part."""
    with atomic_write(path, "w") as f:
        f.write(text)


def write_json(path: Path, value: Any) -> None:
    """Writes ``value`` as indented JSON, atomically."""
    write_text(path, json.dumps(value, indent=2) + "\n")
