"""Crops per second of one recipe's training views from one source, the in-memory cache or the disk store, in one
process with one torch thread, as a loader worker: ``data_scale.py``'s crops phase cut down to one source, so that a
whole process can be timed (``/usr/bin/time``, or several runs paired against another version of the store or
against the other source).

    python benchmarks/crop_rate.py --work /tmp/crop_rate --recipe ssl --source disk --passes 20
    python benchmarks/crop_rate.py --work /tmp/crop_rate --recipe ssl --source disk --passes 0   # the setup alone

The work folder holds ``--volumes`` synthetic CT volumes (and 4 labeled ones for finetuning), written on the first
call, and the recipe's store, written there on the first call and again where it answers other transforms or another
store format. After one untimed pass (seed 0) come ``--passes`` passes over every volume (seeds 1, 2, ...), the same
crops from either source. ``--arrays_kept 0``: every item opens its file and checks its chunks anew, as at 100,000
volumes; ``--cold`` also evicts the store's files from the page cache before each pass (``page_cache``). Prints one
JSON line: crops, seconds and CPU seconds of the timed passes (the process's CPU time: what the crops cost, where
other jobs take the cores), crops per second of each, bytes read from storage per crop, the load average before them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_scale import RECIPES, SMALL, Settings, _crop_sources, _timed_pass, arrays_kept, write_corpus  # noqa: E402
from page_cache import drop_page_cache, store_files  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="the corpus and the stores")
    parser.add_argument("--recipe", choices=list(RECIPES), default="ssl")
    parser.add_argument("--source", choices=("memory", "disk"), default="disk")
    parser.add_argument("--passes", type=int, default=5, help="timed passes over every volume (0: the setup alone)")
    parser.add_argument("--volumes", type=int, default=8, help="volumes of the pretraining recipes (default 8)")
    parser.add_argument("--arrays_kept", type=int, help="the store's OPEN_ARRAYS meanwhile (default: as it is)")
    parser.add_argument("--cold", action="store_true", help="disk: the store's files evicted before each pass, no "
                        "array kept")  # fmt: skip
    parser.add_argument("--small", action="store_true", help="CI: data_scale's small settings (64x64x48 volumes)")
    args = parser.parse_args(argv)
    if args.cold and (args.source != "disk" or args.arrays_kept not in (None, 0)):
        parser.error("--cold reads the disk store with no array kept (--source disk, --arrays_kept 0 or none)")
    kept = 0 if args.cold else args.arrays_kept
    base = SMALL if args.small else Settings()
    settings = replace(base, sizes=(args.volumes,), distinct=args.volumes, validation=0, crop_volumes=args.volumes,
                       workers=min(2, os.cpu_count() or 1))  # fmt: skip
    corpus = args.work / "corpus"
    write_corpus(settings, corpus)
    store = args.work / "stores" / f"crops_{args.recipe}"
    dataset = _crop_sources(settings, corpus, store, args.recipe, (args.source,))[args.source]
    import torch

    torch.set_num_threads(1)  # as a DataLoader worker runs
    crops, seconds, cpu, read = 0, 0.0, 0.0, 0
    with nullcontext() if kept is None else arrays_kept(kept):
        _timed_pass(dataset, seed=0)  # imports and first calls, not timed
        load = [round(v, 2) for v in os.getloadavg()]
        for seed in range(1, args.passes + 1):
            if args.cold:
                gc.collect()  # no array of the last pass still mapped: mapped pages are not evicted
                drop_page_cache(store_files(store))
            started = time.process_time()
            cut, spent, moved = _timed_pass(dataset, seed)
            crops, seconds, cpu = crops + cut, seconds + spent, cpu + time.process_time() - started
            read = None if read is None or moved is None else read + moved
    result = {"recipe": args.recipe, "source": args.source, "volumes": len(dataset), "crops": crops,
              "seconds": round(seconds, 3), "crops_per_s": round(crops / seconds, 2) if seconds else None,
              "cpu_seconds": round(cpu, 3), "crops_per_cpu_s": round(crops / cpu, 2) if cpu else None,
              "arrays_kept": kept, "cold": args.cold,
              "read_bytes_per_crop": round(read / crops) if read is not None and crops else None,
              "load_avg_before": load}  # fmt: skip
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
