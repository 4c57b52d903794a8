"""Continued pretraining from published weights, end to end on CPU: a VoCo v2 encoder file given as
``--pretrained_path`` to each pretraining bundle (SSL, self-distillation).

Per bundle, on tiny synthetic CT (feature size 12, 2 training volumes, one per batch: 2 iterations per epoch):

- the run starts from the file: the load report says that every ``swinViT.*`` tensor loaded and the heads did not,
  and the weights when training starts (after every STARTED handler of the bundle: the pretrained load, the resume,
  the teacher's copy) are the file's, bitwise; the self-distillation teacher starts as that student;
- the bundles' default v1 network stops the run before its first iteration with one line naming
  ``--network_def#use_v2 true``;
- a run stopped after its first epoch and relaunched with ``--max_epochs 2`` and the same ``--pretrained_path``
  starts from its checkpoint, not from the file (the log shows the file loaded, then the checkpoint), and ends where
  an uninterrupted 2-epoch run ends;
- BrainSegFounder's 2-channel (T1 + T2) encoder continued on this 1-channel CT: ``--training#channel_policy repeat``
  loads every encoder tensor, the patch embedding adapted; without it the run stops before its first iteration
  with one line naming that override.

The file is VoCo's ``{"global_step", "state_dict"}`` of its DDP-wrapped ``VoCoHead`` at feature size 12, as
tests/test_checkpoint_layouts.py builds it. It has VoCo's window 7, so these runs keep the bundles' default window 7
(a window 4 network would fail the architecture check).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from components import write_dataset
from components.demo.runner import bundle_command
from tests.probes import read_lr
from tests.test_checkpoint_layouts import Published, _published, _random
from tests.test_pretrain_bundle import REPO, _run
from tests.test_restarts import (
    BUNDLES,
    IDS,
    Bundle,
    _assert_same_state,
    _bundle_copy,
    _load,
)

VOCO_ENCODER = "module.backbone.swinViT."  # where VoCo's file keeps the encoder


@dataclass(frozen=True)
class Continued:
    """A pretraining bundle continued from a published file.

    Args:
        bundle: the bundle and its tiny settings (tests/test_restarts.py).
        network_class: the class of the network the pretrained weights load into, as the load report names it.
        target: the report's target kind of that network.
        modules: what the probe saves when training starts: a name -> the config id of a module.
    """

    bundle: Bundle
    network_class: str
    target: str
    modules: dict = field(repr=False)


CONTINUED = [
    Continued(BUNDLES[0], network_class="SSLHead", target="sslhead", modules={"network": "network_def"}),
    Continued(BUNDLES[1], network_class="SelfDistillationNetwork", target="encoder",
              modules={"network": "train#student_def", "teacher": "train#recipe.teacher"}),
]  # fmt: skip
CONTINUED_IDS = IDS[:2]


@dataclass(frozen=True)
class Run:
    """A finished bundle run: its copy, its output, the LR of every iteration (``tests.probes.record_lr``) and the
    file of the state dicts of :attr:`Continued.modules` when training started."""

    root: Path
    output: str
    lr_log: Path
    start: Path

    @property
    def checkpoint(self) -> Path:
        return self.root / "models" / "checkpoint.pt"


@pytest.fixture(scope="module", autouse=True)
def one_thread_runs():
    """One OpenMP thread: two runs of the same iterations compute the same weights (tests/test_restarts.py)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        yield


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("continued_ct")
    write_dataset(folder, kind="ct", num=4, seed=1)  # 2 training volumes, 1 validation, 1 test
    return folder


@pytest.fixture(scope="module")
def two_channel(tmp_path_factory) -> tuple[Path, Published]:
    """BrainSegFounder's stage-1 SSL checkpoint (T1 + T2: 2 input channels) at feature 12 with random values, saved
    as its code saves it (window 7, as the bundles' default)."""
    brainsegfounder = _published("brainsegfounder_stage1", 12, _random)
    path = tmp_path_factory.mktemp("brainsegfounder") / "BrainSegFounder_T1T2_12.pt"
    torch.save(brainsegfounder.checkpoint, path)
    return path, brainsegfounder


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> tuple[Path, Published]:
    """VoCo's published SSL checkpoint at feature size 12 with random values, saved as its code saves it."""
    voco = _published("voco_ssl", 12, _random)
    path = tmp_path_factory.mktemp("voco") / "VoCo_12_SSL_head.pt"
    torch.save(voco.checkpoint, path)
    return path, voco


def _overrides(case: Continued, data: Path, path: Path, **more) -> dict:
    """The bundle's tiny settings continued from ``path`` with the v2 encoder it holds, ``use_v2`` as typed."""
    return {**case.bundle.overrides, "dataset_dir": str(data), "pretrained_path": str(path),
            "network_def#use_v2": "true", **more}  # fmt: skip


def _probe(case: Continued, lr_log: Path, start: Path) -> dict:
    """An extra config: records every iteration's LR to ``lr_log`` and, when the trainer starts, saves the state
    dicts of ``case.modules`` to ``start``: after the bundle's own STARTED handlers, which were attached before."""
    modules = ", ".join(f"{name!r}: @{ref}" for name, ref in case.modules.items())
    states = "{name: m.state_dict() for name, m in modules.items()}"
    save = f"lambda engine, modules={{{modules}}}: torch.save({states}, {str(start)!r})"
    return {"run": ["$import tests.probes as probes", "$from ignite.engine import Events",
                    f"$probes.record_lr(@train#trainer, {str(lr_log)!r})",
                    f"$@train#trainer.add_event_handler(Events.STARTED, {save})", "$@train#trainer.run()"]}  # fmt: skip


def _continued_run(root: Path, case: Continued, overrides: dict, name: str) -> Run:
    lr_log, start = root.parent / f"{name}.lr", root.parent / f"{name}_start.pt"
    output = _run(root, overrides, extra=_probe(case, lr_log, start))
    return Run(root, output, lr_log, start)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data, published):
    """A bundle's uninterrupted 2-epoch run continued from the published file, run once for two tests."""
    done: dict[str, Run] = {}

    def of_case(case: Continued) -> Run:
        if case.bundle.name not in done:
            root = _bundle_copy(tmp_path_factory.mktemp(f"straight_{case.bundle.name}"), case.bundle)
            overrides = _overrides(case, data, published[0], max_epochs=2)
            done[case.bundle.name] = _continued_run(root, case, overrides, "straight")
        return done[case.bundle.name]

    return of_case


def _report(case: Continued, path: Path, network: dict) -> str:
    """The line PretrainedLoader logs for the published file loaded into ``network`` (a state dict): every encoder
    tensor loaded, every other tensor missing and allowed to be."""
    n_encoder = sum(k.startswith("swinViT.") for k in network)
    n_heads = len(network) - n_encoder
    return (f"PretrainedLoader: {case.network_class} starts from {path}: layout=voco target={case.target}: loaded "
            f"{n_encoder}/{n_encoder} encoder tensors ({n_encoder}/{len(network)} model tensors), {n_heads} missing "
            f"(0 encoder; {n_heads} allowed by required='encoder')")  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", CONTINUED, ids=CONTINUED_IDS)
def test_published_v2_encoder_starts_the_continued_run(uninterrupted, published, case):
    """Every encoder tensor of the file is in the network when training starts, bitwise, and the report counts them
    all; the heads are not in the file and reported missing; the self-distillation teacher starts as that student."""
    path, voco = published
    run = uninterrupted(case)
    assert f"resume: no {run.checkpoint} yet; starting from scratch" in run.output
    start = _load(run.start)
    network = start["network"]
    encoder = [k for k in network if k.startswith("swinViT.")]
    heads = [k for k in network if not k.startswith("swinViT.")]
    assert heads and not any(voco.file_key(k) for k in heads)
    assert sorted(voco.file_key(k) for k in encoder) == sorted(k for k in voco.state if k.startswith(VOCO_ENCODER))
    assert all(torch.equal(network[k], voco.state[voco.file_key(k)]) for k in encoder)
    assert _report(case, path, network) in run.output
    if "teacher" in start:
        assert start["teacher"].keys() == network.keys()
        assert all(torch.equal(v, network[k]) for k, v in start["teacher"].items())
    trained = _load(run.checkpoint)["model"]["swinViT.patch_embed.proj.weight"]
    assert not torch.equal(trained, network["swinViT.patch_embed.proj.weight"])  # the probe saw the start, not the end


@pytest.mark.slow
@pytest.mark.parametrize("case", CONTINUED, ids=CONTINUED_IDS)
def test_v2_file_into_the_default_v1_network_stops_before_reading_data_unless_auto(tmp_path, data, published, case):
    """Without ``--network_def#use_v2 true`` the architecture check stops the run when network_def is built, before
    any volume is read, iteration run or checkpoint written, with one line that names the difference and the override;
    with ``--training#pretrained_arch auto`` instead, the run builds the v2 network and loads every encoder tensor."""
    path, _ = published
    outputs = {}
    for arch in ("config", "auto"):
        root = _bundle_copy(tmp_path / arch, case.bundle)
        overrides = {**_overrides(case, data, path, max_epochs=1), "bundle_root": str(root), "training#pretrained_arch": arch}
        del overrides["network_def#use_v2"]
        proc = subprocess.run(bundle_command(root, overrides=overrides), check=False, capture_output=True, text=True,
                              timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=root)  # fmt: skip
        outputs[arch] = (proc.returncode, proc.stdout + proc.stderr, root)
    code, output, root = outputs["config"]
    assert code != 0
    message = (f"checkpoint {path} was trained with another network: use_v2=true in the checkpoint, false in the "
               "network. Run with --network_def#use_v2 true.")  # fmt: skip
    assert f": error: CheckpointLoadError: {message} (--debug shows the traceback)\n" in output, output[-4000:]
    assert "dataset of" not in output and "Epoch: 1/" not in output and not (root / "models" / "checkpoint.pt").exists()

    code, output, root = outputs["auto"]
    assert code == 0, output[-4000:]
    assert f"pretrained_arch='auto': use_v2=true from the checkpoint {path} instead of the configured false" in output
    model = _load(root / "models" / "checkpoint.pt")["model"]
    n_encoder = sum(k.startswith("swinViT.") for k in model)
    assert any(k.startswith("swinViT.layers4c.") for k in model)
    assert f"loaded {n_encoder}/{n_encoder} encoder tensors" in output


@pytest.mark.slow
@pytest.mark.parametrize("case", CONTINUED, ids=CONTINUED_IDS)
def test_resumed_continued_run_starts_from_its_checkpoint_not_the_file(tmp_path, data, published, uninterrupted,
                                                                       case):  # fmt: skip
    """1 epoch continued from the file, then relaunched with ``--max_epochs 2`` and the same ``--pretrained_path``
    (auto_resume): the file is loaded, then the checkpoint over it, so training restarts from the checkpoint's
    weights (the teacher from the checkpoint's teacher) and ends as the uninterrupted 2-epoch run: the same LRs and
    the same final state."""
    path, voco = published
    root = _bundle_copy(tmp_path, case.bundle)
    first_run = _continued_run(root, case, _overrides(case, data, path, max_epochs=1), "first")
    first = _load(first_run.checkpoint)
    assert first["trainer"]["iteration"] == 2
    embedding = "swinViT.patch_embed.proj.weight"
    assert not torch.equal(first["model"][embedding], voco.state[voco.file_key(embedding)])  # trained: not the file

    resumed = _continued_run(root, case, _overrides(case, data, path, max_epochs=2), "resumed")
    loaded = resumed.output.index(_report(case, path, first["model"]))
    assert resumed.output.index(f"resumed from {resumed.checkpoint} (found by auto_resume") > loaded
    assert "Epoch: 2/2" in resumed.output and "Epoch: 1/" not in resumed.output
    start = _load(resumed.start)
    assert start["network"].keys() == first["model"].keys()
    assert all(torch.equal(v, first["model"][k]) for k, v in start["network"].items())
    if "teacher" in start:
        saved = {k[len("teacher.") :]: v for k, v in first["recipe"].items() if k.startswith("teacher.")}
        assert start["teacher"].keys() == saved.keys()
        assert all(torch.equal(v, saved[k]) for k, v in start["teacher"].items())
        assert not torch.equal(start["teacher"][embedding], start["network"][embedding])  # an EMA, not a new copy

    straight = uninterrupted(case)
    lrs = read_lr(straight.lr_log)
    assert sorted(read_lr(resumed.lr_log)) == [3, 4]
    assert read_lr(first_run.lr_log) | read_lr(resumed.lr_log) == lrs
    a, b = _load(straight.checkpoint), _load(resumed.checkpoint)
    assert a["trainer"] == b["trainer"]
    _assert_same_state(case.bundle, a, b, reference=first, lrs=lrs)


@pytest.mark.slow
@pytest.mark.parametrize("case", CONTINUED, ids=CONTINUED_IDS)
def test_two_channel_encoder_continues_on_one_channel_data_with_the_channel_policy(tmp_path, data, two_channel,
                                                                                  case):  # fmt: skip
    """Without a channel policy the run stops when the trainer starts, before its first iteration or checkpoint,
    with one line naming ``--training#channel_policy repeat``; with it every encoder tensor of the file is in the
    network when training starts, the patch embedding the sum of its two kernels (the same response to a constant
    image), and the report counts them all and the one adapted."""
    path, brainsegfounder = two_channel
    embedding = "swinViT.patch_embed.proj.weight"
    stopped = _bundle_copy(tmp_path / "error", case.bundle)
    overrides = {**case.bundle.overrides, "dataset_dir": str(data), "pretrained_path": str(path), "max_epochs": 1,
                 "bundle_root": str(stopped)}  # fmt: skip
    proc = subprocess.run(bundle_command(stopped, overrides=overrides), check=False, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=stopped)  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    message = (f"CheckpointLoadError: checkpoint {path} (layout=ssl_original): the patch embedding '{embedding}' has 2 "
               "input channel(s) in the checkpoint (shape [12, 2, 2, 2, 2]) but the model has 1 (shape [12, 1, 2, 2, "
               "2]). Run with --training#channel_policy repeat (")  # fmt: skip
    assert message in output, output[-4000:]
    assert "Epoch: 1/" not in output and not (stopped / "models" / "checkpoint.pt").exists()

    root = _bundle_copy(tmp_path / "repeat", case.bundle)
    overrides = {**case.bundle.overrides, "dataset_dir": str(data), "pretrained_path": str(path), "max_epochs": 1,
                 "training#channel_policy": "repeat"}  # fmt: skip
    run = _continued_run(root, case, overrides, "repeat")
    network = _load(run.start)["network"]
    encoder = [k for k in network if k.startswith("swinViT.")]
    file_key = {k: "module." + k for k in encoder}
    assert all(torch.equal(network[k], brainsegfounder.state[file_key[k]]) for k in encoder if k != embedding)
    assert torch.allclose(network[embedding], brainsegfounder.state[file_key[embedding]].sum(1, keepdim=True))
    assert (f"PretrainedLoader: {case.network_class} starts from {path}: layout=ssl_original target={case.target}: "
            f"loaded {len(encoder)}/{len(encoder)} encoder tensors") in run.output  # fmt: skip
    assert f"load_pretrained: adapted {embedding}: repeat: input channels 2 -> 1" in run.output
    assert "Epoch: 1/1" in run.output
