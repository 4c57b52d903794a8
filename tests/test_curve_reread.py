"""benchmarks/curve_reread.py: the curve's final encoders read again on the same crops. It reads the SSL and masked
image runs' checkpoints (not self-distillation's), refuses a finished run whose checkpoint is gone, and the curve
summary shows a point's re-read only when every run of the point was re-read."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import curve_reread  # noqa: E402
import pretrain_curve as curve  # noqa: E402

import components  # noqa: E402
from components.data import synthetic  # noqa: E402


def _signal(value, baseline=1.386, margin=0.07, verdict="learning"):
    return {"value": value, "baseline": baseline, "margin": margin, "better": "lower", "kind": "pretext",
            "verdict": verdict}  # fmt: skip


def _reread(verdict, value):
    return {"verdict": verdict, "commit": "abc", "settings": {"crops": 256}, "signals": {"rotation_loss": _signal(value, verdict=verdict)}}


def test_a_point_is_re_read_only_when_every_run_is():
    runs = [{"recipe": "ssl", "iterations": 1003, "seed": s} for s in (0, 1, 2)]
    rereads = {"ssl_1003_seed0": _reread("learning", 1.20), "ssl_1003_seed1": _reread("learning", 1.22)}
    assert curve._reread_point(runs, rereads) is None
    rereads["ssl_1003_seed2"] = _reread("at baseline", 1.36)
    point = curve._reread_point(runs, rereads)
    assert point["verdicts"] == ["learning", "learning", "at baseline"] and point["crops"] == 256
    rotation = point["signals"]["rotation_loss"]
    assert rotation["value_mean"] == pytest.approx(1.26) and rotation["gap_mean"] == pytest.approx(0.126)
    assert rotation["verdicts"] == point["verdicts"] and not rotation["beyond_spread"]  # seed 2's gap is 0.026


def test_the_docs_show_the_re_read_table_below_the_runs_own():
    signal = {"value_mean": 1.26, "baseline_mean": 1.386, "gap_mean": 0.126, "gap_sd": 0.086, "beyond_spread": False}
    point = {"verdicts": ["at baseline"], "seeds": [2], "signals": {"rotation_loss": signal}, "probe": {},
             "reread": {"verdicts": ["learning"], "crops": 256, "commits": ["abc"], "signals": {"rotation_loss": signal}}}
    summary = {"code": "c", "commits": ["x"], "machine": {"cpu_model": "cpu", "torch": "t"}, "settings": {"crops": 64},
               "table": {"ssl": {"1003": point, "204": {**point, "reread": None}}}}
    text = curve.markdown(summary)
    own, reread = text.split("read again on 256 validation crops")
    assert "| ssl | 1003 | at baseline (2) | rotation_loss 1.26 vs 1.39, +0.126 +- 0.086 |" in own
    assert "| ssl | 1003 | learning (2) | rotation_loss 1.26 vs 1.39, +0.126 +- 0.086 |" in reread
    assert "| ssl | 204 |" in own and "| ssl | 204 |" not in reread and "commits abc" in reread


def _curve_record(folder: Path, name: str, recipe: str, seed: int) -> None:
    record = {"recipe": recipe, "seed": seed, "overrides": {"roi_size": [64, 32, 32]}}
    (folder / f"{name}.json").write_text(json.dumps(record))


def test_the_command_reads_the_ssl_runs_checkpoint_and_skips_self_distillation(tmp_path, monkeypatch):
    curve_records, records = tmp_path / "curve", tmp_path / "reread"
    curve_records.mkdir()
    monkeypatch.setattr(curve_reread, "CURVE_RECORDS", curve_records)
    monkeypatch.setattr(curve_reread, "RECORDS", records)
    monkeypatch.setattr(curve_reread, "CROPS", 4)
    synthetic.write_dataset(tmp_path / "data" / "unlabeled", num=3, seed=0, varied=True, labels=False)
    _curve_record(curve_records, "ssl_8_seed1", "ssl", 1)
    _curve_record(curve_records, "dino_8_seed0", "dino", 0)
    torch.manual_seed(0)
    network = components.SSLHead(in_channels=1, feature_size=12, window_size=4)
    checkpoint = tmp_path / "runs" / "ssl_8_seed1" / "models" / "checkpoint.pt"
    checkpoint.parent.mkdir(parents=True)
    torch.save({"model": network.state_dict()}, checkpoint)

    assert curve_reread.main(["--work", str(tmp_path)]) == 0
    assert sorted(p.name for p in records.iterdir()) == ["ssl_8_seed1.json"]  # dino's checkpoint holds no pretext heads
    record = curve_reread.load_records()["ssl_8_seed1"]
    assert record["heads"] == "ssl" and record["seed"] == 1 and record["crops"] == 4
    assert record["settings"] == {"crops": 4, "crop_seed": 0, "batch_size": 4, "list": "validation",
                                  "roi_size": [64, 32, 32], "intensity_range": [-1000.0, 1000.0]}  # fmt: skip
    assert {"rotation_accuracy", "rotation_loss", "contrast_loss", "inpainting_l1"} <= set(record["signals"])
    assert record["signals"]["rotation_loss"]["baseline"] == pytest.approx(1.3862944)
    assert len(record["checkpoint_sha256"]) == 64

    checkpoint.unlink()  # a finished run not yet re-read whose weights are gone is refused, naming both
    records.joinpath("ssl_8_seed1.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"ssl_8_seed1\.json: its run's final checkpoint .*checkpoint\.pt is missing"):
        curve_reread.run(tmp_path)
