"""Errors as the user meets them (components.errors): one line on stderr naming the culprit, exit status 1, no
traceback unless COMPONENTS_DEBUG=1; every bad override id at once; an error raised inside the engine said once;
under torchrun, said once by rank 0. Each run is ``python -m monai.bundle run`` (or torchrun) in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

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


def _torchrun(cmd: list[str], nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
            f"--nproc_per_node={nproc}", *cmd[1:]]  # fmt: skip


def test_every_bad_override_id_is_one_line_and_nothing_else(tmp_path):
    overrides = {"bundle_root": str(tmp_path), "dataset_dir": str(tmp_path / "none"), "val_interval": 1, "max_epoch": 1}
    code, lines, out = _run(bundle_command(BTCV, overrides=overrides), tmp_path)
    assert code == 1, out[-3000:]
    assert len(lines) == 2, out[-3000:]
    assert lines[0].startswith("swin_unetr_btcv_finetune: error: ConfigError: --val_interval names no id of ")
    assert "run with --training#val_interval instead." in lines[0]
    assert lines[0].endswith("(COMPONENTS_DEBUG=1 shows the traceback)")
    assert lines[1].startswith("  --max_epoch names no id of ") and lines[1].endswith("did you mean --max_epochs?")
    assert "Traceback" not in out and "Failed to evaluate" not in out


def test_the_traceback_is_shown_with_components_debug(tmp_path):
    overrides = {"bundle_root": str(tmp_path), "dataset_dir": str(tmp_path / "none"), "val_interval": 1}
    code, lines, _ = _run(bundle_command(BTCV, overrides=overrides), tmp_path, COMPONENTS_DEBUG="1")
    assert code == 1
    assert lines[0] == "Traceback (most recent call last):" and "Failed to evaluate ConfigExpression" in lines[-2]
    assert any(line.startswith("components.errors.ConfigError: --val_interval names no id") for line in lines)


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
def test_under_torchrun_rank_zero_says_it_once_and_the_others_nothing(tmp_path):
    overrides = {"bundle_root": str(tmp_path), "dataset_dir": str(tmp_path / "none"), "val_interval": 1}
    cmd = bundle_command(SSL, ["train.json", "multi_gpu_train.json"], overrides)
    code, lines, out = _run(_torchrun(cmd), tmp_path)
    assert code != 0
    ours = [line for line in lines if ": error: " in line]
    assert len(ours) == 1 and ours[0].startswith("swin_unetr_ssl_pretrain: error: ConfigError: --val_interval "), out
    assert out.count("names no id") == 1 and "Failed to evaluate" not in out, out[-3000:]


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
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("COMPONENTS_DEBUG", raising=False)
    monkeypatch.setattr(components.errors, "_handlers", lambda: [])  # no filter left on pytest's log handlers
    report_errors("tiny_bundle")

    def fail() -> None:
        raise ConfigError("first line\nsecond line")

    thread = threading.Thread(target=fail)
    thread.start()
    thread.join()
    assert capsys.readouterr().err.splitlines() == [
        "tiny_bundle: error: ConfigError: first line (COMPONENTS_DEBUG=1 shows the traceback)", "  second line"]


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
    assert line.startswith("swin_unetr_ssl_pretrain: error: ConfigError: accumulation_steps must be the integer 1")
    assert "got 1.5." in line


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
