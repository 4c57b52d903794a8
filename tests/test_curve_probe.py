"""benchmarks/curve_probe.py: the standardised probe of the curve's encoders. Its point features are exactly what the
probe's own upsampling gives at those voxels, its fit converges to a separating probe with the batch norms holding the
points' statistics, and the curve summary puts it beside the health signals only when every encoder and its random
baseline were probed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import curve_probe  # noqa: E402
import pretrain_curve as curve  # noqa: E402

import components  # noqa: E402


def test_point_features_are_the_probes_trilinear_upsampling_at_those_voxels():
    torch.manual_seed(0)
    size = (20, 12, 8)
    features = [torch.randn(1, 3, 10, 6, 4), torch.randn(1, 5, 5, 3, 2), torch.randn(1, 2, 1, 1, 1)]
    points = torch.stack([torch.randint(0, s, (50,)) for s in size], dim=1)
    points[0] = torch.tensor([0, 0, 0])  # the first and last voxels: the border clamp
    points[1] = torch.tensor([s - 1 for s in size])
    sampled = curve_probe.point_features(features, points, size)
    for f, values in zip(features, sampled):
        full = F.interpolate(f, size=size, mode="trilinear", align_corners=False)[0]
        expected = full[:, points[:, 0], points[:, 1], points[:, 2]].T
        torch.testing.assert_close(values, expected, atol=1e-5, rtol=1e-5)


def test_the_fit_converges_separates_the_classes_and_standardises_with_the_points_statistics():
    torch.manual_seed(0)
    probe = components.LinearProbe(1, 3, feature_size=3, window_size=2)
    classes = torch.arange(3).repeat_interleave(200)
    centres = torch.randn(3, 93) * 3
    shifts = [0.0, 10.0, -5.0, 100.0, 1.0]  # scales of very different offsets and magnitudes
    scales = [1.0, 0.01, 5.0, 1000.0, 0.1]
    widths = [3, 6, 12, 24, 48]
    points = centres[classes] + torch.randn(600, 93)
    features, start = [], 0
    for width, shift, scale in zip(widths, shifts, scales):
        features.append(points[:, start:start + width] * scale + shift)
        start += width
    fit = curve_probe.fit_heads(probe, features, classes)
    assert fit["converged"] and fit["rounds"] < curve_probe.MAX_ROUNDS and fit["points"] == 600
    for norm, f in zip(probe.norms, features):
        torch.testing.assert_close(norm.running_mean, f.mean(0), rtol=1e-4, atol=1e-3 * float(f.abs().max()))
    probe.eval()
    with torch.no_grad():
        logits = sum(h(n(f[:, :, None, None, None]))[:, :, 0, 0, 0] for n, h, f in zip(probe.norms, probe.heads, features))
    assert (logits.argmax(1) == classes).float().mean() > 0.98


def _runs(recipe="ssl", iterations=1003, seeds=(0, 1, 2)):
    return [{"recipe": recipe, "iterations": iterations, "seed": s} for s in seeds]


def _probe_record(dice, converged=True):
    return {"mean_dice": dice, "fit": {"converged": converged}, "commit": "abc"}


def test_a_point_is_probed_only_when_every_encoder_and_its_random_baseline_are():
    probes = {f"random_seed{s}": _probe_record(0.30 + 0.01 * s) for s in range(3)}
    probes.update({f"ssl_1003_seed{s}": _probe_record(0.50 + 0.01 * s) for s in range(2)})
    assert curve._probe_point(_runs(), probes) is None
    probes["ssl_1003_seed2"] = _probe_record(0.52)
    point = curve._probe_point(_runs(), probes)
    assert point["dice"] == [0.50, 0.51, 0.52] and point["random"] == [0.30, 0.31, 0.32]
    assert point["gap_mean"] == pytest.approx(0.20) and point["beyond_spread"] and point["converged"]
    probes["ssl_1003_seed1"] = _probe_record(0.10)  # one encoder below its random baseline
    assert not curve._probe_point(_runs(), probes)["beyond_spread"]


def test_the_docs_table_shows_the_probe_beside_the_signals():
    signal = {"value_mean": 0.5, "baseline_mean": 0.25, "gap_mean": 0.25, "gap_sd": 0.01, "beyond_spread": True}
    point = {"verdicts": ["learning"], "seeds": [0], "signals": {"rotation_accuracy": signal},
             "probe": {"finetuning": {"value_mean": 0.612, "baseline_mean": 0.401, "gap_mean": 0.211, "gap_sd": 0.02,
                                      "beyond_spread": True}, "pretraining": None}}
    summary = {"code": "c", "commits": ["x"], "machine": {"cpu_model": "cpu", "torch": "t"}, "settings": {"crops": 64},
               "table": {"ssl": {"1003": point, "204": {**point, "probe": {}}}}}
    text = curve.markdown(summary)
    assert ("| ssl | 1003 | learning (0) | rotation_accuracy 0.5 vs 0.25, +0.25 +- 0.01 beyond | "
            "0.612 vs 0.401, +0.211 +- 0.020 beyond | not probed |") in text
    assert text.index("| ssl | 204 |") < text.index("| ssl | 1003 |") and "| not probed | not probed |" in text
    assert "probe Dice vs random encoder, finetuning window | probe Dice vs random encoder, pretraining window |" in text


@pytest.mark.slow
def test_the_command_probes_a_random_encoder_and_writes_its_record(tmp_path, monkeypatch):
    """The documented command end to end, on the demo's labeled data, with one random baseline and fewer points."""
    records = {window: tmp_path / "records" / window for window in curve_probe.WINDOWS}
    monkeypatch.setattr(curve_probe, "RECORDS", records)
    monkeypatch.setattr(curve_probe, "RANDOM_SEEDS", (0,))
    monkeypatch.setattr(curve_probe, "POINTS", (64, 16, 16, 16, 16, 16))
    (tmp_path / "runs").mkdir()
    assert curve_probe.main(["--work", str(tmp_path)]) == 0
    record = curve_probe.load_records()["random_seed0"]
    assert record["fit"]["converged"] and record["settings"]["window"] == "finetuning"
    assert len(record["dice"]["validation"]) == len(record["dice"]["test"]) == 4
    assert 0.0 < record["mean_dice"] < 1.0
