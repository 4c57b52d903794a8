"""Where benchmark figures come from: the machine facts every benchmark prints with its results, and the commit.

torch is imported by the functions that read it, so that a command can name its commit or refuse its input first."""

from __future__ import annotations

import os
import platform
import re
import subprocess
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = "benchmarks/results"


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (or the text given); "unknown" where there is none."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "unknown"
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.split(":", 1)[0].strip() == "model name"]
    return names[0] if names else "unknown"


def machine_info() -> dict:
    """Where the figures come from: CPU count, model and the vector instructions torch's kernels dispatch to (two
    2-vCPU VMs that both call themselves "AMD EPYC", one AVX2-only, one with AVX-512, ran the same finetuning run in
    about 470 s and 185 s), load averages, torch threads and versions."""
    import torch

    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "load_avg_1_5_15": [round(v, 2) for v in load],
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "monai": _installed("monai"),
        "cuda": torch.cuda.is_available(),
    }


def device_facts() -> dict:
    """The accelerator: name (torch's), memory, compute capability, CUDA, cuDNN and driver versions; the CPU alone
    is "cpu"."""
    import torch

    if not torch.cuda.is_available():
        return {"name": "cpu"}
    props = torch.cuda.get_device_properties(0)
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "--id=0"]
        driver = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        driver = None
    return {"name": torch.cuda.get_device_name(0), "memory_gib": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}", "multiprocessors": props.multi_processor_count,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(), "driver": driver}  # fmt: skip


def device_slug(device: str) -> str:
    """A device's name as a file name's part.

    Example:
        >>> device_slug("NVIDIA H100 80GB HBM3")
        'nvidia-h100-80gb-hbm3'
    """
    return re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")


def _installed(package: str) -> str | None:
    """The installed version of ``package`` without importing it (None where it is missing), so that the machine
    facts are written even where MONAI failed to install."""
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def git_commit(repo: Path = REPO) -> str:
    """HEAD of ``repo``, with "+changes" when tracked files other than the recorded results differ from it; "unknown"
    without git. ``benchmarks/results/`` is left out of that check so that a benchmark which has written its own
    results can still match its commit when it resumes. A copied checkout may carry stale git metadata: a result
    from another machine should name its commit explicitly."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", f":(exclude){RESULTS_DIR}"],
                               cwd=repo, capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
        return commit + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def descends_from(commit: str, ancestor: str, repo: Path = REPO) -> bool:
    """Whether ``commit`` (a hash as :func:`git_commit` records it: one with "+changes" is no commit, so never) is
    ``ancestor`` or a descendant of it in ``repo``'s history; False where git or either commit is unknown."""
    if not commit or commit.endswith("+changes"):
        return False
    try:
        done = subprocess.run(["git", "merge-base", "--is-ancestor", ancestor, commit], cwd=repo, capture_output=True)
    except OSError:
        return False
    return done.returncode == 0


def changed_since(commit: str, paths: Sequence[str], repo: Path = REPO) -> list[str]:
    """The files of ``paths`` (relative to ``repo``'s root) whose content in the working tree, uncommitted changes
    included, differs from ``commit``'s (``git diff --name-only <commit> -- paths``: a deleted file too), sorted.
    Where git, the repository or the commit is unknown, every path: none can be shown unchanged, so a caller that
    withholds results on a change withholds them."""
    try:
        done = subprocess.run(["git", "diff", "--name-only", commit, "--", *paths], cwd=repo, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return sorted(paths)
    return sorted(done.stdout.splitlines())


def write_result(result: dict, out, started: float) -> dict:
    """Adds the load at the end and the wall time since ``started`` (``time.perf_counter``), and writes ``result``
    as indented JSON to ``out``."""
    import json
    import time

    result["machine"]["load_avg_1_5_15_at_end"] = [round(v, 2) for v in os.getloadavg()]
    result["wall_s"] = round(time.perf_counter() - started, 1)
    out.write(json.dumps(result, indent=2) + "\n")
    out.flush()
    return result


def bundle_parser(bundle, overrides: dict, num_workers: int | None = None, config: str = "train.json"):
    """A bundle's ``configs/<config>`` (with its metadata; train.json with the shared config) and ``overrides`` (plus
    ``loader#num_workers`` when given), as a MONAI ``ConfigParser`` ready to parse: the benchmarks time the bundles'
    own objects."""
    from monai.bundle import ConfigParser

    from components.config.running import run_config_files

    parser = ConfigParser()
    parser.read_config([str(f) for f in run_config_files(bundle, [config])])
    parser.read_meta(str(Path(bundle) / "configs" / "metadata.json"))
    parser.update({**overrides, **({} if num_workers is None else {"loader#num_workers": num_workers})})
    return parser


def bundle_start(parser) -> None:
    """What a bundle's ``run`` does before it builds anything, short of its checks: the allocator tuning and the
    seed (``components.tune_allocator``, ``set_determinism``), so that a timed step starts as a bundle run's does."""
    for index, step in enumerate(parser["run"]):
        if isinstance(step, str) and step.startswith(("$components.tune_allocator(", "$monai.utils.set_determinism(")):
            parser.get_parsed_content(f"run#{index}")
