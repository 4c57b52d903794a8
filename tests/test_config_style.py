"""The bundle configs stay in the Model Zoo's style (issue 46): each train.json a short table of its own settings and
components, the settings all the bundles share in one configs/common.json read first, no flag converted in JSON,
no long expressions, an initialize of two short lines."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from monai.bundle import ConfigParser

from components.config.running import SHARED_CONFIG, run_config_files

BUNDLES = Path(__file__).resolve().parents[1] / "bundles"
TRAIN_CONFIGS = sorted(BUNDLES.glob("*/configs/train.json"))
IDS = [p.parents[1].name for p in TRAIN_CONFIGS]

#: the most top-level ids (keys) of a train.json: the finetuning bundles carry label names, spacing and their
#: checkpoint cadence besides what every bundle has (the Model Zoo's BTCV train.json has 16)
MOST_IDS = 18
#: the longest ``$`` expression, in characters
LONGEST_EXPRESSION = 100
#: the most lines of a run's ``initialize``, and the longest of them
INITIALIZE_LINES, INITIALIZE_LINE_LENGTH = 2, 60
#: the ids each train.json keeps although they are the same everywhere: ``monai.bundle.load`` (and the packaging's
#: check of the weights) builds ``network_def`` from train.json alone, which needs its imports, its ``feature_size``
#: and (finetuning, for the default ``pretrained_path``) ``bundle_root``
KEPT_IN_EACH = {"imports", "bundle_root", "feature_size"}


def _expressions(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        for item in value.values():
            yield from _expressions(item)
    elif isinstance(value, list):
        for item in value:
            yield from _expressions(item)
    elif isinstance(value, str) and value.startswith("$"):
        yield value


@pytest.mark.parametrize("config", TRAIN_CONFIGS, ids=IDS)
def test_a_train_json_is_a_short_table(config):
    content = json.loads(config.read_text())
    assert len(content) <= MOST_IDS, f"{config}: {len(content)} top-level ids: {list(content)}"
    long = [e for e in _expressions(content) if len(e) > LONGEST_EXPRESSION]
    assert long == [], f"{config}: expressions over {LONGEST_EXPRESSION} characters"
    assert "initialize" not in content, "the shared initialize is in configs/common.json"
    ids = list(content)
    assert ids[:2] == ["imports", "bundle_root"] and ids[-4:] == ["network_def", "train", "validate", "run"]
    first_group = ids.index("training")  # the ids a user sets for a new dataset and machine come first
    assert {"roi_size", "in_channels", "feature_size", "batch_size", "max_epochs", "learning_rate"} <= set(ids[:first_group])
    assert "out_channels" not in content  # segmentation outputs are the label_names


def test_the_limits_hold_what_they_say():
    """The checks above fail on what they refuse: an expression of 101 characters, a 19th id."""
    assert list(_expressions({"a": ["$" + "x" * LONGEST_EXPRESSION], "b": "@x"})) == ["$" + "x" * LONGEST_EXPRESSION]
    assert len("$" + "x" * LONGEST_EXPRESSION) > LONGEST_EXPRESSION


@pytest.mark.parametrize("config", TRAIN_CONFIGS, ids=IDS)
def test_a_run_initializes_in_two_short_lines(config):
    merged = ConfigParser.load_config_files([str(f) for f in run_config_files(config.parents[1], ["train.json"])])
    lines = merged["initialize"]
    assert len(lines) <= INITIALIZE_LINES and all(len(line) <= INITIALIZE_LINE_LENGTH for line in lines), lines


def test_no_config_converts_a_flag():
    """Booleans are read by the components that take them (``"false"`` from a command line included), never with
    ``components.as_bool`` in a config."""
    found = [p for p in sorted(BUNDLES.glob("*/configs/*.json")) if "as_bool" in p.read_text()]
    assert found == []


def test_every_bundle_carries_the_same_shared_config():
    """One shared config, the same bytes in every bundle (each bundle folder is packaged and downloaded alone, so each
    holds its copy): a change to it is made in all five, or this fails."""
    copies = {p.parents[1].name: p.read_bytes() for p in sorted(BUNDLES.glob(f"*/configs/{SHARED_CONFIG}"))}
    assert sorted(copies) == IDS
    assert len(set(copies.values())) == 1, "configs/common.json differs between the bundles"


def test_a_setting_is_written_once():
    """No top-level id is in both the shared config and a train.json, and none has one value in every train.json
    (it belongs in the shared config then), but those train.json needs alone."""
    shared = json.loads((BUNDLES / IDS[0] / "configs" / SHARED_CONFIG).read_text())
    configs = [json.loads(p.read_text()) for p in TRAIN_CONFIGS]
    assert [sorted(set(shared) & set(c)) for c in configs] == [[] for _ in configs]
    same = [k for k in configs[0] if all(k in c and c[k] == configs[0][k] for c in configs)]
    assert set(same) <= KEPT_IN_EACH, same


@pytest.mark.parametrize("config", TRAIN_CONFIGS, ids=IDS)
def test_a_cache_mode_is_a_pipeline_a_reference_names(config):
    """One ``train#transforms`` of deterministic and random transforms; a pretraining bundle names one of its two
    pipelines with a ``%`` reference (``--train#transforms %train#plain_transforms`` picks the other), and no
    transform is switched on or off by a setting."""
    train = json.loads(config.read_text())["train"]
    transforms = train["transforms"]
    if isinstance(transforms, str):
        assert transforms == "%train#compact_transforms"
        pipelines = [train["compact_transforms"], train["plain_transforms"]]
    else:
        pipelines = [transforms]
    for pipeline in pipelines:
        assert {"deterministic", "random"} <= set(pipeline)
        assert not any("_disabled_" in t for part in pipeline.values() for t in part)
