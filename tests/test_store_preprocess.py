"""Writing the on-disk store (components/data/store/preprocessing.py and ``python -m components preprocess``): the
data check first, worker processes, parts on several machines, resuming after a kill, errors never silent."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from components import DataCheckError, StoreError, bundle_transforms, open_store, preprocess
from components.data.store import VolumeFailedError
from tests.processes import HAS_PROC, alive, descendants, signal_each
from tests.test_store import write_tiny_ct

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # Orientationd's `labels` default notice

REPO = Path(__file__).resolve().parents[1]


def _bundle(root: Path, func: str = "$lambda x: x") -> Path:
    """A bundle folder whose deterministic transforms are the SSL bundle's compact ones (roi 16) with a
    ``Lambdad(func)`` on the image before the compact crop (to slow a run down, or to fail on one volume)."""
    transforms = [
        {"_target_": "LoadImaged", "keys": ["image"], "image_only": False, "dtype": None},
        {"_target_": "EnsureChannelFirstd", "keys": ["image"]},
        {"_target_": "Orientationd", "keys": ["image"], "axcodes": "RAS"},
        {"_target_": "Lambdad", "keys": ["image"], "func": func},
        {"_target_": "components.CompactCropForegroundd", "keys": ["image"], "source_key": "image",
         "roi_size": "@roi_size", "a_min": -1000, "a_max": 1000},
    ]  # fmt: skip
    (root / "configs").mkdir(parents=True)
    config = {"roi_size": [16, 16, 16], "in_channels": 1, "train": {"transforms": {"deterministic": transforms}}}
    (root / "configs" / "train.json").write_text(json.dumps(config))
    return root


def _cli(*args: str, cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "components", "preprocess", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def _store_files(root: Path) -> dict[str, bytes]:
    """Every file of a store but the index shards (which name their part) and temporary leftovers."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "parts" not in p.parts and ".tmp" not in str(p)}  # fmt: skip


def test_worker_processes_write_the_store_one_process_writes(tmp_path):
    datalist = write_tiny_ct(tmp_path / "data", num=4)
    transforms = bundle_transforms(_bundle(tmp_path / "bundle"))
    progress = io.StringIO()
    workers = preprocess(datalist, tmp_path / "workers", transforms, workers=2, progress_every=2, stream=progress)
    assert workers.written == 4 and workers.line().startswith("preprocess: 4 written, 0 already there, 0 skipped")
    lines = progress.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == ["preprocess: 2/4 volumes", "preprocess: 4/4 volumes"]
    assert all("ETA" in line for line in lines)
    single = preprocess(datalist, tmp_path / "single", transforms)
    assert single.written == 4 and _store_files(tmp_path / "workers") == _store_files(tmp_path / "single")
    again = preprocess(datalist, tmp_path / "single", transforms)
    assert (again.written, again.reused) == (0, 4)


def test_parts_on_several_machines_make_the_same_store_as_one_run(tmp_path):
    datalist = write_tiny_ct(tmp_path / "data", num=5)
    transforms = bundle_transforms(_bundle(tmp_path / "bundle"))
    preprocess(datalist, tmp_path / "one", transforms)
    first = preprocess(datalist, tmp_path / "split", transforms, part=2, parts=3)
    assert first.written == 1 and first.index is None
    with pytest.raises(StoreError, match=r"part\(s\) \[0, 1\] of 3 have not finished"):
        open_store(tmp_path / "split")
    assert preprocess(datalist, tmp_path / "split", transforms, part=0, parts=3).written == 2
    last = preprocess(datalist, tmp_path / "split", transforms, part=1, parts=3)
    assert last.written == 2 and last.index == tmp_path / "split" / "index.json"
    assert _store_files(tmp_path / "split") == _store_files(tmp_path / "one")
    assert len(open_store(tmp_path / "split")) == 5


def test_a_killed_run_resumes_and_makes_the_store_of_an_uninterrupted_one(tmp_path):
    """The command killed with SIGKILL mid-run (each volume takes 0.3 s), then run again: the index, the item files
    and every array's bytes equal an uninterrupted run's, and the volumes finished before the kill are not redone."""
    datalist = write_tiny_ct(tmp_path / "data", num=8)
    bundle = _bundle(tmp_path / "bundle", "$lambda x: __import__('time').sleep(0.3) or x")
    args = ("--datalist", str(datalist), "--out", "store", "--bundle", str(bundle))
    killed = _cli(*args, cwd=tmp_path)
    command = f"python -m components preprocess --datalist {datalist} --out store --bundle {bundle}"
    preprocess(datalist, tmp_path / "whole", bundle_transforms(bundle), command=command)  # meanwhile
    volumes, deadline = tmp_path / "store" / "volumes", time.monotonic() + 120
    while time.monotonic() < deadline and len(list(volumes.glob("case_*")) if volumes.is_dir() else []) < 2:
        time.sleep(0.02)
    killed.send_signal(signal.SIGKILL)
    killed.communicate(timeout=60)
    done_before = len(list(volumes.glob("case_*")))
    assert killed.returncode == -signal.SIGKILL and 2 <= done_before < 8
    assert not (tmp_path / "store" / "index.json").exists()
    resumed = _cli(*args, cwd=tmp_path)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-2000:]
    assert f"{8 - done_before} written, {done_before} already there" in out and "index store/index.json" in out
    assert "preprocess: 8/8 volumes" not in err and f"preprocess: {8 - done_before}/{8 - done_before} volumes" in err
    whole, resumed_store = _store_files(tmp_path / "whole"), _store_files(tmp_path / "store")
    assert whole.keys() == resumed_store.keys() and sum(k.endswith(".b2nd") for k in whole) == 8
    assert whole == resumed_store
    assert json.loads(resumed_store["index.json"])["command"] == command
    assert not list(volumes.glob(".*"))  # no temporary folder left


def _break(datalist: Path) -> tuple[str, str]:
    """Truncates the image of entry 1 and removes that of entry 3; returns their paths."""
    truncated, missing = datalist.parent / "images" / "case_1.nii.gz", datalist.parent / "images" / "case_3.nii.gz"
    truncated.write_bytes(truncated.read_bytes()[:200])
    missing.unlink()
    return str(truncated), str(missing)


def test_broken_files_stop_the_run_before_any_work_or_are_skipped_and_listed(tmp_path):
    datalist = write_tiny_ct(tmp_path / "data", num=5)
    truncated, missing = _break(datalist)
    transforms = bundle_transforms(_bundle(tmp_path / "bundle"))
    with pytest.raises(DataCheckError, match="2 broken entries, nothing written") as caught:
        preprocess(datalist, tmp_path / "stop", transforms)
    assert truncated in str(caught.value) and missing in str(caught.value) and "\n" not in str(caught.value)
    assert not (tmp_path / "stop").exists()
    summary = preprocess(datalist, tmp_path / "skip", transforms, on_error="skip")
    assert summary.written == 3 and [s["source"] for s in summary.skipped] == [truncated, missing]
    assert f"skipped {truncated}: " in summary.line() and f"skipped {missing}: " in summary.line()
    store = open_store(tmp_path / "skip")
    assert [e["position"] for e in store.entries] == [0, 2, 4]
    assert [(s["position"], s["source"]) for s in store.skipped] == [(1, truncated), (3, missing)]
    assert all(s["reason"] for s in store.skipped)


def test_a_volume_whose_transforms_fail_stops_the_run_or_is_listed_as_failed(tmp_path):
    datalist = write_tiny_ct(tmp_path / "data", num=4)  # volume i has 40 - i voxels along x
    transforms = bundle_transforms(_bundle(tmp_path / "bundle", "$lambda x: x if x.shape[1] != 38 else 1 / 0"))
    failing = str(datalist.parent / "images" / "case_2.nii.gz")
    with pytest.raises(VolumeFailedError, match=rf"{failing} \(training\[2\]\) failed: .*ZeroDivisionError"):
        preprocess(datalist, tmp_path / "stop", transforms)
    assert len(list((tmp_path / "stop" / "volumes").glob("case_*"))) == 2  # kept for the rerun
    summary = preprocess(datalist, tmp_path / "skip", transforms, on_error="skip")
    assert summary.written == 3 and [f["source"] for f in summary.failed] == [failing]
    assert "ZeroDivisionError" in summary.failed[0]["reason"] and f"failed {failing}: " in summary.line()
    assert [f["position"] for f in open_store(tmp_path / "skip").failed] == [2]


@pytest.mark.parametrize("death", ["__import__('os')._exit(9)", "__import__('os').kill(__import__('os').getpid(), 9)"],
                         ids=["exit", "SIGKILL"])
def test_a_worker_that_dies_fails_its_volume_and_the_run_goes_on(tmp_path, death):
    """The worker writing case_2 ends (os._exit, or SIGKILL as the kernel's out-of-memory killer sends it): with
    on_error skip that volume is listed as failed with the reason and the other three are written by the workers
    left and a new one; a rerun meets the same death, says so again and finishes; with stop the run stops naming
    case_2."""
    datalist = write_tiny_ct(tmp_path / "data", num=4)  # volume i has 40 - i voxels along x
    transforms = bundle_transforms(_bundle(tmp_path / "bundle", f"$lambda x: x if x.shape[1] != 38 else {death}"))
    failing = str(datalist.parent / "images" / "case_2.nii.gz")
    why = "exited with status 9" if "exit" in death else "was killed by SIGKILL (the kernel's out-of-memory killer"
    for run in range(2):
        summary = preprocess(datalist, tmp_path / "store", transforms, workers=2, on_error="skip")
        assert (summary.written, summary.reused) == ((3, 0) if run == 0 else (0, 3))
        assert [f["source"] for f in summary.failed] == [failing], summary.line()
        assert summary.failed[0]["reason"].startswith(f"the worker process writing it {why}")
        assert [f["position"] for f in open_store(tmp_path / "store").failed] == [2]
    with pytest.raises(VolumeFailedError, match=rf"{failing} \(training\[2\]\) failed: the worker process writing it "
                       rf"{re.escape(why)}"):  # fmt: skip
        preprocess(datalist, tmp_path / "stop", transforms, workers=2)


def test_a_store_of_other_transforms_is_not_overwritten_unless_asked(tmp_path):
    datalist = write_tiny_ct(tmp_path / "data", num=3)
    bundle = _bundle(tmp_path / "bundle")
    preprocess(datalist, tmp_path / "store", bundle_transforms(bundle))
    other = bundle_transforms(bundle, {"roi_size": [24, 24, 24]})
    with pytest.raises(StoreError, match="holds a store of other transforms.*--overwrite true"):
        preprocess(datalist, tmp_path / "store", other)
    summary = preprocess(datalist, tmp_path / "store", other, overwrite=True)
    assert (summary.written, summary.reused) == (3, 0)
    assert open_store(tmp_path / "store").index["transforms"][-1]["roi_size"] == [24, 24, 24]


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"on_error": "maybe"}, "on_error must be one of"),
        ({"part": 2, "parts": 2}, "part must be in 0..parts-1"),
        ({"workers": 0}, "workers must be >= 1"),
    ],
)
def test_bad_arguments_fail_before_any_work(tmp_path, arguments, message):
    with pytest.raises(ValueError, match=message):
        preprocess(tmp_path / "missing.json", tmp_path / "store", [], **arguments)
    assert not (tmp_path / "store").exists()


def test_an_unknown_override_or_bundle_is_named(tmp_path):
    with pytest.raises(ValueError, match="override 'roi_sise': the bundle has no such id"):
        bundle_transforms(_bundle(tmp_path / "bundle"), {"roi_sise": [8, 8, 8]})
    with pytest.raises(FileNotFoundError, match="configs/train.json: no such file"):
        bundle_transforms(tmp_path)


def test_the_command_fails_in_one_line_naming_the_broken_files(tmp_path, capsys):
    from components.__main__ import main

    datalist = write_tiny_ct(tmp_path / "data", num=5)
    truncated, missing = _break(datalist)
    bundle = str(_bundle(tmp_path / "bundle"))
    assert main(["preprocess", "--datalist", str(datalist), "--out", str(tmp_path / "s"), "--bundle", bundle]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("components preprocess: error: DataCheckError: preprocess: the data")
    assert truncated in err and missing in err and not (tmp_path / "s").exists()
    assert main(["preprocess", "--help"]) == 0
    assert "--on_error ON_ERROR" in capsys.readouterr().out


# ---------------------------------------------------------------- worker processes die with their parent


def _pid_recording_bundle(root: Path, pids: Path, seconds: float) -> Path:
    """A bundle whose transforms append the worker's PID to ``pids``, then take ``seconds`` per volume."""
    func = (f"$lambda x: (open({str(pids)!r}, 'a').write(str(__import__('os').getpid()) + chr(10)), "
            f"__import__('time').sleep({seconds}), x)[2]")  # fmt: skip
    return _bundle(root, func)


def _start_preprocess(root: Path) -> subprocess.Popen:
    """`preprocess --workers 2` in ``root`` over 4 volumes of 60 s each, its output in ``root/output.log``."""
    datalist = write_tiny_ct(root / "data", num=4)
    bundle = _pid_recording_bundle(root / "bundle", root / "worker.pids", 60)
    args = ("--datalist", str(datalist), "--out", "store", "--bundle", str(bundle), "--workers", "2")
    with open(root / "output.log", "w") as log:  # a file: a pipe would stay open while any worker holds it
        return subprocess.Popen([sys.executable, "-m", "components", "preprocess", *args], cwd=root,
                                env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=log, stderr=log)  # fmt: skip


def _busy_tree(command: subprocess.Popen, root: Path) -> set[int]:
    """The processes below ``command`` once both its workers have started a volume (their PIDs among them)."""
    pids = root / "worker.pids"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(pids.read_text().split() if pids.is_file() else []) < 2:
        assert command.poll() is None, (root / "output.log").read_text()
        time.sleep(0.05)
    workers = {int(p) for p in pids.read_text().split()}
    started = descendants(command.pid)
    assert len(workers) == 2 and workers <= started
    return started


@pytest.mark.skipif(not HAS_PROC, reason="reads the process tree from Linux /proc")
def test_workers_die_with_the_preprocess_command(tmp_path):
    """`preprocess --workers 2` killed (SIGTERM, and SIGKILL: two commands started at once) while both workers are
    in the middle of a 60 s volume: within seconds no process it started is left (fork server, workers; recorded
    PIDs and the process tree)."""
    signals = (signal.SIGTERM, signal.SIGKILL)
    commands = {sig: _start_preprocess(tmp_path / sig.name) for sig in signals}
    started = {sig: _busy_tree(commands[sig], tmp_path / sig.name) for sig in signals}
    codes = signal_each(commands, started.values(), 30, 15)
    for sig in signals:
        assert codes[sig] == -sig, sig.name
        left = [p for p in started[sig] if alive(p)]
        assert not left, f"left running after {sig.name}: {left}"
        assert not (tmp_path / sig.name / "store" / "index.json").exists()
