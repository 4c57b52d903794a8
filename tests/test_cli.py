"""The command line: convert-checkpoint, help without heavy imports, one-line errors (other commands are tested beside
their modules)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from monai.networks.nets import SwinUNETR

from components import SSLHead
from components.__main__ import COMMANDS, _unknown_flags, main
from tests.test_checkpoint_layouts import _published, _random


def _cli(*args: str, cwd: Path | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "components", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


def test_convert_checkpoint_writes_a_strictly_loadable_swinunetr_state(tmp_path):
    torch.manual_seed(0)
    ssl = SSLHead(feature_size=12)
    # as the original SSL code saved it under DDP
    torch.save({"epoch": 3, "state_dict": {f"module.{k}": v for k, v in ssl.state_dict().items()}}, tmp_path / "ssl.pt")
    result = _cli("convert-checkpoint", str(tmp_path / "ssl.pt"), str(tmp_path / "out.pt"), "--target", "swinunetr", "--feature_size", "12")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "layout=ssl_original target=swinunetr: loaded 126/126 encoder tensors" in result.stdout
    state = torch.load(tmp_path / "out.pt", map_location="cpu", weights_only=True)
    model = SwinUNETR(in_channels=1, out_channels=14, feature_size=12)
    model.load_state_dict(state)  # strict
    for key, value in ssl.swinViT.state_dict().items():
        assert torch.equal(model.swinViT.state_dict()[key], value), key


def test_convert_checkpoint_fails_loudly_on_a_partial_encoder(tmp_path):
    ssl = SSLHead(feature_size=12).state_dict()
    partial = {k: v for k, v in ssl.items() if not k.startswith("swinViT.layers4")}
    torch.save(partial, tmp_path / "partial.pt")
    result = _cli("convert-checkpoint", str(tmp_path / "partial.pt"), str(tmp_path / "out.pt"), "--target", "sslhead", "--feature_size", "12")
    assert result.returncode != 0
    assert "swinViT.layers4" in result.stderr and "ssl_collection" in result.stderr
    assert not (tmp_path / "out.pt").exists()


def _swinunetr_file(path: Path, **network) -> dict:
    """A trained-looking SwinUNETR (14 outputs) saved as a bare state dict; returns the state dict."""
    torch.manual_seed(0)
    state = {k: v + 0.05 * torch.randn(v.shape) if v.is_floating_point() else v
             for k, v in SwinUNETR(out_channels=14, **network).state_dict().items()}  # fmt: skip
    torch.save(state, path)
    return state


def _brainsegfounder_deep_file(path: Path) -> dict:
    """BrainSegFounder's deeper SSL checkpoint (2 channels, depths (2, 2, 6, 2), heads (4, 8, 16, 32)) at feature
    12, as its code saves it; returns its state dict without the module. prefix."""
    published = _published("brainsegfounder_deep", 12, _random)
    torch.save(published.checkpoint, path)
    return {k[len("module.") :]: v for k, v in published.state.items()}


def test_convert_checkpoint_reads_every_architecture_value_from_the_file(tmp_path, capsys):
    """No size flag: a feature-24 v2 window-4 SwinUNETR and BrainSegFounder's deeper 2-channel encoder convert into
    state dicts that load strictly into networks of exactly those values, every encoder tensor the file's."""
    v2 = _swinunetr_file(tmp_path / "v2.pt", in_channels=1, feature_size=24, window_size=4, use_v2=True)
    assert main(["convert-checkpoint", str(tmp_path / "v2.pt"), str(tmp_path / "v2_out.pt")]) == 0
    seg = SwinUNETR(in_channels=1, out_channels=14, feature_size=24, window_size=4, use_v2=True)
    n_encoder = sum(k.startswith("swinViT.") for k in seg.state_dict())
    assert (f"layout=swinunetr target=swinunetr: loaded {n_encoder}/{n_encoder} encoder tensors ({len(v2)}/{len(v2)} "
            "model tensors), 0 missing") in capsys.readouterr().out  # fmt: skip
    seg.load_state_dict(torch.load(tmp_path / "v2_out.pt", weights_only=True), strict=True)
    assert all(torch.equal(seg.state_dict()[k], v) for k, v in v2.items())

    deep = _brainsegfounder_deep_file(tmp_path / "deep.pt")
    targets = {"sslhead": SSLHead(in_channels=2, feature_size=12, depths=(2, 2, 6, 2), num_heads=(4, 8, 16, 32)),
               "swinunetr": SwinUNETR(in_channels=2, out_channels=14, feature_size=12, depths=(2, 2, 6, 2),
                                      num_heads=(4, 8, 16, 32))}  # fmt: skip
    for target, network in targets.items():
        out = tmp_path / f"deep_{target}.pt"
        assert main(["convert-checkpoint", str(tmp_path / "deep.pt"), str(out), "--target", target]) == 0
        n_encoder = sum(k.startswith("swinViT.") for k in network.state_dict())
        assert f"layout=ssl_original target={target}: loaded {n_encoder}/{n_encoder} encoder tensors" in (
            capsys.readouterr().out
        )
        network.load_state_dict(torch.load(out, weights_only=True), strict=True)
        assert all(torch.equal(v, deep[k]) for k, v in network.state_dict().items() if k.startswith("swinViT."))


def _partial_file(path: Path) -> None:
    torch.save({k: v for k, v in SSLHead(feature_size=12).state_dict().items() if "layers4" not in k}, path)


def _patch_4_file(path: Path) -> None:
    _swinunetr_file(path, in_channels=1, feature_size=12, patch_size=4)


# each failure of the converter: the file, the flags given, the flags its message must advise (rerunning with the
# advised flags in place of the given ones converts the file, where the advice is a value)
FAILURES = {
    "feature_size": ("v2", ["--feature_size", "12"], {"--feature_size"}),
    "v2_and_window": ("v2", ["--use_v2", "false", "--window_size", "7"], {"--use_v2", "--window_size"}),
    "depths_and_heads": ("deep", ["--depths", "[2,2,2,2]", "--num_heads", "[3,6,12,24]"], {"--depths", "--num_heads"}),
    "channels": ("v2", ["--in_channels", "4"], {"--channel_policy"}),
    "partial_encoder": ("partial", ["--target", "sslhead"], {"--required"}),
    "patch_size_into_sslhead": ("patch_4", ["--target", "sslhead"], {"--target"}),
}


@pytest.mark.parametrize("failure", list(FAILURES))
def test_every_flag_the_converter_advises_is_one_it_accepts(failure, tmp_path, capsys):
    """The converter's one-line errors advise flags of convert-checkpoint (checked by the command's own unknown-flag
    check), never a bundle's config ids; an architecture mismatch's "Run with ..." converts the file as advised."""
    name, given, advised = FAILURES[failure]
    src = tmp_path / f"{name}.pt"
    {"v2": lambda p: _swinunetr_file(p, in_channels=1, feature_size=24, window_size=4, use_v2=True),
     "deep": _brainsegfounder_deep_file, "partial": _partial_file, "patch_4": _patch_4_file}[name](src)  # fmt: skip
    dst = tmp_path / "out.pt"
    assert main(["convert-checkpoint", str(src), str(dst), *given]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("components convert-checkpoint: error: ")
    flags = set(re.findall(r"(?<![\w#])--[A-Za-z_][\w#-]*", err)) - {"--debug"}
    assert flags == advised, err
    assert _unknown_flags(COMMANDS["convert-checkpoint"], sorted(flags)) is None
    assert not dst.exists()
    run_with = re.search(r"Run with (--.*?)\.", err)
    if failure in ("feature_size", "v2_and_window", "depths_and_heads"):
        assert main(["convert-checkpoint", str(src), str(dst), *run_with.group(1).split()]) == 0
        assert dst.is_file()


# ------------------------------------------------------------------------------------------------------------
# help, errors and lazy imports (issue 13)

HEAVY = ("torch", "monai", "numpy", "nibabel", "ignite")


def test_help_loads_no_heavy_module():
    """`python -m components --help` and `COMMAND --help` answer without importing torch, MONAI or numpy (that is
    what made --help take 8-9 s): the package's names are imported lazily and each command imports its own."""
    code = (
        "import runpy, sys\n"
        "for argv in (['--help'], ['demo', '--help'], ['check-data', '-h']):\n"
        "    sys.argv = ['components', *argv]\n"
        "    try:\n"
        "        runpy.run_module('components', run_name='__main__')\n"
        "    except SystemExit as e:\n"
        "        assert not e.code, e.code\n"
        f"print('HEAVY', sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "HEAVY []" in result.stdout, result.stdout.splitlines()[-1]
    assert "commands:" in result.stdout and "convert-checkpoint" in result.stdout
    assert "usage: components demo [FLAGS]" in result.stdout


def test_command_help_shows_readable_types_and_defaults(capsys):
    from components.__main__ import main

    assert main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    assert "Optional" not in out and "'str" not in out
    rows = {line.split()[0]: line.split()[2:] for line in out.splitlines() if line.startswith("  --")}
    assert rows["--device"] == ["str", "default:", "none"]
    assert rows["--seed"] == ["int", "default:", "0"]
    assert rows["--compare"] == ["bool", "default:", "false"]
    assert main(["check-data", "--help"]) == 0
    out = capsys.readouterr().out
    assert "  DATALIST" in out and "training, and validation when the datalist has one" in out  # --lists default


def test_errors_are_one_line_with_status_2_and_debug_shows_the_traceback(tmp_path, capsys):
    from components.__main__ import main

    missing = tmp_path / "missing.pt"
    assert main(["convert-checkpoint", str(missing), str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("components convert-checkpoint: error: FileNotFoundError:") and str(missing) in err
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        main(["convert-checkpoint", str(missing), str(tmp_path / "out.pt"), "--debug"])

    # a mistyped flag stops before the command runs (python-fire would run synth with its defaults first)
    assert main(["synth", "--out", str(tmp_path / "d"), "--nun", "3"]) == 2
    assert "unknown flag --nun" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
    assert main(["no-such-command"]) == 2
    assert "unknown command 'no-such-command'" in capsys.readouterr().err


def test_the_process_exits_with_status_2_and_one_line(tmp_path):
    result = _cli("fetch", str(tmp_path / "x.zip"), str(tmp_path / "D"), "--sha256", "abc")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr, result.stderr
    assert "is not a SHA-256" in result.stderr


def test_lazy_package_names_resolve():
    """Every public name (what bundle configs write as components.X) is the object of the module whose __all__ lists
    it."""
    import importlib
    import pkgutil

    import components

    owner = {name: module.name for module in pkgutil.walk_packages(components.__path__, "components.")
             if not module.ispkg and module.name != "components.__main__"
             for name in importlib.import_module(module.name).__dict__.get("__all__", ())}  # fmt: skip
    for name in components.__all__:
        assert getattr(components, name) is getattr(importlib.import_module(owner[name]), name), name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        components.nope  # noqa: B018
