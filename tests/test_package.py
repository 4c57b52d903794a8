"""Release and reuse: reproducible packaging, MONAI download / load of the package, hash-checked fetch, safe
extraction, finetuning from downloaded weights, MLflow tracking and the command line (components.release.package).

Everything works on copies under tmp_path; nothing is written into bundles/."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import fire
import pytest
import torch
from monai.networks.nets import SwinUNETR

import components
from components.release import download as fetching
from components.release import package as pkg
from components.__main__ import COMMANDS
from components.release.origin import package_source
from components.demo.runner import BUNDLES_DIR, bundle_command

pytestmark = [
    pytest.mark.filterwarnings("ignore:parsing config_file:UserWarning"),  # MONAI's notice for every config parse
    pytest.mark.filterwarnings("ignore:No hash value provided:UserWarning"),  # what fetch exists for
    pytest.mark.filterwarnings("ignore::DeprecationWarning:mlflow"),
    pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy:DeprecationWarning"),
]

REPO = Path(__file__).resolve().parents[1]
SSL = "swin_unetr_ssl_pretrain"
DINO = "swin_unetr_dino_pretrain"
BTCV = "swin_unetr_btcv_finetune"
FS = 12  # feature size of the tiny models

# files a bundle folder accumulates that must never be released (relative to the bundle root)
JUNK = [
    "eval/events.out.tfevents.1700000000.host.1.0",
    "eval/reconstructions/case_000_recon.nii.gz",
    "eval/mlruns.db",
    "data/dataset.json",
    "logs/train.log",
    "runs/x/events.out.tfevents.1",
    "mlruns/0/meta.yaml",
    "dist/old_v0.0.1.zip",
    "models/checkpoint.pt",
    "models/.model.pt.1234.tmp",
    "models/old/model.pt",
    "configs/__pycache__/x.cpython-311.pyc",
    "configs/notes.tmp",
    "configs/events.out.tfevents.2",
    "docs/.README.md.swp",
    "docs/README.md~",
    ".DS_Store",
    "train.log",
    "stray.pyc",
]


def _run(cmd: list[str], timeout: int = 600, **kwargs) -> str:
    env = dict(os.environ, PAGER="cat", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO, **kwargs)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{out[-4000:]}"
    return out


def _fake_trained_state(net: torch.nn.Module | None = None) -> dict[str, torch.Tensor]:
    """``net``'s (default SSLHead(feature_size=12)) weights that no fresh initialisation reproduces (as if trained)."""
    gen = torch.Generator().manual_seed(1234)
    net = net or components.SSLHead(feature_size=FS)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return {k: v.clone() for k, v in net.state_dict().items()}


@pytest.fixture(scope="module")
def fake_state() -> dict[str, torch.Tensor]:
    return _fake_trained_state()


def _copy_bundle(name: str, dst: Path) -> Path:
    """Copies the release files of bundles/<name> (what the repository tracks) to dst/<name>."""
    src = BUNDLES_DIR / name
    root = dst / name
    for rel in pkg.bundle_files(src, include_weights=False):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / rel, root / rel)
    return root


@pytest.fixture(scope="module")
def ssl_copy(tmp_path_factory, fake_state) -> Path:
    """A copy of the SSL bundle with tiny 'trained' weights in models/model.pt and junk everywhere."""
    root = _copy_bundle(SSL, tmp_path_factory.mktemp("src"))
    (root / "models").mkdir()
    torch.save(fake_state, root / "models" / "model.pt")
    for rel in JUNK:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"junk " + rel.encode())
    return root


@pytest.fixture(scope="module")
def packaged(ssl_copy, tmp_path_factory) -> Path:
    return pkg.package_bundle(ssl_copy, tmp_path_factory.mktemp("dist"))


def _version(root: Path) -> str:
    return json.loads((root / "configs" / "metadata.json").read_text())["version"]


# ------------------------------------------------------------------------------------------------------------
# packaging


def test_package_is_reproducible_with_sha256_file(ssl_copy, packaged, tmp_path):
    assert packaged.name == f"{SSL}_v{_version(ssl_copy)}.zip"
    digest = hashlib.sha256(packaged.read_bytes()).hexdigest()
    sidecar = packaged.with_name(packaged.name + ".sha256")
    assert sidecar.read_text() == f"{digest}  {packaged.name}\n"  # sha256sum format

    # same files, new timestamps and permissions, another folder and time: the same bytes
    for path in ssl_copy.rglob("*"):
        if path.is_file():
            os.utime(path, (1_900_000_000, 1_900_000_000))
            path.chmod(0o600)
    again = pkg.package_bundle(ssl_copy, tmp_path / "dist2")
    assert again.read_bytes() == packaged.read_bytes()
    assert again.with_name(again.name + ".sha256").read_text() == sidecar.read_text()
    assert not [p.name for p in again.parent.iterdir() if p.name.endswith(".tmp")]

    with zipfile.ZipFile(packaged) as zf:
        infos = zf.infolist()
    names = [i.filename for i in infos]
    assert names == sorted(names)
    assert all(n.startswith(f"{SSL}/") for n in names)
    for info in infos:
        assert info.date_time == pkg.ZIP_DATE_TIME
        assert info.extra == b"" and info.comment == b""
        mode = info.external_attr >> 16
        assert mode == (0o040755 if info.is_dir() else 0o100644), (info.filename, oct(mode))


def test_package_includes_weights_and_excludes_outputs(ssl_copy, packaged, fake_state):
    with zipfile.ZipFile(packaged) as zf:
        files = sorted(n[len(SSL) + 1 :] for n in zf.namelist() if not n.endswith("/"))
        weights = torch.load(zf.open(f"{SSL}/models/model.pt"), map_location="cpu", weights_only=True)
    tracked = pkg.bundle_files(BUNDLES_DIR / SSL, include_weights=False)
    carried = [f"components/{rel}" for rel in package_source()]
    assert files == sorted(tracked + ["models/model.pt"] + carried)  # no large_files.yml without a release URL
    for rel in JUNK:
        assert rel not in files
    assert weights.keys() == fake_state.keys()
    assert all(torch.equal(weights[k], fake_state[k]) for k in fake_state)


def test_bundle_files_include_an_exported_program_but_not_training_state(tmp_path):
    """``python -m components export`` writes models/model.pt2: a release carries it; checkpoint.pt stays out."""
    root = _copy_bundle(BTCV, tmp_path / "src")
    (root / "models").mkdir()
    for name in ("model.pt", "model.pt2", "checkpoint.pt"):
        (root / "models" / name).write_bytes(b"x")
    files = pkg.bundle_files(root)
    assert "models/model.pt2" in files and "models/model.pt" in files and "models/checkpoint.pt" not in files


def test_package_without_weights_and_metadata_checks(tmp_path):
    root = _copy_bundle(SSL, tmp_path / "src")
    z = pkg.package_bundle(root, tmp_path / "dist")
    with zipfile.ZipFile(z) as zf:
        assert not [n for n in zf.namelist() if "/models/" in n]

    meta_file = root / "configs" / "metadata.json"
    meta = json.loads(meta_file.read_text())

    def package_with(changes: dict | None) -> None:
        if changes is None:
            meta_file.unlink()
        else:
            meta_file.write_text(json.dumps({**meta, **changes}, indent=4))
        pkg.package_bundle(root, tmp_path / "bad")

    with pytest.raises(ValueError, match="no 'version'"):
        package_with({"version": None})
    with pytest.raises(ValueError, match="not a semantic version"):
        package_with({"version": "1.0"})
    with pytest.raises(ValueError, match="no entry in 'changelog'"):
        package_with({"version": "9.9.9"})
    with pytest.raises(FileNotFoundError, match="metadata.json"):
        package_with(None)
    assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").iterdir())
    with pytest.raises(FileNotFoundError, match="no bundle folder"):
        pkg.package_bundle(tmp_path / "nope", tmp_path / "bad")


def test_bundle_files_refuses_symlinks(tmp_path):
    root = _copy_bundle(SSL, tmp_path)
    (root / "docs" / "link.md").symlink_to(root / "docs" / "README.md")
    with pytest.raises(ValueError, match="symbolic link"):
        pkg.bundle_files(root)


def test_package_carries_the_running_components_source(packaged):
    """The zip holds the running package's modules and schema, byte for byte, under <name>/components/ (what its
    configs import when run from the bundle folder), and no cache or compiled file."""
    with zipfile.ZipFile(packaged) as zf:
        carried = {n[len(f"{SSL}/components/") :]: zf.read(n) for n in zf.namelist()
                   if n.startswith(f"{SSL}/components/") and not n.endswith("/")}  # fmt: skip
    package = Path(components.__file__).resolve().parent
    assert sorted(carried) == package_source(package)
    assert {"__init__.py", "release/origin.py", "release/package.py", "release/schema/bundle_metadata.schema.json"} <= set(carried)
    assert {"checkpoint/__init__.py", "recipes/self_distillation/__init__.py"} <= set(carried)  # sub-packages too
    assert not [n for n in carried if "__pycache__" in n or n.endswith(".pyc") or "/." in f"/{n}"]
    different = [n for n, data in carried.items() if data != (package / n).read_bytes()]
    assert not different, different


def test_package_refuses_a_components_copy_kept_in_the_bundle(tmp_path):
    root = _copy_bundle(SSL, tmp_path / "src")
    (root / "components").mkdir()
    (root / "components" / "__init__.py").write_text('__version__ = "0.0.1"\n')
    with pytest.raises(ValueError, match=r"components exists: a package carries the components package copied from"):
        pkg.package_bundle(root, tmp_path / "dist")
    assert not (tmp_path / "dist").exists()


@pytest.fixture(scope="module")
def released(ssl_copy, tmp_path_factory) -> tuple[Path, str]:
    """The SSL package made with a release URL: the dist folder itself, as a file:// URL (where the assets lie)."""
    dist = tmp_path_factory.mktemp("release")
    return pkg.package_bundle(ssl_copy, dist, release_url=dist.as_uri() + "/"), dist.as_uri()


def test_a_release_zip_holds_large_files_yml_and_no_weights(ssl_copy, released, fake_state):
    """With a release URL the weights stay out of the zip (as in the Model Zoo): large_files.yml names
    models/model.pt with its URL among the release's files and its SHA-256, and the file is written beside the zip
    under that name."""
    zip_path, url = released
    with zipfile.ZipFile(zip_path) as zf:
        names = zf.namelist()
        listed = zf.read(f"{SSL}/{pkg.LARGE_FILES}").decode()
    assert not [n for n in names if n.startswith(f"{SSL}/models/")], names
    weights = (ssl_copy / "models" / "model.pt").read_bytes()
    asset = zip_path.with_name(pkg.release_asset_name(SSL, _version(ssl_copy), "models/model.pt"))
    assert asset.name == f"{SSL}_v{_version(ssl_copy)}_model.pt"
    assert listed == (
        "large_files:\n"
        '  - path: "models/model.pt"\n'
        f'    url: "{url}/{asset.name}"\n'
        f'    hash_val: "{hashlib.sha256(weights).hexdigest()}"\n'
        '    hash_type: "sha256"\n'
    )
    assert asset.read_bytes() == weights
    state = torch.load(asset, map_location="cpu", weights_only=True)
    assert all(torch.equal(state[k], fake_state[k]) for k in fake_state)


def test_monai_download_then_download_large_files_gives_the_weights(ssl_copy, released, fake_state, tmp_path):
    """The Model Zoo's route for a release made with a release URL: `monai.bundle download --url` extracts a bundle
    without weights, `monai.bundle download_large_files` (MONAI reads large_files.yml with pyyaml) downloads
    models/model.pt and checks its SHA-256, and monai.bundle.load then returns every packaged tensor."""
    import monai.bundle

    zip_path, _ = released
    d = tmp_path / "D"
    monai.bundle.download(name=SSL, url=zip_path.as_uri(), bundle_dir=str(d), progress=False)
    folder = d / SSL
    assert (folder / pkg.LARGE_FILES).is_file() and not (folder / "models").exists()
    monai.bundle.download_large_files(bundle_path=str(folder))
    digest = pkg.sha256_file(folder / "models" / "model.pt")
    assert digest == pkg.sha256_file(ssl_copy / "models" / "model.pt")
    assert f'hash_val: "{digest}"' in (folder / pkg.LARGE_FILES).read_text()
    net = monai.bundle.load(name=SSL, bundle_dir=d, workflow_type="inference", device="cpu", progress=False)
    _assert_same(net, fake_state)

    # a changed weight file fails MONAI's hash check: the hash is checked, not only the name
    (folder / "models" / "model.pt").unlink()
    asset = zip_path.with_name(f"{zip_path.stem}_model.pt")
    original = asset.read_bytes()
    asset.write_bytes(original + b"x")
    # MONAI 1.5 raises RuntimeError("sha256 check of ..."), 1.6 its HashCheckError, a ValueError ("sha256 hash check")
    try:
        with pytest.raises((RuntimeError, ValueError), match="sha256 (hash )?check of downloaded file failed"):
            monai.bundle.download_large_files(bundle_path=str(folder))
    finally:
        asset.write_bytes(original)


def test_fetch_bundle_downloads_the_large_files(ssl_copy, released, tmp_path):
    """`fetch` of a release made with a release URL gives a whole bundle: the weights large_files.yml lists are
    downloaded and hash-checked before the bundle folder appears; a changed weight file fails naming the file and
    both hashes, and leaves no bundle folder, no zip and no temporary file."""
    zip_path, _ = released
    folder = fetching.fetch_bundle(zip_path.as_uri(), tmp_path / "D")
    expected = pkg.sha256_file(ssl_copy / "models" / "model.pt")
    assert pkg.sha256_file(folder / "models" / "model.pt") == expected

    asset = zip_path.with_name(f"{zip_path.stem}_model.pt")
    original = asset.read_bytes()
    asset.write_bytes(original + b"x")
    try:
        with pytest.raises(fetching.HashMismatchError) as error:
            fetching.fetch_bundle(zip_path.as_uri(), tmp_path / "E")
        actual = pkg.sha256_file(asset)
    finally:
        asset.write_bytes(original)
    assert str(error.value).startswith(f"sha256 of {asset.as_uri()} is {actual}, not the expected {expected}; ")
    assert list((tmp_path / "E").iterdir()) == []


def test_release_url_must_be_a_url(ssl_copy, tmp_path):
    for bad in ("dist/releases", "s3://bucket/tag", "https://"):
        with pytest.raises(ValueError, match="is not an http"):
            pkg.package_bundle(ssl_copy, tmp_path / "dist", release_url=bad)
    assert not (tmp_path / "dist").exists()


# ------------------------------------------------------------------------------------------------------------
# MONAI download / load of the package (offline)


def _assert_same(net: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    got = net.state_dict()
    assert got.keys() == state.keys()
    different = [k for k in state if not torch.equal(got[k].cpu(), state[k])]
    assert not different, f"{len(different)} tensors differ from the packaged weights, e.g. {different[:3]}"


def _load_each_workflow(name: str, bundle_dir: Path, network_type: type, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """``monai.bundle.load`` of the train and the inference config: each returns ``network_type`` holding ``state``;
    returns the inference one."""
    import monai.bundle

    for workflow_type in ("train", "inference"):
        net = monai.bundle.load(
            name=name, bundle_dir=bundle_dir, source="github", repo="owner/repo/v0", workflow_type=workflow_type,
            device="cpu", progress=False,
        )
        assert isinstance(net, network_type)
        _assert_same(net, state)
    return net


def test_monai_download_url_then_load(ssl_copy, packaged, fake_state, tmp_path):
    """`python -m monai.bundle download --name N --url file://...zip` extracts to D/N/; monai.bundle.load builds
    network_def from configs/<workflow_type>.json and loads the packaged weights, without network."""
    d = tmp_path / "D"
    url = packaged.as_uri()  # file:///...; MONAI rejects a path without a scheme
    _run([sys.executable, "-m", "monai.bundle", "download", "--name", SSL, "--url", url, "--bundle_dir", str(d)])
    assert (d / SSL / "configs" / "metadata.json").is_file()
    assert (d / SSL / "models" / "model.pt").read_bytes() == (ssl_copy / "models" / "model.pt").read_bytes()

    net = _load_each_workflow(SSL, d, components.SSLHead, fake_state)
    assert net.output == "reconstruction"  # inference.json's network_def


def test_dino_bundle_packages_and_loads_its_teacher_encoder(tmp_path):
    """The self-distillation bundle's release: its models/model.pt (the teacher encoder, swinViT.* keys) comes back
    through `monai.bundle download --url` and monai.bundle.load, for the train and the inference config alike,
    into the embedding net with every tensor (the trained student with its head is not network_def)."""
    root = _copy_bundle(DINO, tmp_path / "src")
    state = _fake_trained_state(components.SwinViTEmbedding(feature_size=FS))
    assert all(k.startswith("swinViT.") for k in state)
    (root / "models").mkdir()
    torch.save(state, root / "models" / "model.pt")
    packaged = pkg.package_bundle(root, tmp_path / "dist")
    assert packaged.name == f"{DINO}_v{_version(root)}.zip"
    d = tmp_path / "D"
    _run([sys.executable, "-m", "monai.bundle", "download", "--name", DINO, "--url", packaged.as_uri(), "--bundle_dir", str(d)])
    _load_each_workflow(DINO, d, components.SwinViTEmbedding, state)


def _perturbed(net: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return {k: v.clone() for k, v in net.state_dict().items()}


# a tiny 'trained' network of each bundle, of another size than the configs' default 48
LOADED = {
    SSL: lambda: components.SSLHead(feature_size=FS),
    BTCV: lambda: SwinUNETR(in_channels=1, out_channels=14, feature_size=FS),
    "swin_unetr_brats_finetune": lambda: SwinUNETR(in_channels=4, out_channels=3, feature_size=FS),
}


@pytest.mark.parametrize("name", sorted(LOADED))
def test_monai_bundle_load_returns_every_packaged_tensor(name, tmp_path, monkeypatch):
    """As the READMEs show it: package, fetch, then ``monai.bundle.load(name=..., bundle_dir=..., workflow_type=...,
    source="github", repo=..., version=...)`` with no net_override. The packaged configs take the network sizes
    from the weights, so every tensor comes back (MONAI alone would load 19 of 142 and say so only at INFO).
    Loading for inference applies no allocator tuning in the caller's process (inference.json's tune_allocator is
    off); train.json builds the same network with every weight."""
    import monai.bundle

    build = LOADED[name]
    root = _copy_bundle(name, tmp_path / "src")
    (root / "models").mkdir()
    state = _perturbed(build(), seed=len(name))
    torch.save(state, root / "models" / "model.pt")
    zip_path = pkg.package_bundle(root, tmp_path / "dist")
    version = _version(root)
    assert zip_path.name == f"{name}_v{version}.zip"
    with zipfile.ZipFile(zip_path) as zf:
        inference = json.loads(zf.read(f"{name}/configs/inference.json"))
    assert inference["feature_size"] == FS and inference["speed"]["tune_allocator"] is False
    fetching.fetch_bundle(zip_path.as_uri(), tmp_path / "downloads")

    tuned = []
    monkeypatch.setattr(components, "tune_allocator", lambda enabled=True, **kw: tuned.append(enabled) or False)
    for kind in ("inference", "train"):
        net = monai.bundle.load(
            name=name, bundle_dir=tmp_path / "downloads", workflow_type=kind, source="github", repo="owner/repo/v0",
            version=version, device="cpu", progress=False,
        )
        _assert_same(net, state)
        if kind == "inference":  # train.json tunes by default: it is the training process's own setting
            assert tuned == [False], "loading a bundle tuned the allocator of the caller's process"


@pytest.mark.parametrize("name", [SSL, BTCV])
def test_a_v2_model_packages_and_loads_whole(name, tmp_path):
    """SwinUNETR v2 weights (residual blocks layers1c..): the packaged configs take network_def#use_v2 true from
    them, and monai.bundle.load returns every tensor."""
    import monai.bundle

    build = {SSL: lambda: components.SSLHead(feature_size=FS, use_v2=True),
             BTCV: lambda: SwinUNETR(in_channels=1, out_channels=14, feature_size=FS, use_v2=True)}[name]  # fmt: skip
    root = _copy_bundle(name, tmp_path / "src")
    (root / "models").mkdir()
    state = _perturbed(build(), seed=3)
    torch.save(state, root / "models" / "model.pt")
    zip_path = pkg.package_bundle(root, tmp_path / "dist")
    with zipfile.ZipFile(zip_path) as zf:
        assert json.loads(zf.read(f"{name}/configs/inference.json"))["network_def"]["use_v2"] is True
    fetching.fetch_bundle(zip_path.as_uri(), tmp_path / "downloads")
    net = monai.bundle.load(name=name, bundle_dir=tmp_path / "downloads", workflow_type="inference", source="github",
                            repo="owner/repo/v0", version=_version(root), device="cpu", progress=False)  # fmt: skip
    _assert_same(net, state)


def test_package_refuses_weights_the_configs_cannot_hold(tmp_path):
    """Weights of another decoder than the config's ``upsample``: no size id can fix that, so packaging fails
    naming the config and tensors instead of publishing a bundle that loads partly random."""
    root = _copy_bundle(SSL, tmp_path / "src")
    (root / "models").mkdir()
    torch.save(components.SSLHead(feature_size=FS, upsample="deconv").state_dict(), root / "models" / "model.pt")
    with pytest.raises(ValueError, match=r"configs/inference.json: network_def does not hold exactly the tensors"):
        pkg.package_bundle(root, tmp_path / "dist")
    assert not (tmp_path / "dist").exists() or not list((tmp_path / "dist").iterdir())


def test_package_refuses_weights_with_another_number_of_classes(tmp_path):
    """A segmentation bundle's outputs are its label_names: weights of 3 classes in the 14-name CT bundle fail
    naming label_names and both counts, before anything is written."""
    root = _copy_bundle(BTCV, tmp_path / "src")
    (root / "models").mkdir()
    torch.save(SwinUNETR(in_channels=1, out_channels=3, feature_size=FS).state_dict(), root / "models" / "model.pt")
    with pytest.raises(ValueError, match=r"configs/inference.json: label_names has 14 names, models/model.pt has 3 "
                                         r"output channels \(out.conv.conv.weight\)"):
        pkg.package_bundle(root, tmp_path / "dist")
    assert not (tmp_path / "dist").exists() or not list((tmp_path / "dist").iterdir())


def _packaged_metadata(zip_path: Path, name: str) -> dict:
    with zipfile.ZipFile(zip_path) as zf:
        return json.loads(zf.read(f"{name}/configs/metadata.json"))


def test_package_records_the_exported_program_in_the_metadata(exported_btcv, tmp_path):
    """A release with models/model.pt2 says in configs/metadata.json what the program takes, read from the program
    (the metadata's network_data_format says 64*n, the program takes its one ROI), and which model.pt it came from;
    the metadata still passes the collection's schema and MONAI's published one (when present). Without a .pt2 the
    key is absent."""
    from monai.bundle import verify_metadata

    bundle = exported_btcv.bundle  # tests/conftest.py: the CT bundle with weights and their exported program
    zip_path = pkg.package_bundle(bundle, tmp_path / "dist")
    meta = _packaged_metadata(zip_path, BTCV)
    assert meta["exported_program"] == {
        "file": "models/model.pt2",
        "input_shape": ["dynamic", 1, 64, 32, 32],
        "dtype": "float32",
        "exported_from": "models/model.pt",
        "exported_from_sha256": pkg.sha256_file(bundle / "models" / "model.pt"),
    }
    repository_meta = json.loads((bundle / "configs" / "metadata.json").read_text())
    assert {k: v for k, v in meta.items() if k not in ("exported_program", "eval_metrics")} == {
        k: v for k, v in repository_meta.items() if k != "eval_metrics"
    }
    packaged_meta = tmp_path / "metadata.json"
    packaged_meta.write_text(json.dumps(meta))
    published = Path(os.environ.get("BUNDLE_SCHEMA_PATH") or REPO.parent / "shared" / "bundle-schema" / pkg.SCHEMA_NAME)
    for schema in [pkg.metadata_schema()] + ([published] if published.is_file() else []):
        verify_metadata(meta_file=str(packaged_meta), filepath=str(schema))

    without = tmp_path / "without" / BTCV
    shutil.copytree(bundle, without, ignore=shutil.ignore_patterns("model.pt2"))
    assert "exported_program" not in _packaged_metadata(pkg.package_bundle(without, tmp_path / "dist2"), BTCV)


def test_package_refuses_an_exported_program_of_other_weights(exported_btcv, tmp_path):
    """model.pt retrained (or replaced) after the export: the .pt2 would compute with the old weights. Packaging
    fails with one line naming the file and the export command, before anything is written; so does a program that
    records no weights (exported before the record existed, or by other code)."""
    root = tmp_path / "src" / BTCV
    shutil.copytree(exported_btcv.bundle, root)
    torch.save(_perturbed(LOADED[BTCV](), seed=6), root / "models" / "model.pt")
    program = root / "models" / "model.pt2"
    with pytest.raises(ValueError) as stale:
        pkg.package_bundle(root, tmp_path / "dist")
    with torch.no_grad():
        torch.export.save(torch.export.export(torch.nn.Linear(2, 2), (torch.zeros(2, 2),)), program)
    with pytest.raises(ValueError) as unrecorded:
        pkg.package_bundle(root, tmp_path / "dist")
    for error, why in ((stale, "was exported from weights of sha256 "), (unrecorded, "records no weights")):
        message = str(error.value)
        assert "\n" not in message and message.startswith(f"{program}: ") and why in message, message
        assert f"python -m components export {root}" in message, message
    assert not (tmp_path / "dist").exists() or not list((tmp_path / "dist").iterdir())


def _evaluation_record(bundle: Path, seed: int) -> dict:
    """Writes bundle/eval/metrics.json as configs/evaluate.json's PerClassMetrics does after evaluating
    models/model.pt (per-image, per-organ Dice of 2 images, one organ absent from both), and returns it."""
    from ignite.engine import Engine, Events

    organs = json.loads((bundle / "configs" / "inference.json").read_text())["label_names"][1:]
    dice = torch.rand(2, len(organs), generator=torch.Generator().manual_seed(seed))
    dice[:, 3] = float("nan")
    engine = Engine(lambda engine, batch: None)

    @engine.on(Events.EPOCH_COMPLETED)
    def measured(engine: Engine) -> None:  # what MeanDice(save_details=True) leaves in the state
        engine.state.metric_details = {"val_mean_dice": dice}
        engine.state.metrics["val_mean_dice"] = float(dice.nanmean(dim=1).mean())

    record = bundle / "eval" / "metrics.json"
    handler = components.PerClassMetrics("val_mean_dice", organs, json_path=record, weights=bundle / "models" / "model.pt")
    handler.attach(engine)
    engine.run([0])
    return json.loads(record.read_text())


def test_package_takes_eval_metrics_from_the_record_of_the_packaged_weights(tmp_path, caplog):
    """eval_metrics of a release are the numbers measured on its weights: the evaluation record names the SHA-256 of
    the weights it evaluated, and packaging those weights copies the record's mean and per-organ Dice; packaging
    other weights (trained again after the evaluation) writes {} with a WARNING naming the record and both hashes."""
    root = _copy_bundle(BTCV, tmp_path / "src")
    (root / "models").mkdir()
    torch.save(_perturbed(LOADED[BTCV](), seed=7), root / "models" / "model.pt")
    record = _evaluation_record(root, seed=0)
    measured = pkg.sha256_file(root / "models" / "model.pt")
    assert record["weights"] == {"file": str(root / "models" / "model.pt"), "sha256": measured}
    caplog.set_level(logging.INFO, logger="components.release.package")
    metrics = _packaged_metadata(pkg.package_bundle(root, tmp_path / "dist"), BTCV)["eval_metrics"]
    assert metrics == {"val_mean_dice": record["mean"], **record["per_class"]}
    assert len(metrics) == 14 and metrics["gallbladder"] is None and 0 < metrics["val_mean_dice"] < 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]

    torch.save(_perturbed(LOADED[BTCV](), seed=8), root / "models" / "model.pt")
    assert _packaged_metadata(pkg.package_bundle(root, tmp_path / "dist2"), BTCV)["eval_metrics"] == {}
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    record_file = root / "eval" / "metrics.json"
    assert f"{record_file} measured weights of sha256 {measured}, not models/model.pt " in warning
    assert f"(sha256 {pkg.sha256_file(root / 'models' / 'model.pt')})" in warning


def test_package_never_copies_the_repository_eval_metrics(tmp_path, caplog):
    """The bundle's metadata held the demo's synthetic Dice: a release of any weights carried it. Without a record of
    the packaged weights the release's eval_metrics are {} and a WARNING says why."""
    root = _copy_bundle(BTCV, tmp_path / "src")
    meta_file = root / "configs" / "metadata.json"
    demo = {"demo_dice": 0.793}
    meta_file.write_text(json.dumps({**json.loads(meta_file.read_text()), "eval_metrics": demo}, indent=4))
    (root / "models").mkdir()
    torch.save(_perturbed(LOADED[BTCV](), seed=7), root / "models" / "model.pt")
    caplog.set_level(logging.WARNING, logger="components.release.package")
    assert _packaged_metadata(pkg.package_bundle(root, tmp_path / "dist"), BTCV)["eval_metrics"] == {}
    (warning,) = [r.getMessage() for r in caplog.records]
    assert f"no evaluation record at {root / 'eval' / 'metrics.json'}" in warning


def test_github_source_is_offline_when_zip_present(packaged, fake_state, tmp_path, monkeypatch):
    """`--source github --repo owner/repo/tag --version X` resolves <name>_v<X>.zip and skips the download when
    that zip is already in bundle_dir (sockets are disabled here to prove it)."""
    d = tmp_path / "D"
    d.mkdir()
    shutil.copyfile(packaged, d / packaged.name)

    def no_network(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    import monai.bundle

    version = packaged.name[len(SSL) + 2 : -len(".zip")]
    monai.bundle.download(name=SSL, version=version, bundle_dir=d, source="github", repo="owner/repo/v0")
    assert (d / SSL / "models" / "model.pt").is_file()
    shutil.rmtree(d / SSL)
    net = monai.bundle.load(
        name=SSL, version=version, bundle_dir=d, source="github", repo="owner/repo/v0", workflow_type="train",
        device="cpu", progress=False,
    )
    _assert_same(net, fake_state)


# ------------------------------------------------------------------------------------------------------------
# fetch: hash-checked download


def test_fetch_bundle_verifies_with_sidecar_and_extracts(packaged, fake_state, tmp_path):
    d = tmp_path / "D"
    folder = fetching.fetch_bundle(packaged.as_uri(), d)  # hash from <url>.sha256
    assert folder == d / SSL
    assert (d / packaged.name).read_bytes() == packaged.read_bytes()  # kept for monai.bundle download/load
    state = torch.load(folder / "models" / "model.pt", map_location="cpu", weights_only=True)
    assert all(torch.equal(state[k], fake_state[k]) for k in fake_state)
    assert not [p for p in d.iterdir() if p.name.startswith(".")]  # no staging or partial files left

    with pytest.raises(FileExistsError, match="overwrite"):
        fetching.fetch_bundle(packaged.as_uri(), d)
    (folder / "configs" / "stale.json").write_text("{}")
    digest = packaged.with_name(packaged.name + ".sha256").read_text().split()[0]
    assert fetching.fetch_bundle(str(packaged), d, sha256=digest.upper(), overwrite=True) == folder  # plain path
    assert not (folder / "configs" / "stale.json").exists()


def test_extraction_goes_through_monai(packaged, tmp_path, monkeypatch):
    """The writing of the archive's members is MONAI's ``extractall``; download.py adds only the checks MONAI lacks
    (see extract_zip_safely). The download and its hash check are ours (see fetch)."""
    calls = []
    extractall = fetching.extractall
    monkeypatch.setattr(fetching, "extractall", lambda *a, **k: calls.append(("extractall",)) or extractall(*a, **k))
    folder = fetching.fetch_bundle(packaged.as_uri(), tmp_path / "D")
    assert calls == [("extractall",)]
    assert (folder / "models" / "model.pt").is_file()


def test_fetch_hash_mismatch_leaves_nothing(packaged, tmp_path):
    """A mismatch is one error naming the source, the expected and the actual SHA-256, and leaves no file and no
    folder the call created; an existing target with another hash stays as it was."""
    target = tmp_path / "new" / "sub" / packaged.name
    with pytest.raises(fetching.HashMismatchError) as error:
        fetching.fetch(packaged.as_uri(), target, sha256="0" * 64)
    assert str(error.value) == (f"sha256 of {packaged.as_uri()} is {pkg.sha256_file(packaged)}, not the expected "
                                f"{'0' * 64}; the download was discarded (corrupt, truncated or not the published "
                                "file).")  # fmt: skip
    assert not (tmp_path / "new").exists()
    stale = tmp_path / "stale.zip"
    stale.write_bytes(b"stale")
    with pytest.raises(fetching.HashMismatchError):
        fetching.fetch(packaged, stale, sha256="e" * 64)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [] and stale.read_bytes() == b"stale"

    existing = tmp_path / "existing"
    existing.mkdir()
    with pytest.raises(fetching.HashMismatchError):
        fetching.fetch(str(packaged), existing, sha256="f" * 64)
    assert list(existing.iterdir()) == []
    with pytest.raises(fetching.HashMismatchError):
        fetching.fetch_bundle(packaged.as_uri(), tmp_path / "D", sha256="1" * 64)
    assert not (tmp_path / "D").exists()


def test_fetch_requires_a_valid_hash(packaged, tmp_path):
    lone = tmp_path / "lone" / packaged.name
    lone.parent.mkdir()
    shutil.copyfile(packaged, lone)
    with pytest.raises(ValueError, match="no sha256 given"):
        fetching.fetch(lone.as_uri(), tmp_path / "out.zip")
    with pytest.raises(ValueError, match="not a SHA-256"):
        fetching.fetch(lone, tmp_path / "out.zip", sha256="abc")
    lone.with_name(lone.name + ".sha256").write_text(f"{pkg.sha256_file(lone)}  other.zip\n")
    with pytest.raises(ValueError, match="not of"):
        fetching.fetch(lone, tmp_path / "out.zip")
    with pytest.raises(ValueError, match="unsupported URL scheme"):
        fetching.fetch("s3://bucket/x.zip", tmp_path, sha256="0" * 64)
    assert not (tmp_path / "out.zip").exists()

    # a target that already has the expected content is kept without reading the source again
    out = fetching.fetch(lone, tmp_path / "copy.zip", sha256=pkg.sha256_file(lone))
    lone.unlink()
    assert fetching.fetch(lone, out, sha256=pkg.sha256_file(out)) == out


# ------------------------------------------------------------------------------------------------------------
# safe extraction


def _zip_with(path: Path, members: list[tuple[str, bytes, int]]) -> Path:
    with warnings.catch_warnings(), zipfile.ZipFile(path, "w") as zf:
        warnings.simplefilter("ignore", UserWarning)  # "Duplicate name": wanted in one case
        for name, data, mode in members:
            info = zipfile.ZipInfo(name, date_time=pkg.ZIP_DATE_TIME)
            info.create_system = 3
            info.external_attr = mode << 16
            zf.writestr(info, data)
    return path


OK_MEMBER = ("b/configs/metadata.json", b"{}", 0o100644)


@pytest.mark.parametrize(
    "member, reason",
    [
        (("../evil", b"x", 0o100644), "'..'"),
        (("b/../../evil", b"x", 0o100644), "'..'"),
        (("/abs/evil", b"x", 0o100644), "would be written outside"),
        (("C:/evil", b"x", 0o100644), "absolute"),
        (("b\\..\\..\\evil", b"x", 0o100644), "backslash"),
        (("b/link", b"../../../etc/passwd", stat.S_IFLNK | 0o777), "symbolic link"),
        (("b/fifo", b"", stat.S_IFIFO | 0o644), "not a regular file"),
        (("b/configs/metadata.json", b"{}", 0o100644), "twice"),
    ],
    ids=["dotdot", "nested-dotdot", "absolute", "drive", "backslash", "symlink", "fifo", "duplicate"],
)
def test_extract_refuses_unsafe_members(tmp_path, member, reason):
    archive = _zip_with(tmp_path / "b.zip", [OK_MEMBER, member])
    dest = tmp_path / "out"
    with pytest.raises(fetching.UnsafeArchiveError, match=reason) as err:
        fetching.extract_zip_safely(archive, dest)
    assert repr(member[0]) in str(err.value)
    assert not dest.exists()  # checked before anything is written
    assert not (tmp_path / "evil").exists()


def test_extract_refuses_escape_through_existing_link(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "b").symlink_to(outside, target_is_directory=True)
    archive = _zip_with(tmp_path / "b.zip", [("b/evil", b"x", 0o100644)])
    with pytest.raises(fetching.UnsafeArchiveError, match="outside"):
        fetching.extract_zip_safely(archive, dest)
    assert list(outside.iterdir()) == []


def test_extract_writes_plain_files(tmp_path):
    archive = _zip_with(tmp_path / "b.zip", [("b/", b"", 0o040755), OK_MEMBER, ("b/run.sh", b"echo", 0o104777)])
    written = fetching.extract_zip_safely(archive, tmp_path / "out")
    names = sorted(p.relative_to(tmp_path / "out").as_posix() for p in written)
    assert names == ["b/configs/metadata.json", "b/run.sh"]
    umask = os.umask(0)
    os.umask(umask)
    # no setuid / exec bits from the archive: a new file's mode under this process's umask
    assert stat.S_IMODE((tmp_path / "out" / "b" / "run.sh").stat().st_mode) == 0o666 & ~umask


def test_extract_refuses_a_folder_that_is_not_empty(tmp_path):
    """MONAI's extractall skips a non-empty folder without a word; extract_zip_safely says so instead."""
    archive = _zip_with(tmp_path / "b.zip", [OK_MEMBER])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.txt").write_text("x")
    with pytest.raises(FileExistsError, match="out is not empty"):
        fetching.extract_zip_safely(archive, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["old.txt"]


def test_fetch_bundle_refuses_unsafe_or_foreign_zip(tmp_path):
    (tmp_path / "src").mkdir()
    slip = _zip_with(tmp_path / "src" / "b_v0.1.0.zip", [OK_MEMBER, ("b/../evil", b"x", 0o100644)])
    with pytest.raises(fetching.UnsafeArchiveError, match="evil"):
        fetching.fetch_bundle(slip, tmp_path / "D", sha256=pkg.sha256_file(slip))
    assert sorted(p.name for p in (tmp_path / "D").iterdir()) == []  # neither the zip nor a partial bundle
    assert not (tmp_path / "evil").exists() and not (tmp_path / "D" / "evil").exists()

    foreign = _zip_with(tmp_path / "src" / "c.zip", [("c/readme.txt", b"x", 0o100644)])
    with pytest.raises(ValueError, match="not a bundle release"):
        fetching.fetch_bundle(foreign, tmp_path / "D", sha256=pkg.sha256_file(foreign))


def test_fetch_bundle_says_that_large_files_yml_needs_pyyaml(released, tmp_path, monkeypatch):
    """Where PyYAML is not installed (MONAI's config parser then holds a placeholder for it), fetching a release
    with large_files.yml fails with one line naming the list and the package, and leaves no bundle folder."""
    import monai.bundle.config_parser
    from monai.utils import optional_import

    monkeypatch.setattr(monai.bundle.config_parser, "yaml", optional_import("a_module_that_is_not_installed")[0])
    zip_path, _ = released
    with pytest.raises(ModuleNotFoundError) as error:
        fetching.fetch_bundle(zip_path.as_uri(), tmp_path / "D")
    assert str(error.value).endswith("large_files.yml lists the bundle's weights and MONAI reads it with PyYAML, which "
                                     "is not installed: pip install pyyaml") and "\n" not in str(error.value)  # fmt: skip
    assert not (tmp_path / "D" / SSL).exists()


def test_fetch_bundle_refuses_large_files_without_a_hash(tmp_path):
    """MONAI's download_large_files downloads an entry without hash_val unchecked: fetch refuses the bundle."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "w.pt").write_bytes(b"weights")
    listed = f'large_files:\n  - path: "models/w.pt"\n    url: "{(tmp_path / "src" / "w.pt").as_uri()}"\n'
    archive = _zip_with(tmp_path / "src" / "b_v0.1.0.zip", [OK_MEMBER, (f"b/{pkg.LARGE_FILES}", listed.encode(), 0o100644)])
    with pytest.raises(ValueError, match=r"b/large_files.yml lists \['models/w.pt'\] without hash_val"):
        fetching.fetch_bundle(archive, tmp_path / "D", sha256=pkg.sha256_file(archive))
    assert list((tmp_path / "D").iterdir()) == []


def _bundle_with_large_file(archive: Path, path: str, weight: Path, digest: str, hash_type: str | None) -> Path:
    """A bundle zip ``b/`` whose large_files.yml lists ``weight`` (by its file:// URL) as ``path``."""
    listed = f'large_files:\n  - path: "{path}"\n    url: "{weight.as_uri()}"\n    hash_val: "{digest}"\n'
    listed += f'    hash_type: "{hash_type}"\n' if hash_type else ""
    return _zip_with(archive, [OK_MEMBER, (f"b/{pkg.LARGE_FILES}", listed.encode(), 0o100644)])


@pytest.mark.parametrize(
    "path, hash_type, message",
    [
        ("models/w.pt", None, "without a hash_type of md5, sha1, sha256, sha512"),
        ("models/w.pt", "crc32", "without a hash_type of md5, sha1, sha256, sha512"),
        ("../w.pt", "sha256", "which would be written outside b/"),
        ("models/../../w.pt", "sha256", "which would be written outside b/"),
        ("{tmp}/w.pt", "sha256", "which would be written outside b/"),
    ],
)
def test_fetch_bundle_checks_every_large_file_entry_first(tmp_path, path, hash_type, message):
    """Each large_files.yml entry names its hash type (MONAI's default for a missing one is md5 before 1.6, sha256
    after) and a path inside the bundle (MONAI 1.5's download_large_files writes wherever it points): a bundle with
    one that does not is refused, naming the entry, before any download, and nothing is left."""
    path = path.format(tmp=tmp_path)
    weight = tmp_path / "src" / "w.pt"
    weight.parent.mkdir()
    weight.write_bytes(b"weights")
    archive = _bundle_with_large_file(tmp_path / "src" / "b.zip", path, weight, pkg.sha256_file(weight), hash_type)
    with pytest.raises(ValueError, match=re.escape(f"b/large_files.yml lists [{path!r}]") + ",? " + re.escape(message)):
        fetching.fetch_bundle(archive, tmp_path / "D", sha256=pkg.sha256_file(archive))
    assert list((tmp_path / "D").iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["D", "src"]


def test_fetch_bundle_checks_large_files_by_their_hash_type(tmp_path):
    """A large_files.yml entry with an md5 hash (as many Model Zoo bundles list them) is checked by md5: the right
    one gives the file, a wrong one fails naming both."""
    weight = tmp_path / "src" / "w.pt"
    weight.parent.mkdir()
    weight.write_bytes(b"weights")
    for name, digest in [("D", hashlib.md5(b"weights").hexdigest()), ("E", hashlib.md5(b"other").hexdigest())]:
        archive = _bundle_with_large_file(tmp_path / f"b_{name}.zip", "models/w.pt", weight, digest, "md5")
        if name == "D":
            folder = fetching.fetch_bundle(archive, tmp_path / name, sha256=pkg.sha256_file(archive))
            assert (folder / "models" / "w.pt").read_bytes() == b"weights"
        else:
            with pytest.raises(fetching.HashMismatchError, match=f"md5 of .* is {hashlib.md5(b'weights').hexdigest()}, "
                                                                 f"not the expected {digest}; "):  # fmt: skip
                fetching.fetch_bundle(archive, tmp_path / name, sha256=pkg.sha256_file(archive))
            assert list((tmp_path / name).iterdir()) == []


# ------------------------------------------------------------------------------------------------------------
# schema lookup


def test_schema_path_lookup(tmp_path, monkeypatch):
    """MONAI's published schema: BUNDLE_SCHEMA_PATH, else a cached copy with the right md5, else a download checked
    against the md5. The project's own schema ships with the package and needs none of this."""
    monkeypatch.delenv("BUNDLE_SCHEMA_PATH", raising=False)
    assert pkg.metadata_schema().is_file() and pkg.metadata_schema().parent.parent == Path(pkg.__file__).parent
    calls = []

    def fake_download(url, filepath, hash_val, hash_type, progress):
        calls.append((url, hash_val, hash_type))
        Path(filepath).parent.mkdir(parents=True, exist_ok=True)
        Path(filepath).write_bytes(b'{"fake": "schema"}')

    monkeypatch.setattr("monai.apps.utils.download_url", fake_download)
    cached = tmp_path / "cache" / pkg.SCHEMA_NAME
    assert pkg.schema_path(cache_dir=tmp_path / "cache") == cached
    assert calls == [(pkg.SCHEMA_URL, pkg.SCHEMA_MD5, "md5")]
    cached.write_bytes(b"{}")  # pretend it is the published file: its md5 is used, not its name
    monkeypatch.setattr(pkg, "SCHEMA_MD5", hashlib.md5(b"{}").hexdigest())
    assert pkg.schema_path(cache_dir=tmp_path / "cache") == cached
    assert len(calls) == 1  # the cached copy's md5 matched: no download

    mine = tmp_path / "my_schema.json"
    mine.write_text("{}")
    monkeypatch.setenv("BUNDLE_SCHEMA_PATH", str(mine))
    assert pkg.schema_path() == mine
    monkeypatch.setenv("BUNDLE_SCHEMA_PATH", str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError, match="BUNDLE_SCHEMA_PATH"):
        pkg.schema_path()


# ------------------------------------------------------------------------------------------------------------
# command line


def test_cli_help_lists_every_command():
    out = _run([sys.executable, "-m", "components", "--help"], timeout=300)
    for name in COMMANDS:
        assert name in out, f"`python -m components --help` does not list {name}"
    assert {"package", "fetch"} <= set(COMMANDS)


def test_cli_package_and_fetch(ssl_copy, fake_state, tmp_path, capsys):
    """The package / fetch commands through python-fire's argument parsing (in-process: no interpreter start)."""
    fire.Fire(COMMANDS, command=["package", str(ssl_copy), "--out", str(tmp_path / "dist")], name="components")
    zips = list((tmp_path / "dist").glob("*.zip"))
    assert [z.name for z in zips] == [f"{SSL}_v{_version(ssl_copy)}.zip"]
    assert "sha256" in capsys.readouterr().out

    fire.Fire(COMMANDS, command=["fetch", zips[0].as_uri(), str(tmp_path / "D")], name="components")
    assert "verified and extracted" in capsys.readouterr().out
    state = torch.load(tmp_path / "D" / SSL / "models" / "model.pt", map_location="cpu", weights_only=True)
    assert all(torch.equal(state[k], fake_state[k]) for k in fake_state)

    digest = pkg.sha256_file(zips[0])
    raw = str(tmp_path / "raw.zip")
    fire.Fire(COMMANDS, command=["fetch", str(zips[0]), raw, "--sha256", digest, "--extract", "false"])
    assert (tmp_path / "raw.zip").read_bytes() == zips[0].read_bytes()
    with pytest.raises(fetching.HashMismatchError):
        fire.Fire(COMMANDS, command=["fetch", str(zips[0]), str(tmp_path / "E"), "--sha256", "a" * 64])
    assert not (tmp_path / "E").exists()


# ------------------------------------------------------------------------------------------------------------
# end-to-end runs (subprocesses; a minute or two each on CPU)


@pytest.fixture(scope="module")
def ct_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ct")
    components.write_dataset(out, kind="ct", num=3, seed=0)  # one training, one validation, one test volume
    return out


@pytest.mark.slow
def test_finetune_from_downloaded_pretraining_weights(packaged, fake_state, ct_data, tmp_path):
    """The BTCV bundle starts from the downloaded SSL bundle's model.pt via pretrained_path. With the encoder frozen
    for the whole run (a zero learning rate is refused by the settings check) the finetuned encoder must equal the
    packaged swinViT weights exactly."""
    if not (BUNDLES_DIR / BTCV / "configs" / "train.json").is_file():
        pytest.skip(f"bundles/{BTCV} does not exist yet (written by another engineer); required before release")
    d = tmp_path / "D"
    pretrained = fetching.fetch_bundle(packaged.as_uri(), d) / "models" / "model.pt"
    run = tmp_path / "run"
    overrides = {
        "bundle_root": str(run),
        "dataset_dir": str(ct_data),
        "output_dir": str(run / "eval"),
        "ckpt_dir": str(run / "models"),
        "pretrained_path": str(pretrained),
        "roi_size": [64, 32, 32],  # 32^3 leaves one voxel at SwinUNETR's bottleneck: InstanceNorm refuses it
        "spacing": [3.0, 3.0, 4.0],
        "feature_size": FS,
        "max_epochs": 1,
        "training#num_samples": 1,
        "batch_size": 1,
        "loader#num_workers": 0,
        "speed#amp": False,
        "speed#use_checkpoint": False,
        "device": "cpu",
        "training#freeze_encoder_iterations": 1000,
        "training#val_interval": 1,
    }
    out = _run(bundle_command(BTCV, overrides=overrides))
    ckpt = torch.load(run / "models" / "checkpoint.pt", map_location="cpu", weights_only=True)
    encoder = {k: v for k, v in ckpt["model"].items() if k.startswith("swinViT.")}
    assert encoder, f"no swinViT.* tensors in the finetuned checkpoint: {list(ckpt['model'])[:5]}"
    different = [k for k, v in encoder.items() if k not in fake_state or not torch.equal(v, fake_state[k])]
    assert not different, f"{len(different)} encoder tensors differ from the download: {different[:3]}\n{out[-3000:]}"


@pytest.mark.slow
def test_evaluate_json_binds_its_metrics_to_the_weights_it_evaluated(ct_data, tmp_path):
    """The CT bundle's evaluation (train.json + evaluate.json) of its models/model.pt names that file's SHA-256 in
    eval/metrics.json, and a package of these weights carries the evaluation's numbers as eval_metrics."""
    root = _copy_bundle(BTCV, tmp_path / "src")
    (root / "models").mkdir()
    torch.save(_perturbed(LOADED[BTCV](), seed=9), root / "models" / "model.pt")
    overrides = {"dataset_dir": str(ct_data), "roi_size": [64, 32, 32], "spacing": [3.0, 3.0, 4.0], "feature_size": FS,
                 "batch_size": 1, "loader#num_workers": 0, "speed#amp": False, "speed#use_checkpoint": False,
                 "device": "cpu"}  # fmt: skip
    _run(bundle_command(root, ["train.json", "evaluate.json"], overrides))
    record = json.loads((root / "eval" / "metrics.json").read_text())
    assert record["weights"] == {"file": str(root / "models" / "model.pt"), "sha256": pkg.sha256_file(root / "models" / "model.pt")}
    metrics = _packaged_metadata(pkg.package_bundle(root, tmp_path / "dist"), BTCV)["eval_metrics"]
    assert metrics == {"val_mean_dice": record["mean"], **record["per_class"]} and len(metrics) == 14


@pytest.mark.slow
def test_mlflow_tracking_and_tensorboard(ct_data, tmp_path):
    """`monai.bundle run ... --tracking mlflow` records an MLflow run with the training and validation metrics in a
    local SQLite store under output_dir (MONAI 1.6.1's default: mlruns.db; MONAI refuses file:// stores), and
    the bundle's TensorBoard event files are written as usual."""
    for module in ("mlflow", "sqlalchemy", "alembic"):
        pytest.importorskip(module, reason=f"{module} is not installed (test extra: mlflow-skinny sqlalchemy alembic)")
    import mlflow

    run = tmp_path / "run"
    overrides = {
        "bundle_root": str(run),
        "dataset_dir": str(ct_data),
        "output_dir": str(run / "eval"),
        "ckpt_dir": str(run / "models"),
        "roi_size": [64, 32, 32],
        "feature_size": FS,
        "training#num_samples": 1,
        "batch_size": 1,
        "loader#num_workers": 0,
        "max_epochs": 1,
        "speed#amp": False,
        "device": "cpu",
        "training#warmup_iterations": 1,
        "speed#use_checkpoint": False,
        "experiment_name": "ssl_release_test",
    }
    cmd = bundle_command(SSL, overrides=overrides) + ["--tracking", "mlflow"]
    _run(cmd)

    store = run / "eval" / "mlruns.db"
    assert store.is_file()
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{store}")
    experiment = client.get_experiment_by_name("ssl_release_test")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    metrics = runs[0].data.metrics
    assert {"train_loss", "val_recon_l1"} <= set(metrics), metrics
    assert list((run / "eval").glob("events.out.tfevents.*")), "no TensorBoard event files under output_dir"
    assert list((run / "eval").glob("config_*.json")), "the executed config was not saved next to the store"
