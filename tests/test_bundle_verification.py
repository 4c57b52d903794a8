"""The Model Zoo checks, run on every folder under bundles/: required files, JSON formatting, file sizes,
version and changelog, the metadata schema (the project's own, and MONAI's published one when it can be had), the
network's input / output against the metadata, and the workflow properties of train.json and inference.json (MONAI 1.6.1's ConfigWorkflow.check_properties).

MONAI is called through its Python API (the functions ``python -m monai.bundle verify_metadata`` /
``verify_net_in_out`` run), saving an interpreter start per check; ``components`` is importable here."""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from monai.bundle import ConfigWorkflow, verify_metadata, verify_net_in_out

import components
from components.release.package import SCHEMA_MD5, SCHEMA_NAME, SCHEMA_URL, SEMVER_RE, bundle_files, metadata_schema, schema_path
from components.config.running import run_config_files

pytestmark = [
    pytest.mark.filterwarnings("ignore:parsing config_file:UserWarning"),
    pytest.mark.filterwarnings("ignore:No hash value provided:UserWarning"),
    pytest.mark.filterwarnings("ignore:monai.transforms.spatial.dictionary Orientationd:FutureWarning"),
]

REPO = Path(__file__).resolve().parents[1]
BUNDLES = sorted(p for p in (REPO / "bundles").iterdir() if p.is_dir())
REQUIRED = ["LICENSE", "configs/metadata.json", "configs/inference.json", "configs/logging.conf", "docs/README.md"]
MAX_BYTES = 1_000_000  # "no file in git over 1 MB"
FS = 12  # tiny feature size for the network and workflow checks

bundle_param = pytest.mark.parametrize("bundle", BUNDLES, ids=[p.name for p in BUNDLES])


def _meta(bundle: Path) -> dict:
    return json.loads((bundle / "configs" / "metadata.json").read_text(encoding="utf-8"))


def _tracked_files(bundle: Path) -> list[str]:
    """What the repository holds of the bundle: ``git ls-files`` (when git knows it) plus the release files
    without weights (covers a bundle not committed yet; models/, eval/, data/ are gitignored)."""
    files = set(bundle_files(bundle, include_weights=False))
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--", "."], cwd=bundle, capture_output=True, check=True, timeout=60
        ).stdout.decode()
        files |= {f for f in out.split("\0") if f}
    except (OSError, subprocess.SubprocessError):
        pass
    return sorted(f for f in files if (bundle / f).is_file())


def test_every_bundle_is_checked():
    assert BUNDLES, "no bundle folders under bundles/"
    assert {"swin_unetr_ssl_pretrain", "swin_unetr_dino_pretrain"} <= {b.name for b in BUNDLES}


@bundle_param
def test_required_files(bundle):
    missing = [f for f in REQUIRED if not (bundle / f).is_file()]
    assert not missing, f"{bundle.name} lacks {missing}"


@bundle_param
def test_json_is_4_space_indented(bundle):
    bad = []
    for rel in _tracked_files(bundle):
        if not rel.endswith(".json"):
            continue
        text = (bundle / rel).read_text(encoding="utf-8")
        formatted = json.dumps(json.loads(text), indent=4, ensure_ascii=False)
        if text not in (formatted, formatted + "\n"):
            bad.append(rel)
    assert not bad, f"{bundle.name}: not formatted as json.dumps(indent=4): {bad}"


@bundle_param
def test_no_file_over_1mb(bundle):
    big = {f: (bundle / f).stat().st_size for f in _tracked_files(bundle) if (bundle / f).stat().st_size > MAX_BYTES}
    assert not big, f"{bundle.name}: files over 1 MB in the repository (list large files in large_files.json): {big}"


@bundle_param
def test_version_and_changelog(bundle):
    meta = _meta(bundle)
    version = meta.get("version")
    assert isinstance(version, str) and SEMVER_RE.match(version), f"version {version!r} is not MAJOR.MINOR.PATCH"
    changelog = meta.get("changelog")
    assert isinstance(changelog, dict) and version in changelog, f"version {version} has no changelog entry"
    assert all(SEMVER_RE.match(v) for v in changelog), f"changelog keys are not all semantic: {list(changelog)}"


@bundle_param
def test_metadata_matches_the_project_schema_and_required_packages(bundle):
    """The schema that ships with the project (components/release/schema): no network, no file outside the repository."""
    verify_metadata(meta_file=str(bundle / "configs" / "metadata.json"), filepath=str(metadata_schema()))
    meta = _meta(bundle)
    required = meta["required_packages_version"]
    # the code travels in the bundle (components/); only what an index serves is named, by its distribution name
    assert "swin-ssl-bundles" not in required
    assert not {"torch", "monai", "numpy"} & set(required), "torch, MONAI and numpy have their own *_version keys"
    for name, version in required.items():
        assert importlib.metadata.version(name), f"{name} is not an installed distribution"
        assert re.fullmatch(r"\d+(\.\d+)*", version), f"{name}: {version!r} is not a plain release version"
    declared = {"torch", "monai", "numpy", *required}
    undeclared = {m: d for m, d in _imported_distributions().items() if not set(d) & declared}
    assert not undeclared, f"components imports {undeclared} when imported; name them in required_packages_version"


def _imported_distributions() -> dict[str, list[str]]:
    """The third-party modules that ``components``' modules import at module level (what a bundle run imports;
    imports inside functions are lazy) -> their distributions' names."""
    distributions = importlib.metadata.packages_distributions()
    found: dict[str, list[str]] = {}
    for path in sorted((REPO / "components").rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module else []
            for top in {n.split(".")[0] for n in names} - set(sys.stdlib_module_names) - {"__future__", "components"}:
                found[top] = [d.lower() for d in distributions.get(top, [top])]
    return found


@bundle_param
def test_every_run_first_reports_which_components_runs(bundle, tmp_path, caplog):
    """The shared config's ``initialize`` (read with train.json) puts ``bundle_root`` first on sys.path (MONAI does it
    only in ``run()``, after ``initialize``) and imports components again (its ``imports`` were evaluated before,
    maybe without that folder); train.json's and evaluate.json's ``run`` then start with ``components.start`` (errors
    in one line naming the bundle, report_origin, the command line checked). inference.json, read alone, does the same
    in its own ``initialize``: then it reads components through MONAI's optional_import (so that a bundle whose code is
    not importable says why), makes its errors one line naming the bundle (report_errors, given the ``debug`` id that
    ``--debug`` sets; MONAI parses an expression holding "import" before it replaces its references, so ``@debug``
    needs a line of its own), then calls report_origin, which logs the imported package's version and folder."""
    shared = json.loads((bundle / "configs" / "common.json").read_text())
    assert shared["initialize"] == ["$sys.path.insert(0, os.path.abspath(@bundle_root))", "$import components"]
    assert shared["debug"] is False
    for name in ("train.json", "evaluate.json"):
        if (bundle / "configs" / name).is_file():
            run = json.loads((bundle / "configs" / name).read_text())["run"]
            assert run[0].startswith(f"$components.start('{bundle.name}'"), name
    configs = [p for p in sorted((bundle / "configs").glob("*.json")) if "initialize" in json.loads(p.read_text())]
    assert {p.name for p in configs} == {"common.json", "inference.json"}
    for config in configs[1:]:
        content = json.loads(config.read_text())
        path, again, importable, errors, origin = content["initialize"][:5]
        assert path == "$sys.path.insert(0, os.path.abspath(@bundle_root))", config.name
        assert again == "$import components", config.name
        assert importable.startswith("$monai.utils.optional_import('components', descriptor='{} failed: this bundle "
                                     "runs its own code") and importable.endswith(")[0].__version__"), config.name  # fmt: skip
        assert errors == f"$components.report_errors('{bundle.name}', @debug)" and content["debug"] is False, config.name
        assert origin == "$components.report_origin()", config.name
    caplog.set_level(logging.INFO, logger="components.release.origin")
    workflow = ConfigWorkflow(
        config_file=str(bundle / "configs" / "inference.json"), meta_file=str(bundle / "configs" / "metadata.json"),
        logging_file=False, workflow_type="infer", bundle_root=str(tmp_path), device="cpu",
    )  # fmt: skip
    workflow.initialize()
    package = Path(components.__file__).resolve().parent
    assert f"components {components.__version__} from {package}" in caplog.text


# MONAI's commands that need a package beyond the bundle's own: command -> (distribution, module)
RELEASE_TOOLS = {"download_large_files": ("pyyaml", "yaml"), "verify_metadata": ("jsonschema", "jsonschema")}


def _downloaded_bundle_section(bundle: Path) -> str:
    text = (bundle / "docs" / "README.md").read_text(encoding="utf-8")
    assert "## Run a downloaded bundle" in text
    return text.split("## Run a downloaded bundle", 1)[1].split("\n## ", 1)[0]


def _install_pins(section: str) -> dict[str, str]:
    lines = [line.split() for line in section.splitlines() if line.strip().startswith("pip install ")]
    assert len(lines) == 1, lines
    return dict(word.split("==", 1) for word in lines[0][2:])


@bundle_param
def test_docs_install_exactly_the_metadata_packages_and_the_release_tools(bundle):
    """The "Run a downloaded bundle" section's one ``pip install`` line pins what the metadata names and what the
    MONAI commands its docs use need (:data:`RELEASE_TOOLS`), no more."""
    text = (bundle / "docs" / "README.md").read_text(encoding="utf-8")
    meta = _meta(bundle)
    tools = {dist: importlib.metadata.version(dist) for command, (dist, _) in RELEASE_TOOLS.items()
             if f"monai.bundle {command}" in text}  # fmt: skip
    expected = {"torch": meta["pytorch_version"], "monai": meta["monai_version"], **meta["required_packages_version"]}
    expected.update(tools)
    assert _install_pins(_downloaded_bundle_section(bundle)) == expected


@bundle_param
def test_docs_name_what_monais_release_commands_need(bundle):
    """A release packaged with --release_url holds no weights: the docs' download runs `download_large_files`
    (MONAI reads large_files.yml with PyYAML) and checks the metadata with `verify_metadata` (jsonschema). Every
    such command the docs use has its package on the install line, at the version the tests run with, importable."""
    section = _downloaded_bundle_section(bundle)
    text = (bundle / "docs" / "README.md").read_text(encoding="utf-8")
    pins = _install_pins(section)
    for command, (dist, module) in RELEASE_TOOLS.items():
        assert f"python -m monai.bundle {command}" in section, f"{bundle.name}: the download section runs no {command}"
        if f"monai.bundle {command}" in text:
            installed = importlib.metadata.version(dist)
            assert pins.get(dist) == installed, f"{bundle.name}: {command} needs {dist}=={installed}, install line {pins}"
            assert importlib.import_module(module)


@pytest.fixture(scope="module")
def published_schema() -> Path:
    """MONAI's published metadata schema: BUNDLE_SCHEMA_PATH, else the md5-checked copy in ../shared/bundle-schema
    beside the repository (where the developers keep one), else the cached or downloaded file; skipped when none
    can be had (offline, plain clone), since the project's own schema is checked regardless."""
    shared = REPO.parent / "shared" / "bundle-schema" / SCHEMA_NAME
    if not os.environ.get("BUNDLE_SCHEMA_PATH") and shared.is_file():
        assert hashlib.md5(shared.read_bytes()).hexdigest() == SCHEMA_MD5, f"{shared} is not {SCHEMA_NAME}"
        return shared
    try:
        return schema_path()
    except Exception as err:  # noqa: BLE001 -- offline: URLError, or MONAI's RuntimeError around it
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        pytest.skip(f"MONAI's published metadata schema is not available ({SCHEMA_URL}: {reason}); "
                    "the project's own schema was checked")  # fmt: skip


@bundle_param
def test_metadata_matches_monais_published_schema(bundle, published_schema):
    verify_metadata(meta_file=str(bundle / "configs" / "metadata.json"), filepath=str(published_schema))


def test_schema_checks_pass_on_an_offline_plain_clone(tmp_path):
    """A copy of the repository's files with no ../shared beside it, no cached schema and no network (every URL
    goes to a proxy that refuses): the own-schema checks pass and the published-schema checks skip, saying why."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True, check=True, timeout=60
    ).stdout.decode().split("\0")
    clone = tmp_path / "clone" / "repo"
    for rel in filter(None, files):
        if (REPO / rel).is_file() and rel.split("/")[0] in ("components", "bundles", "tests", "pyproject.toml"):
            (clone / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(REPO / rel, clone / rel)
    env = {k: v for k, v in os.environ.items() if k != "BUNDLE_SCHEMA_PATH" and not k.lower().endswith("_proxy")}
    refused = "http://127.0.0.1:9"  # the discard port: nothing listens there
    env.update(PYTHONPATH=str(clone), XDG_CACHE_HOME=str(tmp_path / "cache"), http_proxy=refused, https_proxy=refused)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_bundle_verification.py",
         "-k", "metadata_matches"],
        cwd=clone, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    n = len(BUNDLES)
    assert f"{n} passed, {n} skipped" in out, out[-3000:]
    assert "MONAI's published metadata schema is not available" in out
    assert not (clone.parent / "shared").exists()


@bundle_param
def test_net_in_out(bundle):
    """``python -m monai.bundle verify_net_in_out --net_id network_def ... --config_file configs/inference.json``
    with the smallest shape the metadata allows (n=1) and feature size 12. An embedding output has 16 values per
    unit of feature size (the Swin ViT's last stage), so its metadata channel count is scaled with it."""
    pred = _meta(bundle)["network_data_format"]["outputs"]["pred"]
    scaled = {"_meta_#network_data_format#outputs#pred#num_channels": 16 * FS} if pred["type"] == "embedding" else {}
    verify_net_in_out(
        net_id="network_def",
        meta_file=str(bundle / "configs" / "metadata.json"),
        config_file=str(bundle / "configs" / "inference.json"),
        device="cpu",
        n=1,
        p=1,
        any=1,
        feature_size=FS,
        **scaled,
    )


@pytest.fixture(scope="module")
def synthetic_data(tmp_path_factory):
    """Lazily written synthetic datasets by kind ("ct" / "mri"): 1 training, 1 validation, 1 test volume."""
    written: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in written:
            written[kind] = tmp_path_factory.mktemp(kind)
            components.write_dataset(written[kind], kind=kind, num=3, seed=0)
        return written[kind]

    return get


def _kind(meta: dict) -> str:
    image = meta["network_data_format"]["inputs"]["image"]
    return "ct" if str(image.get("modality", "")).upper() == "CT" and image.get("num_channels", 1) == 1 else "mri"


@bundle_param
@pytest.mark.parametrize("config, workflow_type", [("train.json", "train"), ("inference.json", "infer")])
def test_workflow_properties(bundle, config, workflow_type, synthetic_data, tmp_path):
    """ConfigWorkflow(...).check_properties() == [] for train.json ("train") and inference.json ("infer").
    MONAI 1.6.1 instantiates each property for the check (initialize() first), so the workflow is pointed at
    a tiny synthetic dataset and a temporary bundle_root; nothing is run."""
    if not (bundle / "configs" / config).is_file():
        pytest.fail(f"{bundle.name} has no configs/{config}")
    overrides = {
        "bundle_root": str(tmp_path),
        "dataset_dir": str(synthetic_data(_kind(_meta(bundle)))),
        "device": "cpu",
        "loader#num_workers": 0,
        "batch_size": 1,
        "feature_size": FS,
    }
    if bundle.name == "swin_unetr_dino_pretrain" and config == "train.json":
        overrides["training#num_samples"] = 2  # KoLeo needs 2 crops per rank and step
    workflow = ConfigWorkflow(
        config_file=[str(f) for f in run_config_files(bundle, [config])],
        meta_file=str(bundle / "configs" / "metadata.json"),
        logging_file=False,
        workflow_type=workflow_type,
        **overrides,
    )
    workflow.initialize()
    assert workflow.check_properties() == []


def _workflow_cases(bundle: Path) -> list[tuple[list[str], str]]:
    cases = [(["train.json"], "train"), (["inference.json"], "infer")]
    if (bundle / "configs" / "evaluate.json").is_file():
        cases.append((["train.json", "evaluate.json"], "train"))
    return cases


@bundle_param
def test_workflow_properties_without_data(bundle, tmp_path, caplog):
    """The Model Zoo checks a bundle with no dataset at all: check_properties() == [] for every config with
    ``dataset_dir`` an empty folder (the datalist is read when the workflow runs); running it then stops at once,
    naming the datalist."""
    for configs, workflow_type in _workflow_cases(bundle):
        workflow = ConfigWorkflow(
            config_file=[str(f) for f in run_config_files(bundle, configs)],
            meta_file=str(bundle / "configs" / "metadata.json"),
            logging_file=False,
            workflow_type=workflow_type,
            bundle_root=str(tmp_path),
            dataset_dir=str(tmp_path / "no_data"),
            device="cpu",
            feature_size=FS,
            **{"loader#num_workers": 0},
        )
        workflow.initialize()
        assert workflow.check_properties() == [], configs
        with pytest.raises(RuntimeError) as err:  # MONAI wraps what an expression raises
            workflow.run()
        assert isinstance(err.value.__cause__, FileNotFoundError), configs
        assert str(err.value.__cause__).endswith("no_data/dataset.json' does not exist (set `datalist` or `dataset_dir`).")
    assert "does not exist: the 'training' list is empty" in caplog.text or "'test' list is empty" in caplog.text


@bundle_param
def test_repository_eval_metrics_are_empty(bundle):
    """metadata.json's eval_metrics describe no weights in the repository (weights are not in git): a release's are
    filled by `package` from the evaluation record of the packaged weights, and a figure such as the demo's is
    stated in the docs, where its command and data are."""
    assert _meta(bundle)["eval_metrics"] == {}
