"""The SSL views (``ssl_views``) of this checkout against those of another revision: time and bit identity, on CPU.

The other revision's ``components/recipes/inpainting_contrast/views.py`` (``git show``, or a file given with
``--before-file``) is loaded as a module beside this checkout's, and both draw the two views of an SSL step from the
same generator state, one after the other, alternating which goes first, so that both see the same load. Every
repetition checks that the two results are equal tensor for tensor. Paths: ``cpu`` (the bundle on CPU: boxes drawn
and trimmed where the crops are) and ``host_boxes`` (the bundle on an accelerator: boxes from a CPU generator; here
the crops are on CPU too). Figures: median and minimum seconds of each side, and the median over repetitions of
this checkout's time over the other's (below 1: faster). Default size: the SSL bundle's step, 2 volumes x 2 crops
of 96^3; ``--size 64x32x32`` times a non-cubic crop (the demo's).

    python benchmarks/views_against_revision.py --before 05e2a50 --threads 1 --conditions "idle 8-core workstation"
    python benchmarks/views_against_revision.py --small --before-file old_views.py   # CI: 32^3, 2 repetitions

Prints one JSON object; exits 1 when the views differ.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from components.recipes.inpainting_contrast import views as views_after  # noqa: E402

from machine import git_commit, machine_info, write_result  # noqa: E402

VIEWS = "components/recipes/inpainting_contrast/views.py"


def load_views(source: str, name: str = "views_before") -> ModuleType:
    """The views module from the Python ``source`` text (it imports only torch and the standard library)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{name}.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


def _revision_source(revision: str) -> str:
    """``views.py`` as ``revision`` has it."""
    shown = subprocess.run(["git", "show", f"{revision}:{VIEWS}"], cwd=REPO, check=True, capture_output=True, text=True)
    return shown.stdout


def _timed(fn) -> tuple[float, tuple]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def crop_size(text: str) -> tuple[int, int, int]:
    """``"96"`` (a cube) or ``"64x32x32"`` (H x W x D) as three sides."""
    sides = tuple(int(side) for side in text.lower().split("x"))
    if len(sides) not in (1, 3):
        raise argparse.ArgumentTypeError(f"--size takes N or HxWxD, got {text!r}")
    return sides * 3 if len(sides) == 1 else sides


def compare(before: ModuleType, size: tuple[int, int, int], batch: int, reps: int, seed: int) -> dict:
    """Per path: both sides' times over ``reps`` interleaved repetitions, their ratio, and whether every pair of
    results was equal."""
    x = torch.rand(batch, 1, *size, generator=torch.Generator().manual_seed(seed))
    paths = {
        "cpu": lambda views, rep: views.ssl_views(x, torch.Generator().manual_seed(seed + rep)),
        "host_boxes": lambda views, rep: views.ssl_views(x, torch.Generator().manual_seed(seed + rep),
                                                         box_generator=torch.Generator().manual_seed(seed + reps + rep)),
    }  # fmt: skip
    result = {}
    for name, run in paths.items():
        run(views_after, reps), run(before, reps)  # warm-up: first-call costs (allocations, caches) on neither side
        times: dict[str, list[float]] = {"before": [], "after": []}
        identical = True
        for rep in range(reps):
            order = [("before", before), ("after", views_after)][:: 1 if rep % 2 == 0 else -1]  # alternate the first
            outputs = {}
            for side, module in order:
                seconds, outputs[side] = _timed(lambda: run(module, rep))
                times[side].append(seconds)
            identical &= all(torch.equal(a, b) for a, b in zip(outputs["before"], outputs["after"]))
        result[name] = {
            **{f"{side}_median_s": round(statistics.median(t), 4) for side, t in times.items()},
            **{f"{side}_min_s": round(min(t), 4) for side, t in times.items()},
            "after_over_before_median": round(statistics.median(a / b for a, b in zip(times["after"], times["before"])), 3),
            "identical": identical,
        }
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--before", help="the revision to compare with (its views.py through git show)")
    source.add_argument("--before-file", type=Path, help="the views.py to compare with")
    parser.add_argument("--size", type=crop_size, default=(96, 96, 96), help="crop side N or HxWxD (SSL bundle: 96)")
    parser.add_argument("--batch", type=int, default=4, help="crops per step (the SSL bundle: 2 volumes x 2 crops)")
    parser.add_argument("--reps", type=int, default=12, help="timed repetitions per side and path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--conditions", default="not stated", help="the machine's state, written with the figures")
    parser.add_argument("--small", action="store_true", help="CI: 32^3, 2 repetitions")
    args = parser.parse_args(argv)
    if args.small:
        args.size, args.reps = (32, 32, 32), 2
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    text = args.before_file.read_text() if args.before_file else _revision_source(args.before)
    result = {
        "benchmark": "views_against_revision",
        "machine": machine_info(),
        "conditions": args.conditions,
        "before": str(args.before_file) if args.before_file else args.before,
        "after": git_commit(),
        "size": args.size[0] if len(set(args.size)) == 1 else list(args.size),
        "batch": args.batch,
        "reps": args.reps,
        "paths": compare(load_views(text), args.size, args.batch, args.reps, args.seed),
    }
    write_result(result, sys.stdout, started)
    if not all(path["identical"] for path in result["paths"].values()):
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()
