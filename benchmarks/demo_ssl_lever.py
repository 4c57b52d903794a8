"""A lever on the demo's pretraining, seed by seed: the pretraining step of recorded demo runs again, with overrides,
and its final health report (the demo's own crops), into ``benchmarks/results/demo_ssl_levers.json`` under the
lever's name.

The demo runs of ``benchmarks/demo_seeds.py`` keep their ``summary.json``, which holds the pretraining's command; this
reruns that command for each seed with ``--output_dir`` and ``--ckpt_dir`` under ``<work>/levers/<name>/seed<N>``
and the given overrides appended, so a lever differs from the demo's run by its overrides only. A seed already
recorded under the name is skipped, so a stopped measurement resumes.

Example (the demo's seeds 3 and 4 at half the learning rate, one thread each)::

    python benchmarks/demo_ssl_lever.py --work /tmp/demo_seeds --seeds 3,4 --name lr2e-4 --threads 1 \
        --set learning_rate=0.0002
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.machine import git_commit, machine_info  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "demo_ssl_levers.json"


def lever_command(summary: dict, out: Path, overrides: dict[str, str]) -> list[str]:
    """The demo's pretraining command from its ``summary``, writing under ``out``, with ``overrides`` appended.

    Raises:
        ValueError: the summary has no pretraining step.
    """
    step = next((s for s in summary["steps"] if s["step"].endswith("pretraining")), None)
    if step is None:
        raise ValueError("the demo summary has no pretraining step")
    folders = {"--output_dir": str(out / "eval"), "--ckpt_dir": str(out / "models")}
    command = [folders.get(previous, arg) for previous, arg in zip([None, *step["command"][:-1]], step["command"])]
    return command + [item for key, value in overrides.items() for item in (f"--{key}", value)]


def run_seed(work: Path, seed: int, name: str, overrides: dict[str, str], threads: int | None) -> dict:
    """One seed's pretraining with the lever; its final health report's verdict and signals."""
    out = work / "levers" / name / f"seed{seed}"
    command = lever_command(json.loads((work / f"seed{seed}" / "summary.json").read_text()), out, overrides)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    load = [round(v, 2) for v in os.getloadavg()]
    start = time.perf_counter()
    with open(out / "train.log", "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"seed {seed} failed (exit {done.returncode}); its log: {out / 'train.log'}")
    report = json.loads((out / "eval" / "health.json").read_text())["reports"][-1]
    signals = {key: {"value": s["value"], "baseline": s["baseline"], "verdict": s["verdict"]}
               for key, s in report["signals"].items()}  # fmt: skip
    return {"overrides": overrides, "iteration": report["iteration"], "crops": report["crops"],
            "verdict": report["verdict"], "signals": signals, "seconds": round(time.perf_counter() - start, 1),
            "threads": threads, "load_avg_before": load}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="the --work folder of benchmarks/demo_seeds.py")
    parser.add_argument("--seeds", required=True, help="comma-separated demo seeds, e.g. 3,4")
    parser.add_argument("--name", required=True, help="the lever's name in the results file")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="bundle overrides, e.g. learning_rate=2e-4")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of each run")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    malformed = [item for item in args.set if "=" not in item]
    if malformed:
        parser.error(f"--set takes KEY=VALUE, got {malformed}")
    overrides = dict(item.split("=", 1) for item in args.set)
    results = json.loads(args.out.read_text()) if args.out.is_file() else {"benchmark": "demo_ssl_lever", "levers": {}}
    lever = results["levers"].setdefault(args.name, {"commit": git_commit(), "machine": machine_info(), "seeds": {}})
    for seed in (int(s) for s in args.seeds.split(",")):
        if str(seed) in lever["seeds"]:
            continue
        lever["seeds"][str(seed)] = run_seed(args.work, seed, args.name, overrides, args.threads)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"{args.name} seed {seed}: {lever['seeds'][str(seed)]['verdict']}", file=sys.stderr, flush=True)
    return results


if __name__ == "__main__":
    main()
