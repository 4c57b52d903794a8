"""End-to-end runs of the self-distillation bundle on synthetic CT (CPU): one process and 2-rank torchrun (gloo);
the exported teacher encoder loaded by the BTCV finetuning bundle's PretrainedLoader; embeddings from inference;
the config's wiring of the recipe (teacher, augmentations, drop-path, the KoLeo batch check) without a run."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
from monai.bundle import ConfigParser
from monai.networks.layers import DropPath
from monai.networks.nets.swin_unetr import WindowAttention

from components import FusedWindowAttention, write_dataset
from components.networks.wrappers import unwrap
from components.demo.runner import BUNDLES_DIR, bundle_command
from components.config.running import run_config_files
from tests.test_multi_gpu_bundle import _launch_all, _torchrun

BUNDLE = BUNDLES_DIR / "swin_unetr_dino_pretrain"
REPO = Path(__file__).resolve().parent.parent
FS = 12
#: attention windows of 4 voxels: the 16^3 and 8^3 tokens of a 32^3 crop fill whole windows (7, the bundle's, pads
#: them to 21^3 and 14^3 and makes a CPU step many times as long)
WS = 4
# tiny but real: 32^3 global and local crops drawn from 48^3 regions, feature size 12, window 4, 32 prototypes
TINY = {
    "roi_size": [32, 32, 32],
    "training#context_size": [48, 48, 48],
    "training#local_size": [32, 32, 32],
    "training#num_local_crops": 1,
    "feature_size": FS,
    "network_def#window_size": WS,
    "training#prototypes": 32,
    "training#head_hidden_dim": 24,
    "training#head_bottleneck_dim": 8,
    "max_epochs": 1,
    "training#warmup_epochs": 1,
    "training#teacher_temperature_warmup_epochs": 1,
    "training#log_interval": 1,
    "loader#num_workers": 0,
    "device": "cpu",
    "speed#amp": False,
    "speed#use_checkpoint": False,
    "training#rankme_crops": 16,  # RankMe's 256 crops would cost ~7 s of one CPU thread per validation
}
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _overrides(root: Path, data: Path, **more) -> dict:
    return {**TINY, "dataset_dir": str(data), "ckpt_dir": str(root / "models"), "output_dir": str(root / "eval"), **more}


def _save_teacher_run(root: Path) -> Path:
    """An extra config: after training, every rank saves its teacher (to compare ranks)."""
    extra = root / "save_teacher.json"
    save = "$torch.save(@train#recipe.teacher.state_dict(), os.path.join(@ckpt_dir, f'teacher_rank{components.get_rank()}.pt'))"
    extra.write_text(json.dumps({"run": ["$@train#trainer.run()", save]}))
    return extra


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("dino_data")
    write_dataset(folder, kind="ct", num=6, seed=0)  # 4 training volumes, 1 validation, 1 test
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data) -> dict[str, tuple[Path, str]]:
    """The bundle's two training runs, started at once (one thread per process, so together they keep two cores
    busy), by name with their folder and output: "one", one process, and "two_ranks", 2-rank torchrun whose ranks
    save their teachers after training."""
    one, ddp = tmp_path_factory.mktemp("dino_one"), tmp_path_factory.mktemp("dino_ddp")
    # 2 crops per volume: RankMe's 16 crops are 8 draws of 2 from the one validation volume
    single = bundle_command(BUNDLE, overrides=_overrides(one, data, batch_size=2, **{"training#num_samples": 2}))
    # batch 1 x 2 crops per volume: KoLeo's 2 neighbours on each rank's own batch
    overrides = _overrides(ddp, data, batch_size=1, dist_timeout_s=150, **{"training#num_samples": 2})
    cmd = bundle_command(BUNDLE, overrides=overrides)
    files = [*map(str, run_config_files(BUNDLE, ["train.json", "multi_gpu_train.json"])), str(_save_teacher_run(ddp))]
    cmd[cmd.index("--config_file") + 1] = json.dumps(files)
    torchrun = _torchrun("--standalone", "--nnodes=1", "--nproc_per_node=2", *cmd[1:])
    launches = _launch_all([single, torchrun], ENV, tmp_path_factory.mktemp("dino_logs"))
    return {name: (root, launch) for name, root, launch in zip(("one", "two_ranks"), (one, ddp), launches)}


@pytest.fixture(scope="module")
def trained(runs):
    root, launch = runs["one"]
    assert launch.code == 0 and not launch.timed_out, launch.ok()
    return root, launch.output


@pytest.fixture(scope="module")
def two_ranks(runs):
    root, launch = runs["two_ranks"]
    assert launch.code == 0 and not launch.timed_out, launch.ok()
    return root, launch.output


def _parser(**overrides) -> ConfigParser:
    """train.json with the tiny settings; the recipe's schedule lengths given, so no dataset is built."""
    parser = ConfigParser()
    parser.read_config([str(f) for f in run_config_files(BUNDLE, ["train.json"])])
    parser.update({**TINY, "train#recipe#total_iterations": 2, "train#recipe#teacher_temperature_warmup_iterations": 1,
                   **overrides})  # fmt: skip
    parser.get_parsed_content("imports")
    return parser


@pytest.mark.parametrize("first", ["train#recipe", "train#network"])
def test_teacher_is_a_copy_of_the_prepared_network_whichever_id_resolves_first(first):
    """Resolving the recipe before the network used to copy the bare student_def as the teacher (explicit
    attention) while the student became fused: now the recipe takes @train#network, the prepared one, in either order."""
    parser = _parser()
    order = [first, "train#network" if first == "train#recipe" else "train#recipe"]
    parsed = {name: parser.get_parsed_content(name) for name in order}
    student, teacher = unwrap(parsed["train#network"]), parsed["train#recipe"].teacher
    attention = [type(m) for m in student.modules() if isinstance(m, WindowAttention)]
    assert attention == [FusedWindowAttention] * 8
    assert [type(m) for m in teacher.modules() if isinstance(m, WindowAttention)] == attention
    state = student.state_dict()
    assert teacher.state_dict().keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in teacher.state_dict().items())
    assert any(isinstance(m, DropPath) and m.drop_prob > 0 for m in student.modules())  # student_drop_path_rate
    assert not any(isinstance(m, DropPath) for m in teacher.modules())


def test_teacher_temperature_warms_up_from_0_04_to_0_07_over_30_of_100_epochs_by_default(data):
    """DINO's paper and DINOv2's default config: the teacher temperature rises linearly from 0.04 to 0.07 over the
    first 30 (of 100) epochs. With the bundle's own schedule lengths: 4 training volumes in batches of 2 make 2
    iterations per epoch, so 60 warm-up iterations of 200."""
    parser = ConfigParser()
    parser.read_config([str(f) for f in run_config_files(BUNDLE, ["train.json"])])
    names = ("max_epochs", "training#warmup_teacher_temperature", "training#teacher_temperature",
             "training#teacher_temperature_warmup_epochs")  # fmt: skip
    assert [parser[name] for name in names] == [100, 0.04, 0.07, 30]
    parser.update({**{k: v for k, v in TINY.items() if k not in ("max_epochs", "training#teacher_temperature_warmup_epochs")},
                   "dataset_dir": str(data), "loader#cache": "none", "loader#check_data": False})  # fmt: skip
    parser.get_parsed_content("imports")
    recipe = parser.get_parsed_content("train#recipe")
    assert (recipe.total_iterations, recipe.warmup_iterations) == (200, 60)
    steps = (0, 30, 59, 60, 199)
    expected = [0.04, 0.055, 0.04 + 0.03 * 59 / 60, 0.07, 0.07]
    assert [recipe.teacher_temperature_at(s) for s in steps] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("encoder_lr_decay, patch_embed_lr_mult", [(1.0, 1.0), (0.9, 0.2)])
def test_optimizer_offers_dinov2_layer_wise_learning_rates(encoder_lr_decay, patch_embed_lr_mult):
    """Off by default (the head and the encoder at learning_rate); training#encoder_lr_decay 0.9 and
    training#patch_embed_lr_mult 0.2 (DINOv2's default config) give each encoder stage one step deeper 0.9 times the
    rate and the patch embedding a further 0.2."""
    parser = _parser(**{"training#encoder_lr_decay": encoder_lr_decay, "training#patch_embed_lr_mult": patch_embed_lr_mult})
    optimizer = parser.get_parsed_content("train#optimizer")
    student = unwrap(parser.get_parsed_content("train#network"))
    rate_of = {id(p): group["lr"] for group in optimizer.param_groups for p in group["params"]}
    rates = {name.split(".")[1] if name.startswith("swinViT.") else "head": rate_of[id(p)]
             for name, p in student.named_parameters() if p.requires_grad}  # fmt: skip
    lr = parser["learning_rate"]
    assert rates == pytest.approx({"head": lr, **{f"layers{i}": lr * encoder_lr_decay ** (5 - i) for i in range(1, 5)},
                                   "patch_embed": lr * encoder_lr_decay**5 * patch_embed_lr_mult})  # fmt: skip
    assert len(optimizer.param_groups) == (2 if encoder_lr_decay == 1 else 12)
    assert optimizer.param_groups[0]["lr"] == lr and optimizer.param_groups[0]["scheduled_weight_decay"]


def test_views_augment_the_global_crops_as_the_augmentation_group_says():
    views = _parser(**{"augmentation#global_crop_2#solarize_prob": 0.3}).get_parsed_content("train#views")
    assert (views.global_blur_prob, views.global_solarize_prob) == ((1.0, 0.1), (0.0, 0.3))
    assert (views.local_blur_prob, views.local_solarize_prob, views.blur_sigma) == (0.5, 0.0, (0.1, 2.0))


def _koleo_check(parser: ConfigParser) -> None:
    """Evaluates the KoLeo batch check at the start of ``run`` (and nothing else of it)."""
    (index,) = [i for i, e in enumerate(parser["run"]) if "check_koleo_batch" in str(e)]
    assert index < 5  # among the start's steps, before anything is built
    parser.get_parsed_content(f"run#{index}")


def test_one_volume_per_step_with_koleo_fails_at_the_start_naming_both_settings():
    """Before any data is cached or any network built: batch_size x num_samples < 2 with KoLeo on."""
    with pytest.raises(RuntimeError) as err:  # MONAI wraps what an expression raises
        _koleo_check(_parser(batch_size=1))
    assert isinstance(err.value.__cause__, ValueError)
    assert str(err.value.__cause__).startswith("batch_size 1 with koleo_weight 0.1: KoLeo compares every student")
    assert "--training#koleo_weight 0" in str(err.value.__cause__)
    _koleo_check(_parser(batch_size=1, **{"training#num_samples": 2}))
    _koleo_check(_parser(batch_size=1, **{"training#koleo_weight": 0}))


class _Recorded(Exception):
    """Raised by the student's forward pre-hook once it has recorded its inputs: the shapes are all the test needs."""


def _real_step_inputs(parser: ConfigParser) -> list[list[int]]:
    """The shapes the student's forward receives in a real step: the first batch of ``train#dataloader`` (its
    ``batch_size`` x ``num_samples`` regions), the recipe's views of it and the recipe's forward."""
    recipe = parser.get_parsed_content("train#recipe")
    batch = next(iter(parser.get_parsed_content("train#dataloader")))
    views = recipe.views(batch["image"], torch.Generator().manual_seed(0))
    received = []

    def record(module, args):
        received.extend(list(t.shape) for t in args[0])
        raise _Recorded

    network = parser.get_parsed_content("train#network")
    handle = unwrap(network).register_forward_pre_hook(record)
    with pytest.raises(_Recorded):
        recipe.forward(network, views)
    handle.remove()
    return received


@pytest.mark.parametrize("num_samples, num_local", [(1, 3), (2, 3), (2, 0)])
def test_step_inputs_are_the_crops_a_real_step_feeds_the_student(data, num_samples, num_local, caplog):
    """train#network#step_inputs (0.4.0's speed#step_inputs), what use_checkpoint "auto" estimates, ignored
    training#num_samples: with 2 regions per volume it estimated half the crops a step feeds (3.1 GiB for a 5.2 GiB step at the defaults). Without local
    crops the student gets an empty batch, which the estimate skips."""
    overrides = {"dataset_dir": str(data), "batch_size": 2, "training#num_samples": num_samples,
                 "training#num_local_crops": num_local, "loader#cache": "none", "loader#check_data": False,
                 "speed#use_checkpoint": "auto"}  # fmt: skip
    parser = _parser(**overrides)
    regions = 2 * num_samples
    expected = [[2 * regions, 1, 32, 32, 32], [num_local * regions, 1, 32, 32, 32]]  # 2 global crops per region
    with caplog.at_level("INFO", logger="components.networks.step_memory"):
        assert _real_step_inputs(parser) == expected
    assert parser.get_parsed_content("train#network#step_inputs") == expected
    assert f"use_checkpoint auto: a step of {expected} needs about" in caplog.text


def test_checkpointing_estimate_follows_num_samples():
    """The "auto" estimate's activations at 2 regions per volume are about twice those at 1 (all but the shared
    relative-position tables scale with the crops)."""
    from components import saved_activation_bytes

    estimates = []
    for num_samples in (1, 2):
        parser = _parser(**{"training#num_samples": num_samples})
        student = unwrap(parser.get_parsed_content("train#network"))
        estimates.append(saved_activation_bytes(student, parser.get_parsed_content("train#network#step_inputs")))
    assert 1.95 < estimates[1] / estimates[0] <= 2.0, estimates


def test_one_process_run_logs_the_named_parts_and_collapse_diagnostics(trained):
    _, output = trained
    lines = [line for line in output.splitlines() if "loss_dino" in line]
    assert len(lines) == 2 and "Epoch: 1/1, Iter: 2/2" in lines[-1]
    for key in ("loss_koleo", "teacher_entropy", "kl", "momentum", "teacher_temperature"):
        assert f"{key}: " in lines[0]


def test_one_process_run_logs_the_health_line_and_the_teachers_rankme_to_the_log_and_tensorboard(trained):
    root, output = trained
    line = next(text for text in output.splitlines() if "health_handler - INFO - health: " in text)
    assert "| teacher_entropy " in line and "| prototypes_in_use " in line and "| rankme " in line and "(epoch 1, 16 crops, " in line
    from components.demo.runner import read_scalars

    scalars = read_scalars(root / "eval")
    (point,) = scalars["val_rankme"]
    assert point[0] == 1 and 1.0 <= point[1] <= 16.0
    (trivial,) = scalars["health_teacher_entropy_trivial"]  # ln K beside the teacher's entropy
    assert trivial[1] == pytest.approx(math.log(32), rel=1e-6) and "health_teacher_entropy" in scalars
    report = json.loads((root / "eval" / "health.json").read_text())["reports"][-1]
    assert report["extra"]["rankme"] == pytest.approx(point[1], rel=1e-6)


def test_exported_teacher_encoder_loads_fully_into_the_btcv_bundle(trained, caplog):
    root, _ = trained
    state = torch.load(root / "models" / "model.pt", map_location="cpu", weights_only=True)
    assert state and all(key.startswith("swinViT.") for key in state)
    checkpoint = torch.load(root / "models" / "checkpoint.pt", map_location="cpu", weights_only=True)
    teacher = {k[len("teacher."):]: v for k, v in checkpoint["recipe"].items() if k.startswith("teacher.swinViT.")}
    assert teacher.keys() == state.keys() and all(torch.equal(teacher[k], state[k]) for k in state)

    parser = ConfigParser()
    parser.read_config([str(f) for f in run_config_files(BUNDLES_DIR / "swin_unetr_btcv_finetune", ["train.json"])])
    parser.update({"bundle_root": str(root), "feature_size": FS, "network_def#window_size": WS,
                   "pretrained_path": str(root / "models" / "model.pt")})  # fmt: skip
    loader = parser.get_parsed_content("train#handlers#0", instantiate=True)
    assert type(loader).__name__ == "PretrainedLoader"
    with caplog.at_level("INFO"):
        report = loader()
    assert report.layout == "swinvit_encoder"
    assert report.encoder_loaded == report.encoder_keys and len(report.encoder_keys) == len(state)
    assert not report.unknown and not report.shape_mismatched
    loaded = f"loaded {len(state)}/{len(state)} encoder tensors"
    assert loaded in report.summary() and loaded in caplog.text
    swin = parser.get_parsed_content("network_def").swinViT.state_dict()
    assert all(torch.equal(swin[k[len("swinViT."):]], v) for k, v in state.items())


def test_inference_writes_one_embedding_per_test_volume(trained, data):
    root, _ = trained
    out = root / "embeddings"
    overrides = {"dataset_dir": str(data), "feature_size": FS, "network_def#window_size": WS,
                 "ckpt_dir": str(root / "models"), "output_dir": str(out), "device": "cpu", "loader#num_workers": 0}  # fmt: skip
    proc = subprocess.run(bundle_command(BUNDLE, ("inference.json",), overrides), capture_output=True, text=True,
                          timeout=600, env=ENV)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = list(csv.reader((out / "embeddings.csv").open()))
    test_image = json.loads((data / "dataset.json").read_text())["test"][0]["image"]
    assert len(rows) == 1 and rows[0][0].endswith(Path(test_image).name)
    values = [float(v) for v in rows[0][1:]]
    assert len(values) == 16 * FS and all(map(torch.isfinite, torch.tensor(values)))


def test_two_rank_torchrun_run_keeps_one_teacher_and_exports_it(two_ranks):
    root, output = two_ranks
    teachers = [torch.load(root / "models" / f"teacher_rank{r}.pt", weights_only=True) for r in range(2)]
    assert teachers[0].keys() == teachers[1].keys()
    assert all(torch.equal(teachers[0][k], teachers[1][k]) for k in teachers[0])
    state = torch.load(root / "models" / "model.pt", map_location="cpu", weights_only=True)
    assert all(torch.equal(state[k], teachers[0][k]) for k in state)
    lines = [line for line in output.splitlines() if "loss_dino" in line]
    assert len(lines) == 2 and "Epoch: 1/1, Iter: 2/2" in lines[-1]  # 4 volumes, 2 per rank, batch 1: logged once


def test_continued_pretraining_loads_the_projection_head_the_file_holds(trained):
    """As the README says: from this bundle's checkpoint.pt the student's projection head loads too; from its
    encoder-only model.pt the head starts fresh, and the load report says so."""
    from components import SelfDistillationNetwork, load_pretrained

    root, _ = trained
    sizes = {"feature_size": FS, "window_size": WS, "out_dim": 32, "hidden_dim": 24, "bottleneck_dim": 8}
    student = lambda: SelfDistillationNetwork(**sizes)  # noqa: E731
    checkpoint = torch.load(root / "models" / "checkpoint.pt", map_location="cpu", weights_only=True)["model"]
    full = load_pretrained(student(), {"state_dict": checkpoint})
    assert full.missing == [] and any(k.startswith("head.") for k in full.loaded)
    encoder_only = load_pretrained(student(), root / "models" / "model.pt")
    assert not any(k.startswith("head.") for k in encoder_only.loaded) and any(k.startswith("head.") for k in encoder_only.missing)
