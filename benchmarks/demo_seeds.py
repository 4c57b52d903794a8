"""The demo over several seeds, one after the other: wall time and peak memory of each whole run, its pretraining's
health verdict and its held-out Dice, written to ``benchmarks/results/demo_cpu.json`` under ``seeds`` and printed
as JSON.

Each seed runs ``python -m components demo --out <work>/seed<N> --seed N`` under ``/usr/bin/time -v`` (the largest
process's peak RSS) and keeps the demo's ``summary.json``. A seed already recorded at this commit is skipped, so that
a stopped measurement resumes; the seeds of another commit move under ``earlier``. The machine's load is recorded before each seed: a timing is a measurement only when
nothing else ran. Other keys of the results file (earlier trials) are kept.

Example::

    python benchmarks/demo_seeds.py --seeds 0,1,2,3,4 --work /tmp/demo_seeds
    python benchmarks/demo_seeds.py --table   # the README's rows from the recorded seeds
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.machine import git_commit, machine_info  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "demo_cpu.json"


def peak_rss_kb(time_report: str) -> int:
    """The ``Maximum resident set size (kbytes)`` of a ``/usr/bin/time -v`` report.

    Raises:
        ValueError: when the report has no such line.
    """
    match = re.search(r"Maximum resident set size \(kbytes\): (\d+)", time_report)
    if match is None:
        raise ValueError("the /usr/bin/time -v report has no 'Maximum resident set size' line")
    return int(match.group(1))


def run_seed(seed: int, work: Path, extra: list[str]) -> dict:
    """One demo run of ``seed`` under ``/usr/bin/time -v``; its wall time, peak RSS and summary."""
    out = work / f"seed{seed}"
    command = ["/usr/bin/time", "-v", sys.executable, "-m", "components", "demo", "--out", str(out), "--seed", str(seed), *extra]
    load = [round(v, 2) for v in os.getloadavg()]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"demo seed {seed} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return {
        "command": " ".join(["/usr/bin/time -v python -m components demo --out demo_out --seed", str(seed), *extra]),
        "wall_s": round(wall, 1), "max_rss_kb": peak_rss_kb(done.stderr), "load_avg_before": load,
        "summary": json.loads((out / "summary.json").read_text()),
    }  # fmt: skip


def measure(seeds: list[int], work: Path, extra: list[str]) -> dict:
    """Runs every seed not yet recorded at this commit and writes the results file after each."""
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    commit = git_commit()
    if results.get("commit") != commit:  # a new measurement; the earlier one is kept under its commit
        if results.get("seeds"):
            earlier = {key: results[key] for key in ("seeds", "machine", "date") if key in results}
            results.setdefault("earlier", {})[results.get("commit", "unknown")] = earlier
        results.update({"benchmark": "demo_seeds", "commit": commit, "seeds": {}})
    results["machine"] = machine_info()
    results["date"] = time.strftime("%Y-%m-%d")
    for seed in seeds:
        if str(seed) in results["seeds"]:
            continue
        results["seeds"][str(seed)] = run_seed(seed, work, extra)
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")
        print(f"seed {seed}: {results['seeds'][str(seed)]['wall_s']} s", file=sys.stderr, flush=True)
    return results


def table(results: dict) -> str:
    """The README's rows: per seed the pretraining's iterations and time, its health verdict, the finetuning's time,
    the whole run's wall time and peak memory, and the held-out Dice (mean and per organ)."""
    lines = []
    for seed, entry in sorted(results["seeds"].items(), key=lambda item: int(item[0])):
        summary = entry["summary"]
        steps = {step["step"]: step["seconds"] for step in summary["steps"]}
        pretraining = next(v for k, v in steps.items() if k.endswith("pretraining"))
        finetuning = next(v for k, v in steps.items() if k.startswith("finetune,"))
        arm = next(iter(summary["arms"].values()))
        organs = " | ".join(f"{v:.2f}" for v in arm["per_class_dice"].values() if v is not None)
        verdict = summary["pretraining_health"]["verdict"]
        lines.append(f"| {seed} | {pretraining:.1f} s | {verdict} | {finetuning:.1f} s | {entry['wall_s']:.0f} s | "
                     f"{entry['max_rss_kb'] / 1e6:.1f} GB | **{arm['mean_dice']:.3f}** | {organs} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--work", default="/tmp/demo_seeds", help="where the demo runs write (outside the repository)")
    parser.add_argument("--table", action="store_true", help="print the README's rows from the recorded seeds")
    args, extra = parser.parse_known_args(argv)
    if args.table:
        print(table(json.loads(RESULTS.read_text())))
        return 0
    print(json.dumps(measure([int(s) for s in args.seeds.split(",")], Path(args.work), extra), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
