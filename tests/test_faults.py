"""Fail fast and clearly: a NaN/Inf training loss stops the run with its context; resume picks the latest checkpoint."""

from __future__ import annotations

import logging
import re
import sys

import pytest
import torch
from ignite.engine import Events
from monai.data import MetaTensor
from monai.engines import SupervisedTrainer

from components import NonFiniteLossError, SSLLoss, SSLTrainer, StopOnNonFiniteLoss, batch_filenames, resolve_resume
from components.data import item_sources
from tests.probes import read_volumes
from tests.test_engine import TinySSLNet, _one_thread  # noqa: F401 (autouse fixture: one thread here too)


def _ssl_batches(kind: str) -> list[dict]:
    """Three batches of two 20^3 crops; the second holds a NaN voxel (in b.nii.gz)."""
    g = torch.Generator().manual_seed(0)
    batches = []
    for i in range(3):
        image = torch.rand(2, 1, 20, 20, 20, generator=g)
        if i == 1:
            image[1, 0, 3, 3, 3] = float("nan")
        names = [f"vol_{i}_a.nii.gz", f"vol_{i}_b.nii.gz"]
        if kind == "meta":
            batches.append({"image": MetaTensor(image, meta={"filename_or_obj": names})})
        elif kind == "meta_dict":
            batches.append({"image": image, "image_meta_dict": {"filename_or_obj": names}})
        else:
            batches.append({"image": image})
    return batches


def _ssl_trainer(batches: list[dict], handlers: list) -> SSLTrainer:
    torch.manual_seed(0)
    net = TinySSLNet()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    return SSLTrainer(device="cpu", max_epochs=2, train_data_loader=batches, network=net, optimizer=optimizer,
                      loss_function=SSLLoss(), train_handlers=handlers)  # fmt: skip


@pytest.mark.parametrize("kind", ["meta", "meta_dict"])
def test_nan_loss_stops_at_its_iteration_with_parts_and_files(kind, caplog):
    seen = []
    trainer = _ssl_trainer(_ssl_batches(kind), [StopOnNonFiniteLoss()])
    # attached after the stop handler, like the checkpoint saver in the bundles: never sees the NaN iteration
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: seen.append(e.state.iteration))
    with caplog.at_level(logging.ERROR, logger="components.training.non_finite"), pytest.raises(NonFiniteLossError) as err:
        trainer.run()
    message = str(err.value)
    assert "at epoch 1, iteration 2 (iteration 2/3 of the epoch)" in message
    assert "nan" in message.lower()
    for part in ("loss_rot=", "loss_contrast=", "loss_recon="):
        assert part in message
    assert "['vol_1_a.nii.gz', 'vol_1_b.nii.gz']" in message
    assert "vol_0" not in message and "vol_2" not in message
    assert seen == [1]
    assert trainer.state.iteration == 2
    # the message is the error's alone (components.errors prints it once, from a bad rank): the handler logs nothing
    assert not any(r.name == "components.training.non_finite" and r.levelno == logging.ERROR for r in caplog.records)


def test_files_not_tracked_is_said():
    trainer = _ssl_trainer(_ssl_batches("plain"), [StopOnNonFiniteLoss()])
    with pytest.raises(NonFiniteLossError, match=r"batch files: not tracked .*track_meta=True"):
        trainer.run()


def test_finite_losses_run_through():
    batches = [b for i, b in enumerate(_ssl_batches("meta")) if i != 1]
    trainer = _ssl_trainer(batches, [StopOnNonFiniteLoss()])
    trainer.run()
    assert trainer.state.iteration == 4


def test_supervised_trainer_inf_loss():
    """A MONAI SupervisedTrainer output: a list of per-sample dicts (decollated), loss read with from_engine."""
    torch.manual_seed(0)
    net = torch.nn.Conv3d(1, 2, 1)
    data = []
    for i in range(3):
        image = torch.rand(2, 1, 4, 4, 4)
        if i == 2:
            image[0, 0, 0, 0, 0] = float("inf")
        names = [f"case_{i}{s}.nii.gz" for s in "xy"]
        data.append({"image": MetaTensor(image, meta={"filename_or_obj": names}), "label": torch.randint(0, 2, (2, 1, 4, 4, 4))})
    loss = lambda pred, label: (pred - label.float()).pow(2).mean()  # noqa: E731
    trainer = SupervisedTrainer(device="cpu", max_epochs=1, train_data_loader=data, network=net,
                                optimizer=torch.optim.SGD(net.parameters(), lr=0.01), loss_function=loss,
                                train_handlers=[StopOnNonFiniteLoss()])  # fmt: skip
    with pytest.raises(NonFiniteLossError) as err:
        trainer.run()
    message = str(err.value)
    assert "iteration 3 (iteration 3/3 of the epoch)" in message
    assert "loss parts" not in message  # none reported by this trainer
    assert "['case_2x.nii.gz', 'case_2y.nii.gz']" in message


def test_batch_filenames_deduplicates_crops_of_one_volume():
    image = MetaTensor(torch.zeros(4, 1, 2, 2, 2), meta={"filename_or_obj": ["a", "a", "b", "b"]})
    assert batch_filenames({"image": image}) == ["a", "b"]
    assert batch_filenames({"image": torch.zeros(1)}) is None
    assert batch_filenames([1, 2]) is None
    decollated = [{"image": MetaTensor(torch.zeros(1), meta={"filename_or_obj": n})} for n in "aab"]
    assert batch_filenames(decollated) == ["a", "b"]


def test_item_sources_before_and_after_transforms():
    assert item_sources({"image": "/d/a.nii.gz", "label": "/d/a_seg.nii.gz", "id": 3}) == {
        "image": "/d/a.nii.gz",
        "label": "/d/a_seg.nii.gz",
    }
    loaded = {"image": MetaTensor(torch.zeros(1), meta={"filename_or_obj": "/d/b.nii.gz"}), "label": torch.zeros(1)}
    assert item_sources(loaded) == {"image": "/d/b.nii.gz"}
    compact = {"image": torch.zeros(1), "image_meta_dict": {"filename_or_obj": "/d/c.nii.gz"}, "image_compact": {}}
    assert item_sources(compact) == {"image": "/d/c.nii.gz"}
    assert item_sources([compact, dict(compact)]) == {"image": "/d/c.nii.gz"}  # crops of one volume
    assert item_sources({"image": torch.zeros(1)}) == {} and item_sources(7) == {}


def test_resolve_resume(tmp_path, caplog):
    ckpt = tmp_path / "checkpoint.pt"
    with caplog.at_level(logging.INFO, logger="components.checkpoint"):
        assert resolve_resume(None, tmp_path, True) is None  # nothing saved yet: from scratch
        ckpt.write_bytes(b"x")
        assert resolve_resume(None, tmp_path, True) == str(ckpt)
        assert resolve_resume(None, tmp_path, False) is None
        assert resolve_resume("/given.pt", tmp_path, True) == "/given.pt"  # an explicit resume wins
    text = caplog.text
    assert "auto_resume found" in text and "auto_resume is off" in text and "(given)" in text


# ------------------------------------------------------------------------------------------- bundle runs (slow)

import json  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from components import write_dataset  # noqa: E402
from tests.test_multi_gpu_bundle import BUNDLE, CONFIGS, TINY, _bundle_args, _env, _launch_all, _torchrun, _write_datalist  # noqa: E402

PROBES = "probes"  # imported by the first expression of "run" (RUN), before the trainer is built
RUN = ["$import tests.probes as probes", "$@train#trainer.run()"]
# A failing rank ends every rank within FAIL_BOUND_S of its error (the bound docs/pretraining.md states: torchrun's
# agent polls its workers every 0.1 s and stops the others with SIGTERM, then SIGKILL after 30 s), far below the
# process-group timeout of these runs; the whole launch has a limit below that timeout too, so a run whose ranks
# waited for the timeout fails the test instead of passing late.
FAIL_BOUND_S = 31
PG_TIMEOUT_S = 180
LAUNCH_LIMIT_S = 150


@pytest.fixture(scope="module")
def fault_data(tmp_path_factory) -> Path:
    data = tmp_path_factory.mktemp("fault_data")
    write_dataset(data, kind="ct", num=6, seed=0)
    return data


def _overrides(data: Path, tmp: Path, name: str, **extra) -> dict:
    datalist = _write_datalist(data, f"{name}.json", [0, 1, 2, 3], [4, 5])
    return {**TINY, "dataset_dir": data, "datalist": datalist, "ckpt_dir": tmp / "models", "output_dir": tmp / "eval",
            "max_epochs": 1, "speed#use_checkpoint": "false", "dist_timeout_s": PG_TIMEOUT_S, **extra}  # fmt: skip


def _extra(tmp: Path, config: dict) -> str:
    path = tmp / "extra.json"
    path.write_text(json.dumps(config, indent=4))
    return str(path)


@pytest.mark.slow
def test_bundle_stops_on_nan_loss_with_its_context(fault_data, tmp_path):
    """One process, the SSL bundle with a loss that turns NaN at its 2nd call: exit non-zero, the error names
    iteration 2 and the NaN loss part; the iteration checkpoint holds iteration 1 (the NaN state was not saved)."""
    overrides = _overrides(fault_data, tmp_path, "nan", **{"checkpointing#iteration_interval": 1})
    overrides.pop("dist_timeout_s")  # an id of multi_gpu_train.json only: the run would stop on it (check_overrides)
    extra = _extra(tmp_path, {"run": RUN, "train#trainer#loss_function": f"${PROBES}.nan_loss_from(@train#loss, 2)"})
    args = _bundle_args(["configs/common.json", "configs/train.json", extra], overrides)
    proc = subprocess.run([sys.executable, *args], cwd=BUNDLE, env=_env(None), capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-4000:]
    assert "NonFiniteLossError" in output
    assert "non-finite training loss nan at epoch 1, iteration 2 (iteration 2/4 of the epoch)" in output, output[-4000:]
    assert "loss_recon=nan" in output and "loss_rot=" in output and "loss_contrast=" in output
    files = re.search(r"batch files \(rank 0\): \['([^']+)'\]", output)  # LoadImaged(image_only=False) keeps them
    assert files and Path(files.group(1)).parent == fault_data / "imagesTr", output[-4000:]
    ckpt = torch.load(tmp_path / "models" / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert ckpt["trainer"]["iteration"] == 1
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values() if v.is_floating_point())


def _torchrun_bundle(tmp: Path, overrides: dict, extra: dict, *torchrun_args: str, timeout: float = 300):
    configs = CONFIGS + [_extra(tmp, extra)]
    cmd = _torchrun("--standalone", "--nnodes=1", "--nproc_per_node=2", *torchrun_args, *_bundle_args(configs, overrides))
    started = time.time()
    (launch,) = _launch_all([cmd], _env(None), tmp, timeout=timeout)
    launch.ended = started + launch.seconds  # wall-clock time at which the last process of the launch was gone
    return launch


def _assert_prompt_end(launch, marker: Path) -> None:
    """Non-zero exit, within the launch limit, and every rank gone within FAIL_BOUND_S of the failure."""
    assert launch.code != 0 and not launch.timed_out, launch.ok()
    assert marker.is_file(), f"the failure was not reached:\n{launch.ok()}"
    after = launch.ended - float(marker.read_text())
    assert after < FAIL_BOUND_S, f"ranks outlived the failure by {after:.1f} s\n{launch.ok()}"
    print(f"every rank gone {after:.1f} s after the failure (launch {launch.seconds:.0f} s)")


@pytest.mark.slow
def test_rank_failing_while_caching_stops_every_rank(fault_data, tmp_path):
    """Rank 1 raises in a cached (deterministic) transform while rank 0 finishes caching and waits at the barrier:
    the whole run exits non-zero long before any timeout, and the output names rank 1's error."""
    overrides = _overrides(fault_data, tmp_path, "cache_fail")
    marker = tmp_path / "failed_at"
    raising = f"{PROBES}.raise_on_rank(1, 'boom while caching', {str(marker)!r})"
    transform = f"$monai.transforms.Compose([{raising}, @train#preprocessing])"
    extra = {"run": RUN, "train#dataset#transform": transform, "debug": True}  # debug: the traceback, not one line
    launch = _torchrun_bundle(tmp_path, overrides, extra, timeout=LAUNCH_LIMIT_S)
    _assert_prompt_end(launch, marker)
    assert "boom while caching (rank 1)" in launch.output, launch.ok()
    assert "_load_cache_item" in launch.output  # raised by CacheDataset's caching, not later in a data loader


@pytest.mark.slow
def test_rank_failing_in_training_stops_every_rank(fault_data, tmp_path):
    """Rank 1 raises after iteration 2 while rank 0 goes on into the next DDP step (a collective rank 1 never
    joins): the whole run exits non-zero long before the process-group timeout, naming rank 1's error."""
    overrides = _overrides(fault_data, tmp_path, "train_fail", max_epochs=2)
    marker = tmp_path / "failed_at"
    run = [RUN[0], f"${PROBES}.raise_at_iteration(@train#trainer, 2, 1, 'boom in training', {str(marker)!r})", RUN[1]]
    launch = _torchrun_bundle(tmp_path, overrides, {"run": run}, timeout=LAUNCH_LIMIT_S)
    _assert_prompt_end(launch, marker)
    assert "boom in training (rank 1, iteration 2)" in launch.output, launch.ok()


@pytest.mark.slow
def test_killed_rank_is_restarted_and_the_run_resumes(fault_data, tmp_path):
    """torchrun --max-restarts=1: rank 1 SIGKILLs itself after iteration 3 (once, when rank 0 has saved it: the first
    iteration of epoch 2); torchrun restarts both ranks, which resume from that checkpoint (auto_resume), continue
    epoch 2 with its remaining volume and finish: 4 iterations, model.pt written, each volume once per epoch."""
    overrides = _overrides(fault_data, tmp_path, "kill", max_epochs=2, **{"checkpointing#iteration_interval": 1})
    marker = tmp_path / "killed.marker"
    order = str(tmp_path / "order.rank")
    record = f"${PROBES}.record_lr(@train#trainer, {order!r} + str(components.get_rank()))"
    saved = str(tmp_path / "models" / "checkpoint.pt")  # killed once rank 0 saved iteration 3: a mid-epoch restart
    run = [RUN[0], record, f"${PROBES}.kill_once_at_iteration(@train#trainer, 3, 1, {str(marker)!r}, {saved!r})", RUN[1]]
    # torchrun's default shared store: init_distributed keeps the attempts' keys apart (pytorch/pytorch#135712)
    launch = _torchrun_bundle(tmp_path, overrides, {"run": run}, "--max-restarts=1", timeout=420)
    assert launch.code == 0 and not launch.timed_out, launch.ok()
    assert marker.read_text() == "3"
    output = launch.output
    assert "probe: SIGKILL rank 1 at iteration 3" in output
    assert "failed (exitcode: -9) local_rank: 1" in output  # torchrun saw the SIGKILL ...
    killed_at = output.index("failed (exitcode: -9) local_rank: 1")
    assert output.count("auto_resume found") == 2, launch.ok()  # ... and restarted both ranks, which resumed
    assert output.index("auto_resume found") > killed_at
    resumed = [int(m) for m in re.findall(r"resumed from \S+ \([^)]*\) at epoch \d+, iteration (\d+)", output)]
    assert resumed == [3, 3], launch.ok()  # both ranks continue from the mid-epoch checkpoint
    ckpt = torch.load(tmp_path / "models" / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert ckpt["trainer"]["iteration"] == 4
    assert (tmp_path / "models" / "model.pt").is_file()
    # each rank saw each volume of its shard once per epoch: the restarted epoch was continued, not replayed
    for rank in (0, 1):
        seen = dict(read_volumes(f"{order}{rank}"))  # iteration -> volumes; a re-run iteration: its last record
        assert sorted(seen) == [1, 2, 3, 4], launch.ok()
        epochs = [sorted(seen[1] + seen[2]), sorted(seen[3] + seen[4])]
        assert epochs[0] == epochs[1] and len(set(epochs[0])) == 2, (rank, seen)
    assert output.count("continue the epoch's order from sample 1") == 2
