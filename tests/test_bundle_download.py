"""The packaged bundles as a user meets them: downloaded with ``python -m monai.bundle download`` into a fresh virtual
environment holding only torch, MONAI, fire and the packages of ``required_packages_version`` (no clone of this
repository on the path, no ``components`` installed), and run from their folders.

- One venv for the module (``python -m venv``, no system site packages): pip installs exactly the metadata's
  ``torch==pytorch_version``, ``monai==monai_version`` and ``required_packages_version`` (fire among them), from
  this machine's configured wheel folders and indexes (``--no-compile``: the first import writes the byte code).
  ``jsonschema`` (what ``verify_metadata`` needs) and PyYAML (what ``download_large_files`` reads
  ``large_files.yml`` with) go to a separate folder put on ``PYTHONPATH`` only for the download process, as the
  Model Zoo CI brings its own.
- Each bundle is packaged from a copy with tiny "trained" weights (feature size 12) and a ``file://`` release URL,
  so its zip holds no weights: they lie beside it, listed in ``large_files.yml``.
- One venv process downloads the four zips (``python -m monai.bundle download --name --version --url file://...``)
  and, in each bundle folder as the bundles' docs say, their weights (``python -m monai.bundle
  download_large_files``) and runs ``verify_metadata``, against the schema the bundle carries and MONAI's published
  one when the repository's neighbour folder has it; no bundle code is imported there.
- Per bundle, one venv process without ``jsonschema``, started in the bundle folder: ``python -m components synth``
  (the bundle's own copy writes the synthetic data), ``verify_net_in_out``, ``monai.bundle.load`` of the train and
  the inference config (the state dicts saved for comparison here), inference on the test volume (finetuning
  bundles), then one training iteration (last: it replaces ``models/model.pt``).

Every step of a venv process is ``python -m <module> <args>`` executed by ``runpy`` in that one interpreter, the
command line's own code path with the working directory and ``sys.path[0]`` as ``python -m`` sets them, so that a
2-core machine pays one torch import per process rather than one per step.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import nibabel as nib
import pytest
import torch
from monai.networks.nets import SwinUNETR

import components
from components import write_dataset
from components.release import package as pkg
from tests.test_package import _copy_bundle, _fake_trained_state

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
PUBLISHED_SCHEMA = REPO.parent / "shared" / "bundle-schema" / pkg.SCHEMA_NAME
FS = 12
SSL, DINO, MIM = "swin_unetr_ssl_pretrain", "swin_unetr_dino_pretrain", "swin_unetr_mim_pretrain"
BTCV, BRATS = "swin_unetr_btcv_finetune", "swin_unetr_brats_finetune"
BUNDLES = [SSL, DINO, MIM, BTCV, BRATS]
FINETUNING = [BTCV, BRATS]
TIMEOUT_S = 900
#: the config files of a training run, as the docs give them
TRAIN_FILES = "['configs/common.json','configs/train.json']"

# the tiny "trained" network of each bundle (what its models/model.pt holds) and its synthetic data
NETWORKS: dict[str, Callable[[], torch.nn.Module]] = {
    SSL: lambda: components.SSLHead(feature_size=FS),
    DINO: lambda: components.SwinViTEmbedding(feature_size=FS),
    MIM: lambda: components.MaskedImageModel(feature_size=FS),
    BTCV: lambda: SwinUNETR(in_channels=1, out_channels=14, feature_size=FS),
    BRATS: lambda: SwinUNETR(in_channels=4, out_channels=3, feature_size=FS),
}
KIND = {SSL: "ct", DINO: "ct", MIM: "ct", BTCV: "ct", BRATS: "mri"}
CPU = {"loader#num_workers": 0, "device": "cpu", "speed#amp": False}
TRAIN_COMMON = {**CPU, "max_epochs": 1, "batch_size": 1, "speed#use_checkpoint": False, "training#log_interval": 1}
# one iteration: 1 training volume (synth --num 3), batch 1
TRAIN = {
    SSL: {"roi_size": [64, 32, 32], "training#num_samples": 1, "training#warmup_iterations": 1},
    MIM: {"roi_size": [64, 32, 32], "training#num_samples": 1, "training#warmup_iterations": 1, "training#rankme_crops": 4},
    DINO: {"roi_size": [32, 32, 32], "training#context_size": [48, 48, 48], "training#local_size": [32, 32, 32],
           "training#num_local_crops": 1, "training#prototypes": 32, "training#head_hidden_dim": 24,
           "training#head_bottleneck_dim": 8, "training#warmup_epochs": 1,
           "training#teacher_temperature_warmup_epochs": 1, "training#num_samples": 2},  # 2 crops: KoLeo and RankMe
    BTCV: {"roi_size": [64, 32, 32], "spacing": [3.0, 3.0, 4.0], "training#num_samples": 1, "training#val_interval": 1},
    BRATS: {"roi_size": [64, 32, 32], "spacing": [2.0, 2.0, 2.0], "training#num_samples": 1, "training#val_interval": 1},
}  # fmt: skip
INFER = {BTCV: {"roi_size": [64, 32, 32], "spacing": [3.0, 3.0, 4.0]}, BRATS: {"roi_size": [64, 32, 32], "spacing": [2.0, 2.0, 2.0]}}
# an embedding's channels are 16 x feature_size (the metadata states the default 48)
NET_IN_OUT = {DINO: {"_meta_#network_data_format#outputs#pred#num_channels": 16 * FS}}

# runs in the venv: `python -c DRIVER '<json steps>'`; each step prints a line "STEP <what>" first
DRIVER = r'''
import json, os, runpy, sys

def start_in(folder):
    """What `python -m` started in `folder` has: that working directory, first on sys.path."""
    os.chdir(folder)
    sys.path[:] = [os.getcwd()] + [p for p in sys.path if p not in ("", os.getcwd())]

def cli(module, args):
    """`python -m <module> <args>`: the command line's code path, in this interpreter."""
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            raise

def load(name, bundle_dir, workflow_type, out):
    import monai.bundle, torch
    net = monai.bundle.load(name=name, bundle_dir=bundle_dir, workflow_type=workflow_type, device="cpu", progress=False)
    torch.save(net.state_dict(), out)

for step, *args in json.loads(sys.argv[1]):
    print("STEP", step, *args, flush=True)
    {"start_in": start_in, "cli": cli, "load": load}[step](*args)
carried = sys.modules.get("components")
print("IMPORTED " + json.dumps({"components": getattr(carried, "__file__", None),
      "files": sorted({f for m in list(sys.modules.values()) if isinstance(f := getattr(m, "__file__", None), str)})}))
'''


def _cli_value(value: object) -> str:
    """An override as ``monai.bundle``'s command line (python-fire) reads it back."""
    return json.dumps(value) if isinstance(value, list) else str(value).lower() if isinstance(value, bool) else str(value)


def _overrides(values: dict) -> list[str]:
    return [word for key, value in values.items() for word in (f"--{key}", _cli_value(value))]


def _env(**extra: str) -> dict[str, str]:
    """The environment without this interpreter's Python settings (PYTHONPATH, PYTHONDONTWRITEBYTECODE...)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON") and k != "VIRTUAL_ENV"}
    return {**env, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def _run(cmd: list, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Runs ``cmd``; its output (stdout and stderr in the order written) is ``.stdout``."""
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=TIMEOUT_S, check=False)  # fmt: skip


def _ok(proc: subprocess.CompletedProcess, what: str) -> str:
    assert proc.returncode == 0, f"{what} exited {proc.returncode}:\n{proc.stdout[-6000:]}"
    return proc.stdout


def _imported(out: str) -> dict:
    lines = [line for line in out.splitlines() if line.startswith("IMPORTED ")]
    assert lines, out[-3000:]
    return json.loads(lines[-1][len("IMPORTED ") :])


def _metadata(name: str) -> dict:
    return json.loads((REPO / "bundles" / name / "configs" / "metadata.json").read_text(encoding="utf-8"))


def _pins() -> list[str]:
    """``name==version`` for torch, MONAI and the required packages, the same in every bundle's metadata."""
    pins = {}
    for name in BUNDLES:
        meta = _metadata(name)
        mine = {"torch": meta["pytorch_version"], "monai": meta["monai_version"], **meta["required_packages_version"]}
        assert not pins or mine == pins, f"{name} pins {mine}, another bundle {pins}: one environment runs them all"
        pins = mine
    assert "fire" in pins, "monai.bundle's command line needs fire: name it in required_packages_version"
    return [f"{k}=={v}" for k, v in pins.items()]


@dataclass(frozen=True)
class Venv:
    python: Path
    tools: Path  # jsonschema and pyyaml, for verify_metadata and download_large_files only


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Venv:
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", root / "env"], check=True, timeout=300)
    python = root / "env" / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "--no-compile", "--quiet"]
    _ok(_run([*pip, *_pins()], root, _env()), "pip install into the venv")
    tools = [f"{name}=={importlib.metadata.version(name)}" for name in ("jsonschema", "pyyaml")]
    _ok(_run([*pip, "--target", root / "tools", *tools], root, _env()), f"pip install --target tools {tools}")
    return Venv(python, root / "tools")


def test_the_venv_holds_only_the_users_packages(venv, tmp_path):
    """From a neutral folder the venv cannot import components, and holds no distribution of this repository."""
    proc = _run([venv.python, "-c", "import components"], tmp_path, _env())
    assert proc.returncode != 0 and "No module named 'components'" in proc.stdout, proc.stdout[-2000:]
    listing = "import importlib.metadata as m, json; print(json.dumps([d.metadata['Name'].lower() for d in m.distributions()]))"
    installed = set(json.loads(_ok(_run([venv.python, "-c", listing], tmp_path, _env()), "listing")))
    assert {p.split("==")[0] for p in _pins()} <= installed
    assert "swin-ssl-bundles" not in installed and not {"jsonschema", "pyyaml"} & installed


@dataclass(frozen=True)
class Release:
    zip_path: Path
    weights: Path  # the packaged models/model.pt
    state: dict[str, torch.Tensor]  # its tensors


@dataclass(frozen=True)
class Downloads:
    folder: Path  # the --bundle_dir of every download: <folder>/<name>/
    releases: dict[str, Release]
    output: str


@pytest.fixture(scope="module")
def downloads(venv, tmp_path_factory) -> Downloads:
    """Packages the four bundles (tiny weights, a file:// release URL), then one venv process downloads each with its
    weights and runs verify_metadata in its folder."""
    dist, folder = tmp_path_factory.mktemp("dist"), tmp_path_factory.mktemp("downloads")
    releases, steps = {}, [["start_in", str(folder)]]
    schemas = ["components/release/schema/bundle_metadata.schema.json"] + ([str(PUBLISHED_SCHEMA)] if PUBLISHED_SCHEMA.is_file() else [])
    for name in BUNDLES:
        root = _copy_bundle(name, tmp_path_factory.mktemp("src"))
        (root / "models").mkdir()
        state = _fake_trained_state(NETWORKS[name]())
        torch.save(state, root / "models" / "model.pt")
        zip_path = pkg.package_bundle(root, dist, release_url=dist.as_uri())
        releases[name] = Release(zip_path, root / "models" / "model.pt", state)
        version = _metadata(name)["version"]
        steps += [["cli", "monai.bundle", ["download", "--name", name, "--version", version, "--url", zip_path.as_uri(),
                                           "--bundle_dir", str(folder)]],
                  ["start_in", str(folder / name)],
                  ["cli", "monai.bundle", ["download_large_files"]]]  # fmt: skip
        steps += [["cli", "monai.bundle", ["verify_metadata", "--meta_file", "configs/metadata.json", "--filepath", s]]
                  for s in schemas]  # fmt: skip
        steps += [["start_in", str(folder)]]
    proc = _run([venv.python, "-c", DRIVER, json.dumps(steps)], folder, _env(PYTHONPATH=str(venv.tools)))
    return Downloads(folder, releases, _ok(proc, "download, download_large_files and verify_metadata"))


@dataclass(frozen=True)
class BundleRun:
    folder: Path  # the downloaded bundle
    release: Release
    loaded: Path  # <workflow_type>.pt: the state dicts monai.bundle.load returned
    output: str
    returncode: int


@pytest.fixture(scope="module")
def bundle_run(venv, downloads, tmp_path_factory) -> Callable[[str], BundleRun]:
    """The per-bundle venv process (run once per bundle, on first use), started in the downloaded bundle's folder."""
    done: dict[str, BundleRun] = {}

    def get(name: str) -> BundleRun:
        if name not in done:
            folder = downloads.folder / name
            loaded = tmp_path_factory.mktemp(f"loaded_{name}")
            logs = ["--meta_file", "configs/metadata.json", "--logging_file", "configs/logging.conf"]
            steps = [["start_in", str(folder)],
                     ["cli", "components", ["synth", "--kind", KIND[name], "--num", "3", "--out", "data", "--seed", "0"]],
                     ["cli", "monai.bundle", ["verify_net_in_out", "--net_id", "network_def", "--config_file",
                                              "configs/inference.json", "--meta_file", "configs/metadata.json",
                                              "--device", "cpu", "--n", "1", "--p", "1", "--any", "1",
                                              *_overrides(NET_IN_OUT.get(name, {}))]],
                     ["load", name, str(downloads.folder), "train", str(loaded / "train.pt")],
                     ["load", name, str(downloads.folder), "inference", str(loaded / "inference.pt")]]  # fmt: skip
            if name in INFER:
                steps.append(["cli", "monai.bundle", ["run", "--config_file", "configs/inference.json", *logs,
                                                      *_overrides({**CPU, **INFER[name]})]])  # fmt: skip
            steps.append(["cli", "monai.bundle", ["run", "--config_file", TRAIN_FILES, *logs,
                                                  *_overrides({**TRAIN_COMMON, **TRAIN[name]})]])  # fmt: skip
            proc = _run([venv.python, "-c", DRIVER, json.dumps(steps)], folder, _env())
            done[name] = BundleRun(folder, downloads.releases[name], loaded, proc.stdout, proc.returncode)
        return done[name]

    return get


def _ran(run: BundleRun) -> str:
    assert run.returncode == 0, f"the bundle process in {run.folder} exited {run.returncode}:\n{run.output[-6000:]}"
    return run.output


@pytest.mark.parametrize("name", BUNDLES)
def test_download_passes_the_model_zoo_metadata_check(name, downloads):
    """The zip (no weights in it) extracts to <bundle_dir>/<name>/ with its components/ and large_files.yml, and
    download_large_files brings the packaged weights; verify_metadata passes against each schema (the carried one,
    and MONAI's published one when present) with no bundle code imported."""
    folder = downloads.folder / name
    release = downloads.releases[name]
    with zipfile.ZipFile(release.zip_path) as zf:
        assert not [n for n in zf.namelist() if n.startswith(f"{name}/models/")]
    assert (folder / "components" / "__init__.py").is_file() and (folder / "configs" / "metadata.json").is_file()
    segment = downloads.output.split(f"STEP start_in {folder}\n", 1)[1].split("STEP start_in", 1)[0]
    schemas = 2 if PUBLISHED_SCHEMA.is_file() else 1
    assert segment.count("metadata is verified with no error.") == schemas, segment[-3000:]
    assert _imported(downloads.output)["components"] is None  # download and the metadata checks import no bundle code

    listed = (folder / pkg.LARGE_FILES).read_text()
    digest = hashlib.sha256((folder / "models" / "model.pt").read_bytes()).hexdigest()
    assert re.findall(r'hash_val: "([0-9a-f]{64})"', listed) == [digest] == [pkg.sha256_file(release.weights)]
    assert re.findall(r'path: "([^"]+)"', listed) == ["models/model.pt"]


def test_a_downloaded_bundle_runs_from_another_folder_when_bundle_root_names_it(venv, downloads, tmp_path):
    """Downloaded as the docs say and run as users run bundles from their own project folders and job scripts:
    ``python -m monai.bundle run --config_file "['D/N/configs/common.json','D/N/configs/train.json']" --bundle_root D/N
    ...`` from another folder.
    MONAI puts the bundle folder on sys.path only in ``run()``, after ``initialize``, and the bundle stopped at its
    first expression ("start Python in the bundle folder"); its ``initialize`` now puts ``bundle_root`` first on
    sys.path. The run imports the bundle's own components, writes its model and checkpoint into the bundle and
    nothing into the working directory."""
    project, bundle_dir, data = tmp_path / "project", tmp_path / "bundles", tmp_path / "data"
    project.mkdir()
    write_dataset(data, kind="ct", num=3, seed=0)
    release = downloads.releases[BTCV]
    _ok(_run([venv.python, "-m", "monai.bundle", "download", "--name", BTCV, "--url", release.zip_path.as_uri(),
              "--bundle_dir", bundle_dir], project, _env()), "download")  # fmt: skip
    root = bundle_dir / BTCV
    assert sorted(p.name for p in project.iterdir()) == []
    files = json.dumps([str(root / "configs" / f) for f in ("common.json", "train.json")])
    cmd = [venv.python, "-m", "monai.bundle", "run", "--config_file", files, "--bundle_root",
           root, "--meta_file", root / "configs" / "metadata.json", "--logging_file", root / "configs" / "logging.conf",
           *_overrides({**TRAIN_COMMON, **TRAIN[BTCV], "dataset_dir": str(data)})]  # fmt: skip
    out = _ok(_run(cmd, project, _env()), "the bundle run from another folder")
    carried = root.resolve() / "components"
    assert f"components.release.origin - INFO - components {components.__version__} from {carried}" in out
    assert (root / "models" / "model.pt").is_file() and (root / "models" / "checkpoint.pt").is_file()
    assert sorted(p.name for p in project.iterdir()) == [], "the run wrote into the working directory"


@pytest.mark.parametrize("name", BUNDLES)
def test_the_bundle_runs_its_own_components(name, bundle_run):
    """Every command imported the bundle's components/ (its report says so, with no warning) and nothing from this
    repository; the synthetic data came from the bundle's own `python -m components synth`."""
    run = bundle_run(name)
    out = _ran(run)
    carried = (run.folder / "components").resolve()
    assert f"components.release.origin - INFO - components {components.__version__} from {carried}" in out
    assert "components.release.origin - WARNING" not in out
    imported = _imported(out)
    assert imported["components"] == str(carried / "__init__.py")
    assert not [f for f in imported["files"] if f.startswith(str(REPO) + os.sep)], "a module came from the repository"
    assert "data shape of network is verified with no error." in out
    assert (run.folder / "data" / "dataset.json").is_file()


@pytest.mark.parametrize("name", BUNDLES)
def test_monai_bundle_load_returns_every_packaged_tensor(name, bundle_run):
    run = bundle_run(name)
    _ran(run)
    expected = run.release.state
    for workflow_type in ("train", "inference"):
        got = torch.load(run.loaded / f"{workflow_type}.pt", map_location="cpu", weights_only=True)
        assert got.keys() == expected.keys(), workflow_type
        different = [k for k in expected if not torch.equal(got[k], expected[k])]
        assert not different, f"{workflow_type}: {len(different)} of {len(expected)} tensors differ, e.g. {different[:3]}"


@pytest.mark.parametrize("name", BUNDLES)
def test_one_training_iteration(name, bundle_run):
    run = bundle_run(name)
    _ran(run)
    checkpoint = torch.load(run.folder / "models" / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert (checkpoint["trainer"]["epoch"], checkpoint["trainer"]["iteration"]) == (1, 1)


@pytest.mark.parametrize("name", FINETUNING)
def test_inference_writes_a_segmentation_of_the_input_shape(name, bundle_run):
    run = bundle_run(name)
    _ran(run)
    case = json.loads((run.folder / "data" / "dataset.json").read_text())["test"][0]
    source = nib.load(run.folder / "data" / case["image"])
    stem = Path(case["image"]).name.split(".")[0]
    seg = nib.load(run.folder / "eval" / "segmentations" / f"{stem}_seg.nii.gz")
    assert seg.shape == source.shape[:3]
