"""benchmarks/data_scale.py: its --small run reports every phase, size, mode and recipe with consistent bytes and
counts, measures a rank with its loader workers, reads its cold passes from storage (and its warm ones from the page
cache), leaves no process behind, resumes from its work folder and renders its Markdown tables; the estimate that
decides whether an in-memory mode is measured, the workers a GPU needs and the sizing table on known numbers; the
committed results' tables are those in the docs. No timing is asserted."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "data_scale.py"
sys.path.insert(0, str(REPO / "benchmarks"))
MODES = {"full", "smart", "none", "disk"}
RECIPES = {"ssl", "dino", "finetune"}


def _run(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _processes_using(folder: Path) -> list[str]:
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if str(folder) in cmdline and proc.info["pid"] != os.getpid():
            found.append(cmdline)
    return found


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> tuple[Path, Path, dict, str]:
    root = tmp_path_factory.mktemp("data_scale")
    work, out = root / "work", root / "data_scale.json"
    proc = _run("--small", "--work", str(work), "--out", str(out), "--caveat", "loaded test machine")
    return work, out, json.loads(proc.stdout), proc.stderr


@pytest.mark.slow
def test_the_small_run_reports_every_section_and_mode(small_run):
    work, out, result, _ = small_run
    assert json.loads(out.read_text()) == result  # exactly one JSON object on stdout, the same in the file
    assert result["benchmark"] == "data_scale" and len(result["commit"]) >= 40
    sections = {"corpus", "preprocess", "memory", "worker_memory", "crops", "cold", "workers", "goals", "settings",
                "machine", "wall_s", "caveat"}  # fmt: skip
    assert sections <= set(result) and result["caveat"] == "loaded test machine"
    assert len(result["machine"]["load_avg_1_5_15_at_end"]) == 3
    assert result["settings"]["sizes"] == [4, 8] and result["settings"]["shape"] == [64, 64, 48]
    assert list(result["preprocess"]) == list(result["memory"]) == list(result["worker_memory"]) == ["4", "8"]
    assert set(result["crops"]) == set(result["cold"]) == set(result["workers"]) == RECIPES
    for size in ("4", "8"):
        assert set(result["memory"][size]) == MODES
    assert not _processes_using(work)  # every bundle run's process tree was ended


@pytest.mark.slow
def test_the_corpus_links_and_the_store_bytes_are_consistent(small_run):
    work, _, result, _ = small_run
    corpus = result["corpus"]
    assert (corpus["distinct_volumes"], corpus["linked_volumes"], corpus["written_now"]) == (4, 4, 4 + 2 + 2)
    images = work / "corpus" / "images"
    for i in range(4, 8):  # the larger size repeats the distinct volumes under new names
        link = images / f"case_{i:04d}.nii.gz"
        assert link.is_symlink() and link.resolve() == (images / f"case_{i - 4:04d}.nii.gz").resolve()
    lists = {size: json.loads((work / "corpus" / f"datalist_{size}.json").read_text()) for size in (4, 8)}
    assert [len(lists[s]["training"]) for s in (4, 8)] == [4, 8]
    assert lists[4]["validation"] == lists[8]["validation"] and len(lists[4]["validation"]) == 2
    for size, run in result["preprocess"].items():
        assert run["volumes"] == run["written"] == int(size) and run["reused"] == 0 and run["workers"] == 2
        assert run["nii_gz_bytes_per_volume"] == corpus["nii_gz_bytes_per_volume"]  # links count their target's bytes
        ratio = run["store_bytes_per_volume"] / run["nii_gz_bytes_per_volume"]
        assert run["store_over_nii_gz"] == pytest.approx(ratio, abs=2e-3)
        assert run["store_total_bytes"] > run["volumes"] * run["store_bytes_per_volume"] * 0.99  # the index on top
        assert run["core_s_per_volume"] == pytest.approx(run["s_per_volume"] * 2, rel=0.01)


@pytest.mark.slow
def test_in_memory_modes_beyond_the_budget_are_extrapolated_never_measured(small_run):
    """The small run's budget of 0 GB measures the in-memory modes at the first size only."""
    _, _, result, _ = small_run
    memory = result["memory"]
    measured = [memory["4"][m] for m in MODES] + [memory["8"]["none"], memory["8"]["disk"]]
    for run in measured:
        assert run["status"] == "measured" and run["left_running"] == 0 and len(run["load_avg_before"]) == 3
        assert 0 < run["peak_rank_pss_gb_at_start_line"] <= run["peak_rank_pss_gb"] <= run["peak_tree_pss_gb"]
        assert 0 < run["start_line_s"] <= run["first_iteration_s"]
    for mode in ("full", "smart"):
        run = memory["8"][mode]
        assert run["status"] == "extrapolated" and run["from_sizes"] == [4] and run["budget_gb"] == 0.0
        assert run["both_ranks_gb"] == pytest.approx(2 * run["peak_rank_pss_gb"], abs=0.01)
    assert [memory[s]["full"]["cached_volumes_per_rank"] for s in ("4", "8")] == [2, 4]
    assert [memory[s]["smart"]["cached_volumes_per_rank"] for s in ("4", "8")] == [2, 2]
    assert memory["4"]["none"]["cached_volumes_per_rank"] == memory["8"]["disk"]["cached_volumes_per_rank"] == 0


@pytest.mark.slow
def test_crops_and_workers_per_recipe(small_run):
    _, _, result, _ = small_run
    crops_per_volume = {"ssl": 2, "dino": 1, "finetune": 4}  # the bundles' training#num_samples
    for recipe, run in result["crops"].items():
        assert run["crops"] == run["volumes"] * crops_per_volume[recipe] * result["settings"]["crop_rounds"]
        assert run["crops_per_s_memory"] > 0 and run["crops_per_s_disk"] > 0
        assert run["disk_over_memory"] == pytest.approx(run["crops_per_s_disk"] / run["crops_per_s_memory"], rel=0.02)
        assert run["disk_reads"] == "only the chunks each crop covers"
    for recipe, need in result["workers"].items():
        assert need["crops_per_step"] == need["batch_size"] * crops_per_volume[recipe]
        assert need["gpu_step_ms"] == "not measured" and need["at_gpu_step"] is None
        assert list(need["by_step_ms"]) == ["100", "200", "400"]
        for ms, row in need["by_step_ms"].items():
            assert row["gpu_crops_per_s"] == pytest.approx(need["crops_per_step"] * 1000 / int(ms))
            assert row["workers_disk"] >= 1 and row["workers_memory"] >= 1 and row["workers_cold"] >= 1
    assert set(result["goals"]) >= {"disk_memory_flat_met", "disk_first_iteration_met", "disk_crops_per_s_met",
                                    "disk_cold_crops_per_s_met", "disk_memory_flat_with_workers_met"}  # fmt: skip


@pytest.mark.slow
def test_a_rank_is_measured_with_its_loader_workers(small_run):
    """Each rank's process tree holds the rank and its 2 workers, and their PSS adds up to more than the largest
    process alone; RSS counts the pages they share in each, so it is at least the PSS."""
    _, _, result, _ = small_run
    for size, run in result["worker_memory"].items():
        assert run["status"] == "measured" and run["left_running"] == 0 and run["loader_workers"] == 2
        assert run["iterations"] == min(3, int(size) // 2) and run["iterations_s"] >= run["first_iteration_s"]
        assert run["rank_tree_processes"] >= 1 + 2
        assert run["peak_rank_tree_rss_gb"] >= run["peak_rank_tree_pss_gb"] > run["peak_rank_pss_gb"] + 0.02
        alone = result["memory"][size]["disk"]
        assert alone["rank_tree_processes"] == 1 and alone["peak_rank_tree_pss_gb"] >= alone["peak_rank_pss_gb"]


def _reads_counted(folder: Path) -> bool:
    from page_cache import read_bytes, storage

    return read_bytes() is not None and storage(folder)["filesystem"] not in ("tmpfs", "ramfs", "overlay")


@pytest.mark.slow
def test_the_cold_passes_read_from_storage_and_the_warm_ones_do_not(small_run):
    """After the eviction no byte of the store is cached; the cold passes read from storage at least what the crops
    of an item need, the warm passes (the same crops again, or the warm crops phase) next to nothing, and no array
    is kept open between items in the cold phase while the warm phase keeps every volume's."""
    work, _, result, _ = small_run
    rounds = result["settings"]["cold_rounds"]
    for recipe, run in result["cold"].items():
        cache, warm = run["page_cache"], result["crops"][recipe]
        assert run["crops"] == warm["crops"] * rounds // result["settings"]["crop_rounds"]
        assert run["crops_per_s_cold"] > 0 and run["crops_per_s_arrays_missing"] > 0
        assert run["cold_over_memory"] == pytest.approx(run["crops_per_s_cold"] / run["crops_per_s_memory"], rel=0.02)
        assert cache["mechanism"].startswith("fsync, then posix_fadvise") and cache["files"] >= run["volumes"]
        assert len(cache["resident_bytes_after_drop"]) == rounds and max(cache["resident_bytes_after_drop"]) == 0
        assert run["store_files_mapped_after"] == [0] * rounds
        assert warm["store_files_mapped_after"] >= run["volumes"] and run["store_files_mapped_kept"] >= run["volumes"]
        assert run["arrays_kept_over_memory"] == pytest.approx(
            run["crops_per_s_arrays_kept"] / run["crops_per_s_memory_beside_kept"], rel=0.02)
        if _reads_counted(work):
            cold = run["read_bytes_per_item_cold"]
            assert cold >= 4096 and run["read_bytes_per_crop_cold"] * run["crops"] == pytest.approx(
                cold * run["volumes"] * rounds, rel=0.01)
            assert run["read_bytes_per_crop_arrays_missing"] <= 0.05 * run["read_bytes_per_crop_cold"]
            assert warm["read_bytes_per_crop_disk"] <= 0.05 * run["read_bytes_per_crop_cold"]


@pytest.mark.slow
def test_a_rerun_keeps_every_phase_and_takes_measured_step_times(small_run, tmp_path):
    work, out, result, _ = small_run
    again = _run("--small", "--work", str(work), "--gpu_step_ms", "ssl=250", "--out", str(tmp_path / "again.json"))
    kept = 1 + 2 + 6 + 2 + 3 + 3  # corpus, preprocess and memory per size, memory with workers, crops and cold
    assert again.stderr.count("done in") == 0 and again.stderr.count("kept from an earlier run") == kept
    rerun = json.loads(again.stdout)
    for section in ("corpus", "preprocess", "memory", "worker_memory", "crops", "cold"):
        assert rerun[section] == result[section]
    ssl = rerun["workers"]["ssl"]
    assert ssl["gpu_step_ms"] == 250 and ssl["at_gpu_step"]["gpu_crops_per_s"] == pytest.approx(16.0)
    assert rerun["workers"]["dino"]["gpu_step_ms"] == "not measured"


@pytest.mark.slow
def test_the_markdown_renders_and_fills_a_document_block(small_run, tmp_path):
    _, out, _, _ = small_run
    text = _run("--markdown", str(out)).stdout
    for expected in ("| none |", "| disk |", "| smart |", "| full |", "extrapolated from 4", "| ssl |", "| dino |",
                     "| finetune |", "not measured", "Goals:", "**loaded test machine**", "| 8 | 2 | ",
                     "rank + workers, PSS", "disk crops/s, cold", "; cold: "):  # fmt: skip
        assert expected in text, expected
    index = REPO / "benchmarks" / "results" / "index_scale.json"
    sizing = _run("--sizing", str(out), str(out), str(index)).stdout
    rows = [line for line in sizing.splitlines() if line.startswith("| 1") or line.startswith("| 5")]
    assert [row.split(" | ")[0] for row in rows] == [f"| {n} (extrapolated)" for n in ("10,000", "50,000", "100,000",
                                                                                         "160,000")]  # fmt: skip
    assert "loaded test machine" in sizing and "with 2 workers each" in sizing
    from data_scale_tables import DOC_BLOCK, DOC_BLOCK_END

    doc = tmp_path / "README.md"
    doc.write_text(f"before\n{DOC_BLOCK.format(result=out.as_posix())}\nOLD BLOCK\n{DOC_BLOCK_END}\nafter\n")
    assert "updated" in _run("--markdown", str(out), "--write_docs", str(doc)).stdout
    written = doc.read_text()
    assert written.startswith("before\n") and written.endswith(f"{DOC_BLOCK_END}\nafter\n")
    assert "OLD BLOCK" not in written
    assert text in written
    assert "unchanged" in _run("--markdown", str(out), "--write_docs", str(doc)).stdout


def test_the_estimate_adds_the_measured_memory_per_cached_volume_to_the_cacheless_run():
    from data_scale import Settings, estimate, workers_needed

    settings = Settings(sizes=(100, 1000), memory_budget_gb=17.0, workers=1)
    runs = {
        100: {"none": {"peak_rank_pss_gb": 1.0, "peak_rank_pss_gb_at_start_line": 0.8, "start_line_s": 8.0,
                       "first_iteration_s": 9.0},
              "full": {"status": "measured", "peak_rank_pss_gb": 1.5, "peak_rank_pss_gb_at_start_line": 1.3,
                       "start_line_s": 33.0, "first_iteration_s": 34.0}},
        1000: {"none": {"peak_rank_pss_gb": 1.1, "peak_rank_pss_gb_at_start_line": 0.9, "start_line_s": 9.0,
                        "first_iteration_s": 10.0}},
    }  # fmt: skip
    assert estimate(settings, "full", 100, runs) is None  # nothing measured before the first size
    guess = estimate(settings, "full", 1000, runs)  # 50 volumes per rank cost 0.5 GiB and 25 s; 500 cost 10x
    assert guess == {"from_sizes": [100], "peak_rank_pss_gb": 6.1, "peak_rank_pss_gb_at_start_line": 5.9,
                     "start_line_s": 259.0, "first_iteration_s": 260.0}  # fmt: skip
    assert workers_needed(4, 200, 5.0) == 4 and workers_needed(4, 200, 4.9) == 5


def test_the_sizing_table_scales_the_largest_corpus_figures():
    """10,000 volumes of 20 MB and 3.6 core-seconds each: 200 GB, 38 minutes on 16 cores (minutes below an hour, else
    hours); a node's memory is 8 ranks of the largest rank with its workers plus its datalist and index shard at N,
    linear between the index sizes measured (50 MiB at 100,000, 500 MiB at 1,000,000: 5 MiB at 10,000, 80 MiB at
    160,000); the workers are the SSL recipe's cold ones by step time, the reads 8 GPUs x 2 volumes per step x 5 MB
    per cold volume; every row is marked extrapolated."""
    from data_scale_tables import index_mib, sizing_table

    preprocess = {
        "commit": "a" * 40, "corpus": {"shape": [256, 256, 160]},
        "preprocess": {"100": {"store_bytes_per_volume": 1e9, "core_s_per_volume": 99.0},
                       "1000": {"store_bytes_per_volume": 1e9, "core_s_per_volume": 3.6}},
    }  # fmt: skip
    store = {
        "commit": "b" * 40, "caveat": "loaded: details",
        "preprocess": {"100": {"store_bytes_per_volume": 20e6}},
        "memory": {"100": {"disk": {"peak_rank_pss_gb": 1.0}}, "200": {"disk": {"peak_rank_pss_gb": 1.0}}},
        "worker_memory": {"100": {"peak_rank_tree_pss_gb": 1.5, "loader_workers": 4},
                          "200": {"peak_rank_tree_pss_gb": 1.25, "loader_workers": 4}},
        "cold": {"ssl": {"crops_per_s_cold": 30.0, "read_bytes_per_item_cold": 5e6}},
        "workers": {"ssl": {"batch_size": 2, "by_step_ms": {"100": {"workers_cold": 9}, "400": {"workers_cold": 3}}}},
    }  # fmt: skip
    summary = {"load_datalist": {"rss_mib": {"max": 40.0}}, "training_store": {"rss_mib": {"max": 10.0}}}
    big = {"load_datalist": {"rss_mib": {"max": 400.0}}, "training_store": {"rss_mib": {"max": 100.0}}}
    index = {"commit": "c" * 40, "sizes": {"100000": {"datalist": {"summary": summary}},
                                           "1000000": {"datalist": {"summary": big}}}}  # fmt: skip
    assert [index_mib(index, n) for n in (10_000, 100_000, 160_000, 1_900_000)] == pytest.approx([5, 50, 80, 950])
    lines = sizing_table(preprocess, store, index)
    row = next(line for line in lines if line.startswith("| 10,000 "))
    assert row == ("| 10,000 (extrapolated) | 200 GB | 38 min | 9 min | 12.0 GiB (8 x 0.00 GiB of datalist and index) "
                   "| 100 ms: 9, 400 ms: 3 | 100 ms: 0.80 GB/s, 400 ms: 0.20 GB/s |")  # fmt: skip
    last = next(line for line in lines if line.startswith("| 160,000 ")).split(" | ")
    assert last[1:4] == ["3.20 TB", "10.0 h", "2.5 h"]
    assert last[4] == f"{8 * (1.5 + 80 / 1024):.1f} GiB (8 x 0.08 GiB of datalist and index)"
    text = "\n".join(lines)
    assert "commit bbbbbbbbbbbb, loaded;" in text and "commit aaaaaaaaaaaa, no caveat recorded" in text
    assert "each worker about 0.12 GiB more" in text
    with pytest.raises(ValueError, match="no worker_memory or cold"):
        sizing_table(preprocess, {"commit": "d" * 40}, index)
    store["caveat"] = "mixed: the cold phase idle, the others loaded"  # records of runs under different loads
    store["preprocess"]["100"].update(commit="e" * 40, load_avg_before=[6.36, 7.1, 7.0])
    store["cold"]["ssl"].update(commit="f" * 40, load_avg_before_rounds=[[0.96, 1.0, 1.0], [1.04, 1.0, 1.0]])
    text = "\n".join(sizing_table(preprocess, store, index))
    assert "(data_scale, commit eeeeeeeeeeee, load 6.4 before it, one record of a mixed result;" in text
    assert "(commit ffffffffffff, load 1.0 before it, one record of a mixed result;" in text
    assert "data_scale, commit bbbbbbbbbbbb, mixed;" in text  # worker memory: no load recorded with it here


def test_the_page_cache_is_evicted_and_the_cold_read_counted(tmp_path):
    """A file just written is cached; after drop_page_cache none of it is, and reading it back reads its bytes from
    storage (where the platform counts them and the folder is on a disk), the second read none."""
    from page_cache import drop_page_cache, mapped_files, read_bytes, resident_bytes, store_files

    data = np.random.default_rng(0).integers(0, 255, 3 * 2**20, dtype=np.uint8).tobytes()
    (tmp_path / "sub").mkdir()
    path = tmp_path / "sub" / "a.bin"
    path.write_bytes(data)
    assert store_files(tmp_path) == [path]
    if resident_bytes([path]) is None:
        pytest.skip("no mincore here")
    assert drop_page_cache([path]) and resident_bytes([path]) == 0
    if _reads_counted(tmp_path):
        before = read_bytes()
        assert path.read_bytes() == data
        middle = read_bytes()
        path.read_bytes()
        assert middle - before >= len(data) and read_bytes() - middle < 0.01 * len(data)
    assert resident_bytes([path]) == len(data)
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ):
        assert mapped_files(tmp_path) == 1
    assert mapped_files(tmp_path) == 0


def test_redo_measures_a_phase_again_and_a_crops_store_of_an_earlier_version_is_written_again(tmp_path, capsys):
    """``--redo`` recomputes a phase whose record is there; the crop phases write a recipe's store again where it
    answers other transforms, format or package versions (a store an earlier version wrote), and reuse it
    otherwise."""
    from dataclasses import replace

    from data_scale import REDO, SMALL, _crop_sources, kept, write_corpus

    assert set(REDO) == {"crops", "cold"}
    record = tmp_path / "phases" / "crops" / "ssl.json"
    assert kept(record, lambda: {"n": 1})["n"] == 1
    assert kept(record, lambda: {"n": 2})["n"] == 1 and kept(record, lambda: {"n": 2}, redo=True)["n"] == 2
    assert json.loads(record.read_text())["n"] == 2
    settings = replace(SMALL, sizes=(2,), distinct=2, validation=1, labeled=1, crop_volumes=2, workers=1)
    write_corpus(settings, tmp_path / "corpus")
    store = tmp_path / "stores" / "crops_ssl"
    assert len(_crop_sources(settings, tmp_path / "corpus", store, "ssl")["disk"]) == 2
    index = json.loads((store / "index.json").read_text())
    assert "written again" not in capsys.readouterr().err
    _crop_sources(settings, tmp_path / "corpus", store, "ssl")
    assert "written again" not in capsys.readouterr().err  # the same transforms: the store is used as it is
    (store / "index.json").write_text(json.dumps({**index, "fingerprint": "0" * 64}))  # as an earlier version's
    sources = _crop_sources(settings, tmp_path / "corpus", store, "ssl")
    assert f"{store} written again" in capsys.readouterr().err and len(sources["disk"]) == 2
    assert json.loads((store / "index.json").read_text())["fingerprint"] == index["fingerprint"]


def test_crop_rate_cuts_the_same_crops_from_either_source_and_times_nothing_with_no_pass(tmp_path, capsys):
    """benchmarks/crop_rate.py (the crops phase for one source, for timing a whole process): memory and disk cut as
    many crops per pass, with the arrays kept or not, and cold (read from storage where reads are counted); with no
    pass nothing is timed."""
    from crop_rate import main

    work = str(tmp_path / "work")
    small = ["--work", work, "--small", "--volumes", "2", "--recipe", "ssl"]
    memory = main([*small, "--source", "memory", "--passes", "2"])
    disk = main([*small, "--source", "disk", "--passes", "2", "--arrays_kept", "0"])
    assert memory["crops"] == disk["crops"] == 2 * 2 * 2 and disk["arrays_kept"] == 0  # 2 volumes x 2 crops x 2 passes
    assert disk["crops_per_s"] > 0 and len(disk["load_avg_before"]) == 3 and disk["cold"] is False
    assert disk["cpu_seconds"] > 0
    assert disk["crops_per_cpu_s"] == pytest.approx(disk["crops"] / disk["cpu_seconds"], rel=0.2)  # both rounded
    cold = main([*small, "--source", "disk", "--passes", "2", "--cold"])
    assert cold["crops"] == disk["crops"] and cold["arrays_kept"] == 0 and cold["cold"] is True
    if _reads_counted(tmp_path):
        assert cold["read_bytes_per_crop"] > 0
    setup = main([*small, "--source", "disk", "--passes", "0"])
    assert setup["crops"] == 0 and setup["crops_per_s"] is None and setup["crops_per_cpu_s"] is None
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["source"] for line in lines] == ["memory", "disk", "disk", "disk"]
    with pytest.raises(SystemExit):
        main([*small, "--source", "memory", "--cold"])


def test_a_work_folder_gains_the_settings_of_new_phases_and_refuses_changed_ones(tmp_path):
    """A work folder written before loader_workers existed is taken (its phase has not run there) and its record
    completed; a folder measured with other loader workers is refused, naming the setting."""
    from dataclasses import asdict

    from data_scale import SMALL, _check_work

    added = ("loader_workers", "worker_iterations", "cold_rounds")
    old = {k: v for k, v in json.loads(json.dumps(asdict(SMALL))).items() if k not in added}
    (tmp_path / "settings.json").write_text(json.dumps(old))
    _check_work(SMALL, tmp_path)
    assert json.loads((tmp_path / "settings.json").read_text())["loader_workers"] == SMALL.loader_workers
    from dataclasses import replace

    with pytest.raises(SystemExit, match="loader_workers differ"):
        _check_work(replace(SMALL, loader_workers=8), tmp_path)


@pytest.mark.parametrize("doc", ["docs/scale.md", "benchmarks/README.md"])
def test_the_docs_show_the_tables_of_the_committed_results(doc):
    """Every data_scale block of the document is what --markdown or --sizing prints for the results it names."""
    from data_scale_tables import (DOC_BLOCK, DOC_BLOCK_END, SIZING_BLOCK, SIZING_BLOCK_END, markdown_tables,
                                   sizing_table)  # fmt: skip

    text = (REPO / doc).read_text()
    blocks = 0
    for line in text.splitlines():
        for begin, end in ((DOC_BLOCK, DOC_BLOCK_END), (SIZING_BLOCK, SIZING_BLOCK_END)):
            head, _, tail = begin.partition("{")
            tail = tail.partition("}")[2]
            if line.startswith(head) and line.endswith(tail):
                names = line[len(head) : len(line) - len(tail)].split()
                results = [json.loads((REPO / name).read_text()) for name in names]
                block = text.split(line, 1)[1].split(end, 1)[0]
                expected = markdown_tables(results[0]) if end == DOC_BLOCK_END else "\n".join(sizing_table(*results))
                assert block.strip() == expected.strip(), f"{doc}: {line}"
                blocks += 1
    assert blocks >= 2
