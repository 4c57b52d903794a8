"""End-to-end runs of the SSL pretraining bundle on synthetic CT (CPU): train, inference, exact resume."""

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

from components import write_dataset
from components.runner import BUNDLES_DIR, bundle_command
from tests.probes import read_lr, read_volumes

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
    files = [str(bundle_root / "configs" / c) for c in configs]
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
        assert set(values) == {"loss", "loss_rot", "loss_contrast", "loss_recon", "lr"}
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
    allocator, now opt-in, took its earlier 64^3 version to 13-14 GB on the reference machine; see the bundle's docs)."""
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


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    data = tmp_path_factory.mktemp("resume_data")
    write_dataset(data, kind="ct", num=4, seed=1)  # 2 training volumes: 2 iterations per epoch
    return data


def _probe(lr_log: Path, stop: str | None = None) -> dict:
    run = ["$import tests.probes as probes", f"$probes.record_lr(@train#trainer, {str(lr_log)!r})"]
    if stop:
        run.append(f"$probes.{stop}")
    return {"run": run + ["$@train#trainer.run()"]}


def _schedule(max_epochs: int, per_epoch: int = 2) -> dict[int, float]:
    """The LR after each iteration of an uninterrupted run: the bundle's WarmupCosineSchedule (lr 4e-4, warm-up
    TINY's 2 iterations, t_total = max_epochs x iterations per epoch), stepped once per iteration."""
    from monai.optimizers import WarmupCosineSchedule

    optimizer = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=4e-4)
    schedule = WarmupCosineSchedule(optimizer, warmup_steps=TINY["training#warmup_iterations"], t_total=max_epochs * per_epoch)
    lrs = {}
    for iteration in range(1, max_epochs * per_epoch + 1):
        optimizer.step()
        schedule.step()
        lrs[iteration] = optimizer.param_groups[0]["lr"]
    return lrs


def _set_best(checkpoint: Path, value: float) -> None:
    """Stands for a stored best that the next validation cannot beat (or cannot fail to beat)."""
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    state["best_metric"] = value
    torch.save(state, checkpoint)


def test_resume_follows_max_epochs_and_reproduces_the_uninterrupted_run(tmp_path, small_data):
    """Shorter: 1 epoch of a 4-epoch schedule, resumed with max_epochs 2, equals 2 uninterrupted epochs (parameters
    and every LR). Longer: those 2 epochs resumed with max_epochs 4 follow the 4-epoch schedule at every iteration,
    and the first validation better than the stored best replaces model.pt."""
    common = {**TINY, "dataset_dir": str(small_data), "max_epochs": 2}
    straight = _bundle_copy(tmp_path / "straight")
    _run(straight, common, extra=_probe(tmp_path / "straight.lr"))

    resumed = _bundle_copy(tmp_path / "resumed")
    _run(resumed, {**common, "max_epochs": 4}, extra=_probe(tmp_path / "resumed.lr", "stop_after_epoch(@train#trainer, 1)"))
    first = torch.load(resumed / "models" / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert first["trainer"]["iteration"] == 2
    ckpt = resumed / "models" / "checkpoint.pt"
    output = _run(resumed, {**common, "checkpointing#resume": str(ckpt)}, extra=_probe(tmp_path / "resumed.lr"))
    assert "with this run's settings {'warmup_steps': 2, 't_total': 4}" in output

    lr_straight, lr_resumed = read_lr(tmp_path / "straight.lr"), read_lr(tmp_path / "resumed.lr")
    assert lr_straight == _schedule(2)  # the uninterrupted bundle run follows the schedule computed here
    assert sorted(lr_resumed) == [1, 2, 3, 4]
    assert lr_resumed == lr_straight  # warm-up did not restart; t_total is this run's, not the 4 epochs' saved one
    a = torch.load(straight / "models" / "checkpoint.pt", map_location="cpu", weights_only=True)
    b = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert a["trainer"] == b["trainer"]
    _assert_same_training(a["model"], b["model"], reference=first["model"], lrs=lr_straight)
    assert b["best_metric"] == pytest.approx(a["best_metric"], rel=1e-4)

    # longer: the 2 epochs of max_epochs 2 resumed with max_epochs 4
    best_before = (resumed / "models" / "model.pt").read_bytes()
    _set_best(ckpt, 1e9)
    output = _run(resumed, {**common, "max_epochs": 4}, extra=_probe(tmp_path / "longer.lr"))  # auto_resume
    longer = read_lr(tmp_path / "longer.lr")
    assert sorted(longer) == [5, 6, 7, 8]
    assert longer == {it: lr for it, lr in _schedule(4).items() if it > 4}  # every iteration of the 4-epoch run
    assert longer[5] > longer[6] > longer[7] > longer[8] == 0.0  # down to 0 at the new end, not back up after the old
    final = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert final["best_metric"] < 1e9 and final["best_metric_epoch"] in (3, 4)
    assert final["best_metric_iteration"] == 2 * final["best_metric_epoch"]
    assert (resumed / "models" / "model.pt").read_bytes() != best_before  # a strictly better validation replaced it
    assert "restored best val_recon_l1 1000000000.0 (epoch 2, iteration 4)" in output


def _adam_step_bound(step: int, betas: tuple[float, float]) -> float:
    """The most one Adam(W) step can move an element, in units of the LR: max |m_hat / sqrt(v_hat)| over every
    gradient sequence of ``step`` steps (Cauchy-Schwarz on the two exponential averages; eps only lowers it)."""
    beta1, beta2 = betas
    ratio = sum(beta1 ** (2 * k) / beta2**k for k in range(step)) ** 0.5
    return (1 - beta1) / (1 - beta1**step) * ((1 - beta2**step) / (1 - beta2)) ** 0.5 * ratio


# tensors whose true gradient is zero at TINY's ROI (64x32x32): the decoder biases right before an InstanceNorm
# (it removes any constant), and the first decoder conv, whose InstanceNorm normalises the 2x1x1 bottleneck: two
# voxels normalise to -1 and +1 whatever the weights, so its gradient is rounding noise, which Adam turns into steps
ZERO_GRADIENT = re.compile(r"conv\.0\.weight|conv\.(0|4|8|12|16)\.bias")


def _assert_same_training(a: dict, b: dict, reference: dict, lrs: dict[int, float]) -> None:
    """Two runs of the same iterations in different processes agree up to floating-point rounding.

    Bitwise equality across processes is not guaranteed on CPU (memory alignment changes how vectorised
    reductions round), and Adam divides each gradient by its own running scale: an element whose true gradient
    is at the level of that rounding noise moves by up to a whole step in either direction. So the tolerances come
    from the optimizer, not from a guess:

    - every element: |a - b| <= 2 x sum_t lr_t x max|m_hat_t / sqrt(v_hat_t)| (both runs start from the same
      initialisation; AdamW's decay, a factor 1 - lr x wd <= 1, only shrinks a difference), with the LRs the
      runs logged;
    - the update of epoch 2 (from the epoch-1 state ``reference``) of every tensor with a true gradient
      (not ``ZERO_GRADIENT``): ||update_a - update_b|| < 1e-2 x ||update_a||. Rounding changes only the few
      elements whose gradient is at its level (repeated runs: at most 1.9e-3 even with conv.0.weight included,
      most runs bitwise equal); a resume that loses or misplaces state (weights, Adam moments, the schedule)
      changes every element's update by a fraction of order one."""
    betas = torch.optim.AdamW([torch.zeros(1)]).defaults["betas"]
    bound = 2 * sum(lr * _adam_step_bound(step, betas) for step, lr in sorted(lrs.items()))
    floats = [k for k in a if a[k].is_floating_point()]
    worst = max(floats, key=lambda k: float((a[k] - b[k]).abs().max()))
    assert float((a[worst] - b[worst]).abs().max()) <= bound, f"{worst} differs by more than Adam can move it ({bound})"
    keys = [k for k in floats if not ZERO_GRADIENT.fullmatch(k)]
    update_a = torch.cat([(a[k] - reference[k]).flatten() for k in keys])
    update_b = torch.cat([(b[k] - reference[k]).flatten() for k in keys])
    assert torch.linalg.vector_norm(update_a - update_b) < 1e-2 * torch.linalg.vector_norm(update_a)


def test_restart_mid_epoch_continues_the_epoch_and_keeps_the_better_stored_model(tmp_path, small_data):
    """Stopped after iteration 3 (the first of epoch 2) and restarted: the iteration count, the schedule and the
    volumes seen continue those of the uninterrupted run; the validation after the restart is worse than the stored
    best, so model.pt stays byte-identical and the logged best is the stored one."""
    common = {**TINY, "dataset_dir": str(small_data), "max_epochs": 2, "checkpointing#iteration_interval": 1}
    reference = _bundle_copy(tmp_path / "reference")
    _run(reference, common, extra=_probe(tmp_path / "reference.lr"))

    root = _bundle_copy(tmp_path / "mid")
    _run(root, common, extra=_probe(tmp_path / "mid.lr", "stop_after_iteration(@train#trainer, 3)"))
    ckpt = root / "models" / "checkpoint.pt"
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert saved["trainer"]["iteration"] == 3 and saved["sampler"]["position"] == 1
    _set_best(ckpt, 1e-9)  # better than any reconstruction error
    best_before = (root / "models" / "model.pt").read_bytes()
    output = _run(root, {**common, "checkpointing#resume": str(ckpt)}, extra=_probe(tmp_path / "mid.lr"))
    lrs, volumes = read_lr(tmp_path / "mid.lr"), read_volumes(tmp_path / "mid.lr")
    assert [it for it, _ in volumes] == [1, 2, 3, 4]  # the iteration count continues
    assert lrs == read_lr(tmp_path / "reference.lr")  # and so does the schedule: no new warm-up
    expected = read_volumes(tmp_path / "reference.lr")
    assert volumes == expected and volumes[3][1] != volumes[2][1]  # the rest of epoch 2, not its head again
    assert "Epoch: 2/2, Iter: 2/2" in output
    assert "continue the epoch's order from sample 1" in output
    assert (root / "models" / "model.pt").read_bytes() == best_before
    assert "Key metric: val_recon_l1 best value: 1e-09 at epoch: 1" in output
    final = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert (final["best_metric"], final["best_metric_epoch"], final["best_metric_iteration"]) == (1e-9, 1, 2)
