"""Every typed setting of every bundle is checked at start (components.check_setting_types): a wrong type or value
stops the run before any data is read, in one line naming the id, the value and what the setting accepts.

The settings are found in the configs themselves (top-level ids, the members of the settings groups, at any depth),
so a setting added without a kind fails :func:`test_every_setting_of_every_bundle_has_a_kind`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from monai.bundle import ConfigParser

import components
from components import BUNDLE_SETTINGS, ConfigError, check_setting_types
from components.config.kinds import Because, Dict, Either, Flag, Integer, Kind, ListOf, Null, Number, OneOf, Text, or_null
from components.config.running import RunningBundle, run_config_files
from components.config.types import literal, setting_problems, setting_values
from components.demo.runner import BUNDLES_DIR, bundle_command
from components.training.setting_types import Device
from tests.test_errors import _run

REPO = Path(__file__).resolve().parents[1]
BUNDLES = sorted(p.parent.name for p in BUNDLES_DIR.glob("*/configs"))
#: the config files a bundle runs together: each file with initialize, evaluate and the multi-GPU files on train.json
RUNS = [
    (bundle, files)
    for bundle in BUNDLES
    for files in (("train.json",), ("train.json", "multi_gpu_train.json"), ("inference.json",),
                  ("train.json", "evaluate.json"), ("train.json", "evaluate.json", "multi_gpu_evaluate.json"))
    if all((BUNDLES_DIR / bundle / "configs" / f).is_file() for f in files)
]  # fmt: skip
#: top-level ids that are built objects or data, not settings a user types
NOT_SETTINGS = {
    "network": "the prepared network, an expression of network_def and the speed settings",
    "test_data": "the inference list, read from datalist",
}
#: the groups of components, whose members are component arguments, not settings
COMPONENT_GROUPS = ("train", "validate")
_WORKFLOW_IDS = ("imports", "initialize", "run", "finalize")


def _files(bundle: str, files: tuple[str, ...]) -> tuple[Path, ...]:
    """The config files of a run of ``files``: the shared config first with train.json."""
    return tuple(run_config_files(BUNDLES_DIR / bundle, files))


def _config(bundle: str, files: tuple[str, ...]) -> dict:
    return ConfigParser.load_config_files([str(f) for f in _files(bundle, files)])


def _leaves(prefix: str, group: dict) -> dict[str, Any]:
    found = {}
    for name, value in group.items():
        if isinstance(value, dict) and "_target_" not in value:
            found.update(_leaves(f"{prefix}#{name}", value))
        else:
            found[f"{prefix}#{name}"] = value
    return found


def settings_of(config: dict) -> dict[str, Any]:
    """Every setting a merged config defines, with its default: the top-level ids that are no component, list of
    components or group of components, and the members of the settings groups (top-level dicts without
    ``_target_``: training, loader, speed, checkpointing, masking, augmentation), at any depth."""
    found = {}
    for name, value in config.items():
        if name in _WORKFLOW_IDS or name in NOT_SETTINGS or name in COMPONENT_GROUPS:
            continue
        if isinstance(value, dict):
            if "_target_" not in value:
                found.update(_leaves(name, value))
        elif not (isinstance(value, list) and value and all(isinstance(v, dict) for v in value)):
            found[name] = value
    return found


def _checking_step(config: dict) -> str:
    """The step that checks the setting types: ``components.start`` first in ``run`` (train.json and evaluate.json),
    else ``check_setting_types`` in ``initialize`` (inference.json, read alone)."""
    first = config["run"][0]
    if first.startswith("$components.start("):
        return first
    (step,) = [s for s in config["initialize"] if "check_setting_types(" in s]
    return step


def recipe_tables(bundle: str, files: tuple[str, ...]) -> tuple[dict[str, Kind], ...]:
    """The tables the bundle's own start gives check_setting_types (its recipe's)."""
    step = _checking_step(_config(bundle, files))
    arguments = step.split("(", 1)[1].removesuffix(")").split(",")
    names = [a.strip() for a in arguments if a.strip().startswith("components.")]
    return tuple(getattr(components, name.removeprefix("components.")) for name in names)


def bundle_kinds(bundle: str, files: tuple[str, ...]) -> dict[str, Kind]:
    """The kinds the bundle's initialize checks: BUNDLE_SETTINGS, its recipe's table winning."""
    return {**BUNDLE_SETTINGS, **{k: v for table in recipe_tables(bundle, files) for k, v in table.items()}}


def defined(bundle: str, files: tuple[str, ...]) -> dict[str, Any]:
    """The defaults of the ids with a kind that the merged config defines (the settings, and the component arguments
    the docs name, such as network_def#use_v2)."""
    return setting_values(RunningBundle(_files(bundle, files)),
                          list(bundle_kinds(bundle, files)))  # fmt: skip


@pytest.mark.parametrize("bundle, files", RUNS)
def test_every_setting_of_every_bundle_has_a_kind(bundle, files):
    config = _config(bundle, files)
    kinds = bundle_kinds(bundle, files)
    missing = [name for name in settings_of(config) if name not in kinds]
    assert missing == [], f"{bundle} {files}: settings without a kind in BUNDLE_SETTINGS or the recipe's table"
    if config["run"][0].startswith("$components.start("):
        assert config["run"][0].startswith(f"$components.start('{bundle}'"), "the run must start with its check"
    else:
        steps = config["initialize"]
        after = steps[steps.index("$components.check_overrides()") + 1]
        assert after.startswith("$components.check_setting_types("), "the check must follow check_overrides"


def _resolved(bundle: str, files: tuple[str, ...], name: str, value: Any) -> Any:
    """A default written as an expression, as the config computes it (on CPU, one process)."""
    if literal(value):
        return value
    parser = ConfigParser(_config(bundle, files))
    parser["device"] = "cpu"
    parser["bundle_root"] = str(BUNDLES_DIR / bundle)
    return parser.get_parsed_content(name)


@pytest.mark.parametrize("bundle, files", RUNS)
def test_every_default_is_accepted(bundle, files):
    """Defaults written as expressions are checked as the config computes them (on CPU, one process)."""
    parser = ConfigParser(_config(bundle, files))
    parser["device"] = "cpu"
    parser["bundle_root"] = str(BUNDLES_DIR / bundle)
    values = {name: value if literal(value) else parser.get_parsed_content(name)
              for name, value in defined(bundle, files).items()}  # fmt: skip
    assert setting_problems(bundle_kinds(bundle, files), values) == []


def test_the_documented_overrides_have_kinds():
    """Each ``--group#id`` the docs tell users to pass names a setting with a kind, or a component swapped whole."""
    import re

    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted(BUNDLES_DIR.glob("*/docs/README.md"))]
    swaps = {"network_def#network", "handlers#0#_disabled_", "train#dataloader#loader_class",
             "train#transforms"}  # components, not values: a class, a handler, a pipeline
    named = {m for doc in docs for m in re.findall(r"(?<![\w#-])--([a-z_]+(?:#[a-z_0-9]+)+)", doc.read_text())}
    kinds = {**BUNDLE_SETTINGS, **components.SSL_SETTINGS, **components.MASKED_IMAGE_SETTINGS,
             **components.SELF_DISTILLATION_SETTINGS}  # fmt: skip
    assert sorted(named - swaps - set(kinds)) == []


def _bad(kind: Kind) -> Any:
    """A value ``kind`` refuses, of the sort a user gets wrong: a fraction for an integer, a word for a flag, a
    value beyond a range, a list of the wrong values."""
    if isinstance(kind, Because):
        return _bad(kind.kind)
    if isinstance(kind, Either):
        candidates = [_bad(k) for k in kind.kinds if not isinstance(k, Null)] + ["maybe", 1.5, {"x": 1}]
        return next(v for v in candidates if not kind.accepts(v))
    if isinstance(kind, Number):
        if kind.high is not None or kind.below is not None:
            return max(b for b in (kind.high, kind.below) if b is not None) + 1
        lower = [b for b in (kind.low, kind.above) if b is not None]
        return min(lower) - 1 if lower else "fast"
    if isinstance(kind, ListOf):
        return [_bad(kind.item)] * (kind.length or 1)
    bad = {Flag: "maybe", Integer: 1.5, OneOf: "nonesuch", Text: 7, Device: 7, Dict: "fast"}
    return bad[type(kind)]


def _every_setting_wrong(bundle: str, files: tuple[str, ...]) -> tuple[dict[str, Any], list[str]]:
    """A wrong value for each id with a kind the config defines (bundle_root excepted: it finds the bundle), and the
    lines check_setting_types says for them, in its order."""
    kinds = bundle_kinds(bundle, files)
    bad = {name: _bad(kinds[name]) for name in defined(bundle, files) if name != "bundle_root"}
    return bad, [f"{name} must be {kind.accepted}, got {bad[name]!r}." for name, kind in kinds.items() if name in bad]


@pytest.mark.parametrize("bundle, files", RUNS)
def test_a_wrong_value_of_every_setting_is_one_line_naming_it_and_what_it_accepts(bundle, files):
    bad, expected = _every_setting_wrong(bundle, files)
    assert set(settings_of(_config(bundle, files))) - {"bundle_root"} <= set(bad)
    run = RunningBundle(_files(bundle, files), bad)
    with pytest.raises(ConfigError) as err:
        check_setting_types(*recipe_tables(bundle, files), bundle=run)
    assert str(err.value).splitlines() == expected


def test_good_values_pass_and_expressions_are_left_to_their_code():
    run = RunningBundle(_files("swin_unetr_btcv_finetune", ("train.json",)),
                        {"max_epochs": 3, "speed#amp": "false", "loader#cache": "smart", "checkpointing#resume": "null",
                         "training#num_samples": "$2 * 2", "roi_size#0": 64, "device": "cuda:1"})  # fmt: skip
    check_setting_types(bundle=run)
    run = RunningBundle(run.config_files, {"roi_size#0": 0.5})
    with pytest.raises(ConfigError, match=r"^roi_size must be a list of 3 values, each an integer >= 1 \(voxels along "
                                          r"each axis\), got \[0\.5, 96, 96\]\.$"):  # fmt: skip
        check_setting_types(bundle=run)


@pytest.mark.parametrize(
    "kind, good, bad, accepted",
    [
        (Flag(), [True, 0, "false", " Yes ", "on"], ["maybe", 2, None, 1.0], "true or false"),
        (Integer(1), [1, 7], [0, 1.5, 2.0, True, "2"], "an integer >= 1"),
        (Integer(1, 1), [1], [2, 1.0], "the integer 1"),
        (Integer(12, multiple_of=12), [12, 48], [0, 18, 6], "a multiple of 12 >= 12"),
        (Number(above=0, below=1), [0.5, 1e-6], [0, 1, 1.5, math.nan, "0.5", False], "a number > 0 and < 1"),
        (Number(0, 1), [0, 1, 0.2], [-0.1, 1.1, math.inf], "a number from 0 to 1"),
        (OneOf(("full", "smart")), ["full"], ["Full", "ful", 1], "one of 'full', 'smart'"),
        (ListOf(Integer(1), 3), [[1, 2, 3], (4, 5, 6)], [[1, 2], [1, 2, 0], "96", []], "a list of 3 values, each an integer >= 1"),
        (or_null(Text("a path")), [None, "null", "None", "", "models/x.pt"], [3, ["a"]], "null or a path"),
        (Either((Flag(), OneOf(("auto",)))), [True, "auto", "false"], ["Auto", 2], "true or false or 'auto'"),
        (Dict(), [{}, {"mode": "max-autotune"}], ["{}", []], "a dict"),
        (Device(), ["cpu", "cuda:1", torch.device("cpu")], ["gpu", 0], "a torch device such as 'cpu', 'cuda' or 'cuda:1'"),
        (Integer(1).because("crops"), [2], [0], "an integer >= 1 (crops)"),
    ],
)
def test_each_kind_accepts_what_its_reader_does_and_says_it(kind, good, bad, accepted):
    assert [v for v in good if not kind.accepts(v)] == []
    assert [v for v in bad if kind.accepts(v)] == []
    assert kind.accepted == accepted


def test_null_from_a_command_line_reaches_the_readers_as_none():
    """The kinds accept "null" where a setting may be unset, since ``--x None`` leaves the config's value: so the code
    that reads those settings takes "null" as None."""
    from components import ResumableCheckpointSaver, loss_class_weights
    from components.training.recipe import resolve_amp_dtype

    saver = ResumableCheckpointSaver(ckpt_dir="unused", to_save={"model": torch.nn.Linear(1, 1)}, epoch_interval="null",
                                     iteration_interval=2, time_interval_s="null")  # fmt: skip
    assert (saver.epoch_interval, saver.iteration_interval, saver.time_interval_s) == (None, 2, None)
    assert loss_class_weights("null", "cpu") is None and loss_class_weights([1, 2], "cpu").tolist() == [1.0, 2.0]
    assert resolve_amp_dtype(torch.device("cpu"), "null") == torch.bfloat16


# ------------------------------------------------------------------------------------------- as the user runs it


def _said_once_each(bundle: str, files: tuple[str, ...], tmp_path: Path) -> None:
    bad, expected = _every_setting_wrong(bundle, files)
    code, lines, out = _run(bundle_command(bundle, files, bad), tmp_path)
    assert code == 1, out[-3000:]
    assert lines[0] == f"{bundle}: error: ConfigError: {expected[0]} (--debug shows the traceback)", out[-3000:]
    assert lines[1:] == [f"  {line}" for line in expected[1:]], out[-3000:]


def test_every_setting_wrong_at_once_is_one_line_each_as_the_user_runs_it(tmp_path):
    _said_once_each("swin_unetr_btcv_finetune", ("train.json", "evaluate.json"), tmp_path)


#: runs the check stops as the user runs them: not the multi-GPU ones, which start the process group (torchrun's) in
#: ``initialize``, before the run's start checks the settings (every id's kind is checked above, without running)
AS_RUN = [r for r in RUNS if not any(f.startswith("multi_gpu") for f in r[1])]


@pytest.mark.slow
@pytest.mark.parametrize("bundle, files", [r for r in AS_RUN if r != ("swin_unetr_btcv_finetune", ("train.json", "evaluate.json"))])
def test_every_setting_wrong_at_once_in_every_bundle(bundle, files, tmp_path):
    _said_once_each(bundle, files, tmp_path)
