"""The command line: convert-checkpoint, help without heavy imports, one-line errors (other commands are tested beside
their modules)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from monai.networks.nets import SwinUNETR

from components import SSLHead


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
    """Every public name (what bundle configs write as components.X) comes from the submodule that defines it."""
    import importlib

    import components

    for name in components.__all__:
        module = importlib.import_module(f"components.{components._SUBMODULE_OF[name]}")
        assert getattr(components, name) is getattr(module, name), name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        components.nope  # noqa: B018
