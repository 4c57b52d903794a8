"""The Markdown tables of a ``benchmarks/data_scale.py`` result, as benchmarks/README.md shows them: printed by
``data_scale.py --markdown RESULT`` and written between the markers of a document by ``--write_docs DOC``."""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC_BLOCK = "<!-- data_scale tables: python benchmarks/data_scale.py --markdown {result} --write_docs ... -->"
DOC_BLOCK_END = "<!-- /data_scale tables -->"


def _row(cells: list) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _table(header: list[str], rows: list[list]) -> list[str]:
    return [_row(header), _row(["---"] * len(header)), *(_row(r) for r in rows), ""]


def _mb(value: float) -> str:
    return f"{value / 1e6:.2f}"


def _load(values: list[float]) -> str:
    return f"{values[0]:.1f}"


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


def crops_table(result: dict) -> list[str]:
    """Per recipe: crops per second of one worker from memory and from disk, and their ratio."""
    rows = []
    for recipe, run in result["crops"].items():
        loads = run["load_avg_before_rounds"]
        rows.append([recipe, f"`{run['bundle']}`", f"{run['volumes']} ({run['crops']} crops)",
                     f"{run['crops_per_s_memory']:.1f}", f"{run['crops_per_s_disk']:.1f}",
                     f"**{run['disk_over_memory']:.2f}**", run["disk_reads"],
                     f"{min(v[0] for v in loads):.1f}-{max(v[0] for v in loads):.1f}"])  # fmt: skip
    return ["Crops per second of one loader worker (one process, one thread), in-memory cache against the disk "
            "store, the same crops:", "",
            *_table(["recipe", "bundle", "volumes", "memory crops/s", "disk crops/s", "disk / memory", "disk reads",
                     "load"], rows)]  # fmt: skip


def _workers_cell(need: dict) -> str:
    mark = "" if need["16_cores_suffice_disk"] else " (more than 16 cores)"
    return f"{need['workers_disk']} disk / {need['workers_memory']} memory{mark}"


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
            "worker; 16 cores suffice with at most 15 workers beside the training process):", "",
            *_table(["recipe", "batch x crops", "measured GPU step", *(f"{ms} ms step" for ms in steps)], rows)]


#: the corpora and machines the sizing table computes for: volumes, preprocessing cores, ranks (GPUs) per node
SIZING_VOLUMES = (10_000, 50_000, 160_000)
SIZING_CORES = (16, 64)
SIZING_RANKS_PER_NODE = 8


def _bytes(value: float) -> str:
    return f"{value / 1e12:.2f} TB" if value >= 1e12 else f"{value / 1e9:.0f} GB"


def duration(seconds: float) -> str:
    """``seconds`` as minutes below an hour, else hours: ``duration(540)`` is ``"9 min"``."""
    return f"{seconds / 60:.0f} min" if seconds < 3600 else f"{seconds / 3600:.1f} h"


def sizing_table(result: dict) -> list[str]:
    """What a corpus of N volumes like the benchmark's needs, computed from the measured figures of the largest
    corpus: the store on disk (stored bytes per volume), preprocessing hours on C cores (core-seconds per volume),
    host memory per node with the disk store (the largest measured peak per rank times the ranks; loader workers
    and what the datalist and index add beyond the measured sizes not included), and loader workers per GPU (the
    SSL recipe at each step time of the workers table)."""
    largest = max(result["preprocess"], key=int)
    run = result["preprocess"][largest]
    disk_memory = max(result["memory"][size]["disk"]["peak_rank_pss_gb"] for size in result["memory"])
    ssl = result["workers"].get("ssl")
    workers = ", ".join(f"{ms} ms: {need['workers_disk']}" for ms, need in ssl["by_step_ms"].items()) if ssl else "not measured"
    rows = [[f"{n:,}", _bytes(n * run["store_bytes_per_volume"]),
             *(duration(n * run['core_s_per_volume'] / cores) for cores in SIZING_CORES),
             f"{SIZING_RANKS_PER_NODE * disk_memory:.1f} GiB", workers] for n in SIZING_VOLUMES]  # fmt: skip
    shape = "x".join(str(n) for n in result["corpus"]["shape"])
    return [f"Sizing, computed from the figures above (the {int(largest):,}-volume corpus: "
            f"{_mb(run['store_bytes_per_volume'])} MB and {run['core_s_per_volume']:.2f} core-seconds per {shape} "
            f"volume; {disk_memory:.2f} GiB per rank with the disk store, at most over the sizes; the SSL recipe's "
            "loader workers per GPU by step time). Scale the store and the times by your volumes' voxels. Every row "
            f"is extrapolated: memory per rank was measured up to {int(largest):,} volumes only, and the host memory "
            "column leaves out what a rank's datalist and index add at N volumes (measured apart: "
            "benchmarks/results/index_scale.json):", "",
            *_table(["volumes", "store on disk", *(f"preprocess on {c} cores" for c in SIZING_CORES),
                     f"host memory, {SIZING_RANKS_PER_NODE} ranks (no workers, nor datalist and index)",
                     "SSL loader workers per GPU"], rows)]


def goals_lines(result: dict) -> list[str]:
    goals, targets = result["goals"], result["goals"]["targets"]

    def met(flag: bool) -> str:
        return "**met**" if flag else "**not met**"

    return ["Goals:", "",
            f"- memory per rank with the disk store flat within {targets['disk_memory_flat_within']:.0%}: "
            f"{goals['disk_memory_change']:.1%} at most ({goals['disk_memory_change_at_start_line']:.1%} up to the "
            f"start line) -- {met(goals['disk_memory_flat_met'])};",
            f"- first iteration within {targets['disk_first_iteration_s']:g} s of the launch (disk): "
            f"{goals['disk_first_iteration_s_max']:.1f} s at most -- {met(goals['disk_first_iteration_met'])};",
            f"- disk at least {targets['disk_over_memory_crops_per_s']}x the in-memory crops per second per worker: "
            f"{goals['disk_over_memory_crops_per_s_min']:.2f}x at least -- {met(goals['disk_crops_per_s_met'])}.",
            ""]  # fmt: skip


def markdown_tables(result: dict) -> str:
    """All tables of ``result`` with its commit and machine, in Markdown."""
    machine = result["machine"]
    head = (f"Commit {result['commit'][:12]}, {machine['cpu_model']} ({machine['cpu_count']} CPUs), load "
            f"{machine['load_avg_1_5_15'][0]:.1f} at the start, {machine['load_avg_1_5_15_at_end'][0]:.1f} at the end; "
            f"{result['wall_s'] / 3600:.2f} h.")  # fmt: skip
    lines = [head, "", *corpus_table(result), *memory_table(result), *crops_table(result), *workers_table(result),
             *goals_lines(result), *sizing_table(result)]  # fmt: skip
    return "\n".join(lines).rstrip() + "\n"


def write_doc_tables(doc: Path, result_path: Path) -> bool:
    """Replaces the block of ``doc`` between :data:`DOC_BLOCK` (naming ``result_path``) and :data:`DOC_BLOCK_END` by
    the tables of that result; True when the file changed.

    Raises:
        ValueError: the document has no block of this result.
    """
    text = doc.read_text()
    resolved = result_path.resolve()
    name = resolved.relative_to(REPO).as_posix() if resolved.is_relative_to(REPO) else result_path.as_posix()
    begin = DOC_BLOCK.format(result=name)
    if begin not in text:
        raise ValueError(f"{doc} has no block of {name} (a line {begin!r} and later {DOC_BLOCK_END!r}).")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(DOC_BLOCK_END, 1)
    new = f"{head}{begin}\n\n{markdown_tables(json.loads(result_path.read_text()))}\n{DOC_BLOCK_END}{tail}"
    doc.write_text(new)
    return new != text
