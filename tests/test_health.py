"""The health report: each signal's baseline equals an independent formula, and constant, random and trained encoders
get the verdicts they deserve."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from ignite.engine import Engine, Events

import components
from components.recipes.inpainting_contrast.recipe import InpaintingContrastRecipe
from components.training.health import (
    AT_BASELINE,
    COLLAPSED,
    LEARNING,
    NOT_COLLAPSED,
    HealthReport,
    accuracy_signal,
    embedding_signals,
    loss_signal,
    visible_fill_errors,
)

CROP = (64, 32, 32)  # the demo's pretraining crop: two last-stage tokens, 16^3 mask blocks tile it


def _mim(seed: int = 0, **encoder) -> tuple[components.MaskedImageModel, components.MaskedImageRecipe]:
    torch.manual_seed(seed)
    network = components.MaskedImageModel(feature_size=12, window_size=4, **encoder)
    return network, components.MaskedImageRecipe(components.MaskedReconstructionLoss(), mask_block=16)


def _halves(count: int, generator: torch.Generator) -> torch.Tensor:
    """Toy crops whose two halves along the first axis hold one intensity each: the masked voxels of a half follow
    from its visible ones, which the visible mean of the whole crop does not tell."""
    levels = torch.rand(count, 2, generator=generator)
    crops = torch.empty(count, 1, *CROP)
    crops[:, 0, : CROP[0] // 2] = levels[:, 0, None, None, None]
    crops[:, 0, CROP[0] // 2 :] = levels[:, 1, None, None, None]
    return crops


def test_the_visible_fill_errors_are_the_mean_and_median_fill_computed_by_hand():
    generator = torch.Generator().manual_seed(0)
    target = torch.rand(3, 2, 4, 4, 4, generator=generator)
    visible = torch.rand(3, 1, 4, 4, 4, generator=generator) > 0.4
    scored = ~visible
    mean_fill, median_fill = visible_fill_errors(target, visible, scored)
    t, v = target.numpy(), np.broadcast_to(visible.numpy(), target.shape)
    errors_mean, errors_median = [], []
    for i in range(3):
        for c in range(2):
            shown, hidden = t[i, c][v[i, c]], t[i, c][~v[i, c]]
            errors_mean.extend(np.abs(hidden - shown.mean()))
            errors_median.extend(np.abs(hidden - torch.tensor(shown).median().item()))  # torch's lower median
    assert float(mean_fill) == pytest.approx(np.mean(errors_mean), rel=1e-6)
    assert float(median_fill) == pytest.approx(np.mean(errors_median), rel=1e-6)
    mse_mean, _ = visible_fill_errors(target, visible, scored, loss="mse")
    squared = [((t[i, c][~v[i, c]] - t[i, c][v[i, c]].mean()) ** 2) for i in range(3) for c in range(2)]
    assert float(mse_mean) == pytest.approx(np.concatenate(squared).mean(), rel=1e-6)


def test_a_reconstruction_that_is_the_visible_mean_fill_is_at_its_baseline_and_a_copy_of_the_target_learns():
    _, recipe = _mim()
    image = _halves(4, torch.Generator().manual_seed(1))
    views = recipe.views(image, torch.Generator().manual_seed(2))
    visible = ~views.voxel_mask
    means = torch.stack([image[i][visible[i].expand_as(image[i])].mean() for i in range(4)])
    fill = means[:, None, None, None, None].expand_as(image).clone()
    at_mean = recipe.health_signals({k: tuple(map(float, v)) for k, v in recipe.health(fill, views).items()}, 4)
    assert at_mean[0].name == "masked_l1" and at_mean[0].verdict == AT_BASELINE
    assert at_mean[0].value == pytest.approx(at_mean[0].baseline, rel=1e-6)
    assert HealthReport(at_mean).verdict == AT_BASELINE  # beating the median fill alone is not learning
    perfect = recipe.health_signals({k: tuple(map(float, v)) for k, v in recipe.health(image.clone(), views).items()}, 4)
    assert {s.name: s.verdict for s in perfect} == {"masked_l1": LEARNING, "masked_l1_median": LEARNING,
                                                    "reconstruction_spread": NOT_COLLAPSED}  # fmt: skip
    same_output = recipe.health_signals({k: tuple(map(float, v)) for k, v in recipe.health(image[:1].expand_as(image), views).items()}, 4)
    assert {s.name: s.verdict for s in same_output}["reconstruction_spread"] == COLLAPSED


def test_the_ssl_baselines_are_chance_and_the_nt_xent_of_identical_views():
    recipe = InpaintingContrastRecipe(components.SSLLoss(temperature=0.5))
    crops = 3
    views = recipe.views(torch.rand(crops, 1, *CROP, generator=torch.Generator().manual_seed(0)), torch.Generator().manual_seed(1))
    rot_logits = torch.zeros(2 * crops, 4)  # no preference: cross-entropy ln 4
    same = torch.ones(2 * crops, 16)  # every view the same embedding: all similarities equal
    health = recipe.health((rot_logits, same, views.targets.clone()), views)
    assert float(health["rotation_loss"][0]) == pytest.approx(math.log(4)) and health["rotation_loss"][1] == pytest.approx(math.log(4))
    assert health["rotation_accuracy"][1] == 0.25
    assert float(health["contrast_loss"][0]) == pytest.approx(math.log(2 * crops - 1), rel=1e-6)
    assert health["contrast_loss"][1] == pytest.approx(math.log(2 * crops - 1))
    assert health["contrast_accuracy"][1] == pytest.approx(1 / (2 * crops - 1))
    assert float(health["inpainting_l1"][0]) == 0.0  # the clean views themselves
    signals = {s.name: s for s in recipe.health_signals({k: tuple(map(float, v)) for k, v in health.items()}, crops)}
    assert signals["contrast_loss"].verdict == AT_BASELINE and signals["rotation_loss"].verdict == AT_BASELINE
    assert signals["inpainting_l1"].verdict == LEARNING


def test_the_self_distillation_baselines_are_ln_k_and_one_prototype():
    torch.manual_seed(0)
    student = components.SelfDistillationNetwork(feature_size=12, window_size=4, out_dim=32, hidden_dim=24, bottleneck_dim=8)
    recipe = components.SelfDistillationRecipe(
        student, components.SelfDistillationLoss(out_dim=32),
        components.MultiCrop(global_size=(32, 32, 32), local_size=(32, 32, 32), num_local=1), total_iterations=10)  # fmt: skip
    views = recipe.views(torch.rand(4, 1, 48, 48, 48, generator=torch.Generator().manual_seed(1)), torch.Generator().manual_seed(2))
    with torch.no_grad():
        outputs = recipe.forward(student, views)
    uniform = outputs._replace(teacher_logits=torch.zeros_like(outputs.teacher_logits))
    health = recipe.health(uniform, views)
    assert float(health["teacher_entropy"][0]) == pytest.approx(math.log(32), rel=1e-6)
    assert health["teacher_entropy"][1] == pytest.approx(math.log(32))
    assert float(health["prototypes_in_use"][0]) == pytest.approx(32, rel=1e-5)
    one = torch.zeros_like(outputs.teacher_logits)
    one[:, 5] = 10.0  # one prototype takes every crop
    signals = {s.name: s for s in recipe.health_signals({k: tuple(map(float, v)) for k, v in recipe.health(outputs._replace(teacher_logits=one), views).items()}, 4)}
    assert signals["prototypes_in_use"].value == pytest.approx(1.0, abs=1e-3) and signals["prototypes_in_use"].verdict == COLLAPSED
    assert signals["teacher_entropy"].verdict == LEARNING  # sharp targets, but the report reads them together:
    assert HealthReport(list(signals.values())).verdict == COLLAPSED
    assert torch.equal(recipe.criterion.center, torch.zeros(1, 32))  # the centre is read, never updated


def test_embedding_signals_call_a_vanishing_residual_collapsed_and_do_not_read_its_centred_rank():
    generator = torch.Generator().manual_seed(0)
    spread = torch.randn(64, 48, generator=generator)
    signals, extra = embedding_signals(spread)
    assert signals[0].verdict == NOT_COLLAPSED and signals[0].value == pytest.approx(1.0, abs=0.1)
    assert math.isfinite(extra["rankme_centred"]) and extra["mean_share"] < 0.1
    # the masked image encoder of the review: its mean held 0.9999956 of the squared norm
    offset = torch.ones(48)
    residual = torch.randn(64, 48, generator=generator)
    residual *= math.sqrt(4.4e-6 * 48 / float((residual**2).sum(dim=1).mean()))
    signals, extra = embedding_signals(offset + residual)
    assert extra["mean_share"] == pytest.approx(1 - 4.4e-6, abs=1e-6)
    assert signals[0].verdict == COLLAPSED and math.isnan(extra["rankme_centred"])
    assert "not read" in signals[0].note
    report = HealthReport(signals, extra=extra)
    assert report.as_dict()["extra"]["rankme_centred"] is None  # valid JSON, not NaN


def test_a_loss_learns_only_beyond_its_margin_and_an_accuracy_beyond_two_standard_errors():
    assert loss_signal("x", 0.94, 1.0).verdict == LEARNING and loss_signal("x", 0.96, 1.0).verdict == AT_BASELINE
    assert loss_signal("x", 1.5, 1.0).verdict == AT_BASELINE  # worse than trivial is at baseline too
    # 64 trials at chance 1/4: two standard errors are 0.108
    assert accuracy_signal("a", 0.35, 0.25, 64).verdict == AT_BASELINE
    assert accuracy_signal("a", 0.37, 0.25, 64).verdict == LEARNING
    assert loss_signal("x", float("nan"), 1.0).verdict == AT_BASELINE


def test_a_constant_encoder_is_collapsed_and_a_random_one_at_baseline():
    network, recipe = _mim()
    crops = list(_halves(8, torch.Generator().manual_seed(0)))
    random_report = components.recipe_health(recipe, network, crops, batch_size=4, seed=0)
    assert random_report.verdict == AT_BASELINE
    assert {s.name: s.verdict for s in random_report.signals}["masked_l1"] == AT_BASELINE
    with torch.no_grad():
        for parameter in network.parameters():
            parameter.zero_()
    constant_report = components.recipe_health(recipe, network, crops, batch_size=4, seed=0)
    verdicts = {s.name: s.verdict for s in constant_report.signals}
    assert constant_report.verdict == COLLAPSED
    assert verdicts["embedding_std"] == COLLAPSED and verdicts["reconstruction_spread"] == COLLAPSED


def test_an_encoder_trained_on_a_toy_pretext_is_learning():
    """Masked image modelling of crops made of two flat halves: after 90 steps the masked voxels are predicted from
    their half's visible ones, far better than from the crop's visible mean. One Swin block per stage keeps the steps
    cheap; 90 of them learn from each of the seeds 0-2 of the network (60 from one of them only)."""
    network, recipe = _mim(depths=(1, 1, 1, 1))
    optimizer = torch.optim.AdamW(network.parameters(), lr=1e-3)
    data, views_from = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    validation = list(_halves(16, torch.Generator().manual_seed(3)))
    before = components.recipe_health(recipe, network, validation, batch_size=4, seed=0)
    for _ in range(90):
        views = recipe.views(_halves(4, data), views_from)
        loss, _ = recipe.loss(recipe.forward(network, views), views)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = components.recipe_health(recipe, network, validation, batch_size=4, seed=0)
    assert before.verdict == AT_BASELINE and after.verdict == LEARNING, after.line()
    masked = {s.name: s for s in after.signals}["masked_l1"]
    assert masked.value < 0.9 * masked.baseline


class _Trainer(Engine):
    """An engine with a recipe, as a PretrainingTrainer has one."""

    def __init__(self, recipe) -> None:
        super().__init__(lambda engine, batch: None)
        self.recipe = recipe


def test_the_handler_logs_one_line_warns_after_its_warmup_and_writes_every_report(tmp_path, caplog):
    network, recipe = _mim()
    volumes = [{"image": crop} for crop in _halves(3, torch.Generator().manual_seed(0))]
    summary = tmp_path / "eval" / "health.json"
    handler = components.HealthHandler(network, volumes, crops=6, batch_size=3, interval=1, warmup_epochs=2, summary_file=summary)
    trainer = _Trainer(recipe)
    handler.attach(trainer)
    with caplog.at_level(logging.INFO, logger="components.training.health_handler"):
        trainer.run([0], max_epochs=2)
    lines = [r for r in caplog.records if r.name == "components.training.health_handler"]
    assert [r.levelname for r in lines] == ["INFO", "INFO", "WARNING"]  # warned from epoch 2 on, not at epoch 1
    assert lines[0].getMessage().startswith("health: at baseline | masked_l1 ") and "6 crops" in lines[0].getMessage()
    assert "masked_l1 at baseline (" in lines[2].getMessage() and "Try: " in lines[2].getMessage()
    reports = json.loads(summary.read_text())["reports"]
    assert [r["epoch"] for r in reports] == [1, 2] and reports[0]["signals"]["masked_l1"]["verdict"] == AT_BASELINE
    metrics = trainer.state.metrics
    assert metrics["health"] == 0.0 and metrics["health_masked_l1_trivial"] == reports[1]["signals"]["masked_l1"]["baseline"]
    assert metrics["val_rankme"] == reports[1]["extra"]["rankme"]


def test_auto_crops_cost_about_a_tenth_of_the_epochs_between_reports():
    assert components.health_crops("auto", epoch_length=24, crops_per_iteration=2, interval=10) == 72
    assert components.health_crops("auto", epoch_length=2, crops_per_iteration=2, interval=1) == 8  # the floor
    assert components.health_crops("auto", epoch_length=1000, crops_per_iteration=4, interval=1) == 256  # the cap
    assert components.health_crops(32, 1, 1, 1) == 32
    for bad in (1, "many", 2.5, True):
        with pytest.raises(ValueError, match="training#rankme_crops"):
            components.health_crops(bad, 1, 1, 1)
    with pytest.raises(ValueError, match="health_warmup_epochs"):
        components.HealthHandler(torch.nn.Identity(), [], warmup_epochs=-1)


def test_an_engine_without_a_recipe_gets_the_embedding_signals_alone(tmp_path):
    network, _ = _mim()
    volumes = [{"image": crop} for crop in _halves(2, torch.Generator().manual_seed(0))]
    handler = components.HealthHandler(network, volumes, crops=4, batch_size=2)
    engine = Engine(lambda engine, batch: None)
    handler.attach(engine)
    engine.add_event_handler(Events.COMPLETED, lambda e: None)
    engine.run([0], max_epochs=1)
    assert {k for k in engine.state.metrics if k.startswith("health_") and not k.endswith("_trivial")} == {"health_embedding_std"}


# ------------------------------------------------------------------------------------------------------------
# python -m components health CHECKPOINT --datalist LIST, as a user runs it


@pytest.fixture(scope="module")
def ct_list(tmp_path_factory):
    from components.data.synthetic import write_dataset

    return write_dataset(tmp_path_factory.mktemp("ct"), num=4, seed=0)


def _health_cli(capsys, *args: str) -> SimpleNamespace:
    """``python -m components health ARGS`` in this process (the process's own exit path: tests/test_cli.py)."""
    from components.__main__ import main

    code = main(["health", *args])
    out = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)


def _published_swinvit(path: Path, feature_size: int = 12) -> None:
    """An encoder in the CVPR release layout (``model_swinvit.pt``: ``module.`` keys, fc1/fc2, a final norm)."""
    encoder = components.SSLHead(feature_size=feature_size).swinViT.state_dict()
    state = {"module." + k.replace(".mlp.linear1.", ".mlp.fc1.").replace(".mlp.linear2.", ".mlp.fc2."): v for k, v in encoder.items()}
    state["module.norm.weight"], state["module.norm.bias"] = torch.ones(16 * feature_size), torch.zeros(16 * feature_size)
    torch.save({"state_dict": state}, path)


def test_the_command_reports_the_pretext_signals_of_our_checkpoints_and_the_embedding_of_a_published_one(ct_list, tmp_path, capsys):
    torch.manual_seed(0)
    torch.save(components.SSLHead(feature_size=12, window_size=4).state_dict(), tmp_path / "ssl.pt")
    torch.save({"model": _mim()[0].state_dict()}, tmp_path / "mim.pt")  # a checkpoint file holding the model
    _published_swinvit(tmp_path / "model_swinvit.pt")
    common = ["--datalist", str(ct_list), "--roi_size", "64,32,32", "--crops", "8"]
    ssl = _health_cli(capsys, str(tmp_path / "ssl.pt"), *common, "--out", str(tmp_path / "ssl.json"))
    assert ssl.returncode == 0, ssl.stderr
    assert "SSL heads" in ssl.stdout and "health: at baseline | rotation_accuracy " in ssl.stdout
    report = json.loads((tmp_path / "ssl.json").read_text())
    assert report["heads"] == "ssl" and report["verdict"] == AT_BASELINE and report["embedded"] == 8
    assert set(report["signals"]) == {"rotation_accuracy", "rotation_loss", "contrast_accuracy", "contrast_loss", "inpainting_l1", "embedding_std"}
    mim = _health_cli(capsys, str(tmp_path / "mim.pt"), *common)
    assert mim.returncode == 0 and "masked image heads" in mim.stdout and "masked_l1 " in mim.stdout, mim.stderr
    published = _health_cli(capsys, str(tmp_path / "model_swinvit.pt"), *common)
    assert published.returncode == 0, published.stderr
    assert "an encoder without pretext heads" in published.stdout and "health: not collapsed | embedding_std " in published.stdout


def test_the_command_exits_1_for_a_collapsed_encoder_and_names_a_bad_list_in_one_line(ct_list, tmp_path, capsys):
    network = components.SSLHead(feature_size=12, window_size=4)
    with torch.no_grad():
        for parameter in network.parameters():
            parameter.zero_()
    torch.save(network.state_dict(), tmp_path / "constant.pt")
    common = ["--datalist", str(ct_list), "--roi_size", "64,32,32", "--crops", "8"]
    collapsed = _health_cli(capsys, str(tmp_path / "constant.pt"), *common)
    assert collapsed.returncode == 1 and "health: collapsed" in collapsed.stdout
    empty = _health_cli(capsys, str(tmp_path / "constant.pt"), *common[:-2], "--list_name", "nothing")
    assert empty.returncode == 2 and empty.stderr.count("\n") == 1 and "has no 'nothing' l" in empty.stderr


def test_a_resumed_run_keeps_the_reports_before_its_restored_iteration_and_a_fresh_run_starts_anew(tmp_path):
    network, recipe = _mim()
    volumes = [{"image": crop} for crop in _halves(2, torch.Generator().manual_seed(0))]
    summary = tmp_path / "health.json"
    earlier = [{"epoch": e, "iteration": e, "verdict": AT_BASELINE} for e in (1, 2, 3)]  # the third after the checkpoint
    for restored, kept in ((2, [1, 2]), (0, [])):
        summary.write_text(json.dumps({"reports": earlier}))
        handler = components.HealthHandler(network, volumes, crops=4, batch_size=2, summary_file=summary)
        trainer = _Trainer(recipe)
        handler.attach(trainer)
        trainer.state.iteration = trainer.state.epoch = restored  # as a resume handler restores them at STARTED
        trainer.run([0], max_epochs=restored + 1)
        reports = json.loads(summary.read_text())["reports"]
        assert [r["iteration"] for r in reports] == [*kept, restored + 1]
