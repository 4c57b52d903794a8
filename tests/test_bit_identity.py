"""benchmarks/bit_identity.py: the comparison of two revisions' tiny runs sees a changed tensor, and overrides in the
grouped ids reach a config from before the grouping under their old names."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import bit_identity  # noqa: E402


def _save(folder: Path, model: dict, checkpoint: dict) -> Path:
    folder.mkdir(parents=True)
    torch.save(model, folder / "model.pt")
    torch.save(checkpoint, folder / "checkpoint.pt")
    return folder


def test_compare_models_finds_the_one_changed_tensor_and_a_missing_file(tmp_path):
    weights = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(3)}
    state = {"model": weights, "optimizer": {"state": {0: {"exp_avg": torch.ones(3)}}, "param_groups": [{"lr": 0.1}]}}
    before = _save(tmp_path / "before", weights, state)
    same = _save(tmp_path / "same", {k: v.clone() for k, v in weights.items()}, state)
    changed_state = {**state, "optimizer": {"state": {0: {"exp_avg": torch.tensor([1.0, 1.0, 1.0 + 2**-20])}}}}
    changed = _save(tmp_path / "changed", weights, changed_state)
    assert all(not f["differ"] and not f["missing"] for f in bit_identity.compare_models(before, same).values())
    files = bit_identity.compare_models(before, changed)
    assert files["checkpoint.pt"]["differ"] == ["optimizer/state/0/exp_avg"] and files["model.pt"]["differ"] == []
    (changed / "model.pt").unlink()
    assert bit_identity.compare_models(before, changed)["model.pt"] == {"only_in": "before"}


def test_grouped_overrides_are_spelled_in_the_old_ids_of_a_config_from_before_the_grouping():
    old = {
        "num_workers": 0, "window_size": 7, "ckpt_time_interval_s": 600, "network_def": {"window_size": "@window_size"},
        "validate": {"datalist": []}, "datalist": "x.json",
    }
    new = {"loader": {"num_workers": 0}, "network_def": {"window_size": 7}, "checkpointing": {"time_interval_s": 600}}
    overrides = {"loader#num_workers": 0, "network_def#window_size": 4, "checkpointing#time_interval_s": 60,
                 "validate#datalist": [], "device": "cpu"}  # fmt: skip
    assert bit_identity._spelled_for(overrides, old) == {
        "num_workers": 0, "window_size": 4, "ckpt_time_interval_s": 60, "validate#datalist": [], "device": "cpu"}
    assert bit_identity._spelled_for(overrides, new) == overrides
