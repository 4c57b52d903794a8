"""Do two revisions train the same weights? Tiny SSL, self-distillation, masked image and BTCV runs, bit for bit.

A refactor that should not change behaviour (moving modules, regrouping config ids) is checked here: every
bundle below trains for a few iterations on the same synthetic CT, once with the code and configs of ``--before``
(exported with ``git archive``) and once with this checkout, and every tensor of every file the runs write under
``models/`` (the model, and the resumable checkpoint with its optimizer and schedule) is compared with
``torch.equal``. Prints JSON; exits 1 when anything differs.

Overrides are written in this checkout's config ids. For a revision from before the config ids were grouped
(``--loader#num_workers`` was ``--num_workers``), an override ``group#member`` is sent as ``member`` when the
``--before`` config has ``member`` as a top-level id, and the checkpointing group's members by their old names
(``ckpt_time_interval_s``, ...); an id a later release moved (``components.config.overrides.MOVED_IDS``, e.g.
``network_def#upsample``, 0.4.0's ``speed#upsample``) is sent by the name the ``--before`` config has. Each side runs
its own bundle's command line: a bundle with the shared ``configs/common.json`` reads it first.

Example::

    python benchmarks/bit_identity.py --before 8b6ac06 --json benchmarks/results/bit_identity.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from monai.bundle import ConfigParser  # noqa: E402

from components.config.overrides import MOVED_IDS  # noqa: E402
from components.config.running import run_config_files  # noqa: E402
from components.demo.runner import bundle_command  # noqa: E402

#: old top-level names of the checkpointing group's members
OLD_NAMES = {
    "checkpointing#iteration_interval": "ckpt_iteration_interval",
    "checkpointing#epoch_interval": "ckpt_epoch_interval",
    "checkpointing#time_interval_s": "ckpt_time_interval_s",
}

_COMMON = {
    "device": "cpu",
    "feature_size": 12,
    "batch_size": 1,
    "max_epochs": 2,
    "network_def#window_size": 4,
    "loader#num_workers": 0,
    "speed#amp": False,
    "speed#use_checkpoint": False,
    "training#log_interval": 1,
    "training#val_interval": 1,
    "checkpointing#iteration_interval": 1,
}

#: bundle -> its tiny run (this checkout's ids)
RUNS: dict[str, dict] = {
    "swin_unetr_ssl_pretrain": {**_COMMON, "roi_size": [64, 32, 32], "training#num_samples": 1, "training#warmup_iterations": 2},
    "swin_unetr_dino_pretrain": {
        **_COMMON,
        "batch_size": 2,  # KoLeo needs a neighbour for every volume
        "roi_size": [32, 32, 32],
        "training#context_size": [48, 48, 48],
        "training#local_size": [32, 32, 32],
        "training#num_local_crops": 1,
        "training#prototypes": 32,
        "training#head_hidden_dim": 24,
        "training#head_bottleneck_dim": 8,
        "training#warmup_epochs": 1,
        "training#teacher_temperature_warmup_epochs": 1,
    },
    "swin_unetr_mim_pretrain": {**_COMMON, "roi_size": [64, 32, 32], "training#num_samples": 1, "training#warmup_iterations": 2,
                                "training#rankme_crops": 8},
    "swin_unetr_btcv_finetune": {**_COMMON, "roi_size": [64, 32, 32], "spacing": [3.0, 3.0, 4.0], "training#num_samples": 1},
}


def _export(revision: str, dest: Path) -> Path:
    """The tree of ``revision`` under ``dest`` (``git archive``; no worktree left registered)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", revision], check=True, capture_output=True).stdout
    dest.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def _defined(config: dict, key: str) -> bool:
    """Whether ``config`` has the id ``key`` (``group#member`` at any depth)."""
    node = config
    for part in key.split("#"):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _spelled_for(overrides: dict, config: dict) -> dict:
    """``overrides`` in the ids of ``config`` (the configs of a run that may predate the grouped or moved ids)."""
    moved_from = {new: old for old, new in MOVED_IDS.items()}
    spelled = {}
    for key, value in overrides.items():
        group, _, member = key.partition("#")
        if key in OLD_NAMES and OLD_NAMES[key] in config:
            key = OLD_NAMES[key]
        elif key in moved_from and not _defined(config, key) and _defined(config, moved_from[key]):
            key = moved_from[key]
        elif member in config and (group not in config or group == "network_def"):  # a knob that was top-level
            key = member
        spelled[key] = value
    return spelled


def _train(tree: Path, bundle: str, data: Path, work: Path, overrides: dict) -> tuple[Path, float]:
    """One tiny run of ``bundle`` from ``tree``; returns its ``models/`` folder."""
    root = work / bundle
    shutil.copytree(tree / "bundles" / bundle, root, ignore=shutil.ignore_patterns("models", "eval", "data"))
    config = ConfigParser.load_config_files([str(f) for f in run_config_files(root, ["train.json"])])
    spelled = _spelled_for({"bundle_root": str(root), "dataset_dir": str(data), **overrides}, config)
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    log = work / f"{bundle}.log"
    with log.open("w") as out:
        code = subprocess.run(bundle_command(root, ("train.json",), spelled), cwd=root, env=env, stdout=out,
                              stderr=subprocess.STDOUT).returncode  # fmt: skip
    if code != 0:
        lines = log.read_text().splitlines()
        errors = [line for line in lines if "Error" in line and not line.startswith(" ")]
        raise RuntimeError(f"{bundle} failed in {tree} (exit {code}):\n" + "\n".join(errors[:5] + lines[-15:]))
    return root / "models"


def _tensors(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a nested checkpoint, by its path."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list | tuple) else ()
    found = {}
    for key, value in items:
        found.update(_tensors(value, f"{prefix}/{key}" if prefix else str(key)))
    return found


def compare_models(before: Path, after: Path) -> dict:
    """Per file under ``models/``: tensors compared, how many differ, and files only one side wrote."""
    names = sorted({p.name for p in before.glob("*.pt")} | {p.name for p in after.glob("*.pt")})
    files = {}
    for name in names:
        if not (before / name).is_file() or not (after / name).is_file():
            files[name] = {"only_in": "before" if (before / name).is_file() else "after"}
            continue
        a = _tensors(torch.load(before / name, map_location="cpu", weights_only=True))
        b = _tensors(torch.load(after / name, map_location="cpu", weights_only=True))
        differ = sorted(k for k in a.keys() & b.keys() if a[k].shape != b[k].shape or not torch.equal(a[k], b[k]))
        files[name] = {"tensors": len(a), "differ": differ, "missing": sorted(a.keys() ^ b.keys())}
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the revision to compare with (e.g. the commit before a refactor)")
    parser.add_argument("--bundles", nargs="+", choices=list(RUNS), default=list(RUNS))
    parser.add_argument("--json", default=None, help="also write the result to this file")
    args = parser.parse_args()
    after_rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "components", "bundles"],
                                capture_output=True, text=True).stdout.strip())  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        before_tree = _export(args.before, tmp / "before_tree")
        data = tmp / "data" / "ct"
        subprocess.run([sys.executable, "-m", "components", "synth", "--kind", "ct", "--num", "4", "--out", str(data)],
                       check=True, cwd=REPO, capture_output=True)  # fmt: skip
        results = {}
        for bundle in args.bundles:
            models = {side: _train(tree, bundle, data, tmp / side, RUNS[bundle])
                      for side, tree in (("before", before_tree), ("after", REPO))}  # fmt: skip
            files = compare_models(models["before"], models["after"])
            identical = bool(files) and all(not f.get("only_in") and not f["differ"] and not f["missing"] for f in files.values())
            results[bundle] = {"identical": identical, "files": files, "overrides": RUNS[bundle]}
    summary = {
        "benchmark": "bit_identity",
        "before": args.before,
        "after": after_rev + (" (with uncommitted changes)" if dirty else ""),
        "identical": all(r["identical"] for r in results.values()),
        "bundles": results,
    }
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    sys.exit(0 if summary["identical"] else 1)


if __name__ == "__main__":
    main()
