"""What the four data modes (``loader#cache`` full, smart, none, disk) cost as the corpus grows to 5,000 CT volumes.

Seven phases, each kept under ``--work`` as it finishes (a volume, a store, a run, a recipe), so a rerun of the same
command skips what is done and a killed run continues (a work folder of an earlier version gains the phases it lacks):

1. ``corpus``: synthetic CT of ``--shape`` (default 256 x 256 x 160) int16 voxels, ``store_format.ct_volume``: a
   body-shaped ellipse of soft tissue in a fat rim, lungs, organs and a spine in Hounsfield units with scanner noise,
   air inside and -1024 outside the reconstruction circle, written as .nii.gz by ``--workers`` processes. The
   largest sizes repeat the first ``--distinct`` volumes under new names (symbolic links ``case_XXXX``). One
   datalist per size (its ``training`` list; the same ``validation`` volumes for every size) and a few labeled
   volumes for the finetuning crops (labels: the smoothed HU thresholded into spine, contrast vessel and liver).
2. ``preprocess``: ``python -m components preprocess --bundle swin_unetr_ssl_pretrain --workers W`` per size: wall
   time (process start and data check included), seconds per volume, core-seconds per volume (wall x W / volumes),
   bytes per stored volume against its .nii.gz.
3. ``memory``: the SSL bundle on 2 ranks (torchrun, gloo, CPU) per size and mode (smart keeps ``--cache_num``
   volumes per rank), with a tiny network (feature 12, window 4, one 96^3 crop per step) and no loader workers, so
   each rank is one process; ``bundle_memory.measure`` samples the process tree and ends it once the first iteration
   is logged. Per rank: peak PSS of the largest process up to the trainer's start line and through the first
   iteration; seconds from the launch to both lines. An in-memory mode runs at a size only when the estimate from
   the sizes measured before (the mode-none run at that size plus, per volume a rank caches, what the measured sizes
   showed) fits ``--memory_budget_gb`` for both ranks; otherwise that estimate is reported, marked "extrapolated".
4. ``worker_memory``: the same SSL run from the disk store with ``--loader_workers`` loader workers per rank, ended
   once iteration ``worker_iterations`` is logged (at most one epoch): per rank, the peak of the sum of PSS (and of
   RSS) over the rank and its workers (``bundle_memory``: forked workers share pages with their rank, which PSS
   splits between them and RSS counts in each).
5. ``crops``: crops per second of one loader worker (one process, one torch thread) for each recipe's training views,
   from the bundle's in-memory cache and from its disk store, alternating, with the same random state (the same
   crops): SSL and masked-image (``RandCompactSpatialCropSamplesd``, 2 crops of 96^3 per volume), self-distillation
   (its ``training#context_size`` crop), BTCV finetuning (its random transforms on labeled volumes; from disk its
   label-centred crops drawn from the stored foreground locations, ``StoreRandCropByPosNegLabeld``); a recipe's store
   is written first where there is none or where it answers other transforms, format or package versions. Warm:
   after a first pass the files are in the page cache and the store's per-process cache of opened arrays holds every
   volume; the bytes read from storage during the timed passes are recorded (``/proc/self/io``).
6. ``cold``: the same crops from the disk store with the per-process cache of opened arrays missing (the store's
   ``OPEN_ARRAYS`` set to 0: every item opens its file and checks the CRC-32 of its chunks anew, as at 100,000
   volumes where that cache never hits), first with the store's files evicted from the page cache before the pass
   (``page_cache.drop_page_cache``: fsync and ``posix_fadvise(POSIX_FADV_DONTNEED)`` per file, no root needed; the
   bytes still resident afterwards are counted with ``mincore``), then again with the page cache warm, against the
   in-memory cache in the same round (``cold_rounds`` rounds); then as many rounds with the opened arrays kept,
   against memory in those rounds. All in one new process per recipe; the bytes read from storage per item against
   the stored bytes per volume.
7. ``workers``: loader workers one GPU needs = batch x crops per volume / GPU step time / crops per second of one
   worker (warm, and cold where phase 6 ran); the step times come from ``--gpu_step_ms``
   (``benchmarks/gpu_check.py`` measures them) or, without them, a table for 100, 200 and 400 ms steps, and whether
   16 cores per GPU (15 workers and the training process) suffice.

Goals, reported against: memory per rank with the disk store flat within 10 % from the smallest to the largest
size; the first iteration within 10 s of the launch at every size (disk); disk at least 0.8x the in-memory crops per
second of one worker, warm and cold.

    nice python benchmarks/data_scale.py --work /work/bench-data/data_scale      # sizes 100, 1,000, 5,000
    nice python benchmarks/data_scale.py --work /work/bench-data/data_scale_100 --sizes 100 --redo crops cold \
        --out benchmarks/results/data_scale_100.json       # the crop phases again, the other phases' records kept
    python benchmarks/data_scale.py --small --work /tmp/data_scale_small         # CI: 64x64x48, sizes 4 and 8
    python benchmarks/data_scale.py --markdown benchmarks/results/data_scale.json [--write_docs benchmarks/README.md]
    python benchmarks/data_scale.py --sizing PREPROCESS_RESULT STORE_RESULT benchmarks/results/index_scale.json \
        [--write_docs docs/scale.md]

Prints one JSON object (the machine, the commit, the settings, the load average before each timed step, and
``--caveat`` when given) and writes it to ``--out`` (default ``benchmarks/results/data_scale.json``; with ``--small``
only when given). ``--sizing`` prints the sizing table: preprocessing time from one result (a machine without other
jobs), the store's bytes, memory per rank with loader workers and cold crop rates from another (this version), and
what a rank's datalist and index shard add at N volumes from ``benchmarks/index_scale.py``'s result.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import psutil

from bundle_memory import measure
from data_scale_tables import markdown_tables, sizing_table, write_doc_sizing, write_doc_tables
from machine import bundle_parser, git_commit, machine_info, write_result
from page_cache import MECHANISM, drop_page_cache, mapped_files, read_bytes, resident_bytes, storage, store_files
from store_format import _nii_gz_bytes, ct_volume

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from components import atomic_write, open_store  # noqa: E402

RESULT = REPO / "benchmarks" / "results" / "data_scale.json"
SSL = "swin_unetr_ssl_pretrain"
MODES = ("none", "disk", "smart", "full")  # the cache-less runs of a size first: the in-memory estimates start there
IN_MEMORY = ("smart", "full")
RECIPES = {"ssl": SSL, "dino": "swin_unetr_dino_pretrain", "finetune": "swin_unetr_btcv_finetune"}
GOALS = {"disk_memory_flat_within": 0.10, "disk_first_iteration_s": 10.0, "disk_over_memory_crops_per_s": 0.8}
STEP_MS = (100, 200, 400)
REDO = ("crops", "cold")
"""Phases ``--redo`` measures again on a work folder's corpus and stores (a crops store of an earlier format is
written again)."""
CORES_PER_GPU = 16
# the network is not what phase 3 measures: small, one crop per step, no mixed precision on the CPU
TINY_NETWORK = {"feature_size": 12, "network_def#window_size": 4, "batch_size": 1, "training#num_samples": 1,
                "speed#amp": False, "device": "cpu"}  # fmt: skip


@dataclass(frozen=True)
class Settings:
    """What a run measures; a work folder holds the phases of one set of settings."""

    sizes: tuple[int, ...] = (100, 1000, 5000)
    distinct: int = 1000
    shape: tuple[int, int, int] = (256, 256, 160)
    validation: int = 2
    labeled: int = 4
    crop_volumes: int = 8
    crop_rounds: int = 5
    cold_rounds: int = 20
    roi_size: tuple[int, int, int] = (96, 96, 96)
    cache_num: int = 32
    world_size: int = 2
    loader_workers: int = 4
    worker_iterations: int = 20
    workers: int = field(default_factory=lambda: os.cpu_count() or 1)
    memory_budget_gb: float = field(default_factory=lambda: round(0.75 * psutil.virtual_memory().total / 2**30, 1))
    run_timeout_s: float = 3600.0
    recipe_overrides: dict = field(default_factory=lambda: {recipe: {} for recipe in RECIPES})


SMALL = Settings(
    sizes=(4, 8), distinct=4, shape=(64, 64, 48), labeled=2, crop_volumes=2, crop_rounds=1, cold_rounds=2,
    roi_size=(64, 32, 32), cache_num=2, workers=2, loader_workers=2, worker_iterations=3, memory_budget_gb=0.0,
    run_timeout_s=300.0,
    recipe_overrides={"ssl": {"roi_size": [64, 32, 32]}, "finetune": {"roi_size": [64, 32, 32]},
                      "dino": {"roi_size": [32, 32, 32], "training#context_size": [48, 48, 48]}},
)  # fmt: skip
"""CI: seconds per phase; a memory budget of 0 measures the in-memory modes at the first size only and extrapolates."""


def _load() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def _write_json(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path, "w") as f:
        f.write(json.dumps(record, indent=1) + "\n")


def kept(path: Path, compute: Callable[[], dict], redo: bool = False) -> dict:
    """The record a previous run left at ``path``, else (or with ``redo``) ``compute()``'s, kept there (with the
    commit) for the next; one line on stderr either way."""
    name = path.relative_to(path.parents[1]).with_suffix("").as_posix()
    if path.is_file() and not redo:
        print(f"data_scale: {name}: kept from an earlier run", file=sys.stderr, flush=True)
        return json.loads(path.read_text())
    start = time.perf_counter()
    record = {**compute(), "commit": git_commit()}
    _write_json(path, record)
    print(f"data_scale: {name}: done in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return record


def _env() -> dict:
    """The environment of the measured commands: this checkout's ``components`` first on the path."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}


# ----------------------------------------------------------------------------------------------------------- corpus


def labeled_ct(shape: tuple[int, int, int], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A CT volume (``ct_volume``) and its uint8 labels: 1 spine, 2 contrast vessel, 3 liver, by thresholds of the HU
    averaged over 5^3 voxels (the noise averaged out; the organs are 20 HU and more apart)."""
    from scipy.ndimage import uniform_filter

    image = ct_volume(shape, seed)
    smooth = uniform_filter(image.astype(np.float32), size=5)
    label = np.zeros(shape, np.uint8)
    label[(smooth > 50) & (smooth <= 100)] = 3
    label[(smooth > 100) & (smooth <= 400)] = 2
    label[smooth > 400] = 1
    return image, label


def _write_case(task: tuple[tuple[int, int, int], int, str, str | None]) -> None:
    """Writes one volume (and its labels when a label path is given), each file atomically, in a worker process."""
    shape, seed, image_path, label_path = task
    arrays = labeled_ct(shape, seed) if label_path else (ct_volume(shape, seed),)
    for array, path in zip(arrays, (image_path, label_path)):
        temporary = Path(path).with_name(f".{Path(path).name.removesuffix('.nii.gz')}.tmp.nii.gz")
        _nii_gz_bytes(array, temporary)
        os.replace(temporary, path)


def corpus_tasks(settings: Settings, root: Path) -> list[tuple]:
    """Every file the corpus holds, as ``_write_case`` tasks: training, validation and labeled volumes (own seeds)."""
    shape = tuple(settings.shape)
    tasks = [(shape, i, str(root / "images" / f"case_{i:04d}.nii.gz"), None) for i in range(settings.distinct)]
    tasks += [(shape, 10**6 + i, str(root / "validation" / f"val_{i:02d}.nii.gz"), None)
              for i in range(settings.validation)]  # fmt: skip
    tasks += [(shape, 2 * 10**6 + i, str(root / "labeled" / f"image_{i:02d}.nii.gz"),
               str(root / "labeled" / f"label_{i:02d}.nii.gz")) for i in range(settings.labeled)]  # fmt: skip
    return tasks


def _datalists(settings: Settings, root: Path) -> None:
    """Links ``case_XXXX`` beyond the distinct volumes and writes ``datalist_<size>.json`` and ``labeled.json``."""
    for i in range(settings.distinct, max(settings.sizes)):
        link = root / "images" / f"case_{i:04d}.nii.gz"
        if not link.is_symlink():
            link.symlink_to(f"case_{i % settings.distinct:04d}.nii.gz")
    validation = [{"image": f"validation/val_{i:02d}.nii.gz"} for i in range(settings.validation)]
    for size in settings.sizes:
        training = [{"image": f"images/case_{i:04d}.nii.gz"} for i in range(size)]
        _write_json(root / f"datalist_{size}.json", {"training": training, "validation": validation})
    labeled = [{"image": f"labeled/image_{i:02d}.nii.gz", "label": f"labeled/label_{i:02d}.nii.gz"}
               for i in range(settings.labeled)]  # fmt: skip
    _write_json(root / "labeled.json", {"training": labeled, "validation": []})


def write_corpus(settings: Settings, root: Path) -> dict:
    """Phase 1: writes the files not there yet in parallel processes, links and datalists."""
    for folder in ("images", "validation", "labeled"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    tasks = corpus_tasks(settings, root)
    missing = [t for t in tasks if not all(Path(p).is_file() for p in t[2:] if p)]
    load, start = _load(), time.perf_counter()
    if missing:  # spawned, not forked: a fork of a process that runs torch's threads can deadlock
        with ProcessPoolExecutor(min(settings.workers, len(missing)), mp_context=get_context("spawn")) as pool:
            list(pool.map(_write_case, missing))
    seconds = time.perf_counter() - start
    _datalists(settings, root)
    sizes = [os.path.getsize(t[2]) for t in tasks[: settings.distinct]]
    return {"distinct_volumes": settings.distinct, "linked_volumes": max(0, max(settings.sizes) - settings.distinct),
            "validation_volumes": settings.validation, "labeled_volumes": settings.labeled,
            "shape": list(settings.shape), "dtype": "int16", "nii_gz_bytes_per_volume": round(float(np.mean(sizes))),
            "written_now": len(missing), "seconds": round(seconds, 1), "workers": settings.workers,
            "load_avg_before": load}  # fmt: skip


# ------------------------------------------------------------------------------------------------------- preprocess


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def preprocess_size(settings: Settings, corpus: Path, store: Path, size: int) -> dict:
    """Phase 2 at one size: the preprocess command's wall time and the store's bytes against the .nii.gz files."""
    cmd = [sys.executable, "-m", "components", "preprocess", "--datalist", str(corpus / f"datalist_{size}.json"),
           "--out", str(store), "--bundle", SSL, "--workers", str(settings.workers),
           "--overrides", json.dumps({"roi_size": list(settings.roi_size)})]  # fmt: skip
    load, start = _load(), time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"preprocess of {size} volumes failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    written, reused = map(int, re.search(r"(\d+) written, (\d+) already there", proc.stdout).groups())
    entries = open_store(store).entries
    stored = [_folder_bytes(store / "volumes" / e["id"]) for e in entries]
    training = json.loads((corpus / f"datalist_{size}.json").read_text())["training"]
    nii = [os.path.getsize(corpus / item["image"]) for item in training]  # a link: its target's bytes
    return {"volumes": len(entries), "written": written, "reused": reused, "workers": settings.workers,
            "wall_s": round(wall, 1), "s_per_volume": round(wall / max(written, 1), 3),
            "core_s_per_volume": round(wall * settings.workers / max(written, 1), 3),
            "store_bytes_per_volume": round(float(np.mean(stored))),
            "nii_gz_bytes_per_volume": round(float(np.mean(nii))),
            "store_over_nii_gz": round(sum(stored) / sum(nii), 3), "store_total_bytes": _folder_bytes(store),
            "load_avg_before": load}  # fmt: skip


# ----------------------------------------------------------------------------------------------------------- memory


def cached_per_rank(settings: Settings, mode: str, size: int) -> int:
    """Volumes one rank holds in memory in ``mode``: its shard (full), ``cache_num`` of it (smart), none otherwise."""
    shard = math.ceil(size / settings.world_size)
    return {"full": shard, "smart": min(settings.cache_num, shard)}.get(mode, 0)


MEASURES = ("peak_rank_pss_gb", "peak_rank_pss_gb_at_start_line", "start_line_s", "first_iteration_s")


def estimate(settings: Settings, mode: str, size: int, runs: dict[int, dict]) -> dict | None:
    """The linear estimate of an in-memory ``mode`` at ``size`` from the sizes measured before: the mode-none run at
    ``size`` plus, per volume a rank caches, the excess over mode none that the measured sizes showed (least squares
    through the origin); None when no size was measured yet."""
    done = [s for s in runs if s < size and runs[s][mode]["status"] == "measured"]
    if not done:
        return None
    cached = [cached_per_rank(settings, mode, s) for s in done]
    out = {"from_sizes": done}
    for key in MEASURES:
        excess = [runs[s][mode][key] - runs[s]["none"][key] for s in done]
        slope = sum(c * e for c, e in zip(cached, excess)) / max(sum(c * c for c in cached), 1)
        out[key] = round(runs[size]["none"][key] + slope * cached_per_rank(settings, mode, size), 3)
    return out


def bundle_run_command(settings: Settings, corpus: Path, store: Path, size: int, mode: str, run_dir: Path,
                       loader_workers: int = 0) -> list[str]:  # fmt: skip
    """The torchrun command of the SSL bundle (``train.json`` + ``multi_gpu_train.json``) for one size and mode, with
    ``loader_workers`` loader workers per rank (each iteration logged when there are any)."""
    from components.demo.runner import bundle_command

    overrides = {**TINY_NETWORK, "datalist": str(corpus / f"datalist_{size}.json"), "roi_size": list(settings.roi_size),
                 "loader#num_workers": loader_workers, "loader#cache": mode, "max_epochs": 1,
                 "ckpt_dir": str(run_dir / "models"), "output_dir": str(run_dir / "eval"),
                 **({"training#log_interval": 1} if loader_workers else {}),
                 **({"loader#cache_num": settings.cache_num} if mode == "smart" else {}),
                 **({"loader#store": str(store)} if mode == "disk" else {})}  # fmt: skip
    bundle = bundle_command(SSL, ("train.json", "multi_gpu_train.json"), overrides)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
            f"--nproc_per_node={settings.world_size}", *bundle[1:]]  # fmt: skip


def memory_run(settings: Settings, cmd: list[str], run_dir: Path, cached: int, iterations: int | None = None) -> dict:
    """Phases 3 and 4, one measured run: launched, sampled and ended at its first iteration, or at iteration
    ``iterations`` (its process tree stopped)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    load = _load()
    stop_at = "first_iteration" if iterations is None else "iterations"
    result = measure(cmd, interval=0.2, cwd=str(run_dir), stop_at=stop_at, timeout=settings.run_timeout_s, env=_env(),
                     iterations=iterations or 1)  # fmt: skip
    shutil.rmtree(run_dir, ignore_errors=True)
    if result["stopped"] != stop_at or result["left_running"]:
        raise RuntimeError(f"no {stop_at.replace('_', ' ')} (exit {result['exit_code']}, stopped: {result['stopped']}, "
                           f"{result['left_running']} process(es) left): {' '.join(cmd)}\n"
                           f"{result['output_tail']}")  # fmt: skip
    record = {"status": "measured", "peak_rank_pss_gb": result["peak_process_pss_gb"],
              "peak_rank_pss_gb_at_start_line": result["peak_process_pss_gb_at_start_line"],
              "peak_rank_rss_gb": result["peak_process_rss_gb"], "peak_tree_pss_gb": result["peak_tree_pss_gb"],
              "peak_rank_tree_pss_gb": result["peak_rank_tree_pss_gb"],
              "peak_rank_tree_rss_gb": result["peak_rank_tree_rss_gb"],
              "rank_tree_processes": result["rank_tree_processes"],
              "start_line_s": result["start_line_s"], "first_iteration_s": result["first_iteration_s"],
              "cached_volumes_per_rank": cached, "left_running": result["left_running"],
              "load_avg_before": load}  # fmt: skip
    if iterations is not None:
        record.update(iterations=iterations, iterations_s=result["iterations_s"])
    return record


def memory_phase(settings: Settings, work: Path) -> dict:
    """Phase 3: every size and mode, measured, or extrapolated where the estimate does not fit the budget."""
    runs: dict[int, dict] = {}
    for size in settings.sizes:
        runs[size] = {}
        for mode in MODES:
            path = work / "phases" / "memory" / f"{size}_{mode}.json"
            guess = estimate(settings, mode, size, runs) if mode in IN_MEMORY else None
            cached = cached_per_rank(settings, mode, size)
            fits = guess is None or settings.world_size * guess["peak_rank_pss_gb"] <= settings.memory_budget_gb
            if fits:
                cmd = bundle_run_command(settings, work / "corpus", work / "stores" / f"ssl_{size}", size, mode,
                                         work / "runs" / f"{size}_{mode}")  # fmt: skip
                record = kept(path, lambda: memory_run(settings, cmd, work / "runs" / f"{size}_{mode}", cached))
                runs[size][mode] = {**record, **({"estimate_before": guess} if guess else {})}
            else:
                runs[size][mode] = {"status": "extrapolated", **guess, "cached_volumes_per_rank": cached,
                                    "both_ranks_gb": round(settings.world_size * guess["peak_rank_pss_gb"], 2),
                                    "budget_gb": settings.memory_budget_gb}  # fmt: skip
    return {str(size): modes for size, modes in runs.items()}


def worker_memory_phase(settings: Settings, work: Path) -> dict:
    """Phase 4: per size, the SSL bundle from the disk store with ``loader_workers`` workers per rank, through
    ``worker_iterations`` iterations (at most the epoch's): a rank's memory with its workers."""
    out = {}
    for size in settings.sizes:
        run_dir = work / "runs" / f"{size}_disk_workers"
        iterations = min(settings.worker_iterations, math.ceil(size / settings.world_size))  # batch 1: one epoch
        cmd = bundle_run_command(settings, work / "corpus", work / "stores" / f"ssl_{size}", size, "disk", run_dir,
                                 loader_workers=settings.loader_workers)  # fmt: skip
        record = kept(work / "phases" / "worker_memory" / f"{size}.json",
                      lambda: {**memory_run(settings, cmd, run_dir, 0, iterations),
                               "loader_workers": settings.loader_workers})  # fmt: skip
        out[str(size)] = record
    return out


# ------------------------------------------------------------------------------------------------------------ crops


def recipe_parser(settings: Settings, recipe: str, datalist: Path, cache: str, store: Path):
    """The recipe's bundle config (``machine.bundle_parser``) reading ``datalist``, with ``cache`` and ``store``."""
    from components.demo.runner import bundle_dir

    overrides = {"datalist": str(datalist), "device": "cpu", "loader#cache": cache, "loader#store": str(store),
                 **settings.recipe_overrides[recipe]}  # fmt: skip
    return bundle_parser(bundle_dir(RECIPES[recipe]), overrides, num_workers=0)


def _crop_datalist(settings: Settings, corpus: Path, recipe: str) -> Path:
    """The labeled list for finetuning, else the first ``crop_volumes`` distinct volumes."""
    if recipe == "finetune":
        return corpus / "labeled.json"
    path = corpus / "crops.json"
    items = [{"image": f"images/case_{i:04d}.nii.gz"} for i in range(min(settings.crop_volumes, settings.distinct))]
    _write_json(path, {"training": items, "validation": []})
    return path


def _timed_pass(dataset, seed: int) -> tuple[int, float, int | None]:
    """(crops, seconds, bytes this process read from storage meanwhile, None where not counted) of fetching every
    item of ``dataset`` once from the random state ``seed``."""
    dataset.transform.set_random_state(seed)
    read, start, crops = read_bytes(), time.perf_counter(), 0
    for index in range(len(dataset)):
        item = dataset[index]
        crops += len(item) if isinstance(item, list) else 1
    seconds, after = time.perf_counter() - start, read_bytes()
    return crops, seconds, None if read is None else after - read


def _add(total: list, timed: tuple[int, float, int | None]) -> None:
    """Adds a pass's (crops, seconds, bytes read) to ``total``; its bytes stay None once a pass was not counted."""
    total[0] += timed[0]
    total[1] += timed[1]
    total[2] = None if total[2] is None or timed[2] is None else total[2] + timed[2]


@contextmanager
def arrays_kept(count: int) -> Iterator[None]:
    """The store's per-process cache of opened arrays (its public ``OPEN_ARRAYS``) limited to ``count`` meanwhile:
    with 0, every item opens its file and checks its chunks anew, as at a corpus far larger than the cache."""
    from components.data.store import handle

    before = handle.OPEN_ARRAYS
    handle.OPEN_ARRAYS = count
    try:
        yield
    finally:
        handle.OPEN_ARRAYS = before


def _crop_sources(settings: Settings, corpus: Path, store: Path, recipe: str,
                  names: tuple[str, ...] = ("memory", "disk")) -> dict:  # fmt: skip
    """The recipe's training dataset from its in-memory cache ("memory") and from its disk store ("disk"), or those
    of ``names``; the store written first where it is not there yet."""
    from components.data.store import (StoreError, bundle_crop_size, bundle_transforms, preprocess,
                                       transforms_fingerprint)  # fmt: skip

    datalist = _crop_datalist(settings, corpus, recipe)
    parser = recipe_parser(settings, recipe, datalist, "disk", store)
    transforms = bundle_transforms(parser)
    try:  # a store of another format or package versions (written by an earlier version) is written again
        open_store(store, fingerprint=transforms_fingerprint(transforms))
    except StoreError as err:
        if (store / "index.json").is_file():
            print(f"data_scale: {store} written again: {err}", file=sys.stderr, flush=True)
        preprocess(datalist, store, transforms, workers=settings.workers, channels=parser["in_channels"],
                   patch_size=bundle_crop_size(parser), overwrite=True)  # as the preprocess command writes it
    sources = {"disk": lambda: parser, "memory": lambda: recipe_parser(settings, recipe, datalist, "full", store)}
    return {name: sources[name]().get_parsed_content("train#dataset") for name in names}


def _per_crop(total: list) -> float | None:
    return None if total[2] is None else round(total[2] / total[0])


def in_new_process(function: Callable[..., dict], *args) -> dict:
    """``function(*args)`` in a new (spawned) process, as a loader worker starts: arrays a process opened stay
    mapped while it keeps them, and mapped pages cannot be evicted from the page cache, so no store is read here."""
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


def crop_rates(settings: Settings, corpus: Path, store: Path, recipe: str) -> dict:
    """Phase 5 for one recipe (in a new process: :func:`in_new_process`): crops per second of one process from the
    in-memory cache and from the disk store, warm (files in the page cache, opened arrays kept), with the bytes read
    from storage by the timed passes."""
    import torch

    sources = _crop_sources(settings, corpus, store, recipe)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a DataLoader worker runs
    try:
        for dataset in sources.values():
            _timed_pass(dataset, seed=0)  # first reads: file handles opened, pages cached
        totals = {name: [0, 0.0, 0] for name in sources}
        loads = []
        for round_ in range(settings.crop_rounds):
            loads.append(_load())
            for name, dataset in sources.items():
                _add(totals[name], _timed_pass(dataset, seed=1 + round_))
        mapped = mapped_files(store)
    finally:
        torch.set_num_threads(threads)
    if totals["memory"][0] != totals["disk"][0]:
        raise RuntimeError(f"{recipe}: {totals['memory'][0]} crops from memory, {totals['disk'][0]} from disk")
    rates = {name: round(crops / seconds, 2) for name, (crops, seconds, _) in totals.items()}
    return {"bundle": RECIPES[recipe], "volumes": len(sources["disk"]), "crops": totals["disk"][0],
            "crops_per_s_memory": rates["memory"], "crops_per_s_disk": rates["disk"],
            "disk_over_memory": round(rates["disk"] / rates["memory"], 3),
            "disk_reads": "only the chunks each crop covers", "read_bytes_per_crop_disk": _per_crop(totals["disk"]),
            "store_files_mapped_after": mapped, "overrides": settings.recipe_overrides[recipe],
            "load_avg_before_rounds": loads}  # fmt: skip


def cold_crop_rates(settings: Settings, corpus: Path, store: Path, recipe: str) -> dict:
    """Phase 6 for one recipe (in a new process: :func:`in_new_process`): crops per second of one process from the
    disk store with the per-process cache of opened arrays missing, cold (the store's files evicted from the page
    cache before the pass) and then warm (the same crops again, after an untimed pass that lets the reads the cold
    pass started finish), against the in-memory cache in the same ``cold_rounds`` rounds; then as many rounds with
    the opened arrays kept (after they are evicted no more: kept arrays stay mapped, and mapped pages stay cached),
    against memory in those rounds.

    Raises:
        RuntimeError: the passes cut different numbers of crops.
    """
    import torch

    sources = _crop_sources(settings, corpus, store, recipe)
    files = store_files(store)
    volume_bytes = sum(p.stat().st_size for p in files if "volumes" in p.relative_to(store).parts)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    totals = {name: [0, 0.0, 0] for name in ("memory", "cold", "arrays_missing", "arrays_kept", "memory_beside_kept")}
    loads, resident, mapped, dropped = [], [], [], True
    try:
        with arrays_kept(0):
            for dataset in sources.values():
                _timed_pass(dataset, seed=0)  # imports and first calls, not timed
            for round_ in range(settings.cold_rounds):
                loads.append(_load())
                gc.collect()  # no array of an earlier pass still mapped: mapped pages are not evicted
                dropped = drop_page_cache(files) and dropped
                resident.append(resident_bytes(files))
                if resident[-1]:
                    print(f"data_scale: cold/{recipe}: {resident[-1]:,} bytes of {store} still cached after the "
                          "eviction (mapped by another process?)", file=sys.stderr, flush=True)  # fmt: skip
                _add(totals["cold"], _timed_pass(sources["disk"], seed=1 + round_))
                _timed_pass(sources["disk"], seed=1 + round_)  # the read-ahead the cold pass started ends here
                _add(totals["arrays_missing"], _timed_pass(sources["disk"], seed=1 + round_))
                mapped.append(mapped_files(store))
                _add(totals["memory"], _timed_pass(sources["memory"], seed=1 + round_))
        _timed_pass(sources["disk"], seed=0)  # opens the arrays, kept from here on
        for round_ in range(settings.cold_rounds):
            loads.append(_load())
            _add(totals["arrays_kept"], _timed_pass(sources["disk"], seed=1 + round_))
            _add(totals["memory_beside_kept"], _timed_pass(sources["memory"], seed=1 + round_))
        kept_mapped = mapped_files(store)
    finally:
        torch.set_num_threads(threads)
    if len({total[0] for total in totals.values()}) != 1:
        raise RuntimeError(f"{recipe}: crops per pass differ: {({k: v[0] for k, v in totals.items()})}")
    rates = {name: round(crops / seconds, 2) for name, (crops, seconds, _) in totals.items()}
    items = len(sources["disk"]) * settings.cold_rounds
    cold_read = totals["cold"][2]
    return {"bundle": RECIPES[recipe], "volumes": len(sources["disk"]), "crops": totals["cold"][0],
            "crops_per_s_memory": rates["memory"], "crops_per_s_cold": rates["cold"],
            "crops_per_s_arrays_missing": rates["arrays_missing"],
            "cold_over_memory": round(rates["cold"] / rates["memory"], 3),
            "arrays_missing_over_memory": round(rates["arrays_missing"] / rates["memory"], 3),
            "crops_per_s_arrays_kept": rates["arrays_kept"],
            "crops_per_s_memory_beside_kept": rates["memory_beside_kept"],
            "arrays_kept_over_memory": round(rates["arrays_kept"] / rates["memory_beside_kept"], 3),
            "read_bytes_per_crop_cold": _per_crop(totals["cold"]),
            "read_bytes_per_crop_arrays_missing": _per_crop(totals["arrays_missing"]),
            "read_bytes_per_item_cold": None if cold_read is None else round(cold_read / items),
            "stored_bytes_per_volume": round(volume_bytes / len(sources["disk"])),
            "page_cache": {"mechanism": MECHANISM if dropped else "none (no posix_fadvise here)",
                           "files": len(files), "store_bytes": sum(p.stat().st_size for p in files),
                           "resident_bytes_after_drop": resident, **storage(store)},
            "array_cache": "missing: OPEN_ARRAYS 0, every item opens its file and checks its chunks",
            "store_files_mapped_after": mapped, "store_files_mapped_kept": kept_mapped,
            "overrides": settings.recipe_overrides[recipe], "load_avg_before_rounds": loads}  # fmt: skip


# ---------------------------------------------------------------------------------------------------------- workers


def crops_per_step(recipe: str) -> tuple[int, int]:
    """(batch size, crops per volume) of the recipe's bundle as shipped (``train.json``)."""
    from components.demo.runner import bundle_dir

    config = json.loads((bundle_dir(RECIPES[recipe]) / "configs" / "train.json").read_text())
    return int(config["batch_size"]), int(config["training"]["num_samples"])


def workers_needed(crops_per_step_: int, step_ms: float, crops_per_s_per_worker: float) -> int:
    """Loader workers that keep up with a GPU consuming ``crops_per_step_`` every ``step_ms``."""
    return math.ceil(crops_per_step_ * 1000.0 / step_ms / crops_per_s_per_worker)


def _need(crops: int, step_ms: float, rates: dict) -> dict:
    disk, memory = (workers_needed(crops, step_ms, rates[f"crops_per_s_{s}"]) for s in ("disk", "memory"))
    need = {"gpu_crops_per_s": round(crops * 1000.0 / step_ms, 2), "workers_disk": disk, "workers_memory": memory,
            "16_cores_suffice_disk": disk <= CORES_PER_GPU - 1}  # fmt: skip
    if "crops_per_s_cold" in rates:
        need["workers_cold"] = workers_needed(crops, step_ms, rates["crops_per_s_cold"])
        need["16_cores_suffice_cold"] = need["workers_cold"] <= CORES_PER_GPU - 1
    return need


def workers_phase(crops: dict, gpu_step_ms: dict[str, float], cold: dict | None = None) -> dict:
    """Phase 7: workers per GPU for each recipe (warm, and cold where ``cold`` has the recipe), at its measured step
    time if given, and for :data:`STEP_MS`."""
    out = {}
    for recipe, warm in crops.items():
        rates = {**warm, **({"crops_per_s_cold": cold[recipe]["crops_per_s_cold"]} if cold and recipe in cold else {})}
        batch, per_volume = crops_per_step(recipe)
        step = gpu_step_ms.get(recipe)
        out[recipe] = {"batch_size": batch, "crops_per_volume": per_volume, "crops_per_step": batch * per_volume,
                       "gpu_step_ms": step if step is not None else "not measured",
                       "at_gpu_step": _need(batch * per_volume, step, rates) if step is not None else None,
                       "by_step_ms": {str(ms): _need(batch * per_volume, ms, rates) for ms in STEP_MS}}  # fmt: skip
    return out


# ------------------------------------------------------------------------------------------------------------ goals


def goals(memory: dict, crops: dict, cold: dict | None = None, worker_memory: dict | None = None) -> dict:
    """The three goals against the figures: memory change of a rank (disk) against the smallest size, through the
    first iteration (the goal), up to the trainer's start line (the data alone, without the network's step) and with
    its loader workers where measured; disk against memory crops per second, warm and, where measured, cold."""
    disk = [memory[size]["disk"] for size in memory]
    spread, at_start = (max(abs(run[key] / disk[0][key] - 1) for run in disk)
                        for key in ("peak_rank_pss_gb", "peak_rank_pss_gb_at_start_line"))  # fmt: skip
    slowest = max(run["first_iteration_s"] for run in disk)
    worst = min(crops[recipe]["disk_over_memory"] for recipe in crops)
    extra = {}
    if worker_memory:
        trees = [run["peak_rank_tree_pss_gb"] for run in worker_memory.values()]
        change = round(max(abs(t / trees[0] - 1) for t in trees), 3)
        extra["disk_memory_change_with_workers"] = change
        extra["disk_memory_flat_with_workers_met"] = change <= GOALS["disk_memory_flat_within"]
    if cold:
        coldest = min(run["cold_over_memory"] for run in cold.values())
        extra["disk_cold_over_memory_crops_per_s_min"] = coldest
        extra["disk_cold_crops_per_s_met"] = coldest >= GOALS["disk_over_memory_crops_per_s"]
    return {**extra,
        "disk_memory_change": round(spread, 3),
        "disk_memory_change_at_start_line": round(at_start, 3),
        "disk_memory_flat_met": spread <= GOALS["disk_memory_flat_within"],
        "disk_first_iteration_s_max": slowest,
        "disk_first_iteration_met": slowest <= GOALS["disk_first_iteration_s"],
        "disk_over_memory_crops_per_s_min": worst,
        "disk_crops_per_s_met": worst >= GOALS["disk_over_memory_crops_per_s"],
        "targets": GOALS,
    }


# ----------------------------------------------------------------------------------------------------------- driver


def _check_work(settings: Settings, work: Path) -> None:
    """Records the settings in ``work``; a folder of other settings is refused (its phases measured something else).
    A setting the folder's record lacks was added with a phase after it was written: that phase has not run there."""
    path, wanted = work / "settings.json", json.loads(json.dumps(asdict(settings)))
    if path.is_file():
        held = json.loads(path.read_text())
        changed = sorted(k for k in held if k not in wanted or held[k] != wanted[k])
        if changed:
            raise SystemExit(f"{work} holds the phases of other settings ({', '.join(changed)} differ): use another "
                             "--work, or remove it to start again.")  # fmt: skip
    _write_json(path, wanted)


def run(settings: Settings, work: Path, gpu_step_ms: dict[str, float], caveat: str | None = None,
        redo: tuple[str, ...] = ()) -> dict:  # fmt: skip
    """All phases, each skipped where ``work`` holds its record but those named in ``redo`` (:data:`REDO`), measured
    again; the result as one dict (with ``caveat`` first where one is given, e.g. a loaded machine)."""
    work = work.resolve()
    _check_work(settings, work)
    corpus, phases = work / "corpus", work / "phases"
    result: dict = {"benchmark": "data_scale", "commit": git_commit(), "machine": machine_info(),
                    **({"caveat": caveat} if caveat else {}), "settings": asdict(settings)}  # fmt: skip
    result["corpus"] = kept(phases / "corpus.json", lambda: write_corpus(settings, corpus))
    result["preprocess"] = {
        str(size): kept(phases / "preprocess" / f"{size}.json",
                        lambda: preprocess_size(settings, corpus, work / "stores" / f"ssl_{size}", size))
        for size in settings.sizes
    }  # fmt: skip
    result["memory"] = memory_phase(settings, work)
    result["worker_memory"] = worker_memory_phase(settings, work)
    result["crops"] = {recipe: kept(phases / "crops" / f"{recipe}.json",
                                    lambda: in_new_process(crop_rates, settings, corpus,
                                                           work / "stores" / f"crops_{recipe}", recipe),
                                    redo="crops" in redo)
                       for recipe in RECIPES}  # fmt: skip
    result["cold"] = {recipe: kept(phases / "cold" / f"{recipe}.json",
                                   lambda: in_new_process(cold_crop_rates, settings, corpus,
                                                          work / "stores" / f"crops_{recipe}", recipe),
                                   redo="cold" in redo)
                      for recipe in RECIPES}  # fmt: skip
    result["workers"] = workers_phase(result["crops"], gpu_step_ms, result["cold"])
    result["goals"] = goals(result["memory"], result["crops"], result["cold"], result["worker_memory"])
    return result


def step_time(pair: str) -> tuple[str, float]:
    """One ``RECIPE=MS`` of ``--gpu_step_ms`` (e.g. ``ssl=420``) as (recipe, milliseconds)."""
    recipe, _, value = pair.partition("=")
    try:
        if recipe in RECIPES and float(value) > 0:
            return recipe, float(value)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"RECIPE=MS with RECIPE one of {list(RECIPES)} and MS > 0, got {pair!r}")


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, help="the corpus, stores and phase records (~50 GB at full size)")
    parser.add_argument("--small", action="store_true", help="CI: 64x64x48 volumes, sizes 4 and 8, seconds per phase")
    parser.add_argument("--sizes", type=int, nargs="+", help="corpus sizes (default 100 1000 5000)")
    parser.add_argument("--workers", type=int, help="processes writing the corpus and the stores (default: all CPUs)")
    parser.add_argument("--memory_budget_gb", type=float, help="what both ranks may use (default: 75 %% of the RAM)")
    parser.add_argument("--cache_num", type=int, help="volumes a rank keeps with loader#cache smart (default 32)")
    parser.add_argument("--loader_workers", type=int,
                        help="loader workers per rank in the worker_memory phase (default 4)")
    parser.add_argument("--gpu_step_ms", type=step_time, nargs="+", default=[], metavar="RECIPE=MS",
                        help=f"GPU step times measured at the recipes' sizes, recipes {list(RECIPES)}")  # fmt: skip
    parser.add_argument("--redo", nargs="+", choices=REDO, default=[],
                        help="measure these phases again, replacing their records in --work (e.g. after a change to "
                             "the store's reads); the other phases are taken from the folder")  # fmt: skip
    parser.add_argument("--out", type=Path, help="where the JSON goes (default: benchmarks/results/data_scale.json)")
    parser.add_argument("--caveat", help='recorded with the result and its tables, e.g. "loaded 2-core VM, not a clean '
                        'measurement"')  # fmt: skip
    parser.add_argument("--markdown", type=Path, help="print the tables of this result JSON and exit")
    parser.add_argument("--sizing", type=Path, nargs=3, metavar=("PREPROCESS_RESULT", "STORE_RESULT", "INDEX_RESULT"),
                        help="print the sizing table (preprocessing time from the first result; store bytes, memory "
                             "with loader workers and cold crops from the second; the index from index_scale's) and "
                             "exit")  # fmt: skip
    parser.add_argument("--write_docs", type=Path, nargs="+",
                        help="with --markdown or --sizing: rewrite these files' blocks of that result or table")
    args = parser.parse_args(argv)
    if args.markdown and args.sizing:
        parser.error("--markdown and --sizing print different tables: give one of them")
    if args.markdown or args.sizing:
        for doc in args.write_docs or []:
            changed = write_doc_tables(doc, args.markdown) if args.markdown else write_doc_sizing(doc, args.sizing)
            print(f"{doc}: {'updated' if changed else 'unchanged'}")
        if not args.write_docs:
            results = [json.loads(path.read_text()) for path in args.sizing or ()]
            print(markdown_tables(json.loads(args.markdown.read_text())) if args.markdown
                  else "\n".join(sizing_table(*results)), end="")  # fmt: skip
        return None
    if args.work is None:
        parser.error("--work FOLDER is required: the corpus and stores go there (~50 GB at full size)")
    settings = SMALL if args.small else Settings()
    chosen = {"sizes": tuple(sorted(set(args.sizes))) if args.sizes else None, "workers": args.workers,
              "memory_budget_gb": args.memory_budget_gb, "cache_num": args.cache_num,
              "loader_workers": args.loader_workers}  # fmt: skip
    settings = replace(settings, **{k: v for k, v in chosen.items() if v is not None})
    settings = replace(settings, distinct=min(settings.distinct, max(settings.sizes)))
    if settings.cache_num > min(settings.sizes) // settings.world_size:
        parser.error(f"--cache_num {settings.cache_num} exceeds a rank's shard at {min(settings.sizes)} volumes")
    # a SIGTERM unwinds like Ctrl-C, so a bundle run under way is stopped with its whole process tree (its own session)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    started = time.perf_counter()
    result = run(settings, args.work, dict(args.gpu_step_ms), args.caveat, tuple(args.redo))
    write_result(result, sys.stdout, started)
    out = args.out or (None if args.small else RESULT)
    if out:
        _write_json(out, result)
    return result


if __name__ == "__main__":
    main()
