"""Rank-partitioned caching vs every rank caching the whole list (distributed-pitfalls.md a), on CPU.

W processes (torch.multiprocessing, gloo) cache N synthetic CT volumes with the pretraining bundle's own
preprocessing (``train#preprocessing`` of bundles/swin_unetr_ssl_pretrain/configs/train.json, read with
``monai.bundle.ConfigParser``; CacheDataset runs it up to its first random transform, exactly as the bundle does):

- ``partitioned``: each rank calls ``components.build_dataset`` (its shard of ceil(N/W) volumes, then a barrier);
- ``full``: each rank builds ``CacheDataset`` of the whole list (then the same barrier), what plain MONAI + DDP does.

Each variant runs in its own fresh processes (peak RSS is per process). Per rank it measures the RSS growth due to
caching (RSS with the cache alive minus RSS just before caching, both after ``gc`` + glibc ``malloc_trim``; imports,
process group, transforms and one warm-up volume are the baseline), the peak RSS growth (``ru_maxrss`` minus the same
baseline; it includes the temporaries of the transforms), the exact bytes of the cached arrays, and
the caching wall time (from a common start barrier to the barrier after caching, i.e. until the slowest rank is
done). The ranks run with ``MALLOC_MMAP_THRESHOLD_=131072`` (see ``MALLOC_ENV``) so that RSS follows live memory
rather than glibc heap fragmentation. Prints one JSON document (and writes it to ``--out``).

Targets (issue 3): per-rank cache memory <= 0.55x and caching time <= 0.6x of the full-list variant.

    python benchmarks/partitioned_cache.py --num 32 --world-size 2 --out partitioned_cache.json
    python benchmarks/partitioned_cache.py --small        # CI: 4 tiny volumes, 64x32x32 ROI
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAIN_CONFIG = REPO / "bundles" / "swin_unetr_ssl_pretrain" / "configs" / "train.json"
VARIANTS = ("full", "partitioned")
TARGETS = {"memory_ratio": 0.55, "time_ratio": 0.6}
PG_TIMEOUT_S = 600
# glibc: serve every block over 128 KiB with its own mmap (and no dynamic threshold), so that freed temporaries leave
# RSS at once. Otherwise heap fragmentation from the transforms' temporaries leaves a few MB in RSS that depend on
# the order of the volumes, which is as large as a whole compact cache of small synthetic volumes.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _release_free_memory() -> None:
    """Collect garbage and hand freed heap memory back to the OS (glibc ``malloc_trim``), so that RSS counts live
    memory: the baseline before caching and the cache after it, not freed temporaries glibc still holds."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: RSS then also counts freed memory the allocator keeps


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _cached_bytes(dataset) -> int:
    """Bytes of the arrays held in a CacheDataset's cache."""
    import numpy as np
    import torch

    total = 0
    for item in getattr(dataset, "_cache", []) or []:
        for value in (item.values() if isinstance(item, dict) else [item]):
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
            elif isinstance(value, np.ndarray):
                total += value.nbytes
    return total


def preprocessing(roi_size: list[int]):
    """The bundle's ``train#preprocessing`` (a Compose), built from train.json with ``roi_size`` set."""
    from monai.bundle import ConfigParser

    from components.config.running import run_config_files

    parser = ConfigParser()
    parser.read_config([str(f) for f in run_config_files(TRAIN_CONFIG.parents[1], ["train.json"])])
    parser["roi_size"] = list(roi_size)
    parser["training#num_samples"] = 1
    return parser.get_parsed_content("train#preprocessing")


def _worker(rank: int, world: int, port: int, variant: str, items: list[dict], roi: list[int], out_dir: str) -> None:
    out = Path(out_dir)
    try:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))  # fmt: skip
        import torch

        torch.set_num_threads(1)
        import components
        from monai.data import CacheDataset

        components.init_distributed(backend="gloo", timeout_s=PG_TIMEOUT_S)
        transform = preprocessing(roi)
        # warm-up, the same in both variants: the first volume through the pipeline pays the one-off costs (lazy
        # imports, reader and thread set-up) outside the measurement; its memory is released before the baseline
        transform(items[rank % len(items)])
        _release_free_memory()
        components.barrier()
        baseline = _rss()
        peak_before = _peak_rss()
        start = time.perf_counter()
        if variant == "partitioned":
            dataset = components.build_dataset(items, transform, cache="full", num_workers=1, batch_size=1, check=False,
                                               progress=False)  # fmt: skip
        else:
            dataset = CacheDataset(items, transform, cache_rate=1.0, num_workers=1, progress=False)
            components.barrier()  # as build_dataset: nobody trains before every rank has cached
        seconds = time.perf_counter() - start
        peak = _peak_rss()
        _release_free_memory()
        result = {
            "rank": rank,
            "volumes": len(dataset),
            "cache_seconds": seconds,
            "cached_bytes": _cached_bytes(dataset),
            "rss_growth_bytes": _rss() - baseline,
            # ru_maxrss is the peak of the whole process life; the warm-up peak may exceed the caching peak
            "peak_rss_growth_bytes": max(peak - baseline, 0),
            "peak_before_bytes": peak_before,
            "baseline_rss_bytes": baseline,
        }
        components.barrier()
        components.cleanup_distributed()
        (out / f"{variant}_rank{rank}.json").write_text(json.dumps(result))
    except BaseException:
        (out / f"{variant}_rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)


def run_variant(variant: str, items: list[dict], world: int, roi: list[int], out_dir: Path, timeout: float) -> list[dict]:
    import torch.multiprocessing as mp

    # forkserver: a clean server process imports the libraries once; every rank of both variants is forked from it
    # (fresh processes, so ru_maxrss is per variant, without paying the imports four times)
    for key, value in MALLOC_ENV.items():
        os.environ.setdefault(key, value)  # read by glibc when the fork server starts; the ranks inherit it
    from tests.ranks import run_ranks  # the repository root is on sys.path (see __main__)

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["components", "monai.bundle", "monai.data", "monai.transforms", "psutil"])
    codes = run_ranks(ctx, _worker, lambda rank, port: (rank, world, port, variant, items, roi, str(out_dir)), world, timeout)
    errors = "\n".join(f"--- {f.name} ---\n{f.read_text()}" for f in sorted(out_dir.glob(f"{variant}_rank*.err")))
    if codes != [0] * world:
        raise RuntimeError(f"{variant}: exit codes {codes} (timeout {timeout} s)\n{errors}")
    return [json.loads((out_dir / f"{variant}_rank{r}.json").read_text()) for r in range(world)]


def _summary(ranks: list[dict]) -> dict:
    return {
        "per_rank": ranks,
        "volumes_per_rank": max(r["volumes"] for r in ranks),
        "cache_seconds": max(r["cache_seconds"] for r in ranks),
        "cached_bytes_per_rank": max(r["cached_bytes"] for r in ranks),
        "rss_growth_bytes_per_rank": max(r["rss_growth_bytes"] for r in ranks),
        "peak_rss_growth_bytes_per_rank": max(r["peak_rss_growth_bytes"] for r in ranks),
    }


def benchmark(num: int, world_size: int, roi_size: list[int], data_dir: Path | None = None, timeout: float = 1800) -> dict:
    from components import load_datalist, write_dataset

    with tempfile.TemporaryDirectory(prefix="partitioned_cache_") as tmp:
        tmp_path = Path(tmp)
        data = Path(data_dir) if data_dir else tmp_path / "data"
        datalist = write_dataset(data, kind="ct", num=num, seed=0)
        items = [it for key in ("training", "validation", "test") for it in load_datalist(datalist, key)]
        items = [{"image": it["image"]} for it in items]  # the SSL bundle reads images only
        results = {v: _summary(run_variant(v, items, world_size, roi_size, tmp_path, timeout)) for v in VARIANTS}
    full, part = results["full"], results["partitioned"]
    ratios = {
        "memory_ratio": part["rss_growth_bytes_per_rank"] / max(full["rss_growth_bytes_per_rank"], 1),
        "peak_memory_ratio": part["peak_rss_growth_bytes_per_rank"] / max(full["peak_rss_growth_bytes_per_rank"], 1),
        "cached_bytes_ratio": part["cached_bytes_per_rank"] / max(full["cached_bytes_per_rank"], 1),
        "time_ratio": part["cache_seconds"] / max(full["cache_seconds"], 1e-9),
    }
    return {
        "benchmark": "partitioned_cache",
        "num": num,
        "world_size": world_size,
        "roi_size": list(roi_size),
        "cpu_count": os.cpu_count(),
        "variants": results,
        "ratios": ratios,
        "targets": TARGETS,
        "meets_targets": {k: ratios[k] <= v for k, v in TARGETS.items()},
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num", type=int, default=32, help="synthetic CT volumes (all of them are cached)")
    parser.add_argument("--world-size", type=int, default=2, help="processes (ranks)")
    parser.add_argument("--roi-size", type=int, nargs=3, default=[96, 96, 96], help="the bundle's roi_size")
    parser.add_argument("--small", action="store_true", help="CI: 4 volumes, ROI 64x32x32 (overrides --num/--roi-size)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per variant before the ranks are killed")
    args = parser.parse_args(argv)
    num, roi = (4, [64, 32, 32]) if args.small else (args.num, args.roi_size)
    if num < max(3, args.world_size):
        parser.error(f"--num must be >= max(3, world size), got {num}")
    result = benchmark(num, args.world_size, roi, timeout=args.timeout)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
