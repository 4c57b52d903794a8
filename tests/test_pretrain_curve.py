"""benchmarks/pretrain_curve.py: the committed summary and the docs' table are what its records give, a seed's
spread decides "beyond", and a real (one-epoch) point runs a bundle and records its health reports."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import pretrain_curve as curve  # noqa: E402


def test_the_committed_summary_table_and_plot_are_what_the_records_give(tmp_path, monkeypatch):
    """Re-summarising the committed records into a scratch copy gives the committed summary and the docs' table."""
    if not curve.SUMMARY.is_file():
        pytest.skip("no pretrain_curve summary committed")
    doc = tmp_path / "measuring.md"
    doc.write_text(curve.DOC.read_text())
    monkeypatch.setattr(curve, "SUMMARY", tmp_path / "summary.json")
    monkeypatch.setattr(curve, "PLOT", tmp_path / "curve.png")
    monkeypatch.setattr(curve, "DOC", doc)
    summary = curve.summarise()
    assert summary == json.loads((REPO / "benchmarks/results/pretrain_curve.json").read_text())
    assert doc.read_text() == (REPO / "docs/measuring.md").read_text()
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_beyond_the_spread_means_the_margin_is_cleared_by_two_sds_of_the_seeds():
    clear = curve._judge([0.10, 0.11, 0.12], [0.20, 0.20, 0.20], "lower", margin=0.01)
    assert clear["gap_mean"] == pytest.approx(0.09) and clear["beyond_spread"]
    noisy = curve._judge([0.10, 0.19, 0.25], [0.20, 0.20, 0.20], "lower", margin=0.01)
    assert not noisy["beyond_spread"]  # one seed at the baseline, one above it
    near = curve._judge([0.28, 0.28, 0.29], [0.25] * 3, "higher", margin=0.077)  # above chance, within the margin
    assert not near["beyond_spread"]
    assert not curve._judge([0.1], [0.2], "lower", margin=0.0)["beyond_spread"]  # one seed has no spread


def test_records_of_different_code_are_not_summarised_together(tmp_path, monkeypatch):
    monkeypatch.setattr(curve, "RECORDS", tmp_path)
    for name, code in (("a", "x"), ("b", "y")):
        (tmp_path / f"{name}.json").write_text(json.dumps({"code": code}))
    with pytest.raises(ValueError, match="different code"):
        curve.summarise()


def test_a_lever_is_recorded_apart_under_a_name_monai_leaves_alone():
    assert curve.arm_name("dino", None) == "dino"
    assert curve.arm_name("dino", {"training#teacher_temperature": 0.04, "max_epochs": 3}) == "dino+max_epochs=3+training.teacher_temperature=0.04"


def test_the_budget_is_whole_epochs_of_the_corpus():
    assert curve.epochs_for(200, 17) == 12 and curve.epochs_for(1000, 17) == 59 and curve.epochs_for(5, 17) == 1


@pytest.mark.slow
def test_a_point_runs_the_bundle_and_records_every_health_report(tmp_path, monkeypatch):
    """One epoch of the masked image recipe on the demo's corpus: the record holds the overrides, the reports at
    every validation and the last losses; a second call reuses it."""
    monkeypatch.setattr(curve, "RECORDS", tmp_path / "records")
    path = curve.run_point("mim", 17, 0, tmp_path / "work", "code")
    record = json.loads(path.read_text())
    assert (record["recipe"], record["iterations"], record["epochs"], record["seed"]) == ("mim", 17, 1, 0)
    assert record["overrides"]["training#rankme_crops"] == curve.CROPS and record["overrides"]["max_epochs"] == 1
    assert len(record["health"]) == 1 and record["health"][0]["verdict"] in ("at baseline", "collapsed")
    assert set(record["health"][0]["signals"]) >= {"masked_l1", "masked_l1_median", "reconstruction_spread", "embedding_std"}
    assert "loss_recon" in record["last_losses"]
    assert curve.run_point("mim", 17, 0, tmp_path / "work", "code") == path
