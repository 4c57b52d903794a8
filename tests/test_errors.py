"""Errors as the user meets them (components.errors): one line on stderr naming the culprit, exit status 1, no
traceback unless ``--debug``; every bad override id at once; an error raised inside the engine said once; under
torchrun, said once by the first rank that meets it, also when only a rank > 0 does. Each run is
``python -m monai.bundle run`` (or torchrun) in a subprocess."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch

from components import ConfigError, write_dataset
from components.demo.runner import BUNDLES_DIR, bundle_command
import components.errors
from components.errors import report_errors, user_error

REPO = Path(__file__).resolve().parent.parent
SSL = BUNDLES_DIR / "swin_unetr_ssl_pretrain"
BTCV = BUNDLES_DIR / "swin_unetr_btcv_finetune"
TINY = {"roi_size": [64, 32, 32], "feature_size": 12, "training#num_samples": 1, "batch_size": 1,
        "loader#num_workers": 0, "speed#amp": "false", "speed#use_checkpoint": "false", "device": "cpu",
        "max_epochs": 1, "training#log_interval": 1}  # fmt: skip
#: MONAI 1.6.1 warns on stderr, before any config runs, that configs are trusted code (two lines per process)
MONAI_TRUST_WARNING = ("UserWarning: parsing config_file", "  workflow = create_workflow(")


def _ours(line: str) -> bool:
    """Not MONAI's trust warning, nor a progress bar of caching (tqdm's carriage returns split it into pieces)."""
    return bool(line) and not (MONAI_TRUST_WARNING[0] in line or line == MONAI_TRUST_WARNING[1] or "Loading dataset" in line)


def _run(cmd: list[str], tmp_path: Path, **env: str) -> tuple[int, list[str], str]:
    """(exit status, the lines of stderr that are not MONAI's trust warning or a progress bar, stdout + stderr)."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env})  # fmt: skip
    return proc.returncode, [line for line in proc.stderr.splitlines() if _ours(line)], proc.stdout + proc.stderr


def _said(lines: list[str]) -> list[str]:
    """The lines of our one-line errors, without the ``[rank0]: `` that torch's hook puts before each line a rank
    prints once its process group exists."""
    return [re.sub(r"^\[rank\d+\]: ", "", line) for line in lines if ": error: " in line]


def _torchrun(cmd: list[str], nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
            f"--nproc_per_node={nproc}", *cmd[1:]]  # fmt: skip


def _btcv_without_data(folder: Path) -> list[str]:
    """The BTCV bundle with ``--val_interval`` (an id 0.2.0 moved to ``training#val_interval``) and no data."""
    overrides = {"bundle_root": str(folder), "dataset_dir": str(folder / "none"), "val_interval": 1}
    return bundle_command(BTCV, overrides=overrides)


def _inference_without_data(folder: Path) -> list[str]:
    """The SSL bundle's inference.json with no datalist."""
    return bundle_command(SSL, ["inference.json"], {"bundle_root": str(folder), "dataset_dir": str(folder)})


@pytest.fixture(scope="module")
def stopped_at_start(tmp_path_factory) -> dict[str, tuple[int, list[str], str]]:
    """The runs that stop at start-up, each ``_run``'s result by name: processes in folders of their own that share
    nothing, as many at a time as the machine has cores (each spends its seconds importing, on one core)."""
    root = tmp_path_factory.mktemp("stopped_at_start")
    commands = {
        "bad_ids": lambda folder: _btcv_without_data(folder) + ["--max_epoch", "1"],
        "debug": lambda folder: _btcv_without_data(folder) + ["--debug"],
        "debug_true": lambda folder: _btcv_without_data(folder) + ["--debug", "true"],
        "inference": _inference_without_data,
        "inference_debug": lambda folder: _inference_without_data(folder) + ["--debug"],
    }
    folders = {name: root / name for name in commands}
    for folder in folders.values():
        folder.mkdir()
    with ThreadPoolExecutor(min(len(commands), os.cpu_count() or 1)) as pool:
        runs = {name: pool.submit(_run, command(folders[name]), folders[name]) for name, command in commands.items()}
        return {name: run.result() for name, run in runs.items()}


def test_every_bad_override_id_is_one_line_and_nothing_else(stopped_at_start):
    code, lines, out = stopped_at_start["bad_ids"]
    assert code == 1, out[-3000:]
    assert len(lines) == 2, out[-3000:]
    assert lines[0].startswith("swin_unetr_btcv_finetune: error: ConfigError: --val_interval names no id of ")
    assert "run with --training#val_interval instead." in lines[0]
    assert lines[0].endswith("(--debug shows the traceback)")
    assert lines[1].startswith("  --max_epoch names no id of ") and lines[1].endswith("did you mean --max_epochs?")
    assert "Traceback" not in out and "Failed to evaluate" not in out


@pytest.mark.parametrize("run", ["debug", "debug_true"])
def test_the_traceback_is_shown_with_debug(stopped_at_start, run):
    """``--debug`` is an id of every bundle (MONAI passes it as an override, bare ``--debug`` as True)."""
    code, lines, _ = stopped_at_start[run]
    assert code == 1
    assert lines[0] == "Traceback (most recent call last):" and "Failed to evaluate ConfigExpression" in lines[-2]
    assert any(line.startswith("components.errors.ConfigError: --val_interval names no id") for line in lines)


def test_inference_shows_the_traceback_with_debug_too(stopped_at_start):
    code, lines, out = stopped_at_start["inference"]
    assert code == 1 and len(lines) == 1, out[-3000:]
    assert lines[0].startswith("swin_unetr_ssl_pretrain: error: MissingFileError: datalist ")
    assert lines[0].endswith("(--debug shows the traceback)")
    code, lines, out = stopped_at_start["inference_debug"]
    assert code == 1 and lines[0] == "Traceback (most recent call last):", out[-3000:]
    assert any(line.startswith("components.errors.MissingFileError: datalist ") for line in lines), out[-3000:]


@pytest.mark.slow
def test_an_error_raised_inside_the_engine_is_said_once(ct, tmp_path):
    """ignite's Engine and MONAI's StatsHandler log it, and Python prints it: three times before components.errors.
    The loss turns NaN at its first call (tests/probes.py): NaN voxels are refused when caching reads them."""
    probe = tmp_path / "nan_loss.json"
    probe.write_text(json.dumps({"probes": "$import tests.probes as probes",
                                 "train#trainer#loss_function": "$@probes.nan_loss_from(@train#loss, 1)"}))  # fmt: skip
    overrides = {**TINY, "bundle_root": str(tmp_path), "dataset_dir": str(ct.parent), "datalist": str(ct)}
    code, lines, out = _run(bundle_command(SSL, ["train.json", str(probe)], overrides), tmp_path)
    assert code == 1, out[-3000:]
    assert lines[0].startswith("swin_unetr_ssl_pretrain: error: NonFiniteLossError: non-finite training loss nan at "
                               "epoch 1, iteration 1"), out[-3000:]  # fmt: skip
    assert all(line.startswith("  ") for line in lines[1:]) and len(lines) == 4, out[-3000:]
    assert out.count("non-finite training loss") == 1, out[-3000:]
    assert "Traceback" not in out and "Exception: " not in out and "terminating due to exception" not in out


@pytest.mark.slow
def test_under_torchrun_an_error_of_every_rank_is_said_once(tmp_path):
    overrides = {"bundle_root": str(tmp_path), "dataset_dir": str(tmp_path / "none"), "val_interval": 1}
    cmd = bundle_command(SSL, ["train.json", "multi_gpu_train.json"], overrides)
    code, lines, out = _run(_torchrun(cmd), tmp_path)
    assert code != 0
    ours = _said(lines)
    assert len(ours) == 1 and ours[0].startswith("swin_unetr_ssl_pretrain: error: ConfigError: --val_interval "), out
    assert re.search(r"\(from rank [01] of 2; --debug shows the traceback\)$", ours[0]), ours[0]
    assert out.count("names no id") == 1 and "Failed to evaluate" not in out, out[-3000:]


@pytest.fixture
def two_rank_ct(tmp_path) -> Path:
    """A CT datalist for two ranks: one training volume per rank, two validation volumes."""
    datalist = write_dataset(tmp_path / "ct", kind="ct", num=4, seed=0)
    content = json.loads(datalist.read_text())
    content["validation"] += content.pop("test")
    datalist.write_text(json.dumps(content))
    return datalist


def _torchrun_ssl(datalist: Path, tmp_path: Path, extra: tuple[str, ...] = ()) -> tuple[int, list[str], str]:
    overrides = {**TINY, "bundle_root": str(tmp_path), "dataset_dir": str(datalist.parent), "datalist": str(datalist),
                 "dist_timeout_s": 120}  # fmt: skip
    return _run(_torchrun(bundle_command(SSL, ["train.json", "multi_gpu_train.json", *extra], overrides)), tmp_path)


@pytest.mark.slow
def test_under_torchrun_an_error_only_rank_one_meets_is_said_once_by_it(two_rank_ct, tmp_path):
    """Rank 1's own training volume holds NaN voxels: rank 1 stops when caching reads it, rank 0 (whose volume is
    clean) waits for it at the next collective until torchrun stops it. Rank 0 alone printing said nothing."""
    from components import partition_for_rank

    content = json.loads(two_rank_ct.read_text())
    (entry,) = partition_for_rank(content["training"], seed=0, rank=1, world_size=2)
    path = two_rank_ct.parent / entry["image"]
    volume = nib.load(path)
    voxels = np.asarray(volume.dataobj, dtype=np.float32)
    voxels[:2, :2, :2] = np.nan
    nib.save(nib.Nifti1Image(voxels, volume.affine), path)
    code, lines, out = _torchrun_ssl(two_rank_ct, tmp_path)
    assert code != 0
    ours = _said(lines)
    assert len(ours) == 1, out[-5000:]
    assert ours[0].startswith(f"swin_unetr_ssl_pretrain: error: DataItemError: image {path}: has non-finite voxels: 8 NaN")
    assert ours[0].endswith("(from rank 1 of 2; --debug shows the traceback)"), ours[0]
    assert out.count("has non-finite voxels") == 1, out[-5000:]
    assert "[rank0]: Traceback" not in out, out[-5000:]  # gloo's "Connection closed by peer" on rank 0: one line


@pytest.mark.slow
def test_under_torchrun_an_error_raised_inside_the_engine_is_said_once(two_rank_ct, tmp_path):
    """Both ranks' losses turn NaN at iteration 1 and both raise: one line, by one of them, naming its batch; ignite,
    MONAI's StatsHandler and the other rank say nothing."""
    probe = tmp_path / "nan_loss.json"
    probe.write_text(json.dumps({"probes": "$import tests.probes as probes",
                                 "train#trainer#loss_function": "$@probes.nan_loss_from(@train#loss, 1)"}))  # fmt: skip
    code, lines, out = _torchrun_ssl(two_rank_ct, tmp_path, (str(probe),))
    assert code != 0
    ours = _said(lines)
    assert len(ours) == 1, out[-5000:]
    assert ours[0].startswith("swin_unetr_ssl_pretrain: error: NonFiniteLossError: non-finite training loss nan at "
                              "epoch 1, iteration 1 (iteration 1/1 of the epoch) on ranks [0, 1] of 2. (from rank ")
    assert out.count("non-finite training loss") == 1 and out.count("batch files (rank ") == 1, out[-5000:]
    assert "Exception: " not in out and "terminating due to exception" not in out and "Failed to evaluate" not in out
    assert "[rank0]: Traceback" not in out and "[rank1]: Traceback" not in out, out[-5000:]


def test_the_user_error_is_found_behind_monai_wrappers():
    try:
        try:
            raise ConfigError("cause")
        except ConfigError as err:
            raise RuntimeError("Failed to evaluate ConfigExpression") from err
    except RuntimeError as wrapper:
        assert str(user_error(wrapper)) == "cause"
    try:
        try:
            raise ConfigError("handled")
        except ConfigError:
            raise KeyError("a bug while handling it") from None
    except KeyError as bug:
        assert user_error(bug) is None  # ``from None``: Python does not show the context, nor do we
    assert user_error(ValueError("plain")) is None


def test_a_user_error_in_a_thread_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(components.errors, "_handlers", lambda: [])  # no filter left on pytest's log handlers
    report_errors("tiny_bundle")

    def fail() -> None:
        raise ConfigError("first line\nsecond line")

    thread = threading.Thread(target=fail)
    thread.start()
    thread.join()
    assert capsys.readouterr().err.splitlines() == [
        "tiny_bundle: error: ConfigError: first line (--debug shows the traceback)", "  second line"]


# ---------------------------------------------------------------------------------------------------------------
# checked before caching: each case stops the run in one line naming the culprit, before "Loading dataset"
# ---------------------------------------------------------------------------------------------------------------

CT_TINY = {**TINY, "spacing": [3.0, 3.0, 4.0], "training#val_interval": 1}


@pytest.fixture(scope="module")
def ct(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("ct") / "ct", kind="ct", num=4, seed=0)


def _refused_before_caching(bundle: Path, ct: Path, tmp_path: Path, **overrides) -> list[str]:
    """Runs ``bundle`` on ``ct``; asserts exit status 1 and no caching; returns the lines of stderr."""
    tiny = CT_TINY if bundle == BTCV else TINY
    overrides = {**tiny, "bundle_root": str(tmp_path), "dataset_dir": str(ct.parent), "datalist": str(ct), **overrides}
    code, lines, out = _run(bundle_command(bundle, overrides=overrides), tmp_path)
    assert code == 1, out[-3000:]
    assert "Loading dataset" not in out, f"the run cached before it stopped:\n{out[-3000:]}"
    assert "Traceback" not in out, out[-3000:]
    assert lines and lines[0].startswith(f"{bundle.name}: error: "), out[-3000:]
    return lines


@pytest.mark.slow
def test_a_two_channel_encoder_into_a_one_channel_model(ct, tmp_path):
    from components import SSLHead

    path = tmp_path / "two_channels.pt"
    torch.save(SSLHead(in_channels=2, feature_size=12).state_dict(), path)
    (line,) = _refused_before_caching(BTCV, ct, tmp_path, pretrained_path=str(path))
    assert line.startswith(f"swin_unetr_btcv_finetune: error: CheckpointLoadError: checkpoint {path} ")
    assert "has 2 input channel(s) in the checkpoint" in line and "--training#channel_policy repeat" in line


@pytest.mark.slow
def test_a_corrupt_checkpoint_found_by_auto_resume(ct, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    torch.save({"model": {"w": torch.zeros(1000)}}, models / "checkpoint.pt")
    corrupt = (models / "checkpoint.pt").read_bytes()
    (models / "checkpoint.pt").write_bytes(corrupt[: len(corrupt) // 2])  # truncated mid-write
    (line,) = _refused_before_caching(BTCV, ct, tmp_path, pretrained_path="null", ckpt_dir=str(models))
    assert line.startswith(f"swin_unetr_btcv_finetune: error: CheckpointLoadError: auto_resume found "
                           f"'{models / 'checkpoint.pt'}'") and "--checkpointing#auto_resume false" in line  # fmt: skip


@pytest.mark.slow
def test_accumulation_steps_of_one_and_a_half(ct, tmp_path):
    (line,) = _refused_before_caching(SSL, ct, tmp_path, **{"train#trainer#accumulation_steps": 1.5})
    assert line.startswith("swin_unetr_ssl_pretrain: error: ConfigError: train#trainer#accumulation_steps must be the "
                           "integer 1 (PretrainingTrainer does not accumulate gradients")
    assert line.endswith("got 1.5. (--debug shows the traceback)"), line


@pytest.mark.slow
def test_a_truncated_validation_label_before_the_training_list_is_cached(ct, tmp_path):
    content = json.loads(ct.read_text())
    label = ct.parent / content["validation"][0]["label"]
    truncated = tmp_path / "truncated_label.nii.gz"
    truncated.write_bytes(label.read_bytes()[:200])
    content["validation"][0]["label"] = str(truncated)
    datalist = tmp_path / "dataset.json"
    datalist.write_text(json.dumps({**content, "training": [
        {k: str(ct.parent / v) for k, v in entry.items()} for entry in content["training"]]}))  # fmt: skip
    lines = _refused_before_caching(BTCV, ct, tmp_path, pretrained_path="null", datalist=str(datalist))
    assert lines[0].startswith("swin_unetr_btcv_finetune: error: DataCheckError: validation: data check FAILED")
    assert [line for line in lines[1:] if line.startswith(f"  ERROR {truncated} ")], lines
