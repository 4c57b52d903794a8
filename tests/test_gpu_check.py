"""benchmarks/gpu_check.py, the one command a lent GPU runs: on the CPU its ``--small`` run writes one JSON with
every part measured (positive, finite figures), a small ``--budget_s`` is kept (parts that do not fit are skipped or
stopped, each with its reason, and the JSON is written all the same), and the wheels the device installs are pinned
once each, within the project's requirements."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
PARTS = ["ssl_step", "finetune_step", "self_distillation_step", "sliding_window", "disk_loader", "cuda_tests"]


def _run(tmp_path: Path, budget_s: int, timeout: int) -> tuple[dict, float]:
    """The --small run on this machine: (its JSON, the process's wall seconds); the JSON printed is the one written."""
    start = time.perf_counter()
    cmd = [sys.executable, str(SCRIPT), "--small", "--budget_s", str(budget_s), "--out_dir", str(tmp_path),
           "--log", str(tmp_path / "gpu_check.log")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    wall = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    written = json.loads((tmp_path / "gpu_check_cpu_small.json").read_text())  # named after the device: the CPU here
    assert json.loads(proc.stdout) == written
    return written, wall


def _numbers(value) -> list[float]:
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in _numbers(v)]
    return [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


def _step_ok(figures: dict) -> None:
    assert figures["ms_per_step"] > 0 and figures["flops_per_step"] > 0 and figures["tflops_per_s"] > 0
    assert figures["tflops_per_s"] == pytest.approx(figures["flops_per_step"] / figures["ms_per_step"] / 1e9, rel=1e-3)
    assert figures["peak_gpu_memory_gib"] is None and figures["share_of_bf16_peak"] is None  # no GPU here


@pytest.mark.slow
def test_small_run_measures_every_part(tmp_path):
    result, _ = _run(tmp_path, budget_s=1500, timeout=1800)
    assert result["device"] == "cpu" and result["small"] is True and result["torch"] and result["commit"]
    parts = result["parts"]
    assert list(parts) == PARTS
    assert {name: part["status"] for name, part in parts.items()} == dict.fromkeys(PARTS, "done"), parts
    assert all(math.isfinite(n) for n in _numbers(result))
    for name in ("ssl_step", "finetune_step"):  # the bundle and the research code's loop, in one process
        assert parts[name]["step"] and parts[name]["reference_step"]
        _step_ok(parts[name]["reference"])
        assert parts[name]["reference_over_bundle"] > 0
    ssl = parts["ssl_step"]["bundle"]  # benchmarks/ssl_step.py's own report
    assert ssl["roi_size"] == [64, 32, 32] and ssl["feature_size"] == 12 and ssl["ms_per_step"] > 0
    assert ssl["flops_per_step"] > 0 and ssl["configuration"]["fused_attention"] is None  # the bundle's own setting
    for name in ("finetune_step", "self_distillation_step"):
        _step_ok(parts[name]["bundle"])
        assert parts[name]["bundle"]["steps_timed"] >= 1
    window = parts["sliding_window"]
    assert window["setup"]["windows"] > 0 and window["setup"]["output"] == [1, 14, *window["setup"]["volume"]]
    assert window["inference"]["ms_per_volume"] > 0
    loader = parts["disk_loader"]
    assert loader["setup"]["store_bytes"] > 0 and loader["setup"]["crops_per_batch"] == 4
    assert all(r["crops_per_s"] > 0 and r["crops"] > 0 for r in loader["by_workers"].values())
    tests = parts["cuda_tests"]  # no CUDA here: every selected test skips, the others are deselected
    assert "tests/test_cuda.py" in tests["files"] and tests["exit_code"] == 0
    counts = tests["counts"]
    assert counts["skipped"] == len(tests["tests"]) > 0 and counts["deselected"] > 0
    assert counts["passed"] == counts["failed"] == counts["error"] == 0 and tests["failures"] == []


def test_a_small_budget_is_kept_and_the_json_written_all_the_same(tmp_path):
    """10 s: most parts get a share under their minimum and are skipped (the last one's share, all that is left, lets
    it start); a part that starts and outruns its share is killed; every part is in the JSON with its reason."""
    budget = 10
    result, wall = _run(tmp_path, budget_s=budget, timeout=300)
    parts = result["parts"]
    assert list(parts) == PARTS
    assert result["wall_s"] <= budget + 5 and wall <= budget + 30  # + the interpreter's start-up before the budget's clock
    assert {p["status"] for p in parts.values()} <= {"skipped", "timed_out", "done"}
    assert sum(p["status"] == "skipped" for p in parts.values()) >= 3
    for part in parts.values():
        if part["status"] == "skipped":
            assert re.fullmatch(r"needs at least \d+ s; its share of the \d+ s left is \d+ s", part["reason"])
        elif part["status"] == "timed_out":
            assert part["reason"].startswith("still running at the end of its share") and part["share_s"] > 0
            assert part["wall_s"] <= part["share_s"] + 5


def _pins() -> dict[str, str]:
    lines = (REPO / "benchmarks" / "gpu_check_wheels.txt").read_text().splitlines()
    requirements = [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]
    names = [re.sub(r"[-_.]+", "-", r.name).lower() for r in requirements]
    assert len(names) == len(set(names)), "one version of each: two stop the whole install"
    assert all(len(r.specifier) == 1 and next(iter(r.specifier)).operator == "==" for r in requirements)
    return {n: next(iter(r.specifier)).version for n, r in zip(names, requirements)}


def test_the_carried_wheels_are_pinned_once_within_the_project_requirements():
    pins = _pins()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    needed = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]
    for requirement in needed:
        name = re.sub(r"[-_.]+", "-", requirement.name).lower()
        if name in pins:
            assert requirement.specifier.contains(pins[name]), (name, pins[name], str(requirement.specifier))
    imported = {"monai", "pytorch-ignite", "nibabel", "fire", "einops", "tqdm", "blosc2", "tensorboard", "pytest"}
    assert imported <= set(pins) and "torch" not in pins  # the machine has its own PyTorch
