"""RAM per cached volume and caching time: the recipe's pipeline against the compact cache.

Both pipelines are the pretraining bundle's own ``train#preprocessing`` (``configs/train.json``) with
``train#transforms`` ``%train#plain_transforms`` (the recipe: float32 in [0, 1] after
``CropForegroundd(k_divisible=roi)``, which pads every axis up to a multiple of the ROI) and
``%train#compact_transforms`` (``components.CompactCropForegroundd``: the foreground box unpadded, as int16 Hounsfield
units). Each mode runs in its own fresh subprocess (alternating, ``--rounds`` times) that caches the
same synthetic CT set (``components.write_dataset(kind="ct")``) in a ``CacheDataset`` and reports:

- ``bytes_per_volume``: bytes of the tensors / arrays each cached item holds (MetaTensor metadata included);
- ``rss_growth_per_volume``: growth of the process's resident memory over the caching, per volume (after
  ``malloc_trim``; what the allocator keeps of the transient loading buffers is included);
- ``caching_s``: wall time of building the cache (one thread), and ``caching_s_per_volume``;
- ``random_part_s_per_item``: what each fetch then costs (CacheDataset's deep copy of the cached item, then the
  random crops: ``num_samples`` ROI crops).

    python benchmarks/cache.py                  # 12 volumes, roi 96 (the recipe's)
    python benchmarks/cache.py --volumes 30 --rounds 3
    python benchmarks/cache.py --small          # CI: 4 volumes, one round, both modes at once

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from copy import deepcopy
from pathlib import Path

import torch

from machine import machine_info

REPO = Path(__file__).resolve().parents[1]
BUNDLE = REPO / "bundles" / "swin_unetr_ssl_pretrain"
MODES = ("recipe", "compact")


def _rss_bytes() -> int | None:
    """Current resident set size (Linux ``/proc/self/statm``), None elsewhere; freed heap memory is first handed
    back to the system (glibc ``malloc_trim``) so that what remains is what the process holds."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def bundle_preprocessing(compact: bool, roi: list[int], num_samples: int):
    """The bundle's ``train#preprocessing`` of its compact pipeline or the recipe's (``train#transforms``)."""
    from monai.bundle import ConfigParser

    from components.config.running import run_config_files

    parser = ConfigParser()
    parser.read_config([str(f) for f in run_config_files(BUNDLE, ["train.json"])])
    transforms = "%train#compact_transforms" if compact else "%train#plain_transforms"
    parser.update({"train#transforms": transforms, "roi_size": roi, "training#num_samples": num_samples, "device": "cpu"})
    return parser.get_parsed_content("train#preprocessing")


def child(mode: str, data_dir: Path, roi: list[int], num_samples: int, draws: int) -> dict:
    """In a fresh process: cache every volume of the dataset with ``mode``'s pipeline and measure."""
    import warnings

    from monai.data import CacheDataset

    from components import compact_nbytes, load_datalist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    items = []
    for key in ("training", "validation", "test"):
        items += load_datalist(data_dir / "dataset.json", key)
    transform = bundle_preprocessing(mode == "compact", roi, num_samples)
    rss_before = _rss_bytes()
    start = time.perf_counter()
    dataset = CacheDataset(items, transform, cache_rate=1.0, num_workers=1, progress=False)
    caching_s = time.perf_counter() - start
    rss_after = _rss_bytes()
    cached = dataset._cache  # the items as CacheDataset holds them
    per_volume = [compact_nbytes(item) for item in cached]
    images = [item["image"] for item in cached]
    dataset[0]  # first fetch: lazy set-up (e.g. the scaler's one-time check)
    start = time.perf_counter()
    for _ in range(draws):
        for index in range(len(dataset)):
            dataset[index]
    fetch_s = (time.perf_counter() - start) / (draws * len(dataset))
    return {
        "mode": mode,
        "volumes": len(items),
        "bytes_per_volume": per_volume,
        "dtype": str(images[0].dtype),
        "cached_shapes": [list(image.shape) for image in images],
        "caching_s": caching_s,
        "rss_growth_bytes": None if rss_before is None else rss_after - rss_before,
        "random_part_s_per_item": fetch_s,
        "deepcopy_s_per_item": _deepcopy_s(cached),
    }


def _deepcopy_s(cached: list) -> float:
    start = time.perf_counter()
    for item in cached:
        deepcopy(item)
    return (time.perf_counter() - start) / max(len(cached), 1)


def _finished(mode: str, process: subprocess.Popen) -> dict:
    """What a child process of ``mode`` printed, once it has ended.

    Raises:
        RuntimeError: the child failed, with the end of its stderr.
    """
    stdout, stderr = process.communicate()
    if process.returncode:
        raise RuntimeError(f"{mode} subprocess failed:\n{stderr[-3000:]}")
    return json.loads(stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--volumes", type=int, default=12, help="synthetic CT volumes (all splits are cached)")
    parser.add_argument("--roi", type=int, nargs=3, default=[96, 96, 96], help="ROI (the recipe: 96 96 96)")
    parser.add_argument("--num-samples", type=int, default=2, help="crops per volume")
    parser.add_argument("--rounds", type=int, default=2, help="subprocesses per mode, alternating")
    parser.add_argument("--draws", type=int, default=3, help="fetches per item timed in each subprocess")
    parser.add_argument("--data", type=Path, default=None, help="an existing synthetic CT folder to reuse")
    parser.add_argument("--small", action="store_true", help="CI: 4 volumes, one round, one draw, both modes at once")
    parser.add_argument("--_child", dest="child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        result = child(args.child, args.data, list(args.roi), args.num_samples, args.draws)
        print(json.dumps(result))
        return result
    if args.small:
        args.volumes, args.rounds, args.draws = 4, 1, 1

    from components import write_dataset

    result: dict = {"benchmark": "cache", "machine": machine_info(), "roi": list(args.roi)}
    result["num_samples"] = args.num_samples
    with tempfile.TemporaryDirectory(prefix="cache_bench_") as tmp:
        data = args.data or Path(tmp) / "ct"
        if not (data / "dataset.json").exists():
            write_dataset(data, kind="ct", num=args.volumes, seed=0)
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        for _ in range(args.rounds):
            started = []
            for mode in MODES:
                cmd = [sys.executable, __file__, "--_child", mode, "--data", str(data), "--roi", *map(str, args.roi)]
                cmd += ["--num-samples", str(args.num_samples), "--draws", str(args.draws)]
                started.append((mode, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)))
                if not args.small:  # one at a time: measured children do not share the CPU
                    runs[mode].append(_finished(*started.pop()))
            for mode, child_process in started:  # --small: both modes at once, its times are no measurement
                runs[mode].append(_finished(mode, child_process))
    for mode, items in runs.items():
        first = items[0]
        n = first["volumes"]
        per_volume = first["bytes_per_volume"]
        rss = [r["rss_growth_bytes"] for r in items if r["rss_growth_bytes"] is not None]
        result[mode] = {
            "volumes": n,
            "dtype": first["dtype"],
            "bytes_per_volume_mean": int(statistics.fmean(per_volume)),
            "bytes_per_volume_min": min(per_volume),
            "bytes_per_volume_max": max(per_volume),
            "bytes_total": sum(per_volume),
            "rss_growth_per_volume": int(statistics.median(rss) / n) if rss else None,
            "caching_s": round(statistics.median(r["caching_s"] for r in items), 4),
            "caching_s_per_volume": round(statistics.median(r["caching_s"] for r in items) / n, 4),
            "random_part_s_per_item": round(statistics.median(r["random_part_s_per_item"] for r in items), 5),
            "deepcopy_s_per_item": round(statistics.median(r["deepcopy_s_per_item"] for r in items), 5),
            "example_cached_shapes": first["cached_shapes"][:3],
        }
    recipe, compact = result["recipe"], result["compact"]
    result["compact_over_recipe"] = {
        "bytes": round(compact["bytes_total"] / recipe["bytes_total"], 4),
        "rss": round(compact["rss_growth_per_volume"] / recipe["rss_growth_per_volume"], 4)
        if compact["rss_growth_per_volume"] and recipe["rss_growth_per_volume"]
        else None,
        "caching_time": round(compact["caching_s"] / recipe["caching_s"], 4),
        "random_part_time": round(compact["random_part_s_per_item"] / recipe["random_part_s_per_item"], 4),
    }
    result["targets"] = {
        "bytes_ratio_max": 0.25,
        "bytes_ratio_met": result["compact_over_recipe"]["bytes"] <= 0.25,
        "caching_time_no_worse": result["compact_over_recipe"]["caching_time"] <= 1.0,
    }
    result["machine"]["load_avg_1_5_15_at_end"] = [round(v, 2) for v in os.getloadavg()]
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
