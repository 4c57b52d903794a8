"""End-to-end runs of the SSL pretraining bundle on synthetic CT (CPU): train, inference, resume (the restart
guarantees of every training bundle: tests/test_restarts.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from components.demo.runner import BUNDLES_DIR, bundle_command
from components.config.running import run_config_files

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
# tiny but real: two final tokens (64x32x32), one crop per volume, one volume per batch
TINY = {
    "roi_size": [64, 32, 32],
    "feature_size": 12,
    "training#num_samples": 1,
    "batch_size": 1,
    "loader#num_workers": 0,
    "training#warmup_iterations": 2,
    "training#log_interval": 1,
    "device": "cpu",
    "speed#amp": False,
    "speed#use_checkpoint": False,
}


def _run(bundle_root: Path, overrides: dict, configs=("train.json",), extra: dict | None = None, timeout=600,
         peak_rss: list | None = None) -> str:
    """Runs the bundle copy at ``bundle_root``; an ``extra`` config is layered last. Returns the output; with
    ``peak_rss`` (a list) also appends the run's peak resident memory in bytes: the largest of the bundle process
    and its loader workers (``wait4``'s ``ru_maxrss``, what ``/usr/bin/time -v`` reports)."""
    files = [str(f) for f in run_config_files(bundle_root, configs)]
    if extra is not None:
        extra_file = bundle_root / f"extra_{len(list(bundle_root.glob('extra_*.json')))}.json"
        extra_file.write_text(json.dumps(extra))
        files.append(str(extra_file))
    cmd = bundle_command(bundle_root, ("train.json",), {"bundle_root": str(bundle_root), **overrides})
    cmd[cmd.index("--config_file") + 1] = json.dumps(files) if len(files) > 1 else files[0]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if peak_rss is None:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=bundle_root)
        output, code = proc.stdout + proc.stderr, proc.returncode
    else:
        with tempfile.TemporaryFile("w+") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env, cwd=bundle_root)
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = code = os.waitstatus_to_exitcode(status)
            log.seek(0)
            output = log.read()
        peak_rss.append(usage.ru_maxrss * 1024)
    assert code == 0, output[-4000:]
    return output


def _bundle_copy(tmp: Path) -> Path:
    root = tmp / "swin_unetr_ssl_pretrain"
    shutil.copytree(BUNDLES_DIR / "swin_unetr_ssl_pretrain", root, ignore=shutil.ignore_patterns("models", "eval", "data"))
    return root


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The documented tiny pretraining command (64x32x32, window 4) on `python -m components synth --kind ct --num 6`."""
    tmp = tmp_path_factory.mktemp("ssl")
    data = tmp / "data" / "ct"
    subprocess.run(["python", "-m", "components", "synth", "--kind", "ct", "--num", "6", "--out", str(data)], check=True)
    root = _bundle_copy(tmp)
    overrides = {"dataset_dir": str(data), "roi_size": [64, 32, 32], "network_def#window_size": 4, "feature_size": 12, "max_epochs": 1, "device": "cpu"}
    overrides["speed#amp"] = "false"  # exactly as typed on a command line: the string "false"
    peak: list[int] = []
    output = _run(root, overrides, peak_rss=peak)
    (tmp / "peak_rss_bytes").write_text(str(peak[0]))
    return root, data, output


def test_tiny_run_writes_a_clean_ssl_model(trained):
    root, _, _ = trained
    state = torch.load(root / "models" / "model.pt", map_location="cpu", weights_only=True)
    prefixes = {key.split(".")[0] for key in state}
    assert prefixes == {"swinViT", "rotation_head", "contrastive_head", "conv"}
    assert not any(key.startswith("module.") for key in state)
    assert state["swinViT.patch_embed.proj.weight"].shape == (12, 1, 2, 2, 2)


def test_tiny_run_logs_finite_loss_parts_and_progress(trained):
    _, _, output = trained
    lines = [line for line in output.splitlines() if "loss_contrast" in line]
    assert len(lines) == 1 and "Epoch: 1/1, Iter: 1/2" in lines[0]  # the first iteration, then every log_interval-th
    for line in lines:
        values = {k: float(v) for k, v in re.findall(r"(loss\w*|lr): (\S+)", line)}
        parts = {"loss_rot", "loss_contrast", "loss_recon"}
        assert set(values) == {"loss", "lr", *parts, *(f"{part}_trivial" for part in parts)}  # each beside its trivial value
        assert all(np.isfinite(list(values.values())))
    assert "val_recon_l1" in output
    assert "Loading dataset: 100%" in output  # caching progress bar


def test_tiny_run_is_quiet_and_starts_with_a_start_line(trained):
    """Quiet by default: no Orientationd FutureWarning, no ignite "resuming from iteration 0" on a fresh run, one
    padding line per dataset (not one per thin synthetic volume); the trainer's start line comes before the first
    iteration. MONAI's eval() notice is printed by `monai.bundle run` itself before any bundle code loads (once)."""
    _, _, output = trained
    assert "Orientationd" not in output and "FutureWarning" not in output
    assert "resuming from iteration 0" not in output
    # at most one padding line per dataset (training, validation); the documented 64x32x32 crop pads none of these
    # volumes; tests/test_check_data.py covers the one-line-per-dataset rule
    assert len([line for line in output.splitlines() if "will be padded" in line]) <= 2
    assert output.count("parsing config_file") <= 1
    start = output.index("SSLTrainer - INFO - Engine run starting, until 1 epochs")
    assert start < output.index("Epoch: 1/1, Iter: 1/2")


def test_tiny_run_fits_a_laptop(trained):
    """The documented tiny CPU command peaks at 6 GB or less by default, with use_checkpoint "auto" (the tuned
    allocator, now opt-in, took its earlier 64^3 version to 13-14 GB on the reference machine; see docs/speed.md)."""
    root, _, _ = trained
    peak = int((root.parent / "peak_rss_bytes").read_text())
    assert 0 < peak <= 6 * 2**30, f"peak RSS {peak / 2**30:.2f} GiB"


def test_tiny_run_writes_tensorboard_scalars_and_view_images(trained):
    root, _, _ = trained
    scalars, images = set(), set()
    for events in (root / "eval").glob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        scalars |= set(acc.Tags()["scalars"])
        images |= set(acc.Tags()["images"])
    assert {"loss", "loss_rot", "loss_contrast", "loss_recon", "lr", "val_recon_l1", "val_rankme"} <= scalars
    assert "ssl_views" in images


def test_checkpoint_is_resumable_and_resume_continues(trained):
    root, data, _ = trained
    checkpoint = torch.load(root / "models" / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert checkpoint["trainer"]["iteration"] == 2 and checkpoint["trainer"]["epoch"] == 1
    assert {"model", "optimizer", "lr_scheduler", "scaler", "best_metric"} <= set(checkpoint)
    overrides = {"dataset_dir": str(data), "roi_size": [64, 32, 32], "network_def#window_size": 4, "feature_size": 12, "device": "cpu", "speed#amp": False}
    output = _run(root, {**overrides, "max_epochs": 2, "training#log_interval": 1, "checkpointing#resume": str(root / "models" / "checkpoint.pt")})
    assert "Epoch: 2/2, Iter: 1/2" in output and "Epoch: 1/" not in output
    resumed = torch.load(root / "models" / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert resumed["trainer"]["iteration"] == 4


def test_continued_pretraining_loads_the_heads_and_decoder_the_file_holds(trained, tmp_path):
    """Continued pretraining from this bundle's own model.pt (a fresh ckpt_dir: nothing to resume) loads every tensor
    of the SSL network, the rotation and contrastive heads and the decoder with the encoder, as the README says (it
    said they start fresh while the load report showed them loaded)."""
    root, data, _ = trained
    weights = tmp_path / "model.pt"
    shutil.copyfile(root / "models" / "model.pt", weights)
    n_model = len(torch.load(weights, map_location="cpu", weights_only=True))
    n_encoder = len([k for k in torch.load(weights, map_location="cpu", weights_only=True) if k.startswith("swinViT.")])
    overrides = {"dataset_dir": str(data), "roi_size": [64, 32, 32], "network_def#window_size": 4, "feature_size": 12,
                 "max_epochs": 1, "device": "cpu", "speed#amp": False, "training#rankme_crops": 4,
                 "pretrained_path": str(weights), "ckpt_dir": str(tmp_path / "models"),
                 "output_dir": str(tmp_path / "eval")}  # fmt: skip
    output = _run(root, overrides)
    assert (f"layout=ssl_collection target=sslhead: loaded {n_encoder}/{n_encoder} encoder tensors "
            f"({n_model}/{n_model} model tensors), 0 missing") in output, output[-3000:]  # fmt: skip
    readme = (BUNDLES_DIR / "swin_unetr_ssl_pretrain" / "docs" / "README.md").read_text(encoding="utf-8")
    paragraph = " ".join(readme.split("Continued pretraining:", 1)[1].split("\n\n", 1)[0].split())
    assert "start fresh" not in paragraph
    assert "this bundle's `models/model.pt`" in paragraph
    assert "rotation and contrastive heads and the decoder" in paragraph


def test_inference_keeps_the_input_geometry(trained):
    root, data, _ = trained
    out_dir = root / "recon"
    overrides = {"dataset_dir": str(data), "roi_size": [64, 32, 32], "network_def#window_size": 4, "feature_size": 12, "device": "cpu", "output_dir": str(out_dir)}
    _run(root, overrides, configs=("inference.json",))
    test_image = Path(json.loads((data / "dataset.json").read_text())["test"][0]["image"])
    source = nib.load(data / test_image)
    written = sorted(out_dir.glob("*recon*.nii.gz"))
    assert len(written) == 1
    result = nib.load(written[0])
    assert result.shape == source.shape
    np.testing.assert_allclose(result.affine, source.affine, atol=1e-4)
    assert np.isfinite(result.get_fdata()).all()
