"""benchmarks/data_scale.py: its --small run reports every phase, size, mode and recipe with consistent bytes and
counts, leaves no process behind, resumes from its work folder and renders its Markdown tables; the estimate that
decides whether an in-memory mode is measured, and the workers a GPU needs, on known numbers. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
    proc = _run("--small", "--work", str(work), "--out", str(out))
    return work, out, json.loads(proc.stdout), proc.stderr


@pytest.mark.slow
def test_the_small_run_reports_every_section_and_mode(small_run):
    work, out, result, _ = small_run
    assert json.loads(out.read_text()) == result  # exactly one JSON object on stdout, the same in the file
    assert result["benchmark"] == "data_scale" and len(result["commit"]) >= 40
    sections = {"corpus", "preprocess", "memory", "crops", "workers", "goals", "settings", "machine", "wall_s"}
    assert sections <= set(result)
    assert len(result["machine"]["load_avg_1_5_15_at_end"]) == 3
    assert result["settings"]["sizes"] == [4, 8] and result["settings"]["shape"] == [64, 64, 48]
    assert list(result["preprocess"]) == list(result["memory"]) == ["4", "8"]
    assert set(result["crops"]) == set(result["workers"]) == RECIPES
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
        assert ("ReadStoredd" in run["disk_reads"]) is (recipe == "finetune")
    for recipe, need in result["workers"].items():
        assert need["crops_per_step"] == need["batch_size"] * crops_per_volume[recipe]
        assert need["gpu_step_ms"] == "not measured" and need["at_gpu_step"] is None
        assert list(need["by_step_ms"]) == ["100", "200", "400"]
        for ms, row in need["by_step_ms"].items():
            assert row["gpu_crops_per_s"] == pytest.approx(need["crops_per_step"] * 1000 / int(ms))
            assert row["workers_disk"] >= 1 and row["workers_memory"] >= 1
    assert set(result["goals"]) >= {"disk_memory_flat_met", "disk_first_iteration_met", "disk_crops_per_s_met"}


@pytest.mark.slow
def test_a_rerun_keeps_every_phase_and_takes_measured_step_times(small_run, tmp_path):
    work, out, result, _ = small_run
    again = _run("--small", "--work", str(work), "--gpu_step_ms", "ssl=250", "--out", str(tmp_path / "again.json"))
    assert again.stderr.count("done in") == 0 and again.stderr.count("kept from an earlier run") == 1 + 2 + 6 + 3
    rerun = json.loads(again.stdout)
    for section in ("corpus", "preprocess", "memory", "crops"):
        assert rerun[section] == result[section]
    ssl = rerun["workers"]["ssl"]
    assert ssl["gpu_step_ms"] == 250 and ssl["at_gpu_step"]["gpu_crops_per_s"] == pytest.approx(16.0)
    assert rerun["workers"]["dino"]["gpu_step_ms"] == "not measured"


@pytest.mark.slow
def test_the_markdown_renders_and_fills_a_document_block(small_run, tmp_path):
    _, out, _, _ = small_run
    text = _run("--markdown", str(out)).stdout
    for expected in ("| none |", "| disk |", "| smart |", "| full |", "extrapolated from 4", "| ssl |", "| dino |",
                     "| finetune |", "not measured", "Goals:", "| 160,000 |"):  # fmt: skip
        assert expected in text, expected
    from data_scale_tables import DOC_BLOCK, DOC_BLOCK_END

    doc = tmp_path / "README.md"
    doc.write_text(f"before\n{DOC_BLOCK.format(result=out.as_posix())}\nold\n{DOC_BLOCK_END}\nafter\n")
    assert "updated" in _run("--markdown", str(out), "--write_docs", str(doc)).stdout
    written = doc.read_text()
    assert written.startswith("before\n") and written.endswith(f"{DOC_BLOCK_END}\nafter\n") and "old" not in written
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
    """10,000 volumes of 20 MB and 3.6 core-seconds each: 200 GB, 38 minutes on 16 cores (minutes below an hour, else hours); memory is the largest peak per
    rank times 8 ranks; the workers are the SSL recipe's by step time."""
    from data_scale_tables import sizing_table

    result = {
        "corpus": {"shape": [256, 256, 160]},
        "preprocess": {"100": {"store_bytes_per_volume": 1e9, "core_s_per_volume": 99.0},
                       "1000": {"store_bytes_per_volume": 20e6, "core_s_per_volume": 3.6}},
        "memory": {"100": {"disk": {"peak_rank_pss_gb": 1.5}}, "1000": {"disk": {"peak_rank_pss_gb": 1.25}}},
        "workers": {"ssl": {"by_step_ms": {"100": {"workers_disk": 9}, "400": {"workers_disk": 3}}}},
    }  # fmt: skip
    lines = sizing_table(result)
    row = next(line for line in lines if line.startswith("| 10,000 |"))
    assert row == "| 10,000 | 200 GB | 38 min | 9 min | 12.0 GiB | 100 ms: 9, 400 ms: 3 |"
    assert next(line for line in lines if line.startswith("| 160,000 |")).split(" | ")[1] == "3.20 TB"
    assert next(line for line in lines if line.startswith("| 160,000 |")).split(" | ")[2] == "10.0 h"
