"""benchmarks/rotation_by_content.py: a demo seed's SSL encoder read on its own crops by body-fraction quartile. It
records each quartile's body fractions, crop count and health signals for both lists, skips a seed already recorded,
and refuses a missing file or a checkpoint without SSL heads before reading any crop."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import rotation_by_content as bench  # noqa: E402

import components  # noqa: E402
from components.data import synthetic  # noqa: E402
from components.release.health import datalist_crops  # noqa: E402


def _demo_seed(work: Path, seed: int, state: dict, settings: dict | None = None) -> Path:
    """A demo run's three files the benchmark reads: the unlabeled datalist, the SSL bundle's ``model.pt`` and the
    summary whose ``settings`` name the pretraining crop."""
    datalist = synthetic.write_dataset(work / f"seed{seed}" / "data" / "unlabeled", num=3, seed=seed, varied=True, labels=False)
    checkpoint = work / f"seed{seed}" / "ssl_pretrain" / "models" / "model.pt"
    checkpoint.parent.mkdir(parents=True)
    torch.save(state, checkpoint)  # the bundle's BestModelSaver writes the network's state dict alone
    summary = {"settings": settings or {"pretraining_roi_size": [64, 32, 32]}}
    (work / f"seed{seed}" / "summary.json").write_text(json.dumps(summary))
    return datalist


def test_each_list_is_read_by_body_fraction_quartile_and_a_recorded_seed_is_skipped(tmp_path):
    torch.manual_seed(0)
    network = components.SSLHead(feature_size=12, window_size=4, depths=(1, 1, 1, 1))  # one block a stage: half the time
    datalist = _demo_seed(tmp_path, 3, network.state_dict())
    out = tmp_path / "by_content.json"

    bench.main(["--work", str(tmp_path), "--crops", "8", "--out", str(out)])
    results = json.loads(out.read_text())
    assert results["settings"]["body_threshold"] == pytest.approx(0.3)  # HU -400 in the window [-1000, 1000]
    assert results["settings"]["roi_size"] == [64, 32, 32] and set(results["seeds"]) == {"3"}
    for list_name in ("training", "validation"):
        by_content = results["seeds"]["3"][list_name]
        quartiles = by_content["quartiles"]
        assert len(quartiles) == 4 and [q["crops"] for q in quartiles] == [2, 2, 2, 2]
        assert by_content["all"]["crops"] == 8
        ranges = [q["body_fraction"] for q in quartiles]
        assert all(low <= high for low, high in ranges)
        assert all(ranges[q][1] <= ranges[q + 1][0] for q in range(3))  # sorted by body fraction
        # the same crops the benchmark drew, their body fractions computed here: the quartiles are their sorted pairs
        crops = datalist_crops(datalist, list_name, [64, 32, 32], (-1000.0, 1000.0), 8, 3)
        fractions = sorted(float((crop > 0.3).float().mean()) for crop in crops)
        assert [f for pair in ranges for f in pair] == pytest.approx(fractions)  # 2 crops a quartile: its least, its most
        assert by_content["all"]["body_fraction"] == pytest.approx([fractions[0], fractions[-1]])
        for entry in [*quartiles, by_content["all"]]:
            signals = entry["signals"]
            assert signals["rotation_accuracy"]["baseline"] == pytest.approx(0.25)
            assert signals["rotation_loss"]["baseline"] == pytest.approx(math.log(4))
            assert 0.0 <= signals["rotation_accuracy"]["value"] <= 1.0 and signals["rotation_loss"]["value"] > 0
            assert {"value", "baseline", "verdict"} == set(signals["rotation_loss"])
    assert len({q["body_fraction"][0] for q in results["seeds"]["3"]["training"]["quartiles"]}) > 1  # crops differ

    (tmp_path / "seed3" / "ssl_pretrain" / "models" / "model.pt").unlink()  # seed 3 is recorded: it is not read again
    bench.main(["--work", str(tmp_path), "--seeds", "3", "--crops", "8", "--out", str(out)])
    assert json.loads(out.read_text()) == results


def test_a_missing_checkpoint_or_one_without_ssl_heads_is_refused_naming_it(tmp_path):
    _demo_seed(tmp_path, 0, components.SSLHead(feature_size=12, window_size=4).swinViT.state_dict())
    (tmp_path / "seed1").mkdir()
    out = tmp_path / "by_content.json"
    missing = tmp_path / "seed1" / "ssl_pretrain" / "models" / "model.pt"
    with pytest.raises(FileNotFoundError, match=f"demo seed 1: {missing} is missing"):
        bench.main(["--work", str(tmp_path), "--crops", "8", "--out", str(out)])  # seed 0 was not read first
    assert not out.exists()
    with pytest.raises(ValueError, match=r"demo seed 0: .*seed0/ssl_pretrain/models/model\.pt holds no SSL heads \(its heads: 'encoder'\)"):
        bench.main(["--work", str(tmp_path), "--seeds", "0", "--crops", "8", "--out", str(out)])
    assert not out.exists()


def test_the_crop_is_each_runs_own_and_runs_of_different_crops_are_refused(tmp_path):
    state = components.SSLHead(feature_size=12, window_size=4, depths=(1, 1, 1, 1)).state_dict()
    _demo_seed(tmp_path, 0, state, {"ssl_roi_size": [64, 32, 32]})  # a summary written before 0.5.0
    _demo_seed(tmp_path, 1, state, {"pretraining_roi_size": [32, 64, 64]})
    assert bench.pretraining_roi_size(tmp_path, [0]) == [64, 32, 32]
    assert bench.pretraining_roi_size(tmp_path, [1]) == [32, 64, 64]
    out = tmp_path / "by_content.json"
    with pytest.raises(ValueError, match=r"pretrained with different crop sizes \(\{0: \[64, 32, 32\], 1: \[32, 64, 64\]\}\)"):
        bench.main(["--work", str(tmp_path), "--crops", "8", "--out", str(out)])
    assert not out.exists()
