"""The pretraining bundle under real torchrun on CPU (gloo): configs/train.json + configs/multi_gpu_train.json.

Every check names the failure of shared/notes/distributed-pitfalls.md that it guards; each fails if that
failure comes back. Runs are shared between assertions (module-scoped fixtures) and kept tiny (64x32x32 crops,
feature size 12, one crop per volume, batch 1), so the three torchrun launches take about a minute and a half
on two cores:

- ``single_node``: ``torchrun --standalone --nproc_per_node=2``, full cache, 4 training volumes (2 per rank),
  3 validation volumes (odd: 2 + 1 per rank), ``log_per_rank`` and ``scale_lr_with_world_size`` on.
- ``multi_node``: two torchrun launchers (``--nnodes=2 --nproc_per_node=1``, c10d rendezvous on one port),
  ``use_checkpoint=true`` and ``cache=smart`` (2 of each rank's 3 volumes cached, one replaced per epoch), 2 epochs.
- ``too_small`` / ``too_small_validation``: one training / one validation volume for two ranks.

A probe module written next to the data (``mgpu_probe.Recorder``, attached through an extra config layered
after multi_gpu_train.json) records on every rank: the volumes of each batch, the rank's shard, the loss and
the per-row validation errors, and the final parameters. Each launch runs under a wall-clock limit (its whole
process group is killed past it) and a short process-group timeout, so a collective mismatch fails the test
instead of hanging the suite.

The last tests need no torchrun: two gloo processes (``tests.ranks.rank_context``) check the validation split and
metric gathering (pitfall g) and the rank partition of the training cache (pitfalls a, b) directly.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import traceback
from pathlib import Path

import pytest
import torch

from components import write_dataset
from tests.ranks import hosted_store, rank_context, run_ranks

REPO = Path(__file__).resolve().parent.parent
BUNDLE = REPO / "bundles" / "swin_unetr_ssl_pretrain"
CONFIGS = ["configs/common.json", "configs/train.json", "configs/multi_gpu_train.json"]
LAUNCH_TIMEOUT_S = 360  # per torchrun launch; a hang fails the test here
PG_TIMEOUT_S = 150  # dist_timeout_s of the runs: a collective mismatch raises well before the launch limit

TINY = {
    "roi_size": "[64,32,32]",  # two final tokens; W == D as rotation needs
    "feature_size": 12,
    "training#num_samples": 1,
    "batch_size": 1,
    "loader#num_workers": 0,
    "speed#amp": "false",
    "device": "cpu",
    "training#warmup_iterations": 1,
    "training#log_interval": 1,
    "dist_timeout_s": PG_TIMEOUT_S,
}

PROBE = '''
"""Test probe attached to the trainer and the evaluator on every rank (tests/test_multi_gpu_bundle.py)."""
import json
import os

import torch
from ignite.engine import Events

import components


def _names(batch):
    # the "label" entry of the datalist passes through the image transforms as a path: it names the volume
    return [os.path.basename(str(p)) for p in batch["label"]]


def _unwrap(net):
    return getattr(net, "module", net)


class Recorder:
    def __init__(self, out_dir, role):
        self.out_dir, self.role, self.rank = out_dir, role, components.get_rank()
        self.record = {"rank": self.rank, "world": components.get_world_size(), "batches": [], "rows": {}}
        # set by torchrun: the launcher (node) of this rank and its rank on that node
        self.record["env"] = {k: os.environ.get(k) for k in ("GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}

    def attach(self, engine):
        engine.add_event_handler(Events.ITERATION_COMPLETED, self.iteration)
        engine.add_event_handler(Events.COMPLETED, self.completed)

    def iteration(self, engine):
        epoch, names, out = engine.state.epoch, _names(engine.state.batch), engine.state.output
        out = out[0] if isinstance(out, list) else out  # SSLTrainer: a one-item list of a dict
        self.record["batches"].append([epoch, names])
        if self.role == "train":
            self.record.setdefault("local_loss", []).append(float(out["loss"]))
            self.record.setdefault("logged_loss", []).append(float(out["log"]["loss"]))
        else:  # MeanAbsoluteError's per-row values: mean over all voxels of each (view, crop) row
            rows = (out["pred"] - out["label"]).abs().flatten(1).mean(1)
            self.record["rows"].setdefault(str(epoch), []).extend(float(v) for v in rows)

    def completed(self, engine):
        if self.role == "train":
            dataset = engine.data_loader.dataset
            self.record["dataset_type"] = type(dataset).__name__
            self.record["dataset_len"] = len(dataset)
            self.record["shard"] = [os.path.basename(d["label"]) for d in dataset.data]
            self.record["initial_lr"] = engine.optimizer.param_groups[0]["initial_lr"]
            modules = list(_unwrap(engine.network).modules())
            self.record["checkpointed_modules"] = sum(getattr(m, "use_checkpoint", False) is True for m in modules)
            self.record["ddp"] = type(engine.network).__name__
            torch.save(_unwrap(engine.network).state_dict(), os.path.join(self.out_dir, f"params_rank{self.rank}.pt"))
        with open(os.path.join(self.out_dir, f"{self.role}_rank{self.rank}.json"), "w") as f:
            json.dump(self.record, f)
'''


def _extra_config(probe_dir: Path) -> dict:
    """Layered after multi_gpu_train.json: the probe on the trainer (after all bundle handlers) and evaluator."""
    return {
        "probe_imports": ["$import mgpu_probe"],
        "probe_dir": str(probe_dir),
        "train#trainer#train_handlers": "$@train#handlers + [mgpu_probe.Recorder(@probe_dir, 'train')]",
        "validate#evaluator#val_handlers": "$@validate#handlers + [mgpu_probe.Recorder(@probe_dir, 'val')]",
    }


# ------------------------------------------------------------------------------------------------ launching


def _cli(overrides: dict) -> list[str]:
    args = []
    for key, value in overrides.items():
        args += [f"--{key}", str(value)]
    return args


def _bundle_args(configs: list[str], overrides: dict) -> list[str]:
    return [
        "-m", "monai.bundle", "run",
        "--config_file", json.dumps(configs),
        "--meta_file", "configs/metadata.json",
        "--logging_file", "configs/logging.conf",
        "--bundle_root", str(BUNDLE),
        *_cli(overrides),
    ]  # fmt: skip


def _env(probe_dir: Path | None) -> dict:
    paths = [str(REPO)] + ([str(probe_dir)] if probe_dir else []) + [os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "OMP_NUM_THREADS": "1"}


class Launch:
    """A finished launch: exit code, output and wall time."""

    def __init__(self, code: int | None, output: str, seconds: float, timed_out: bool) -> None:
        self.code, self.output, self.seconds, self.timed_out = code, output, seconds, timed_out

    def ok(self) -> str:
        return f"exit {self.code}, {self.seconds:.0f} s, timed out: {self.timed_out}\n{self.output[-6000:]}"


def _launch_all(cmds: list[list[str]], env: dict, log_dir: Path, timeout: float = LAUNCH_TIMEOUT_S) -> list[Launch]:
    """Starts the commands at once (each in its own session), waits for all within ``timeout`` and kills the
    whole process group of any still running past it, so no torchrun worker survives a hang."""
    start = time.monotonic()
    procs, logs = [], []
    for i, cmd in enumerate(cmds):
        log = open(log_dir / f"launch{i}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen(cmd, cwd=BUNDLE, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    done: dict[int, float] = {}
    timed_out = set()
    while len(done) < len(procs):
        for i, p in enumerate(procs):
            if i not in done and p.poll() is not None:
                done[i] = time.monotonic() - start
        if time.monotonic() - start > timeout:
            for i, p in enumerate(procs):
                if i not in done:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                    done[i] = time.monotonic() - start
                    timed_out.add(i)
        time.sleep(0.2)
    for log in logs:
        log.close()
    return [
        Launch(p.returncode, (log_dir / f"launch{i}.log").read_text(errors="replace"), done[i], i in timed_out)
        for i, p in enumerate(procs)
    ]


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def _write_datalist(data_dir: Path, name: str, train: list[int], val: list[int]) -> Path:
    items = [{"image": f"imagesTr/case_{i:03d}.nii.gz", "label": f"labelsTr/case_{i:03d}.nii.gz"} for i in range(7)]
    path = data_dir / name
    path.write_text(json.dumps({"training": [items[i] for i in train], "validation": [items[i] for i in val]}))
    return path


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    data = tmp_path_factory.mktemp("mgpu_data")
    write_dataset(data, kind="ct", num=7, seed=0)
    return data


def _probe_dir(tmp: Path) -> Path:
    probe = tmp / "probe"
    probe.mkdir()
    (probe / "mgpu_probe.py").write_text(textwrap.dedent(PROBE))
    (probe / "extra.json").write_text(json.dumps(_extra_config(probe), indent=4))
    return probe


def _read(probe: Path, role: str, world: int = 2) -> list[dict]:
    return [json.loads((probe / f"{role}_rank{r}.json").read_text()) for r in range(world)]


class Run:
    def __init__(self, launches: list[Launch], tmp: Path, probe: Path, overrides: dict) -> None:
        self.launches, self.tmp, self.probe, self.overrides = launches, tmp, probe, overrides
        self.output = "\n".join(launch.output for launch in launches)

    def assert_ok(self) -> None:
        for launch in self.launches:
            assert launch.code == 0 and not launch.timed_out, launch.ok()


# train: cases 0-3 (2 per rank); validation: cases 4-6, an odd number (ranks get 2 and 1: the uneven path)
SINGLE_TRAIN, SINGLE_VAL = [0, 1, 2, 3], [4, 5, 6]
# train: cases 0-5 (3 per rank, smart cache of 2 rotating by 1 per epoch); validation: 2 volumes
MULTI_TRAIN, MULTI_VAL = [0, 1, 2, 3, 4, 5], [5, 6]


@pytest.fixture(scope="module")
def single_node(data_dir, tmp_path_factory) -> Run:
    tmp = tmp_path_factory.mktemp("mgpu_single")
    probe = _probe_dir(tmp)
    datalist = _write_datalist(data_dir, "dl_single.json", SINGLE_TRAIN, SINGLE_VAL)
    overrides = {
        **TINY,
        "dataset_dir": data_dir,
        "datalist": datalist,
        "ckpt_dir": tmp / "models",
        "output_dir": tmp / "eval",
        "max_epochs": 1,
        "speed#use_checkpoint": "false",
        "loader#cache": "full",
        "log_per_rank": "true",
        "scale_lr_with_world_size": "true",
    }
    configs = CONFIGS + [str(probe / "extra.json")]
    cmd = _torchrun("--standalone", "--nnodes=1", "--nproc_per_node=2", *_bundle_args(configs, overrides))
    return Run(_launch_all([cmd], _env(probe), tmp), tmp, probe, overrides)


@pytest.fixture(scope="module")
def multi_node(data_dir, tmp_path_factory) -> Run:
    tmp = tmp_path_factory.mktemp("mgpu_multi")
    probe = _probe_dir(tmp)
    datalist = _write_datalist(data_dir, "dl_multi.json", MULTI_TRAIN, MULTI_VAL)
    overrides = {
        **TINY,
        "dataset_dir": data_dir,
        "datalist": datalist,
        "ckpt_dir": tmp / "models",
        "output_dir": tmp / "eval",
        "max_epochs": 2,
        "training#val_interval": 2,
        "speed#use_checkpoint": "true",
        "loader#cache": "smart",
        "loader#cache_num": 2,
        "loader#replace_rate": 0.5,
    }
    configs = CONFIGS + [str(probe / "extra.json")]
    with hosted_store() as port:  # the rendezvous store is bound before either launcher starts: no port race
        rdzv = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                "--rdzv_conf=is_host=false", f"--rdzv_id=mgpu{port}"]  # fmt: skip
        cmds = [_torchrun(*rdzv, f"--node_rank={n}", *_bundle_args(configs, overrides)) for n in (0, 1)]
        return Run(_launch_all(cmds, _env(probe), tmp), tmp, probe, overrides)


@pytest.fixture(scope="module")
def too_small(data_dir, tmp_path_factory) -> Run:
    tmp = tmp_path_factory.mktemp("mgpu_small")
    datalist = _write_datalist(data_dir, "dl_small.json", [0], [4, 5])
    overrides = {**TINY, "dataset_dir": data_dir, "datalist": datalist, "ckpt_dir": tmp / "models",
                 "output_dir": tmp / "eval", "max_epochs": 1, "speed#use_checkpoint": "false"}  # fmt: skip
    # each rank's output also goes to its own files (--tee/--log_dir), so the test can tell the ranks apart
    cmd = _torchrun("--standalone", "--nnodes=1", "--nproc_per_node=2", "--tee=3", f"--log_dir={tmp / 'ranks'}",
                    *_bundle_args(CONFIGS, overrides))  # fmt: skip
    return Run(_launch_all([cmd], _env(None), tmp, timeout=180), tmp, tmp, overrides)


@pytest.fixture(scope="module")
def too_small_validation(data_dir, tmp_path_factory) -> Run:
    tmp = tmp_path_factory.mktemp("mgpu_small_val")
    datalist = _write_datalist(data_dir, "dl_small_val.json", [0, 1, 2, 3], [4])
    overrides = {**TINY, "dataset_dir": data_dir, "datalist": datalist, "ckpt_dir": tmp / "models",
                 "output_dir": tmp / "eval", "max_epochs": 1, "speed#use_checkpoint": "false"}  # fmt: skip
    cmd = _torchrun("--standalone", "--nnodes=1", "--nproc_per_node=2", "--tee=3", f"--log_dir={tmp / 'ranks'}",
                    *_bundle_args(CONFIGS, overrides))  # fmt: skip
    return Run(_launch_all([cmd], _env(None), tmp, timeout=180), tmp, tmp, overrides)


# ------------------------------------------------------------------------------- 1. single node, full cache


@pytest.mark.slow
def test_single_node_completes_with_one_clean_model(single_node):
    """Completes; one model.pt and one checkpoint.pt, without ``module.`` (pitfall c: saved from the module
    under DDP); only rank 0 wrote TensorBoard files (saving / logging handlers are off on rank 1), and rank 0's
    rank-0-only CheckpointSaver did not hang the run (it needs ignite's distributed context synced on every rank)."""
    single_node.assert_ok()
    models = single_node.tmp / "models"
    assert sorted(p.name for p in models.iterdir()) == ["checkpoint.pt", "model.pt"]
    model = torch.load(models / "model.pt", map_location="cpu", weights_only=True)
    ckpt = torch.load(models / "checkpoint.pt", map_location="cpu", weights_only=True)
    for state in (model, ckpt["model"]):
        assert state and not any(k.startswith("module.") for k in state)
        assert {k.split(".")[0] for k in state} == {"swinViT", "rotation_head", "contrastive_head", "conv"}
    assert single_node.output.count("saved resumable checkpoint") == 1  # epoch 1 (COMPLETED: same state, skipped)
    # event files are named ...tfevents.<time>.<host>.<pid>.<n>: one writer process only
    pids = {p.name.split(".")[-2] for p in (single_node.tmp / "eval").rglob("events.out.tfevents.*")}
    assert len(pids) == 1, pids


@pytest.mark.slow
def test_single_node_parameters_identical_on_both_ranks(single_node):
    """DDP kept the replicas in sync, and the saved model is the trained one."""
    single_node.assert_ok()
    p0, p1 = (torch.load(single_node.probe / f"params_rank{r}.pt", weights_only=True) for r in (0, 1))
    assert p0.keys() == p1.keys()
    for key in p0:
        assert torch.equal(p0[key], p1[key]), key
    model = torch.load(single_node.tmp / "models" / "model.pt", weights_only=True)
    assert all(torch.equal(model[k], p0[k]) for k in p0)
    trainer = torch.load(single_node.tmp / "models" / "checkpoint.pt", weights_only=True)["trainer"]
    assert trainer["iteration"] == 2  # 2 volumes per rank, batch 1: both ranks ran the same 2 steps


@pytest.mark.slow
def test_single_node_each_rank_cached_only_its_shard(single_node):
    """Pitfall a: each rank caches its own half of the training list (not all of it), the halves cover it; each
    rank caches only its part of the validation list (2 + 1 of 3)."""
    single_node.assert_ok()
    out = single_node.output
    for r in (0, 1):
        assert f"rank {r}: dataset of 2/4 volumes (cache=full)" in out
    assert "dataset of 4/4" not in out
    assert "rank 0: dataset of 2/2 volumes" in out and "rank 1: dataset of 1/1 volumes" in out  # validation
    train = _read(single_node.probe, "train")
    shards = [set(t["shard"]) for t in train]
    assert [t["dataset_len"] for t in train] == [2, 2]
    assert shards[0].isdisjoint(shards[1])
    assert shards[0] | shards[1] == {f"case_{i:03d}.nii.gz" for i in SINGLE_TRAIN}
    for t in train:  # each rank trained on its own shard only
        assert {n for _, names in t["batches"] for n in names} == set(t["shard"])


@pytest.mark.slow
def test_single_node_validation_gathers_each_volume_once(single_node):
    """Pitfall g: all ranks validated (2 + 1 of an odd 3: no padding duplicate), without a hang; the key metric
    is the mean over exactly the 3 volumes' rows of both ranks and is logged once (rank 0)."""
    single_node.assert_ok()
    val = _read(single_node.probe, "val")
    seen = [n for v in val for _, names in v["batches"] for n in names]
    assert sorted(seen) == [f"case_{i:03d}.nii.gz" for i in SINGLE_VAL]
    assert [len(v["batches"]) for v in val] == [2, 1]
    rows = [x for v in val for x in v["rows"]["1"]]
    assert len(rows) == 2 * len(SINGLE_VAL)  # two views per crop, one crop per volume
    ckpt = torch.load(single_node.tmp / "models" / "checkpoint.pt", weights_only=True)
    assert ckpt["best_metric"] == pytest.approx(sum(rows) / len(rows), rel=1e-5)
    assert len(re.findall(r"Metrics -- val_recon_l1: ", single_node.output)) == 1


@pytest.mark.slow
def test_single_node_logs_global_mean_and_per_rank_losses(single_node):
    """Pitfall f (logging): the default log line is written once per iteration (rank 0) and shows the mean of the
    ranks' losses; log_per_rank adds one line per rank with the rank in it. scale_lr_with_world_size doubles lr."""
    single_node.assert_ok()
    out = single_node.output
    train = _read(single_node.probe, "train")
    assert len(re.findall(r"Iter: 1/2 -- loss: ", out)) == 1 and len(re.findall(r"Iter: 2/2 -- loss: ", out)) == 1
    for it in range(2):
        local = [t["local_loss"][it] for t in train]
        assert local[0] != local[1]  # different shards, different losses
        for t in train:
            assert t["logged_loss"][it] == pytest.approx(sum(local) / 2, rel=1e-5)
        for r in (0, 1):
            line = re.search(rf"Iter: {it + 1}/2 -- rank{r}_loss: ([0-9.]+)", out)
            assert line and float(line.group(1)) == pytest.approx(local[r], abs=1e-4)
    assert [t["initial_lr"] for t in train] == [pytest.approx(0.0004 * 2)] * 2
    assert len(re.findall(r"SSLTrainer - INFO - Epoch\[1\] Complete", out)) == 2  # log_per_rank: every rank's


# ---------------------------------------------------- 2 + 3. two launchers, c10d, smart cache, checkpointing


@pytest.mark.slow
def test_multi_node_launchers_complete(multi_node):
    """Two torchrun launchers joined by c10d rendezvous (the multi-node command, both nodes on this host) finish;
    the ranks were assigned across the two launchers, one per node, and only rank 0 saved."""
    multi_node.assert_ok()
    train = _read(multi_node.probe, "train")
    assert [t["world"] for t in train] == [2, 2]
    assert sorted(t["env"]["GROUP_RANK"] for t in train) == ["0", "1"]  # one rank per launcher
    assert [t["env"]["LOCAL_RANK"] for t in train] == ["0", "0"]
    assert sorted(p.name for p in (multi_node.tmp / "models").iterdir()) == ["checkpoint.pt", "model.pt"]
    p0, p1 = (torch.load(multi_node.probe / f"params_rank{r}.pt", weights_only=True) for r in (0, 1))
    assert all(torch.equal(p0[k], p1[k]) for k in p0)


@pytest.mark.slow
def test_multi_node_progress_comes_from_rank_zero_only(multi_node):
    """Quiet by default (log_per_rank false): the trainer's start line and epoch lines appear once (rank 0), not once
    per rank (the single-node run, with log_per_rank, has both ranks'); ignite's "resuming from iteration 0" of a
    fresh run is reworded to a start line; no per-rank Orientationd FutureWarning."""
    multi_node.assert_ok()
    out = multi_node.output
    assert len(re.findall(r"SSLTrainer - INFO - Engine run starting, until 2 epochs", out)) == 1, out[-4000:]
    assert len(re.findall(r"SSLTrainer - INFO - Epoch\[1\] Complete", out)) == 1
    assert "resuming from iteration 0" not in out and "Orientationd" not in out


@pytest.mark.slow
def test_multi_node_checkpointing_under_ddp(multi_node):
    """Pitfall d: use_checkpoint=true with DDP trains for 2 epochs (no "Expected to mark a variable ready only
    once") and really used activation checkpointing in the network that DDP wrapped. (Non-reentrant checkpointing
    in MONAI >= 1.3 and SSLTrainer's single forward of both views each avoid the error; this guards both.)"""
    multi_node.assert_ok()
    assert "ready only once" not in multi_node.output
    for t in _read(multi_node.probe, "train"):
        assert t["ddp"] == "DistributedDataParallel" and t["checkpointed_modules"] > 0
    ckpt = torch.load(multi_node.tmp / "models" / "checkpoint.pt", weights_only=True)
    assert ckpt["trainer"]["epoch"] == 2 and ckpt["trainer"]["iteration"] == 4


@pytest.mark.slow
def test_multi_node_smart_cache_rotates_through_each_shard(multi_node):
    """Pitfall b: one SmartCacheDataset per rank holding cache_num (2) of its shard of 3, non-zero iterations,
    and rotated by SmartCacheHandler so that every volume of the shard is trained on within 2 epochs."""
    multi_node.assert_ok()
    train = _read(multi_node.probe, "train")
    for t in train:
        assert t["dataset_type"] == "ResumableSmartCacheDataset" and t["dataset_len"] == 2
        assert len(t["shard"]) == 3
        per_epoch = {e: [n for ep, names in t["batches"] if ep == e for n in names] for e in (1, 2)}
        assert [len(per_epoch[1]), len(per_epoch[2])] == [2, 2]
        assert set(per_epoch[1]) != set(per_epoch[2])  # the cache rotated
        assert set(per_epoch[1]) | set(per_epoch[2]) == set(t["shard"])
    assert set(train[0]["shard"]) | set(train[1]["shard"]) == {f"case_{i:03d}.nii.gz" for i in MULTI_TRAIN}


# ------------------------------------------------------------------------------------ 4. too small dataset


@pytest.mark.slow
def test_too_small_dataset_fails_fast_on_every_rank(too_small):
    """Pitfall b: fewer training volumes than ranks x batch stops every rank before caching with the numbers and
    a fix, a non-zero exit, no hang (the 0-iteration epoch / UnboundLocalError of the original code)."""
    (launch,) = too_small.launches
    assert not launch.timed_out and launch.code != 0, launch.ok()
    assert launch.seconds < 120, launch.ok()
    message = "dl_small.json' has 1 volume(s), too few for 2 rank(s) x batch_size 1"
    _each_rank_stopped_itself_and_one_said_it(too_small, launch, message)


@pytest.mark.slow
def test_too_small_validation_list_fails_before_caching_on_every_rank(too_small_validation):
    """The documented 2-rank command on `synth --num 6` data: one validation volume for two ranks stops every rank
    before the training cache is built, in one line naming the list, its size, the world size and the fix (instead of
    MONAI's "dataset length is less than the number of participating ranks" inside a DistributedSampler)."""
    (launch,) = too_small_validation.launches
    assert not launch.timed_out and launch.code != 0, launch.ok()
    message = ("dl_small_val.json' has 1 volume(s), too few for 2 rank(s) (each rank evaluates at least one): add "
               "volumes (synthetic data: `python -m components synth --num 10`) or run at most 1 rank(s).")
    texts = _each_rank_stopped_itself_and_one_said_it(too_small_validation, launch, message)
    assert all("dataset of" not in text and "participating ranks" not in text for text in texts)


def _each_rank_stopped_itself_and_one_said_it(run, launch: Launch, message: str) -> list[str]:
    """Both ranks stopped before caching without a traceback; one of them, the first to meet it, said ``message`` in
    its one line (components.errors), naming itself, the other rank nothing. Returns each rank's output."""
    assert re.search(r"exitcode\s*: 1 ", launch.output), launch.ok()
    texts = []
    for r in (0, 1):
        files = list((run.tmp / "ranks").rglob(f"attempt_0/{r}/*.log"))
        texts.append("".join(f.read_text(errors="replace") for f in files))
        assert "Loading dataset" not in texts[r] and "Traceback" not in texts[r], f"rank {r}:\n{texts[r][-3000:]}"
    said = [r for r in (0, 1) if message in texts[r]]
    assert len(said) == 1, texts
    assert "swin_unetr_ssl_pretrain: error: ConfigError: " in texts[said[0]], texts[said[0]][-3000:]
    assert f"(from rank {said[0]} of 2; --debug shows the traceback)" in texts[said[0]], texts[said[0]][-3000:]
    return texts


# --------------------------------------------------------------- 5. without torchrun: gloo processes of rank_context


def _child(rank: int, world: int, port: int, out_dir: str) -> None:
    out = Path(out_dir)
    try:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))  # fmt: skip
        torch.set_num_threads(1)
        import components

        components.init_distributed(backend="gloo", timeout_s=60)
        result = {"validation": _validation_scenario(), "partition": _partition_scenario()}
        components.barrier()
        components.cleanup_distributed()
        torch.save(result, out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)


def _val_value(item: dict) -> float:
    return float(item["id"]) ** 2  # a per-volume error that differs between volumes


def _evaluate(items: list[dict]) -> float:
    """MONAI's MeanAbsoluteError handler (the bundle's key metric) on an ignite engine over ``items``."""
    from ignite.engine import Engine
    from monai.handlers import MeanAbsoluteError, from_engine

    def step(engine, batch):
        value = torch.tensor([[_val_value(b)] for b in batch])
        return {"pred": value, "label": torch.zeros_like(value)}

    engine = Engine(step)
    MeanAbsoluteError(output_transform=from_engine(["pred", "label"])).attach(engine, "mae")
    engine.run([[item] for item in items])
    return float(engine.state.metrics["mae"])


def _validation_scenario() -> dict:
    """Pitfall g: the validation split exactly as multi_gpu_train.json builds it, and the metric gathered by MONAI's
    handler, compared with the padded split of a default DistributedSampler."""
    from monai.bundle import ConfigParser
    from monai.data import DistributedSampler

    items = [{"id": i} for i in range(5)]  # odd, and not a multiple of the 2 ranks
    parser = ConfigParser()
    parser.read_config([str(BUNDLE / c) for c in CONFIGS])
    parser["validate#full_datalist"] = items
    mine = parser.get_parsed_content("validate#datalist")
    padded = [items[i] for i in DistributedSampler(items, shuffle=False)]  # even_divisible=True: pads a duplicate
    return {"items": mine, "metric": _evaluate(mine), "padded_metric": _evaluate(padded)}


def _partition_scenario() -> dict:
    """Pitfalls a, b: build_dataset caches only this rank's shard (full and smart cache); a too-small list fails
    on every rank with the same message before caching."""
    import components

    items = [{"id": i} for i in range(7)]
    full = components.build_dataset(items, lambda x: x, cache="full", num_workers=1, check=False, progress=False)
    smart = components.build_dataset(items, lambda x: x, cache="smart", cache_num=3, num_workers=1, check=False,
                                     progress=False)  # fmt: skip
    errors = []
    for build in (
        lambda: components.build_dataset(items[:1], lambda x: x, cache="full", num_workers=1, check=False, progress=False),
        lambda: components.split_for_rank(items[:1], "validation", "data/ct/dataset.json"),  # the real world size
    ):
        try:
            build()
            errors.append(None)
        except ValueError as err:
            errors.append(str(err))
    return {"full": [d["id"] for d in full.data], "full_len": len(full), "smart_len": len(smart),
            "smart_data": [d["id"] for d in smart.data], "error": errors[0], "validation_error": errors[1]}  # fmt: skip


def _spawn(tmp: Path, world: int = 2, timeout: float = 120) -> list[dict]:
    codes = run_ranks(rank_context(), _child, lambda rank, port: (rank, world, port, str(tmp)), world, timeout)
    errors = "\n".join(f"--- {f.name} ---\n{f.read_text()}" for f in sorted(tmp.glob("*.err")))
    assert codes == [0] * world, errors
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> list[dict]:
    return _spawn(tmp_path_factory.mktemp("mgpu_spawn"))


def test_validation_split_and_gathered_metric_match_single_process(spawned):
    """Pitfall g: 5 validation items on 2 ranks: 3 + 2 items, each once; the gathered metric equals the
    single-process one, while a padding sampler (the default) would change it."""
    items = [{"id": i} for i in range(5)]
    single = _evaluate(items)
    ids = [[d["id"] for d in r["validation"]["items"]] for r in spawned]
    assert ids == [[0, 2, 4], [1, 3]]
    for r in spawned:
        assert r["validation"]["metric"] == pytest.approx(single)
        assert r["validation"]["padded_metric"] != pytest.approx(single)  # the check is sensitive to padding


def test_build_dataset_caches_only_this_ranks_shard(spawned):
    """Pitfall a: each rank's cache holds ceil(7/2) = 4 items of its own shard, not all 7; the shards cover the
    list (one item repeated to make them equal). Pitfall b: the smart cache holds cache_num of the shard, and a
    list too short for the ranks fails with the same clear message on every rank."""
    shards = [r["partition"]["full"] for r in spawned]
    assert [r["partition"]["full_len"] for r in spawned] == [4, 4]
    assert set(shards[0]) | set(shards[1]) == set(range(7))
    assert len(set(shards[0]) & set(shards[1])) == 1  # even_divisible: 8 slots for 7 items
    for r, shard in zip(spawned, shards):
        assert r["partition"]["smart_len"] == 3 and sorted(r["partition"]["smart_data"]) == sorted(shard)
        assert "the 'training' list has 1 volume(s), too few for 2 rank(s) x batch_size 1" in r["partition"]["error"]
        assert r["partition"]["validation_error"].startswith(
            "the 'validation' list of 'data/ct/dataset.json' has 1 volume(s), too few for 2 rank(s) (each rank evaluates "
            "at least one): add volumes (synthetic data: `python -m components synth --num 10`) or run at most 1 rank(s)."
        )
