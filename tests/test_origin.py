"""Which copy of components a bundle runs: the bundle's own, or a refusal naming both (components.report_origin)."""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

import monai.bundle
import pytest
from monai.bundle.scripts import create_workflow

import components
from components.release.origin import BundleCodeMismatch, package_source, report_origin, source_digest

PACKAGE = Path(components.__file__).resolve().parent


def _bundle_carrying(root: Path, version: str | None = None) -> Path:
    """A bundle folder whose components/ is a copy of the imported package's source, with another __version__ when
    ``version`` is given (other code)."""
    for rel in package_source(PACKAGE):
        (root / "components" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(PACKAGE / rel, root / "components" / rel)
    if version is not None:
        init = root / "components" / "__init__.py"
        init.write_text(init.read_text().replace(f'__version__ = "{components.__version__}"', f'__version__ = "{version}"'))
    return root


def test_a_bundle_carrying_other_code_is_refused_in_one_line_naming_both(tmp_path):
    bundle = _bundle_carrying(tmp_path / "bundle", "9.9.9")
    with pytest.raises(BundleCodeMismatch) as err:
        report_origin(bundle)
    message = str(err.value)
    carried = (bundle / "components").resolve()
    assert "\n" not in message
    assert f"carries components 9.9.9 at {carried}, but this process imported components {components.__version__} " \
           f"from {PACKAGE}, other code" in message  # fmt: skip
    assert f"started in {bundle.resolve()}" in message


def test_a_copy_of_the_same_code_runs_wherever_it_is(tmp_path, caplog):
    """Two bundles of one release carry the same code: the first copy imported serves both (compared by content,
    not by path or version string)."""
    bundle = _bundle_carrying(tmp_path / "bundle")
    assert source_digest(bundle / "components") == source_digest(PACKAGE)
    caplog.set_level(logging.INFO, logger="components.release.origin")
    assert report_origin(bundle) == PACKAGE
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "components.release.origin"]
    assert lines == [("INFO", f"components {components.__version__} from {PACKAGE}"),
                     ("INFO", f"components at {PACKAGE} is the same code as the bundle's own copy at "
                              f"{(bundle / 'components').resolve()}")]  # fmt: skip


def test_one_changed_byte_is_other_code(tmp_path):
    bundle = _bundle_carrying(tmp_path / "bundle")
    settings = bundle / "components" / "training" / "settings.py"
    settings.write_text(settings.read_text() + "\n")
    with pytest.raises(BundleCodeMismatch, match=f"carries components {components.__version__} at "):
        report_origin(bundle)


def test_a_bundle_without_its_own_copy_runs_the_imported_package(tmp_path, caplog):
    """A bundle of this repository carries no components/; the repository root's components/ is the imported one."""
    caplog.set_level(logging.INFO, logger="components.release.origin")
    assert report_origin(tmp_path) == PACKAGE
    assert report_origin(PACKAGE.parent) == PACKAGE
    assert [r.levelname for r in caplog.records if r.name == "components.release.origin"] == ["INFO", "INFO"]


def test_without_a_command_line_the_first_copy_on_sys_path_is_the_bundles(tmp_path, monkeypatch):
    """monai.bundle.load of a second bundle in one process: no command line names its folder and bundle_root is the
    caller's directory, but the docs have the user put the bundle's folder first on sys.path, where a fresh import
    would find its copy: that copy is compared with the one imported, and other code is refused naming both."""
    bundle = _bundle_carrying(tmp_path / "downloads" / "other_bundle", "9.9.9")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.setattr(sys, "argv", ["python"])
    monkeypatch.setattr(sys, "path", [str(bundle), *sys.path])
    with pytest.raises(BundleCodeMismatch, match=f"the bundle at {bundle.resolve()} carries components 9.9.9"):
        report_origin(elsewhere)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(bundle)])
    assert report_origin(elsewhere) == PACKAGE  # the copy sys.path gives first is the imported one


def test_the_bundle_is_found_from_its_config_files_whatever_the_working_directory(tmp_path, monkeypatch):
    """Under `monai.bundle run` from another folder bundle_root may be the caller's directory, so the check looked for
    components/ there and never saw the bundle's own copy. It takes the folder of the config files of the command
    line (sys.argv, here as ``python -m monai.bundle run`` sets it)."""
    bundle = _bundle_carrying(tmp_path / "downloads" / "other_bundle", "9.9.9")
    config = bundle / "configs" / "inference.json"
    config.parent.mkdir()
    repo_config = json.loads((PACKAGE.parent / "bundles" / "swin_unetr_ssl_pretrain" / "configs" / "inference.json").read_text())
    init = repo_config["initialize"]
    head = init[: init.index("$components.report_origin()") + 1]  # bundle_root onto sys.path ... report_origin
    config.write_text(json.dumps({"imports": ["$import os", "$import sys", "$import components"], "bundle_root": ".",
                                  "debug": False, "initialize": head}))  # fmt: skip
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the insertion of bundle_root is undone after the test
    main = str(Path(monai.bundle.__file__).with_name("__main__.py"))
    monkeypatch.setattr(sys, "argv", [main, "run", "--config_file", str(config)])
    with pytest.raises(RuntimeError) as err:  # MONAI wraps what an initialize expression raises
        create_workflow(config_file=str(config), workflow_type=None, logging_file=False)
    assert isinstance(err.value.__cause__, BundleCodeMismatch)
    assert f"the bundle at {bundle.resolve()} carries components 9.9.9" in str(err.value.__cause__)
