"""The demo command (``python -m components demo``) in its quick budget: every step a bundle run, the summary,
the pictures. What the demo learns at its real budget is measured, not tested (README.md records it)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from components.demo.recipes import RECIPES
from components.demo.run import BUDGETS, run_demo
from components.demo.runner import STOP_GRACE_S
from components.data.synthetic import DEMO_ORGANS
from tests.processes import HAS_PROC, alive, command_line, descendants, signal_each

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory):
    """``demo --budget quick --compare``: both arms, every step, the pictures (about 2 minutes on 2 cores)."""
    out = tmp_path_factory.mktemp("demo")
    stale = out / "finetune_ssl" / "eval"  # an earlier, longer demo's events in the same --out
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(log_dir=str(stale)) as writer:
        writer.add_scalar("val_mean_dice", 0.99, 1000)
    result = subprocess.run(
        [sys.executable, "-m", "components", "demo", "--out", str(out), "--budget", "quick", "--compare", "--seed", "3"],
        capture_output=True, text=True, timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, result.stdout


@pytest.mark.slow
def test_every_training_evaluation_and_inference_step_is_a_bundle_run(quick_demo):
    out, stdout = quick_demo
    for n, title in enumerate(["synthesising", "SSL pretraining", "finetuning", "finetuning", "pictures"], start=1):
        assert f"[{n}/5] {title}" in stdout
    steps = json.loads((out / "summary.json").read_text())["steps"]
    runs = [s for s in steps if "command" in s]
    assert [s["step"] for s in runs] == [
        "SSL pretraining",
        "finetune, SSL init", "evaluate on held-out, SSL init", "segment held-out, SSL init",
        "finetune, random init", "evaluate on held-out, random init", "segment held-out, random init",
    ]
    for run in runs:
        assert run["command"][1:4] == ["-m", "monai.bundle", "run"], run["command"]
        assert run["seconds"] > 0
    evaluate = next(s["command"] for s in runs if s["step"] == "evaluate on held-out, SSL init")
    assert evaluate[evaluate.index("--eval_list") + 1] == "test"  # scored on volumes no training step saw
    for log in ("ssl_pretrain/train.log", "finetune_ssl/train.log", "finetune_ssl/evaluate.log", "finetune_scratch/inference.log"):
        assert "input summary of monai.bundle.scripts.run" in (out / log).read_text()
    # the SSL arm really starts from the pretrained encoder, the scratch arm says it has none
    assert "loaded 126/126 encoder tensors" in (out / "finetune_ssl" / "train.log").read_text()
    scratch_log = (out / "finetune_scratch" / "train.log").read_text()
    assert "encoder tensors" not in scratch_log and "trains from random initialisation" in scratch_log


@pytest.mark.slow
def test_summary_json_and_pictures(quick_demo):
    out, stdout = quick_demo
    from components.demo.runner import read_scalars

    assert max(step for step, _ in read_scalars(out / "finetune_ssl" / "eval")["val_mean_dice"]) < 1000  # stale run gone
    summary = json.loads((out / "summary.json").read_text())
    assert summary["device"] == "cpu" and summary["seed"] == 3
    assert summary["settings"]["organs"] == list(DEMO_ORGANS) and summary["settings"]["budget"]["finetune_epochs"] == 1
    assert summary["settings"]["pretraining_roi_size"] == [32, 64, 64]  # the SSL run's crop, as its command gave it
    assert set(summary["arms"]) == {"SSL init", "random init"}
    # the held-out and validation bodies lie inside the training sizes, and the datalist the runs read says so
    areas = summary["settings"]["body_area_mm2"]
    low, high = min(areas["training"]), max(areas["training"])
    assert all(low < a < high for a in areas["validation"] + areas["test"]), areas
    datalist = json.loads((out / "data" / "labeled" / "dataset.json").read_text())
    assert [len(datalist[k]) for k in ("training", "validation", "test")] == [len(areas[k]) for k in ("training", "validation", "test")]
    # the loss weights come from the training labels: background down, the small organs up
    weights = summary["settings"]["class_weights"]
    assert len(weights) == len(DEMO_ORGANS) + 1 and weights[0] < 0.2 and min(weights[1:4]) > 1.0
    finetune = next(s["command"] for s in summary["steps"] if s["step"] == "finetune, SSL init")
    assert json.loads(finetune[finetune.index("--training#class_weights") + 1]) == weights
    for arm in summary["arms"].values():
        assert list(arm["per_class_dice"]) == list(DEMO_ORGANS)
        assert 0.0 <= arm["mean_dice"] <= 1.0 and arm["seconds"] > 0 and arm["num_images"] == 1
        metrics = json.loads((out / arm["folder"] / "eval" / "metrics.json").read_text())
        assert metrics["mean"] == arm["mean_dice"]
    assert summary["total_seconds"] >= sum(s["seconds"] for s in summary["steps"]) - 1
    expected = ["dice_curves.png", "segmentations.png", "ssl_losses.png", "ssl_views.png"]
    assert summary["pictures"] == expected
    for picture in expected:
        assert (out / picture).read_bytes()[:8] == PNG
    table = (out / "summary.txt").read_text()
    assert "held-out Dice, SSL init" in table and "held-out Dice, random init" in table and table in stdout
    # the pretraining's health: the SSL run's last report, in the summary and its table (one epoch learns nothing)
    health = summary["pretraining_health"]
    reported = json.loads((out / "ssl_pretrain" / "eval" / "health.json").read_text())["reports"][-1]
    assert health == reported and health["verdict"] in ("at baseline", "collapsed")
    assert f"SSL pretraining health | | {health['verdict']} (" in " ".join(table.split())
    # the losses' trivial values were logged beside them, for the picture's dashed lines
    scalars = read_scalars(out / "ssl_pretrain" / "eval")
    assert {"loss_rot_trivial", "loss_contrast_trivial", "loss_recon_trivial"} <= set(scalars)
    assert scalars["loss_rot_trivial"][0][1] == pytest.approx(1.386294, abs=1e-5)


def test_budgets_and_arguments_are_checked(tmp_path):
    assert BUDGETS["quick"].finetune_epochs < BUDGETS["cpu"].finetune_epochs
    with pytest.raises(ValueError, match="budget must be one of"):
        run_demo(tmp_path, budget="huge")
    with pytest.raises(ValueError, match="device must be"):
        run_demo(tmp_path, device="tpu")
    with pytest.raises(ValueError, match=r"recipe must be one of \['dino', 'mim', 'ssl'\], got 'mae'"):
        run_demo(tmp_path, recipe="mae")
    assert not any(tmp_path.iterdir())  # nothing written before the arguments are known to be good


def test_overrides_start_fresh_and_match_the_labels(tmp_path):
    """Every demo run starts fresh (running the demo again into a folder must not auto-resume the last run), and
    the finetuning head has one channel per label name."""
    from components.demo.recipes import finetune_overrides, ssl_overrides

    budget = BUDGETS["cpu"]
    ssl = ssl_overrides(budget, tmp_path / "unlabeled", tmp_path / "ssl", "cpu", 0)
    fine = finetune_overrides(budget, tmp_path / "labeled" / "dataset.json", tmp_path / "ft", "cpu", 1, None)
    assert ssl["checkpointing#auto_resume"] is False and fine["checkpointing#auto_resume"] is False
    assert "out_channels" not in fine and len(fine["label_names"]) == len(DEMO_ORGANS) + 1
    assert fine["pretrained_path"] is None and fine["dataset_dir"] == str(tmp_path / "labeled")
    assert ssl["roi_size"][1] == ssl["roi_size"][2]  # the rotation views need the last two axes equal
    assert ssl["network_def#window_size"] == fine["network_def#window_size"]  # pretrained weights load only into the same window
    assert fine["training#flip_prob"] == fine["training#rotate90_prob"] == 0.0  # mirroring would swap the kidneys' sides


def test_the_segmentation_step_passes_only_ids_of_the_inference_config(tmp_path):
    """The held-out segmentation runs inference.json with the finetuning run's network, data and checkpoints, but
    none of its training knobs: inference.json does not define them, and its initialize stops on them."""
    from components.config.running import RunningBundle
    from components.config.overrides import check_overrides
    from components.demo.recipes import CT_BUNDLE, finetune_overrides, inference_overrides
    from components.demo.runner import bundle_dir

    fine = finetune_overrides(BUDGETS["cpu"], tmp_path / "dataset.json", tmp_path / "ft", "cpu", 1, tmp_path / "m.pt")
    inference = inference_overrides(fine, tmp_path / "ft")
    inference_json = bundle_dir(CT_BUNDLE) / "configs" / "inference.json"
    check_overrides(RunningBundle((inference_json,), inference))
    with pytest.raises(ValueError, match="names no id"):
        check_overrides(RunningBundle((inference_json,), fine))
    kept = ("ckpt_dir", "datalist", "dataset_dir", "device", "feature_size", "network_def#window_size", "roi_size", "spacing")
    assert {k: inference[k] for k in kept} == {k: fine[k] for k in kept}
    assert inference["output_dir"] == str(tmp_path / "ft" / "segmentations")
    assert "training#class_weights" not in inference and "max_epochs" not in inference


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_each_recipe_runs_its_own_bundle_with_ids_it_defines(recipe, tmp_path):
    """``--recipe`` picks the pretraining bundle; every override the demo gives it is an id of that bundle (MONAI would
    add an unknown one silently), and it fits the finetuning network the demo loads its weights into."""
    from components.config.overrides import _unknown_override
    from components.demo.recipes import finetune_overrides, pretraining_overrides
    from components.demo.runner import bundle_dir
    from monai.bundle import ConfigParser

    budget = BUDGETS["cpu"]
    overrides = pretraining_overrides(recipe, budget, tmp_path / "unlabeled", tmp_path / "run", "cpu", 0)
    from components.config.running import run_config_files

    config_files = [str(f) for f in run_config_files(bundle_dir(RECIPES[recipe].bundle), ["train.json"])]
    config = ConfigParser.load_config_files(config_files)
    assert {k: _unknown_override(k, config, config_files[-1]) for k in overrides} == dict.fromkeys(overrides)
    fine = finetune_overrides(budget, tmp_path / "labeled" / "dataset.json", tmp_path / "ft", "cpu", 1, None)
    for key in ("feature_size", "network_def#window_size", "device"):
        assert overrides[key] == fine[key], key
    assert overrides["checkpointing#auto_resume"] is False and overrides["training#rankme_crops"] == 256
    # the demo's SSL weights its rotation term 3 (the bundle's published 1, 1, 1 stays); only SSL has the id
    assert overrides.get("train#loss#alpha") == ([3.0, 1.0, 1.0] if recipe == "ssl" else None)


@pytest.mark.slow
def test_the_masked_image_demo_pretrains_with_its_bundle_and_finetunes_from_it(tmp_path):
    """``demo --recipe mim`` (quick budget): the masked image bundle pretrains, the CT bundle loads its encoder, the
    pictures are the recipe's own."""
    result = subprocess.run(
        [sys.executable, "-m", "components", "demo", "--out", str(tmp_path), "--budget", "quick", "--recipe", "mim"],
        capture_output=True, text=True, timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["recipe"] == "mim" and set(summary["arms"]) == {"masked image init"}
    pretraining = next(s["command"] for s in summary["steps"] if s["step"] == "masked image pretraining")
    assert "swin_unetr_mim_pretrain" in " ".join(pretraining)
    assert "loaded 126/126 encoder tensors" in (tmp_path / "finetune_mim" / "train.log").read_text()
    assert summary["pictures"] == ["dice_curves.png", "mim_losses.png", "mim_views.png", "segmentations.png"]


def _start_demo(root: Path) -> subprocess.Popen:
    """``demo --budget quick`` into ``root/out``, its output in ``root/demo.log``."""
    root.mkdir()
    with open(root / "demo.log", "w") as log:  # a file: a pipe would stay open while the bundle run holds it
        # SIGINT at its default in the demo: a suite started as a background job (`pytest &`) inherits it ignored,
        # and Python then never raises KeyboardInterrupt, as a backgrounded demo ignores Ctrl-C
        return subprocess.Popen([sys.executable, "-m", "components", "demo", "--out", str(root / "out"), "--budget",
                                 "quick", "--seed", "0"], stdout=log, stderr=log,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip


def _training_tree(demo: subprocess.Popen, root: Path) -> tuple[set[int], int]:
    """The processes below ``demo`` once its SSL pretraining bundle has started training, and that bundle run's PID."""
    train_log = root / "out" / "ssl_pretrain" / "train.log"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and "Engine run starting" not in (train_log.read_text() if train_log.is_file() else ""):
        assert demo.poll() is None, (root / "demo.log").read_text()[-3000:]
        time.sleep(0.05)
    tree = descendants(demo.pid)
    bundles = [p for p in tree if "monai.bundle run" in command_line(p)]
    assert len(bundles) == 1, f"the training has not started: {[command_line(p)[:120] for p in tree]}"
    return tree, bundles[0]


@pytest.mark.skipif(not HAS_PROC, reason="reads the process tree from Linux /proc")
def test_a_stopped_demo_ends_its_bundle_run(tmp_path):
    """`python -m components demo` stopped by SIGTERM, and by SIGINT (two demos started at once; each signal sent to
    its demo alone, as `kill` does) once its SSL pretraining bundle has started training: the demo exits, and within
    seconds no process it started is left."""
    signals = (signal.SIGTERM, signal.SIGINT)
    demos = {sig: _start_demo(tmp_path / sig.name) for sig in signals}
    trees = {sig: _training_tree(demos[sig], tmp_path / sig.name) for sig in signals}
    # each demo's wait: the bundle run's grace, then room for a loaded machine
    codes = signal_each(demos, [tree for tree, _ in trees.values()], STOP_GRACE_S + 90, 20)
    for sig in signals:  # 143, 130: the shell's status for a command ended by that signal
        assert codes[sig] == 128 + sig, (sig.name, codes[sig])
        tree, bundle = trees[sig]
        assert not [p for p in tree if alive(p)], (sig.name, [command_line(p)[:120] for p in tree if alive(p)])
        log = (tmp_path / sig.name / "demo.log").read_text()
        assert f"stopping: ending the swin_unetr_ssl_pretrain run (pid {bundle})" in log, sig.name
