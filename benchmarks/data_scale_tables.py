"""The Markdown tables of a ``benchmarks/data_scale.py`` result, as benchmarks/README.md shows them: printed by
``data_scale.py --markdown RESULT`` and written between the markers of a document by ``--write_docs DOC``; and the
sizing table, computed from several results (``--sizing``), written between its own markers."""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC_BLOCK = "<!-- data_scale tables: python benchmarks/data_scale.py --markdown {result} --write_docs ... -->"
DOC_BLOCK_END = "<!-- /data_scale tables -->"
SIZING_BLOCK = "<!-- data_scale sizing: python benchmarks/data_scale.py --sizing {results} --write_docs ... -->"
SIZING_BLOCK_END = "<!-- /data_scale sizing -->"


def _row(cells: list) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _table(header: list[str], rows: list[list]) -> list[str]:
    return [_row(header), _row(["---"] * len(header)), *(_row(r) for r in rows), ""]


def _mb(value: float) -> str:
    return f"{value / 1e6:.2f}"


def _load(values: list[float]) -> str:
    return f"{values[0]:.1f}"


def _loads(values: list[list[float]]) -> str:
    return f"{min(v[0] for v in values):.1f}-{max(v[0] for v in values):.1f}"


def _not_measured(what: str) -> list[str]:
    return [f"{what}: not measured in this run.", ""]


def corpus_table(result: dict) -> list[str]:
    """Per size: the .nii.gz and stored bytes per volume, the preprocessing's seconds per volume and per core."""
    corpus = result["corpus"]
    rows = []
    for size, run in result["preprocess"].items():
        rows.append([f"{int(size):,}", _mb(run["nii_gz_bytes_per_volume"]), _mb(run["store_bytes_per_volume"]),
                     f"{run['store_over_nii_gz']:.3f}", f"{run['wall_s']:.0f} s, {run['workers']} workers",
                     f"{run['s_per_volume']:.3f}", f"{run['core_s_per_volume']:.3f}",
                     _load(run["load_avg_before"])])  # fmt: skip
    shape = "x".join(str(n) for n in corpus["shape"])
    return [f"Corpus: {corpus['distinct_volumes']:,} distinct synthetic CT volumes of {shape} {corpus['dtype']} "
            f"({corpus['linked_volumes']:,} more as links to them); preprocessing with the SSL bundle's "
            "deterministic transforms (wall time includes the process start and the data check):", "",
            *_table(["volumes", ".nii.gz MB / volume", "store MB / volume", "store / .nii.gz", "preprocess wall",
                     "s / volume", "core-s / volume", "load before"], rows)]  # fmt: skip


def _memory_cell(run: dict) -> str:
    if run["status"] == "extrapolated":
        return (f"~{run['peak_rank_pss_gb']:.2f} GiB, ~{run['first_iteration_s']:.0f} s (extrapolated from "
                f"{', '.join(f'{s:,}' for s in run['from_sizes'])})")  # fmt: skip
    return (f"{run['peak_rank_pss_gb']:.2f} GiB ({run['peak_rank_pss_gb_at_start_line']:.2f} at start), "
            f"{run['first_iteration_s']:.1f} s (start {run['start_line_s']:.1f} s; "
            f"load {_load(run['load_avg_before'])})")  # fmt: skip


def memory_table(result: dict) -> list[str]:
    """Per mode and size: peak PSS of a rank and seconds from the launch to the first iteration."""
    settings, memory = result["settings"], result["memory"]
    sizes = list(memory)
    rows = [[mode, *(_memory_cell(memory[size][mode]) for size in sizes)] for mode in memory[sizes[0]]]
    roi = "x".join(str(n) for n in settings["roi_size"])
    return [f"Memory per rank ({settings['world_size']} ranks, gloo, CPU; peak PSS of the largest process through the "
            f"first iteration, and up to the trainer's start line) and seconds from the launch to the first "
            f"iteration (to the start line); tiny network, one {roi} crop per step, no loader workers; smart keeps "
            f"{settings['cache_num']} volumes per rank; extrapolated where both ranks would exceed "
            f"{settings['memory_budget_gb']} GB:", "",
            *_table(["mode", *(f"{int(s):,} volumes" for s in sizes)], rows)]  # fmt: skip


def worker_memory_table(result: dict) -> list[str]:
    """Per size: one rank's memory with its loader workers (the peak of the sum over its process tree), against the
    same rank without workers (the memory table's disk row)."""
    if "worker_memory" not in result:
        return _not_measured("Memory per rank with loader workers")
    settings, rows = result["settings"], []
    for size, run in result["worker_memory"].items():
        alone = result["memory"][size]["disk"]
        rows.append([f"{int(size):,}", run["loader_workers"], f"{run['rank_tree_processes']}",
                     f"**{run['peak_rank_tree_pss_gb']:.2f} GiB**", f"{run['peak_rank_tree_rss_gb']:.2f} GiB",
                     f"{run['peak_rank_pss_gb']:.2f} GiB", f"{alone['peak_rank_pss_gb']:.2f} GiB",
                     f"{run['iterations']} in {run['iterations_s']:.1f} s", _load(run["load_avg_before"])])  # fmt: skip
    return [f"Memory per rank with its loader workers ({settings['world_size']} ranks, the SSL bundle from the disk "
            f"store, tiny network, one crop per step, ended at the iteration shown): the peak over time of the sum "
            "over the rank and its workers, PSS (pages the forked workers share with the rank split between them: "
            "what a node has to hold) and RSS (shared pages counted in every process: an upper bound), the largest "
            "single process, and the same rank without workers through its first iteration (the memory table):", "",
            *_table(["volumes", "workers per rank", "processes per rank", "rank + workers, PSS", "rank + workers, RSS",
                     "largest process, PSS", "rank without workers, PSS", "iterations", "load"], rows)]  # fmt: skip


def _read_mb(run: dict, key: str) -> str:
    value = run.get(key)
    return "not recorded" if value is None else f"{value / 1e6:.2f}"


def crops_table(result: dict) -> list[str]:
    """Per recipe: crops per second of one worker from memory and from disk (warm), their ratio, and what the disk
    passes read from storage."""
    rows = []
    for recipe, run in result["crops"].items():
        rows.append([recipe, f"`{run['bundle']}`", f"{run['volumes']} ({run['crops']} crops)",
                     f"{run['crops_per_s_memory']:.1f}", f"{run['crops_per_s_disk']:.1f}",
                     f"**{run['disk_over_memory']:.2f}**", run["disk_reads"],
                     _read_mb(run, "read_bytes_per_crop_disk"), _loads(run["load_avg_before_rounds"])])  # fmt: skip
    return ["Crops per second of one loader worker (one process, one thread), in-memory cache against the disk "
            "store, the same crops; warm: the store's files in the page cache and its opened arrays kept by the "
            "process (the volumes are few):", "",
            *_table(["recipe", "bundle", "volumes", "memory crops/s", "disk crops/s", "disk / memory", "disk reads",
                     "MB read from storage per crop", "load"], rows)]  # fmt: skip


def _resident(run: dict) -> str:
    values = [v for v in run["page_cache"]["resident_bytes_after_drop"] if v is not None]
    return f"{max(values) / 1e6:.2f} of {run['page_cache']['store_bytes'] / 1e6:.1f}" if values else "not counted"


def cold_table(result: dict) -> list[str]:
    """Per recipe: crops per second of one worker from the disk store with the array cache missing, cold and warm,
    against memory in the same rounds; what the cold passes read from storage."""
    if "cold" not in result:
        return _not_measured("Cold crops (page cache dropped, opened arrays not kept)")
    rows, where = [], None
    for recipe, run in result["cold"].items():
        cache = run["page_cache"]
        where = f"{cache['filesystem']} on {cache['device']}, read-ahead {cache['read_ahead_kb']} KiB"
        rows.append([recipe, f"{run['volumes']} ({run['crops']} crops)", f"{run['crops_per_s_memory']:.1f}",
                     f"{run['crops_per_s_arrays_kept']:.1f} ({run['arrays_kept_over_memory']:.2f})",
                     f"{run['crops_per_s_arrays_missing']:.1f} ({run['arrays_missing_over_memory']:.2f})",
                     f"{run['crops_per_s_cold']:.1f} (**{run['cold_over_memory']:.2f}**)",
                     _read_mb(run, "read_bytes_per_item_cold"), f"{run['stored_bytes_per_volume'] / 1e6:.2f}",
                     _read_mb(run, "read_bytes_per_crop_arrays_missing"), _resident(run),
                     _loads(run["load_avg_before_rounds"])])  # fmt: skip
    first = next(iter(result["cold"].values()))
    return ["Cold crops per second of one loader worker, all in one process: the store's opened arrays not kept "
            "(every item opens its file and checks its chunks, as at 100,000 volumes where the per-process cache "
            "never hits), first with the store's files evicted from the page cache before each pass "
            f"({first['page_cache']['mechanism']}; {where}), then the same crops again with the files cached; then "
            "as many rounds with the arrays kept (files cached); in brackets against memory in the same rounds. MB "
            "read from storage by the cold passes per item (one volume's crops) against the stored MB per volume, "
            "and MB still cached after the eviction:", "",
            *_table(["recipe", "volumes", "memory crops/s", "disk crops/s, arrays kept",
                     "disk crops/s, arrays not kept", "disk crops/s, cold",
                     "MB read per item, cold", "stored MB per volume", "MB read per crop, arrays not kept",
                     "MB cached after eviction", "load"], rows)]  # fmt: skip


def _workers_cell(need: dict) -> str:
    mark = "" if need["16_cores_suffice_disk"] and need.get("16_cores_suffice_cold", True) else " (more than 16 cores)"
    cold = f" / {need['workers_cold']} cold" if "workers_cold" in need else ""
    return f"{need['workers_disk']} disk / {need['workers_memory']} memory{cold}{mark}"


def workers_table(result: dict) -> list[str]:
    """Per recipe: loader workers one GPU needs at its measured step time and at the table's step times."""
    workers = result["workers"]
    steps = list(next(iter(workers.values()))["by_step_ms"])
    rows = []
    for recipe, need in workers.items():
        measured = need["at_gpu_step"]
        at_step = f"{need['gpu_step_ms']:g} ms: {_workers_cell(measured)}" if measured else "not measured"
        rows.append([recipe, f"{need['batch_size']} x {need['crops_per_volume']}", at_step,
                     *(_workers_cell(need["by_step_ms"][ms]) for ms in steps)])  # fmt: skip
    return ["Loader workers one GPU needs (batch x crops per volume / GPU step time / crops per second of one "
            "worker: disk and memory warm, cold where measured; 16 cores suffice with at most 15 workers beside the "
            "training process):", "",
            *_table(["recipe", "batch x crops", "measured GPU step", *(f"{ms} ms step" for ms in steps)], rows)]


#: the corpora and machines the sizing table computes for: volumes, preprocessing cores, ranks (GPUs) per node
SIZING_VOLUMES = (10_000, 50_000, 100_000, 160_000)
SIZING_CORES = (16, 64)
SIZING_RANKS_PER_NODE = 8


def _bytes(value: float) -> str:
    return f"{value / 1e12:.2f} TB" if value >= 1e12 else f"{value / 1e9:.0f} GB"


def duration(seconds: float) -> str:
    """``seconds`` as minutes below an hour, else hours: ``duration(540)`` is ``"9 min"``."""
    return f"{seconds / 60:.0f} min" if seconds < 3600 else f"{seconds / 3600:.1f} h"


def index_mib(index: dict, volumes: int) -> float:
    """What a rank's datalist and its shard of the store's index add at ``volumes`` volumes, in MiB, from
    ``benchmarks/index_scale.py``'s result (``load_datalist`` plus ``training_store``, the largest over its ranks):
    linear between its sizes, through zero below the smallest, along the last segment beyond the largest."""
    points = [(0, 0.0)] + sorted(
        (int(size), run["datalist"]["summary"]["load_datalist"]["rss_mib"]["max"]
         + run["datalist"]["summary"]["training_store"]["rss_mib"]["max"]) for size, run in index["sizes"].items())
    for (n0, m0), (n1, m1) in zip(points, points[1:]):  # fmt: skip
        if volumes <= n1:
            break
    return m0 + (m1 - m0) * (volumes - n0) / (n1 - n0)


def _record_load(record: dict) -> str | None:
    """The 1-minute load average before ``record``'s measurement (its range over the rounds), or None."""
    rounds = record.get("load_avg_before_rounds") or [record[key] for key in ("load_avg_before",) if key in record]
    ones = [round(load[0], 1) for load in rounds]
    if not ones:
        return None
    return f"load {min(ones):.1f}" + (f"-{max(ones):.1f}" if max(ones) > min(ones) else "")


def _origin(result: dict, record: dict | None = None) -> str:
    """The commit that measured ``record`` (a phase's record of ``result``; else ``result``'s) and ``result``'s
    caveat up to its first colon; for a result whose caveat says it is mixed (records of runs on machines under
    different loads), the load before that record instead."""
    caveat = result.get("caveat")
    commit = (record or {}).get("commit") or result["commit"]
    load = _record_load(record) if record else None
    if caveat and caveat.split(":")[0].strip() == "mixed" and load:
        return f"commit {commit[:12]}, {load} before it, one record of a mixed result"
    return f"commit {commit[:12]}, {caveat.split(':')[0] if caveat else 'no caveat recorded'}"


def sizing_table(preprocess: dict, store: dict, index: dict) -> list[str]:
    """What a corpus of N volumes like the benchmark's needs, every row extrapolated from measured figures:

    - preprocessing hours on C cores: core-seconds per volume of the largest corpus of ``preprocess`` (a
      ``data_scale`` result; times need a machine without other jobs);
    - the store on disk: stored bytes per volume of the largest corpus of ``store`` (a ``data_scale`` result of this
      version: the store's format decides them, the load does not);
    - host memory per node: :data:`SIZING_RANKS_PER_NODE` ranks, each the largest measured rank with its loader
      workers (PSS, ``store["worker_memory"]``) plus what its datalist and index shard add at N volumes
      (:func:`index_mib` of ``index``, an ``index_scale`` result);
    - loader workers per GPU and storage reads per node: the SSL recipe's cold crops per second and bytes read per
      item (``store["cold"]``) at each step time of the workers table.

    Raises:
        ValueError: ``store`` has no loader-worker memory or cold crops (a result of an earlier version).
    """
    missing = [key for key in ("worker_memory", "cold") if key not in store]
    if missing:
        raise ValueError(f"the store result (commit {store['commit'][:12]}) has no {' or '.join(missing)}: run "
                         "benchmarks/data_scale.py at this version")  # fmt: skip
    largest = max(preprocess["preprocess"], key=int)
    times = preprocess["preprocess"][largest]
    stored_run = store["preprocess"][max(store["preprocess"], key=int)]
    stored = stored_run["store_bytes_per_volume"]
    size, tree = max(store["worker_memory"].items(), key=lambda item: item[1]["peak_rank_tree_pss_gb"])
    alone = store["memory"][size]["disk"]["peak_rank_pss_gb"]
    per_worker = (tree["peak_rank_tree_pss_gb"] - alone) / tree["loader_workers"]
    measured_at = max(int(size) for size in store["worker_memory"])
    ssl, cold = store["workers"]["ssl"], store["cold"]["ssl"]
    workers = ", ".join(f"{ms} ms: {need['workers_cold']}" for ms, need in ssl["by_step_ms"].items())
    per_step = SIZING_RANKS_PER_NODE * ssl["batch_size"] * cold["read_bytes_per_item_cold"] / 1e9
    reads = ", ".join(f"{ms} ms: {per_step * 1000 / int(ms):.2f} GB/s" for ms in ssl["by_step_ms"])
    rows = []
    for n in SIZING_VOLUMES:
        shard = index_mib(index, n) / 1024
        node = SIZING_RANKS_PER_NODE * (tree["peak_rank_tree_pss_gb"] + shard)
        rows.append([f"{n:,} (extrapolated)", _bytes(n * stored),
                     *(duration(n * times["core_s_per_volume"] / cores) for cores in SIZING_CORES),
                     f"{node:.1f} GiB ({SIZING_RANKS_PER_NODE} x {shard:.2f} GiB of datalist and index)", workers,
                     reads])  # fmt: skip
    shape = "x".join(str(n) for n in preprocess["corpus"]["shape"])
    index_sizes = ", ".join(f"{int(size):,}" for size in index["sizes"])
    return [f"Sizing for N volumes like the benchmark's ({shape} int16 CT; scale the store, the times and the reads "
            "by your volumes' voxels). Every row is extrapolated from figures measured at other sizes:", "",
            f"- preprocessing: {times['core_s_per_volume']:.2f} core-seconds per volume, the {int(largest):,}-volume "
            f"corpus of data_scale ({_origin(preprocess, times)});",
            f"- store on disk: {_mb(stored)} MB per volume (data_scale, {_origin(store, stored_run)}; bytes do not "
            "depend on the load);",
            f"- host memory: {SIZING_RANKS_PER_NODE} ranks, each {tree['peak_rank_tree_pss_gb']:.2f} GiB with its "
            f"{tree['loader_workers']} loader workers (PSS of the rank and its workers, the SSL bundle from the disk "
            f"store, measured at up to {measured_at:,} volumes: data_scale, {_origin(store, tree)}; each worker about "
            f"{per_worker:.2f} GiB more than the rank without workers), plus what its datalist "
            f"and index shard add at N volumes (index_scale at {index_sizes} entries, linear between them; "
            f"{_origin(index)}); the network, its activations and the optimizer state come on top (the benchmark's "
            "network is tiny), and forked workers that touch the pages of the rank's datalist copy them (not "
            "measured at N volumes);",
            f"- SSL loader workers per GPU and storage reads per node by GPU step time: {ssl['batch_size']} volumes "
            f"per step, {cold['crops_per_s_cold']:.1f} cold crops per second of one worker and "
            f"{_mb(cold['read_bytes_per_item_cold'])} MB read from storage per volume read cold "
            f"({_origin(store, cold)}; a loaded machine gives fewer crops per second, so more workers).", "",
            *_table(["volumes", "store on disk", *(f"preprocess on {c} cores" for c in SIZING_CORES),
                     f"host memory, {SIZING_RANKS_PER_NODE} ranks with {tree['loader_workers']} workers each",
                     "SSL loader workers per GPU (cold)",
                     f"storage reads per node of {SIZING_RANKS_PER_NODE} GPUs (cold)"],
                   rows)]  # fmt: skip


def goals_lines(result: dict) -> list[str]:
    goals, targets = result["goals"], result["goals"]["targets"]

    def met(flag: bool) -> str:
        return "**met**" if flag else "**not met**"

    flat = f"- memory per rank with the disk store flat within {targets['disk_memory_flat_within']:.0%}: "
    if len(result["memory"]) == 1:
        lines = ["Goals:", "", flat + "one size measured, not shown;"]
    else:
        lines = ["Goals:", "",
                 flat + f"{goals['disk_memory_change']:.1%} at most ({goals['disk_memory_change_at_start_line']:.1%} "
                 f"up to the start line) -- {met(goals['disk_memory_flat_met'])};"]  # fmt: skip
    if "disk_memory_change_with_workers" in goals and len(result["memory"]) > 1:
        lines.append(f"- the same with the loader workers: {goals['disk_memory_change_with_workers']:.1%} at most -- "
                     f"{met(goals['disk_memory_flat_with_workers_met'])};")  # fmt: skip
    lines += [f"- first iteration within {targets['disk_first_iteration_s']:g} s of the launch (disk): "
              f"{goals['disk_first_iteration_s_max']:.1f} s at most -- {met(goals['disk_first_iteration_met'])};",
              f"- disk at least {targets['disk_over_memory_crops_per_s']}x the in-memory crops per second per worker, "
              f"warm: {goals['disk_over_memory_crops_per_s_min']:.2f}x at least -- {met(goals['disk_crops_per_s_met'])}"
              + ("." if "disk_cold_over_memory_crops_per_s_min" not in goals else
                 f"; cold: {goals['disk_cold_over_memory_crops_per_s_min']:.2f}x at least -- "
                 f"{met(goals['disk_cold_crops_per_s_met'])}."), ""]  # fmt: skip
    return lines


def markdown_tables(result: dict) -> str:
    """All tables of ``result`` with its commit, machine and caveat, in Markdown (the sizing table apart:
    :func:`sizing_table`)."""
    machine = result["machine"]
    head = (f"Commit {result['commit'][:12]}, {machine['cpu_model']} ({machine['cpu_count']} CPUs), load "
            f"{machine['load_avg_1_5_15'][0]:.1f} at the start, {machine['load_avg_1_5_15_at_end'][0]:.1f} at the end; "
            f"{result['wall_s'] / 3600:.2f} h")  # fmt: skip
    head += f"; **{result['caveat']}**." if result.get("caveat") else "."
    lines = [head, "", *corpus_table(result), *memory_table(result), *worker_memory_table(result),
             *crops_table(result), *cold_table(result), *workers_table(result), *goals_lines(result)]  # fmt: skip
    return "\n".join(lines).rstrip() + "\n"


def _name(path: Path) -> str:
    resolved = path.resolve()
    return resolved.relative_to(REPO).as_posix() if resolved.is_relative_to(REPO) else path.as_posix()


def _write_block(doc: Path, begin: str, end: str, body: str) -> bool:
    """Replaces what ``doc`` holds between the line ``begin`` and the next ``end`` by ``body``; True when the file
    changed.

    Raises:
        ValueError: the document has no such block.
    """
    text = doc.read_text()
    if begin not in text or end not in text.split(begin, 1)[1]:
        raise ValueError(f"{doc} has no block {begin!r} ... {end!r}.")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    new = f"{head}{begin}\n\n{body}\n{end}{tail}"
    doc.write_text(new)
    return new != text


def write_doc_tables(doc: Path, result_path: Path) -> bool:
    """Replaces the block of ``doc`` between :data:`DOC_BLOCK` (naming ``result_path``) and :data:`DOC_BLOCK_END` by
    the tables of that result; True when the file changed.

    Raises:
        ValueError: the document has no block of this result.
    """
    begin = DOC_BLOCK.format(result=_name(result_path))
    return _write_block(doc, begin, DOC_BLOCK_END, markdown_tables(json.loads(result_path.read_text())))


def sizing_block(paths: list[Path]) -> str:
    """The line that opens the sizing block computed from ``paths`` (corpus, rates and index results)."""
    return SIZING_BLOCK.format(results=" ".join(_name(p) for p in paths))


def write_doc_sizing(doc: Path, paths: list[Path]) -> bool:
    """Replaces the block of ``doc`` between :func:`sizing_block` of ``paths`` and :data:`SIZING_BLOCK_END` by
    :func:`sizing_table` of those results; True when the file changed.

    Raises:
        ValueError: the document has no sizing block of these results.
    """
    table = "\n".join(sizing_table(*(json.loads(p.read_text()) for p in paths))).rstrip() + "\n"
    return _write_block(doc, sizing_block(paths), SIZING_BLOCK_END, table)
