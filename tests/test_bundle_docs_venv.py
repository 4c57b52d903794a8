"""The bundle docs as a user follows them after a download: the "Run a downloaded bundle" install line and commands,
run as written (placeholders replaced by a local release) in a fresh virtual environment that holds no clone and no
installed ``components``, on a pseudo-terminal.

- The install line is the one every bundle doc shows; it is run with the venv's own ``pip``.
- The CT bundle and the SSL bundle are packaged with tiny weights and a ``file://`` release URL (so the zip holds no
  weights, as a real release), then downloaded, completed and checked with the docs' commands in order.
- Inference runs on a terminal (a pseudo-terminal): ``VolumeProgress`` shows ignite's progress bar there, which needs
  tqdm (0.3.0 named no package that installs it, and piped output hid the crash).
- The docs' ``monai.bundle.load`` snippet runs as written from the folder above ``downloads/``; without its
  ``sys.path`` line the bundle says why its code cannot be imported.
- Two bundles of other code in one process: the second is refused in one line naming both copies, in either order.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
import torch
from monai.networks.nets import SwinUNETR

import components
from components.release import package as pkg
from tests.test_bundle_download import FS, _env
from tests.test_package import _copy_bundle, _fake_trained_state

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SSL, BTCV = "swin_unetr_ssl_pretrain", "swin_unetr_btcv_finetune"
PLACEHOLDER_URL = "https://github.com/<owner>/<repo>/releases/download/<tag>"
TIMEOUT_S = 900
TINY_CT = {"roi_size": "[64,32,32]", "spacing": "[3.0,3.0,4.0]", "loader#num_workers": "0", "device": "cpu",
           "speed#amp": "false"}  # fmt: skip
TINY_SSL_RUN = {"roi_size": "[64,32,32]", "feature_size": str(FS), "max_epochs": "1", "batch_size": "1",
                "training#num_samples": "1", "loader#num_workers": "0", "device": "cpu", "speed#amp": "false",
                "speed#use_checkpoint": "false", "network_def#window_size": "4"}  # fmt: skip


def _section(name: str) -> str:
    text = (REPO / "bundles" / name / "docs" / "README.md").read_text(encoding="utf-8")
    return text.split("## Run a downloaded bundle", 1)[1].split("\n## ", 1)[0]


def _install_line() -> str:
    """The docs' install line: the same in every bundle's "Run a downloaded bundle" section."""
    lines = set()
    for folder in sorted((REPO / "bundles").iterdir()):
        if (folder / "docs" / "README.md").is_file():
            found = [ln.strip() for ln in _section(folder.name).splitlines() if ln.strip().startswith("pip install ")]
            assert len(found) == 1, (folder.name, found)
            lines.add(found[0])
    assert len(lines) == 1, lines
    return lines.pop()


def _commands(name: str) -> list[str]:
    """The shell commands of a doc's "Run a downloaded bundle" section after the install line, continuation lines
    joined, in order (the publisher's `components package` left out: it runs in the repository)."""
    commands, current = [], ""
    for line in _section(name).splitlines():
        if not line.startswith("    ") or line.startswith("    pip install"):
            continue
        current += " " + line.strip().rstrip("\\").strip() if current else line.strip().rstrip("\\").strip()
        if not line.rstrip().endswith("\\"):
            commands.append(current)
            current = ""
    return [c for c in commands if not c.startswith("python -m components package")]


def _snippet(name: str) -> str:
    """The Python code block of the section."""
    block = re.search(r"```python\n(.*?)```", _section(name), flags=re.S)
    assert block, name
    return block.group(1)


def _on_terminal(cmd: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    """Runs ``cmd`` with stdin, stdout and stderr on a pseudo-terminal (``isatty()`` is true in it) of 40 x 160
    characters (a new pseudo-terminal has no width, and tqdm draws nothing in zero columns)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(master)
    code = proc.wait(timeout=60)
    return code, b"".join(chunks).decode(errors="replace")


def _shell(command: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=TIMEOUT_S, check=False)  # fmt: skip


def _ok(proc: subprocess.CompletedProcess | tuple[int, str], what: str) -> str:
    code, out = (proc.returncode, proc.stdout) if isinstance(proc, subprocess.CompletedProcess) else proc
    assert code == 0, f"{what} exited {code}:\n{out[-6000:]}"
    return out


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> dict:
    """A fresh venv with the docs' install line run as written, and the folder a user works in."""
    root = tmp_path_factory.mktemp("docs_venv")
    subprocess.run([sys.executable, "-m", "venv", root / "env"], check=True, timeout=300)
    env = _env(PATH=f"{root / 'env' / 'bin'}{os.pathsep}{os.environ['PATH']}", VIRTUAL_ENV=str(root / "env"),
               PIP_NO_COMPILE="1")  # fmt: skip
    _ok(_shell(_install_line(), root, env), "the docs' install line")
    proc = _shell("python -c 'import components'", root, env)
    assert proc.returncode != 0 and "No module named 'components'" in proc.stdout, proc.stdout[-2000:]
    work = root / "work"
    work.mkdir()
    return {"env": env, "work": work, "python": root / "env" / "bin" / "python"}


def _release(name: str, network: torch.nn.Module, dist: Path, tmp: Path) -> None:
    """Packages bundles/<name> with tiny 'trained' weights as a release at ``dist`` (weights beside the zip)."""
    root = _copy_bundle(name, tmp)
    (root / "models").mkdir()
    torch.save(_fake_trained_state(network), root / "models" / "model.pt")
    pkg.package_bundle(root, dist, release_url=dist.as_uri())


@pytest.fixture(scope="module")
def downloaded(user, tmp_path_factory) -> dict[str, Path]:
    """The CT and SSL bundles released locally, then downloaded and completed with each doc's commands as written
    (the release URL replaced by the local one, the dataset by synthetic data, tiny settings on the training run)."""
    dist = tmp_path_factory.mktemp("dist")
    networks = {BTCV: SwinUNETR(in_channels=1, out_channels=14, feature_size=FS),
                SSL: components.SSLHead(feature_size=FS)}  # fmt: skip
    folders = {}
    for name, network in networks.items():
        _release(name, network, dist, tmp_path_factory.mktemp(f"src_{name}"))
        cwd = user["work"]
        for command in _commands(name):
            command = command.replace(PLACEHOLDER_URL, dist.as_uri())
            if command.startswith("cd "):
                cwd = cwd / command[3:].strip()
                continue
            if " run --config_file \"['configs/common.json','configs/train.json']\"" in command:
                if name == BTCV:  # the finetuning run of the docs needs a labeled set: the bundle's own synthetic one
                    continue
                _ok(_shell("python -m components synth --kind ct --num 3 --out data --seed 0", cwd, user["env"]), "synth")
                command = re.sub(r"--dataset_dir \S+", "--dataset_dir data", command)
                command += "".join(f" --{k} '{v}'" for k, v in TINY_SSL_RUN.items())
            _ok(_shell(command, cwd, user["env"]), f"{name}: {command}")
        folders[name] = cwd
    return folders


def test_the_documented_commands_leave_a_complete_bundle(downloaded):
    """download_large_files brought the weights the zip does not hold; the SSL training run wrote a checkpoint."""
    for name, folder in downloaded.items():
        assert (folder / "models" / "model.pt").is_file() and (folder / "components" / "__init__.py").is_file(), name
    assert (downloaded[SSL] / "models" / "checkpoint.pt").is_file()


def test_inference_on_a_terminal_shows_its_progress_bar(user, downloaded):
    """ignite's ProgressBar (tqdm) on a terminal: the 0.3.0 install line did not install tqdm and inference crashed
    there ("This contrib module requires tqdm to be installed")."""
    folder = downloaded[BTCV]
    _ok(_shell("python -m components synth --kind ct --num 3 --out data --seed 0", folder, user["env"]), "synth")
    cmd = [user["python"], "-m", "monai.bundle", "run", "--config_file", "configs/inference.json",
           "--dataset_dir", "data", *[w for k, v in TINY_CT.items() for w in (f"--{k}", v)]]  # fmt: skip
    out = _ok(_on_terminal(cmd, folder, user["env"]), "inference on a terminal")
    assert "requires tqdm" not in out
    assert re.search(r"volumes.*100%|100%.*volumes", out), out[-3000:]
    assert list((folder / "eval" / "segmentations").glob("*_seg.nii.gz"))


def test_the_docs_load_snippet_runs_as_written(user, downloaded):
    """From the folder above downloads/: the snippet's sys.path line makes monai.bundle.load find the bundle's own
    code; without it the bundle says why it cannot run instead of a bare 'Failed to evaluate' of report_origin."""
    snippet = _snippet(BTCV)
    code = snippet + "\nprint('LOADED', type(net).__name__, sum(p.numel() for p in net.parameters()))\n"
    out = _ok(_shell(f"python - <<'EOF'\n{code}\nEOF", user["work"], user["env"]), "the docs' load snippet")
    assert "LOADED SwinUNETR" in out
    without = "\n".join(line for line in snippet.splitlines() if not line.startswith("sys.path.insert"))
    proc = _shell(f"python - <<'EOF'\n{without}\nEOF", user["work"], user["env"])
    assert proc.returncode != 0
    assert "import components failed: this bundle runs its own code, the folder components/ beside configs/" in proc.stdout


TWO_BUNDLES = r"""
import sys
import monai.bundle

for name in {names!r}:
    sys.path.insert(0, "downloads/" + name)
    try:
        monai.bundle.load(name=name, bundle_dir="downloads", workflow_type="inference", device="cpu")
    except Exception as err:
        while err.__cause__ is not None:
            err = err.__cause__
        print("REFUSED", name, type(err).__name__, str(err))
        break
    print("LOADED", name)
"""


@pytest.mark.parametrize("order", [(BTCV, SSL), (SSL, BTCV)])
def test_two_bundles_of_other_code_in_one_process_are_refused_naming_both(order, user, downloaded):
    """The SSL bundle's copy is made other code (another version); whichever bundle is loaded first, the second
    stops in one line naming its own copy and the one already imported (0.3.0 ran it silently on the first's code,
    or failed on a missing name)."""
    init = downloaded[SSL] / "components" / "__init__.py"
    text = init.read_text()
    if '__version__ = "9.9.9"' not in text:
        init.write_text(re.sub(r'__version__ = "[^"]+"', '__version__ = "9.9.9"', text))
    out = _ok(_shell(f"python - <<'EOF'\n{TWO_BUNDLES.format(names=list(order))}\nEOF", user["work"], user["env"]),
              "two bundles in one process")  # fmt: skip
    first, second = order
    assert f"LOADED {first}" in out and f"LOADED {second}" not in out, out[-3000:]
    refusal = next(line for line in out.splitlines() if line.startswith("REFUSED"))
    assert refusal.startswith(f"REFUSED {second} BundleCodeMismatch the bundle at ")
    ssl_copy, btcv_copy = (downloaded[n] / "components" for n in (SSL, BTCV))
    assert str(ssl_copy.resolve()) in refusal and str(btcv_copy.resolve()) in refusal
    assert "9.9.9" in refusal and components.__version__ in refusal
