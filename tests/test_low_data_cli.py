"""benchmarks/low_data.py's command line: ``--help`` answers before torch or MONAI is imported, and a list or plan
that cannot serve the protocol is refused in one line, before any run and before those imports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from components import write_dataset

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "low_data.py"
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def test_help_answers_in_under_two_seconds_without_importing_torch():
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, env=ENV, timeout=60)
    seconds = time.perf_counter() - started
    assert proc.returncode == 0, proc.stderr
    assert "--labeled" in proc.stdout and "probe_mim" in proc.stdout  # the options and the arms
    assert seconds < 2.0, f"--help took {seconds:.2f} s"
    assert _heavy_imports(["--help"]) == "[]"


def _heavy_imports(args: list[str]) -> str:
    """Which of torch and MONAI the script has imported when it exits with ``args``."""
    probe = (f"import runpy, sys\nsys.argv = [{str(SCRIPT)!r}, *{args!r}]\nsys.path.insert(0, {str(SCRIPT.parent)!r})\n"
             "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\nexcept SystemExit:\n    pass\n"
             "print([m for m in ('torch', 'monai') if m in sys.modules])")
    imported = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=ENV, timeout=60)
    return imported.stdout.strip().splitlines()[-1]


def _one_line_error(args: list[str], tmp_path: Path) -> str:
    """The one stderr line of a refused command; a command not refused within a minute is stopped (with the runs it
    started) and fails the test."""
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--out", str(tmp_path / "out"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"not refused: {args} was still running after 60 s") from None
    assert proc.returncode == 2 and not stdout, (proc.returncode, stdout[-500:], stderr[-2000:])
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert not (tmp_path / "out" / "results").exists()  # refused before any run
    return lines[0]


def test_a_list_that_cannot_be_read_or_names_missing_files_is_one_line(tmp_path):
    unreadable = tmp_path / "unreadable.json"
    unreadable.write_text("{not json")
    corpus = tmp_path / "corpus.json"
    corpus.write_text(json.dumps({"training": [{"image": "u.nii.gz"}]}))
    other_site = ["--shifted", str(tmp_path / "other_site.json")]  # read after the labeled list
    line = _one_line_error(["--small", "--labeled", str(unreadable), "--unlabeled", str(corpus), *other_site], tmp_path)
    assert line.startswith("low_data.py: error: datalist") and "unreadable.json" in line and "cannot be read as JSON" in line
    refused = ["--out", str(tmp_path / "out"), "--small", "--labeled", str(unreadable), "--unlabeled", str(corpus), *other_site]
    assert _heavy_imports(refused) == "[]"  # a list is refused before torch or MONAI is imported
    missing = tmp_path / "missing.json"
    missing.write_text(json.dumps({"labels": {"0": "background"}, "training": [{"image": "nope.nii.gz", "label": "nope.nii.gz"}]}))
    line = _one_line_error(["--small", "--labeled", str(missing), "--unlabeled", str(corpus), *other_site], tmp_path)
    assert "missing.json" in line and "nope.nii.gz" in line and "missing files" in line


def test_a_lone_labeled_list_an_unregistered_plan_or_a_missing_shifted_list_is_one_line(tmp_path):
    line = _one_line_error(["--labeled", str(tmp_path / "x.json")], tmp_path)
    assert "--labeled and --unlabeled go together" in line
    line = _one_line_error(["--arms", "scratch"], tmp_path)  # the pre-registered plan's arms are not chosen here
    assert "unrecognized arguments: --arms scratch" in line
    line = _one_line_error([], tmp_path)  # the CPU plan until its pre-registration
    assert "the plan is not pre-registered: fix its finetuning budget from the pilot" in line
    write_dataset(tmp_path / "site_a", num=8, seed=3, organs=("spleen",))
    labeled = tmp_path / "site_a" / "dataset.json"
    line = _one_line_error(["--small", "--labeled", str(labeled), "--unlabeled", str(labeled)], tmp_path)
    assert "protocol v3 scores every run on a shifted held-out set too: --shifted names its labeled list" in line


def test_lists_that_share_a_held_out_volume_are_one_line(tmp_path):
    """The unlabeled corpus holds every labeled volume: some of them validate or are held out."""
    write_dataset(tmp_path / "site_a", num=8, seed=3, organs=("spleen",))
    labeled = tmp_path / "site_a" / "dataset.json"
    corpus = json.loads(labeled.read_text())
    everything = tmp_path / "site_a" / "corpus.json"
    everything.write_text(json.dumps({"training": [{"image": i["image"]} for key in ("training", "validation", "test") for i in corpus[key]]}))
    write_dataset(tmp_path / "site_b", num=3, seed=5, organs=("spleen",), varied=True)
    shifted = tmp_path / "site_b" / "dataset.json"
    line = _one_line_error(["--small", "--labeled", str(labeled), "--unlabeled", str(everything), "--shifted", str(shifted)], tmp_path)
    assert f"--labeled {str(labeled)!r} (" in line and f"and --unlabeled {str(everything)!r} share a volume: " in line
    assert str(tmp_path / "site_a") in line.split("share a volume: ")[1]
