"""End-to-end runs of the masked image bundle on synthetic CT (CPU), with its masked-token self-distillation on: one
process and 2-rank torchrun (gloo); its model.pt loaded by both finetuning bundles' PretrainedLoader; inference."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from monai.bundle import ConfigParser

from components import write_dataset
from components.demo.runner import BUNDLES_DIR, bundle_command
from components.config.running import run_config_files
from tests.test_multi_gpu_bundle import _launch_all, _torchrun

pytestmark = pytest.mark.slow

BUNDLE = BUNDLES_DIR / "swin_unetr_mim_pretrain"
REPO = Path(__file__).resolve().parent.parent
TINY = {
    "roi_size": [64, 32, 32],
    "feature_size": 12,
    "network_def#window_size": 4,
    "batch_size": 1,
    "training#num_samples": 2,
    "max_epochs": 1,
    "training#warmup_iterations": 1,
    "training#log_interval": 1,
    "training#rankme_crops": 4,
    "masking#distill_weight": 1.0,
    "masking#distill_prototypes": 32,
    "masking#head_hidden_dim": 24,
    "masking#head_bottleneck_dim": 8,
    "loader#num_workers": 0,
    "device": "cpu",
    "speed#amp": False,
    "speed#use_checkpoint": False,
}
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _overrides(root: Path, data: Path, **more) -> dict:
    return {**TINY, "dataset_dir": str(data), "ckpt_dir": str(root / "models"), "output_dir": str(root / "eval"), **more}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("mim_data")
    write_dataset(folder, kind="ct", num=10, seed=0)  # 6 training volumes, 2 validation (one per rank), 2 test
    return folder


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data):
    root = tmp_path_factory.mktemp("mim_one")
    proc = subprocess.run(bundle_command(BUNDLE, overrides=_overrides(root, data)), capture_output=True, text=True,
                          timeout=900, env=ENV)  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    return root, output


def test_one_process_trains_validates_and_saves_the_release_and_the_teacher(trained):
    root, output = trained
    assert "loss_recon:" in output and "loss_distill:" in output and "teacher_temperature:" in output
    assert "val_masked_l1" in output and "val_rankme:" in output
    state = torch.load(root / "models" / "model.pt", map_location="cpu", weights_only=True)
    assert {k.split(".")[0] for k in state} == {"swinViT", "mask_token", "decoder"}  # the token head: pretraining only
    checkpoint = torch.load(root / "models" / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert any(k.startswith("token_head.") for k in checkpoint["model"])  # a resume continues with it
    assert "distillation.center" in checkpoint["recipe"]
    assert any(k.startswith("distillation.teacher.swinViT.") for k in checkpoint["recipe"])


@pytest.mark.parametrize("bundle, channels", [("swin_unetr_btcv_finetune", 1), ("swin_unetr_brats_finetune", 4)])
def test_both_finetuning_bundles_load_every_encoder_tensor(trained, bundle, channels):
    """The exported encoder, in the swinViT layout the finetuning bundles read: every encoder tensor loads (BraTS
    through its repeat channel policy), the mask token and decoder dropped by design."""
    root, _ = trained
    parser = ConfigParser()
    parser.read_config([str(f) for f in run_config_files(BUNDLES_DIR / bundle, ["train.json"])])
    parser.update({"pretrained_path": str(root / "models" / "model.pt"), "feature_size": 12,
                   "network_def#window_size": 4, "device": "cpu"})  # fmt: skip
    parser.get_parsed_content("imports")
    network = parser.get_parsed_content("network_def")
    from components import load_pretrained

    report = load_pretrained(network, str(root / "models" / "model.pt"),
                             channel_policy=parser["training#channel_policy"])  # fmt: skip
    assert report.layout == "mim_collection"
    encoder = [k for k in report.encoder_keys if not k.endswith("relative_position_index")]
    assert set(encoder) <= set(report.loaded) and len(encoder) > 100 and not report.shape_mismatched
    assert network.swinViT.patch_embed.proj.weight.shape[1] == channels
    assert {str(k).split(".")[0] for k in report.unexpected} == {"mask_token", "decoder"}


def test_inference_reconstructs_the_test_volume(trained, data):
    root, _ = trained
    overrides = {"dataset_dir": str(data), "ckpt_dir": str(root / "models"), "output_dir": str(root / "recon"),
                 "roi_size": [64, 32, 32], "device": "cpu", "speed#amp": False, "loader#num_workers": 0}  # fmt: skip
    cmd = bundle_command(BUNDLE, configs=("inference.json",), overrides=overrides)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert list((root / "recon").glob("*_recon.nii.gz"))


def _save_ranks(root: Path) -> Path:
    """An extra config: after training, every rank saves its network and its recipe (to compare ranks)."""
    extra = root / "save_ranks.json"
    save = ("$torch.save({'network': @network_def.state_dict(), 'recipe': @train#recipe.state_dict()}, "
            "os.path.join(@ckpt_dir, f'rank{components.get_rank()}.pt'))")  # fmt: skip
    extra.write_text(json.dumps({"run": ["$@train#trainer.run()", save]}))
    return extra


def test_two_gloo_ranks_train_one_model_and_one_teacher(tmp_path_factory, data):
    """torchrun, 2 ranks: the run completes, the ranks end with the same weights and the same teacher and centre
    (DDP's averaged gradients; the teacher's EMA of those weights; the centre of the global batch)."""
    root = tmp_path_factory.mktemp("mim_ddp")
    cmd = bundle_command(BUNDLE, overrides=_overrides(root, data, dist_timeout_s=150))
    files = [*map(str, run_config_files(BUNDLE, ["train.json", "multi_gpu_train.json"])), str(_save_ranks(root))]
    cmd[cmd.index("--config_file") + 1] = json.dumps(files)
    (launch,) = _launch_all([_torchrun("--standalone", "--nnodes=1", "--nproc_per_node=2", *cmd[1:])], ENV, root)
    assert launch.code == 0 and not launch.timed_out, launch.ok()
    first, second = (torch.load(root / "models" / f"rank{r}.pt", map_location="cpu", weights_only=True) for r in (0, 1))
    for part in ("network", "recipe"):
        different = [k for k in first[part] if not torch.equal(first[part][k], second[part][k])]
        assert not different, f"{part}: {len(different)} tensors differ between the ranks, e.g. {different[:3]}"
    assert (root / "models" / "model.pt").is_file()
