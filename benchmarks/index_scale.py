"""What the store's index costs one rank as the corpus grows: synthetic index entries only (no volumes), at 100,000
and 1,000,000 entries by default, read by each of 8 ranks.

1. ``build``: one synthetic CT volume through the SSL bundle's deterministic transforms gives a template entry (its
   arrays, spacing and compact geometry, as a real store holds them); N entries made from it (each its own id, key,
   source record and position) are written as ``preprocess`` writes them (``--parts`` part shards merged by
   ``merge_parts``), with a datalist of N entries naming their sources. The sources do not exist: nothing reads
   them (``loader#source_check off``). At ``--old_sizes`` the same entries are also written as 0.4.0's single
   ``index.json`` (its entries held the datalist entry and the absolute source paths).
2. ``ranks``: each rank in a fresh process, one after another (the rank and world size are set in the child as
   ``torch.distributed`` would give them; no process group): (a) ``StoreDataset(store, shard=True)``, the index
   alone; (b) ``load_datalist`` of the N-entry datalist, then ``training_store`` over it (the datalist matched
   against the index, the shard's entries read), what a bundle's rank does with ``loader#cache disk``; (c) at
   ``--old_sizes``, ``json.loads`` of 0.4.0's ``index.json``, what every rank did before. For each step: wall and
   CPU seconds, the change of RSS, USS and peak RSS over the process before the step, and the entries read.

    python benchmarks/index_scale.py --work /tmp/index_scale                      # 100k and 1M, 8 ranks
    python benchmarks/index_scale.py --sizes 2000 --old_sizes 2000 --ranks 2 --work /tmp/small --out -

Prints one JSON object and writes it to ``--out`` (default ``benchmarks/results/index_scale.json``; ``-``: stdout
only), with ``--caveat`` (the machine's state, e.g. other jobs running). ``--markdown RESULT`` prints the table
docs/scale.md shows.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import psutil

from machine import git_commit, machine_info, write_result

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULT = REPO / "benchmarks" / "results" / "index_scale.json"
SSL = "swin_unetr_ssl_pretrain"
MIB = 2**20


# ------------------------------------------------------------------------------------------------------------ build


def template_entry(work: Path) -> tuple[dict, list[dict]]:
    """A real store's entry (one synthetic CT volume through the SSL bundle's deterministic transforms) and those
    transforms."""
    from components.data.store import bundle_transforms, open_store, preprocess
    from components.data.synthetic import write_dataset

    transforms = bundle_transforms(REPO / "bundles" / SSL)
    store = work / "template" / "store"
    if not (store / "index.json").is_file():
        datalist = write_dataset(work / "template" / "ct", kind="ct", num=3, seed=0)
        preprocess(datalist, store, transforms)
    return open_store(store).entries[0], transforms


def _entry(template: dict, position: int) -> dict:
    path = f"imagesTr/case_{position:07d}.nii.gz"
    record = {**template["files"][0], "path": path, "mtime_ns": template["files"][0]["mtime_ns"] + position}
    return {**template, "id": f"case_{position:07d}-{position:012x}", "position": position, "key": path,
            "files": [record]}  # fmt: skip


def _old_entry(entry: dict, root: str) -> dict:
    """The entry as 0.4.0 wrote it: the datalist entry and the SHA-256 of each source, by absolute path."""
    old = {k: v for k, v in entry.items() if k not in ("key", "files")}
    source = os.path.join(root, entry["files"][0]["path"])
    return {**old, "source": {"image": source}, "sha256": {source: entry["files"][0]["sha256"]}}


def build(work: Path, size: int, parts: int, old: bool) -> dict:
    """The store's index of ``size`` synthetic entries and its datalist under ``work/<size>``; with ``old`` also
    0.4.0's ``index.json`` of the same entries. Returns what was written and how long it took."""
    from components.data.store import transforms_fingerprint
    from components.data.store.format import FORMAT_VERSION
    from components.data.store.index import HEADER, merge_parts, write_part

    template, transforms = template_entry(work)
    folder = work / str(size)
    store, data = folder / "store", folder / "data"
    data.mkdir(parents=True, exist_ok=True)
    header = {"format_version": FORMAT_VERSION, "fingerprint": transforms_fingerprint(transforms), "transforms": transforms,
              "datalist": str(data / "dataset.json"), "list_key": "training", "datalist_sha256": "synthetic",
              "volumes": size, "command": None, "source_root": str(data)}  # fmt: skip
    result: dict = {"entries": size, "parts": parts}
    if not (store / "index.json").is_file():
        start = time.perf_counter()
        store.mkdir(parents=True, exist_ok=True)
        (store / HEADER).write_text(json.dumps(header, indent=1))
        shard = {"fingerprint": header["fingerprint"], "datalist_sha256": "synthetic", "skipped": [], "failed": []}
        for part in range(parts):
            write_part(store, part, parts, {**shard, "part": part, "parts": parts},
                       [_entry(template, p) for p in range(part, size, parts)])  # fmt: skip
        merge_parts(store, parts)
        (data / "dataset.json").write_text(json.dumps({"training": [{"image": f"imagesTr/case_{p:07d}.nii.gz"}
                                                                    for p in range(size)]}))  # fmt: skip
        result["build_s"] = round(time.perf_counter() - start, 1)
    if old and not (folder / "old_index.json").is_file():
        entries = [_old_entry(_entry(template, p), str(data)) for p in range(size)]
        old_header = {k: v for k, v in header.items() if k != "source_root"}
        (folder / "old_index.json").write_text(json.dumps({**old_header, "entries": entries, "skipped": [],
                                                           "failed": []}, sort_keys=True, separators=(",", ":")))  # fmt: skip
        del entries
    result["bytes"] = {
        "index.json": (store / "index.json").stat().st_size,
        "entries.jsonl": (store / "index" / "entries.jsonl").stat().st_size,
        "columns (offsets, keys, rows)": sum((store / "index" / n).stat().st_size for n in ("offsets.npy", "keys.npy", "rows.npy")),
        "datalist": (data / "dataset.json").stat().st_size,
    }  # fmt: skip
    if old:
        result["bytes"]["0.4.0 index.json"] = (folder / "old_index.json").stat().st_size
    return result


# ------------------------------------------------------------------------------------------------------------ ranks


def _memory() -> dict:
    gc.collect()
    full = psutil.Process().memory_full_info()
    return {"rss": full.rss, "uss": full.uss, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _measured(step) -> tuple[object, dict]:
    """``step()`` and what it cost: wall and CPU seconds, the change of RSS, USS and peak RSS (MiB)."""
    before, wall, cpu = _memory(), time.perf_counter(), time.process_time()
    value = step()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    after = _memory()
    costs = {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3)}
    costs.update({f"{k}_mib": round((after[k] - before[k]) / MIB, 1) for k in ("rss", "uss", "peak")})
    return value, costs


def child(mode: str, folder: Path, rank: int, ranks: int) -> dict:
    """One rank's steps (see the module docstring) in this fresh process; returns their costs."""
    import components.data.partition as partition
    import components.data.store.dataset as dataset
    from components.data.datalists import load_datalist
    from components.data.store import StoreDataset, open_store, training_store

    partition.get_rank, partition.get_world_size = (lambda: rank), (lambda: ranks)  # as torch.distributed would say
    dataset.get_world_size = lambda: ranks
    read = []
    original = dataset.read_entries
    dataset.read_entries = lambda root, rows, fields=None: read.append(len(rows)) or original(root, rows, fields)
    store = folder / "store"
    out: dict = {"rank": rank, "baseline_rss_mib": round(_memory()["rss"] / MIB, 1)}
    if mode == "index":
        shard, out["store_dataset"] = _measured(lambda: StoreDataset(open_store(store), shard=True))
        out["store_dataset"]["entries_read"], out["store_dataset"]["entries_held"] = sum(read), len(shard)
    elif mode == "datalist":
        data, out["load_datalist"] = _measured(lambda: load_datalist(folder / "data" / "dataset.json"))
        out["load_datalist"]["entries"] = len(data)
        shard, out["training_store"] = _measured(
            lambda: training_store(store, data, None, fingerprint=open_store(store).fingerprint, source_check="off")
        )
        out["training_store"]["entries_read"], out["training_store"]["entries_held"] = sum(read), len(shard)
    else:
        index, out["old_index"] = _measured(lambda: json.loads((folder / "old_index.json").read_text()))
        out["old_index"]["entries_read"] = len(index["entries"])
    return out


def _run_child(mode: str, folder: Path, rank: int, ranks: int) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--work", str(folder), "--rank", str(rank), "--ranks", str(ranks)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _summary(ranks: list[dict], step: str) -> dict:
    values = [r[step] for r in ranks]
    keys = [k for k in values[0] if isinstance(values[0][k], (int, float))]
    return {k: {"max": max(v[k] for v in values), "mean": round(sum(v[k] for v in values) / len(values), 3)} for k in keys}


DOC_BLOCK = "<!-- index_scale table: python benchmarks/index_scale.py --markdown benchmarks/results/index_scale.json -->"
DOC_BLOCK_END = "<!-- /index_scale table -->"


def markdown(result: dict) -> str:
    """The table of ``result`` (the largest cost over the ranks), as docs/scale.md shows it between
    :data:`DOC_BLOCK` and :data:`DOC_BLOCK_END`."""
    machine = result["machine"]
    ranks = result["settings"]["ranks"]
    lines = [f"Commit {result['commit'][:12]}, {machine['cpu_model']} ({machine['cpu_count']} CPUs), load "
             f"{machine['load_avg_1_5_15'][0]:.1f} at the start, {machine['load_avg_1_5_15_at_end'][0]:.1f} at the end; "
             f"{result['caveat'] or 'no caveat given'}. Each of {ranks} ranks in its own process, the largest figure "
             "over the ranks; RSS: its growth over the process before the step (torch and MONAI imported, "
             f"{max(r['baseline_rss_mib'] for r in result['sizes'][next(iter(result['sizes']))]['index']['ranks']):.0f} "
             "MiB):", "",
             "| index entries | index on disk | a rank's `StoreDataset(shard=True)` | `load_datalist` of every entry "
             "| `training_store` over it | 0.4.0's `index.json`, loaded whole by every rank (one measured) |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for size, entry in result["sizes"].items():
        def cost(mode: str, step: str, read: bool = True) -> str:
            if mode not in entry:
                return "not measured"
            summary = entry[mode]["summary"][step]
            text = (f"{summary['rss_mib']['max']:,.0f} MiB, {summary['wall_s']['max']:.2f} s "
                    f"({summary['cpu_s']['max']:.2f} CPU s)")  # fmt: skip
            return f"{summary['entries_read']['max']:,} entries read; {text}" if read and "entries_read" in summary else text

        disk = entry["bytes"]
        stored = (f"{disk['entries.jsonl'] / 1e6:,.0f} MB of entries, {disk['columns (offsets, keys, rows)'] / 1e6:.1f}"
                  f" MB of columns, index.json {disk['index.json'] / 1e3:.1f} kB")  # fmt: skip
        lines.append(f"| {int(size):,} | {stored} | {cost('index', 'store_dataset')} | "
                     f"{cost('datalist', 'load_datalist', read=False)} | {cost('datalist', 'training_store')} | "
                     f"{cost('old', 'old_index')} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--old_sizes", type=int, nargs="*", default=[100_000])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--parts", type=int, default=8)
    parser.add_argument("--out", default=str(RESULT))
    parser.add_argument("--caveat", default="")
    parser.add_argument("--markdown", type=Path, help="print the table of this result instead of measuring")
    parser.add_argument("--child", choices=("index", "datalist", "old"))
    parser.add_argument("--rank", type=int, default=0)
    args = parser.parse_args()
    if args.markdown:
        print(markdown(json.loads(args.markdown.read_text())), end="")
        return
    if args.work is None:
        parser.error("--work is required to measure")
    if args.child:
        print(json.dumps(child(args.child, args.work, args.rank, args.ranks)))
        return
    started = time.perf_counter()
    result = {"benchmark": "index_scale", "commit": git_commit(), "machine": machine_info(), "caveat": args.caveat,
              "settings": {"sizes": args.sizes, "old_sizes": args.old_sizes, "ranks": args.ranks, "parts": args.parts},
              "sizes": {}}  # fmt: skip
    for size in args.sizes:
        entry = build(args.work, size, args.parts, size in args.old_sizes)
        folder = args.work / str(size)
        for mode in ("index", "datalist") + (("old",) if size in args.old_sizes else ()):
            ranks = [_run_child(mode, folder, rank, args.ranks) for rank in range(args.ranks if mode != "old" else 1)]
            entry[mode] = {"ranks": ranks,
                           "summary": {s: _summary(ranks, s) for s in ranks[0] if isinstance(ranks[0][s], dict)}}  # fmt: skip
        result["sizes"][str(size)] = entry
        print(f"{size:,} entries done", file=sys.stderr)
    with open(os.devnull if args.out == "-" else args.out, "w") as out:
        write_result(result, out, started)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
