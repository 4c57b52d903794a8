"""The fire command line: convert-checkpoint (the other commands are tested beside their modules)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
