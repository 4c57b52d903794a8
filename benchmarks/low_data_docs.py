"""The low-data protocol's Markdown tables (both models) and findings, the docs' generated blocks (the tables, the
findings, the intervals' coverage, or a sentence while a summary is not measured), and the plots; protocol v3's
answers per recipe and tables (or "not run yet")."""

from __future__ import annotations

import json
import os
from pathlib import Path

from components.demo.plots import pyplot, save_plot
from low_data_arms import CONTRASTS
from low_data_protocol import HELD_OUT_SETS, MODELS, REPO
from low_data_stats import T_MIN_PAIRS, seeds_for_half_width


def _signed(value: float) -> str:
    return f"{value:+.3f}"


def _model_tables(result: dict, model: str, ks: list[str], target: float) -> list[str]:
    """The lines of one model's tables: per held-out set the mean Dice per arm, then the paired differences."""
    header = "| " + " | ".join(["", *(f"k = {k}" for k in ks)]) + " |\n| " + " | ".join(["---"] * (len(ks) + 1)) + " |"
    lines = []
    for held_out in HELD_OUT_SETS:
        name = held_out.replace("_", "-")
        lines += [f"Held-out mean Dice, {name} set, {model} models (mean +- sd over seeds, n seeds):", "",
                  header.replace("|  |", f"| {name} |", 1)]  # fmt: skip
        for arm, per_k in result["table"].get(held_out, {}).get(model, {}).items():
            cells = [f"{per_k[k]['mean']:.3f} +- {per_k[k]['sd']:.3f} ({per_k[k]['n']})" if k in per_k else "not run" for k in ks]
            lines.append("| " + " | ".join([arm, *cells]) + " |")
        lines += ["", f"Paired differences, {name} set, {model} models: mean [95 % t-interval from {T_MIN_PAIRS} pairs, the "
                      f"range [min, max] below] (n pairs; ~ the seeds a half-width of {target} would take):", "",
                  header.replace("|  |", "| contrast |", 1)]  # fmt: skip
        for contrast, per_k in result["paired"].get(held_out, {}).get(model, {}).items():
            lines.append("| " + " | ".join([contrast, *(_difference_cell(per_k.get(k), target) for k in ks)]) + " |")
        lines.append("")
    return lines


def _difference_cell(entry: dict | None, target: float) -> str:
    if entry is None:
        return "not run"
    if entry["interval"] is None:
        return f"{_signed(entry['mean'])} (n = {entry['n']}: no interval)"
    low, high = entry["interval"]
    kind = "range " if entry["interval_kind"] == "range" else ""
    need = seeds_for_half_width(entry["differences"], target)
    return f"{_signed(entry['mean'])} {kind}[{_signed(low)}, {_signed(high)}] ({entry['n']}; ~{need})"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def measured_markdown(result: dict) -> str:
    """Where and with what code a summary was measured, from the summary alone: its runs' commits, the machine, the
    runs side by side; then its encoders' RankMe (on how many crops, its bound), their centred RankMe and the share of
    the embeddings' norm their mean holds (``low_data_rankme.centred_rank``), and whether RankMe orders them as the
    probes' Dice does at each k. Run times are left out: a plan that runs for hours in resumable pieces shares its
    machine at times."""
    machine, numerics = result["machine"], result["settings"]["numerics"]
    where = numerics["device"].upper()
    if numerics["device"] == "cpu":
        where = f"{machine['cpu_model']}, {machine['cpu_count']} CPUs ({numerics['cpu_capability']})"
    commits = ", ".join(f"{c[:7]}{c[40:]}" for c in result["commits"])  # "+changes": tracked files differed from it
    text = (f"Measured at commit {commits} on {where}, torch {numerics['torch']}, "
            f"MONAI {numerics['monai']}: {_count(len(result['pretraining']), 'pretraining')} and "
            f"{_count(len(result['runs']), 'finetuning run')}, {machine['parallel_runs']} side by side with "
            f"{_count(machine['threads_per_run'], 'thread')} each; the record of every run is committed beside the summary.")  # fmt: skip
    rankme = result["rankme"]
    if rankme["encoders"]:
        encoders = rankme["encoders"].values()
        values = ", ".join(f"{name} {entry['rankme']:.1f}" for name, entry in rankme["encoders"].items())
        shares = ", ".join(f"{100 * entry['mean_share']:.0f} %" for entry in encoders)
        centred = ", ".join(f"{entry['rankme_centred']:.1f}" for entry in encoders)
        orders = "; ".join(f"k = {k}: {', '.join(a['rankme_order'])} by RankMe, {', '.join(a['probe_dice_order'])} by "
                           f"the probes' Dice" for k, a in rankme["agreement_with_probe_arms"].items())  # fmt: skip
        text += (f" RankMe of the encoders on {rankme['crops']} held-out crops (at most {rankme['bound']}): {values}; "
                 f"with the embeddings' mean removed (it holds {shares} of their squared norm): {centred}. Highest RankMe "
                 f"first, {orders}.")
    return text + "\n"


def markdown_tables(result: dict) -> str:
    """The result's tables in Markdown, as the docs show them after :func:`measured_markdown` (a test compares them),
    for the selected models and then for the last ones: per held-out set the held-out mean Dice per arm and k (mean +-
    sd, seeds), then the paired differences with their 95 % t-interval (the range [min, max] below
    :data:`~low_data_stats.T_MIN_PAIRS` pairs) and the seeds the target half-width would take
    (:func:`~low_data_stats.seeds_for_half_width`)."""
    ks = [str(k) for k in result["settings"]["ks"]]
    lines = [line for model in MODELS for line in _model_tables(result, model, ks, result["settings"]["target_half_width"])]
    return "\n".join(lines).rstrip() + "\n"


def _cells(result: dict, contrast: str) -> tuple[list[tuple], list[tuple], int, list[int]]:
    """A contrast's cells (k, held-out set, model) whose 95 % t-interval lies above 0 and below 0, the number of its
    cells with a t-interval, and every cell's number of pairs."""
    above, below, with_t, pairs = [], [], 0, []
    for held_out in HELD_OUT_SETS:
        for model in MODELS:
            for k, entry in result["paired"].get(held_out, {}).get(model, {}).get(contrast, {}).items():
                pairs.append(entry["n"])
                if entry["interval_kind"] != "t95":
                    continue
                with_t += 1
                low, high = entry["interval"]
                if low > 0:
                    above.append((k, held_out, model))
                elif high < 0:
                    below.append((k, held_out, model))
    return above, below, with_t, pairs


def _where(found: list[tuple], cells: int) -> str:
    """``found`` cells out of ``cells``, grouped by k: "in 2 of 8 cells (k = 1: in-domain selected, shifted last)"."""
    if len(found) == cells:
        return f"in all {cells} cells"
    by_k: dict[str, list[str]] = {}
    for k, held_out, model in found:
        by_k.setdefault(k, []).append(f"{held_out.replace('_', '-')} {model}")
    return f"in {len(found)} of {cells} cells ({'; '.join(f'k = {k}: ' + ', '.join(v) for k, v in sorted(by_k.items()))})"


def findings_markdown(result: dict) -> str:
    """What the summary finds, one sentence per baseline (finetuning against ``scratch``, the linear probes against
    ``probe_random``, the frozen arms against theirs when they ran): which pretrained arms are above (or below) their
    baseline beyond the 95 % t-interval of the paired differences, in which cells (k, held-out set, model; the tables
    give the numbers), and in how many each stays within it. Cells below :data:`~low_data_stats.T_MIN_PAIRS` pairs
    have no stated coverage and are counted, never ranked. Generated, so that the docs' verdict is the JSON's."""
    present = {contrast for per_model in result["paired"].values() for per_contrast in per_model.values()
               for contrast in per_contrast}  # fmt: skip
    by_baseline: dict[str, list[tuple[str, tuple]]] = {}
    for contrast, (arm, baseline) in CONTRASTS.items():
        if contrast in present:
            by_baseline.setdefault(baseline, []).append((arm, _cells(result, contrast)))
    ns = sorted({n for arms in by_baseline.values() for _, (*_, pairs) in arms for n in pairs})
    seeds = f"{ns[0]}" if len(ns) == 1 else f"{ns[0]}-{ns[-1]}"
    sentences = []
    for baseline, arms in by_baseline.items():
        parts, winners = [], []
        for arm, (above, below, with_t, pairs) in arms:
            cells = len(pairs)
            winners += [arm] if above else []
            said = ([f"above {_where(above, cells)}"] if above else []) + ([f"below {_where(below, cells)}"] if below else [])
            within = with_t - len(above) - len(below)
            if not said:
                said.append(f"within its interval in {'all ' if within == cells else f'{within} of '}{cells} cells")
            if with_t < cells:
                said.append(f"{cells - with_t} without a t-interval")
            parts.append(f"{arm} {', '.join(said)}")
        names = ", ".join(winners[:-1]) + " and " + winners[-1] if len(winners) > 1 else "".join(winners)
        lead = (f"{names} beat{'s' if len(winners) == 1 else ''} {baseline} beyond the 95 % t-interval"
                if winners else f"No arm beats {baseline} beyond its 95 % t-interval")
        sentences.append(f"{lead} ({seeds} paired seeds per cell): {'; '.join(parts)}.")
    return " ".join(sentences) + "\n"


_COVERAGE_ROWS = {
    "bootstrap95": "percentile bootstrap (the old protocol's, called 95 %)",
    "t95": f"Student t, 95 % (from {T_MIN_PAIRS} pairs)",
    "range": f"range [min, max] (below {T_MIN_PAIRS} pairs; never called 95 %)",
}


def coverage_markdown(result: dict) -> str:
    """The table of a summary's ``coverage`` (:func:`~low_data_stats.coverage`): per interval and n, the mean share of
    draws that covered the population mean over the contrasts, the lowest in brackets."""
    cov = result["coverage"]
    ns = list(cov["by_n"])
    sizes = " or ".join(str(s) for s in cov["population_sizes"])
    lines = [f"Coverage of the mean paired difference, simulated: each of {cov['populations']} contrasts' {sizes} paired "
             f"differences is a population; {cov['draws']} times n are drawn from it with replacement and the interval is "
             f"computed (bootstrap: {cov['bootstrap_resamples']} resamples). Share of draws covering the population mean, "
             "mean over the contrasts (the lowest):", "",
             "| interval | " + " | ".join(f"n = {n}" for n in ns) + " |", "| --- |" + " --- |" * len(ns)]  # fmt: skip
    for kind, label in _COVERAGE_ROWS.items():
        cells = [f"{cov['by_n'][n][kind]['mean']:.3f} ({cov['by_n'][n][kind]['min']:.3f})" for n in ns]
        lines.append("| " + " | ".join([label, *cells]) + " |")
    return "\n".join(lines) + "\n"


def not_measured(name: str) -> str:
    """What a tables block says while its summary does not exist: one sentence."""
    return f"The new protocol has not been measured at this commit: its summary {name} does not exist yet."


# ---------------------------------------------------------------------------------------------------- protocol v3

def not_run_yet(name: str) -> str:
    """What a protocol v3 block says while its summary does not exist: one sentence."""
    return f"Protocol v3 has not run yet: no record of its plan exists at this commit ({name} is written by its first piece)."


def _gain(entry: dict) -> str:
    low, high = entry["interval"]
    return f"{entry['mean']:+.3f} [{low:+.3f}, {high:+.3f}]"


def _verdict(entry: dict) -> str:
    return entry["verdict"] if entry.get("verdict") else f"verdict withheld: {entry.get('withheld') or 'no interval'}"


def _pretraining_iterations(settings: dict) -> int:
    from components.data.synthetic import split_sizes

    budget = settings["budget"]
    return budget["ssl_epochs"] * (split_sizes(budget["num_unlabeled"])[0] // budget["ssl_batch"])


def _units(result: dict, n: int) -> str:
    s = result["settings"]
    return (f"{_count(n, 'pretraining')} x {_count(s['finetune_seeds'], 'finetuning seed')} of their own x {len(s['ks'])} k x "
            f"{len(HELD_OUT_SETS)} held-out sets")


def answers_markdown(result: dict, name: str, link: str | None = None) -> str:
    """Protocol v3's answer per recipe, one sentence each, from its summary: the primary contrast (the mean gain in
    held-out Dice over scratch of the selected models, pooled over k and both held-out sets, with its t-interval over
    pretrainings and its verdict; its estimand is the gain of a pretraining that passed the health check, so the
    sentence says how many of those tried passed), the linear probe's gain over a random encoder's (secondary, its Bonferroni level),
    for a matched recipe its gain over its demo recipe; or the recipe's status (not evaluated: too few encoders passed
    health; incomplete). Then where the data, budgets and machine are, linked at ``link`` (default ``name``)."""
    s = result["settings"]
    lines = [f"Protocol v3 (pre-registered; selected models, gain in held-out Dice, {100 * s['level']:.0f} % t-interval over "
             f"pretrainings, equivalence margin +-{s['margin']}):", ""]  # fmt: skip
    for recipe, entry in result["recipes"].items():
        primary = entry.get("primary")
        if primary is None or not primary["n"]:
            lines.append(f"- {entry['name']}: {entry['status']}{'' if primary is None else ', no pretraining finetuned yet'}.")
            continue
        if primary["interval"] is None:
            lines.append(f"- {entry['name']}: {primary['mean']:+.3f} over scratch from {_count(primary['n'], 'pretraining')}, "
                         f"no interval below 2 ({entry['status']}).")  # fmt: skip
            continue
        cells = entry["secondary"]["cells"]
        tried = len(entry["pretrainings"])
        sentence = (f"- {entry['name']}: {_gain(primary)} over scratch ({_verdict(primary)}) on {_units(result, primary['n'])}, "
                    f"among pretrainings that passed the health check ({primary['n']} of {tried} tried)")  # fmt: skip
        probe = cells[f"probe_{recipe} - probe_random, pooled, selected"]
        level = f"{100 * entry['secondary']['level']:.2f} % {entry['secondary']['correction']} interval"
        if probe["interval"] is not None:
            sentence += f"; its linear probe {_gain(probe)} over a random encoder's (secondary, {level}: {_verdict(probe)})"
        for cell_name, cell in cells.items():
            if cell_name.startswith(f"{recipe} - ") and ", pooled," in cell_name and cell["interval"] is not None:
                other = cell_name.split(" - ")[1].split(",")[0]
                sentence += f"; against {result['recipes'][other]['name']} {_gain(cell)} (secondary, {level}: {_verdict(cell)})"
        lines.append(sentence + ".")
    commits = ", ".join(c[:7] + c[40:] for c in result["commits"]) or "none"
    done = "all its runs" if result["complete"] else f"{len(result['runs'])} finetuning runs, {len(result['missing_runs'])} still missing"
    lines += ["", f"Data, budgets and machine: [{Path(name).name}]({Path(link or name).as_posix()}) (pretraining {_pretraining_iterations(s):,} "
                  f"iterations, finetuning {s['finetune_iterations']}; {result['machine']['cpu_model']}, "
                  f"{s['numerics']['device']}; commits {commits}; {done})."]  # fmt: skip
    return "\n".join(lines) + "\n"


def _registration_line(status: dict) -> str:
    """Whether every record follows the pre-registration commit and the analysis code is the pre-registered one
    (``low_data_plan.preregistration_status``)."""
    if status["commit"] is None:
        return "Not pre-registered: no verdict is given."
    changed = status.get("analysis_changed")
    code = f" The analysis code changed since ({', '.join(changed)}): every verdict is withheld." if changed else ""
    if status["records_after"]:
        return f"Pre-registered at commit {status['commit']}: every record was made at it or a commit after it.{code}"
    return (f"Pre-registered at commit {status['commit']}; records made at {', '.join(status['not_after'])} do not follow "
            f"it: every verdict is withheld.{code}")  # fmt: skip


def protocol3_markdown(result: dict) -> str:
    """Protocol v3's tables: every pretraining and its health gate, the units done, the primary contrasts, each recipe's secondary
    cells, the convergence of the finetuning (``scratch``) and of the probe heads (``probe_random``), and the
    simulated coverage per cell kind."""
    s = result["settings"]
    lines = [_registration_line(result.get("preregistration")), ""] if result.get("preregistration") else []
    lines += ["Pretrainings and the health gate (the last health report of each run; passing: "
             f"{', '.join(s['passing'])}):", "", "| recipe | seed | verdict | passed | signals at baseline or collapsed |",
             "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for entry in result["recipes"].values():
        for p in entry["pretrainings"]:
            failing = [f"{n} {v['value']:.3g} vs {v['baseline']:.3g}" for n, v in ((p["health"] or {}).get("signals") or {}).items()
                       if v.get("verdict") in ("at baseline", "collapsed")]  # fmt: skip
            if (p["health"] or {}).get("stopped_by"):
                failing.append(f"stopped by {p['health']['stopped_by']}: {p['health']['message']}")
            lines.append(f"| {entry['name']} | {p['seed']} | {p['verdict']} | {'yes' if p['passed'] else 'no'} | {'; '.join(failing) or '-'} |")
    lines += ["", "Units done (a pretraining that passed the gate with its finetuned and probe runs over its block and "
                  "the block's baselines; one that failed is done):", "", "| recipe | seed | health | runs | done |",
              "| --- | --- | --- | --- | --- |"]  # fmt: skip
    lines += [f"| {result['recipes'][u['recipe']]['name']} | {u['seed']} | {u['verdict']} | {u['runs_done']} of {u['runs_needed']} | "
              f"{'yes' if u['complete'] else 'no'} |" for u in result.get("units", [])]  # fmt: skip
    lines += ["", f"Primary contrasts (recipe - scratch, selected models, pooled over k and both held-out sets; "
                  f"{100 * s['level']:.0f} % t-interval over the pretrainings' means; margin +-{s['margin']}):", "",
              "| recipe | status | gain [interval] | pretrainings | verdict |", "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for entry in result["recipes"].values():
        primary = entry.get("primary")
        gain = _gain(primary) if primary and primary["interval"] else "-"
        lines.append(f"| {entry['name']} | {entry['status']} | {gain} | {primary['n'] if primary else 0} | "
                     f"{_verdict(primary) if primary else '-'} |")  # fmt: skip
    for entry in result["recipes"].values():
        if "secondary" not in entry:
            continue
        sec = entry["secondary"]
        lines += ["", f"Secondary cells of {entry['name']} ({sec['m']} cells, {sec['correction']}: each interval at "
                      f"{100 * sec['level']:.2f} %):", "", "| cell | gain [interval] | verdict |", "| --- | --- | --- |"]  # fmt: skip
        lines += [f"| {cell} | {_gain(e) if e['interval'] else '-'} | {_verdict(e)} |" for cell, e in sec["cells"].items()]
    lines += ["", f"Convergence (the last quarter of the validations gains less than {s['convergence_gain']} over the "
                  "quarter before; mean curve over the finetuning seeds):", "", "| arm | k | last-quarter gain | converged |",
              "| --- | --- | --- | --- |"]  # fmt: skip
    for arm, per_k in result["convergence"].items():
        for k, e in per_k.items():
            gain = "-" if e["last_quarter_gain"] is None else f"{e['last_quarter_gain']:+.4f}"
            lines.append(f"| {arm} | {k} | {gain} | {'-' if e['converged'] is None else 'yes' if e['converged'] else 'no'} |")
    lines += ["", "Coverage of the intervals, simulated from each cell's fitted variance components (normal draws; "
                  "finetuning residuals resampled):", "",
              "| cell kind | nominal | normal: covered (lowest) | resampled: covered (lowest) | populations |",
              "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for kind, c in result["coverage"].items():
        if c is None:
            lines.append(f"| {kind} | - | not simulated: no recipe with 2 passing pretrainings yet | - | 0 |")
            continue
        nominal = ", ".join(f"{v:.4f}" for v in c["nominal"])
        shares = " | ".join(f"{c[name]['mean']:.3f} ({c[name]['min']:.3f})" for name in ("normal", "resampled"))
        lines.append(f"| {kind} | {nominal} | {shares} | {c['populations']} |")
    return "\n".join(lines) + "\n"


def pilot_markdown(result: dict) -> str:
    """The pilot's convergence table (``low_data.py --pilot``): per budget, arm and k the last-quarter gain of the
    mean validation curve and whether it converged, then the smallest budget at which both arms converged at every k."""
    lines = [f"Pilot ({result['rule']}; scratch and the random encoder's probe, mean curve over the finetuning seeds):", "",
             "| iterations | arm | k | last-quarter gain | converged |", "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for budget, arms in result["convergence"].items():
        for arm, per_k in arms.items():
            for k, e in per_k.items():
                gain = "-" if e["last_quarter_gain"] is None else f"{e['last_quarter_gain']:+.4f}"
                lines.append(f"| {budget} | {arm} | {k} | {gain} | {'-' if e['converged'] is None else 'yes' if e['converged'] else 'no'} |")
    smallest = result["smallest_converged_budget"]
    skipped = f" (not run: {', '.join(map(str, result['not_run']))}, as a smaller budget converged)" if smallest and result.get("not_run") else ""
    lines += ["", f"Smallest budget at which both converged at every k: {smallest if smallest else 'none of those run'}"
                  f"{'' if result['complete'] else ' (the pilot is not complete)'}{skipped}."]  # fmt: skip
    return "\n".join(lines) + "\n"


TABLES_BLOCK = "<!-- low_data tables: python benchmarks/low_data.py --markdown {summary} --write_docs ... -->"
COVERAGE_BLOCK = "<!-- low_data coverage: python benchmarks/low_data.py --markdown {summary} --write_docs ... -->"
FINDINGS_BLOCK = "<!-- low_data findings: python benchmarks/low_data.py --markdown {summary} --write_docs ... -->"
ANSWERS_BLOCK = "<!-- low_data answers: python benchmarks/low_data.py --markdown {summary} --write_docs ... -->"
PROTOCOL3_BLOCK = "<!-- low_data protocol3: python benchmarks/low_data.py --markdown {summary} --write_docs ... -->"
BLOCKS = {"tables": TABLES_BLOCK, "coverage": COVERAGE_BLOCK, "findings": FINDINGS_BLOCK, "answers": ANSWERS_BLOCK,
          "protocol3": PROTOCOL3_BLOCK}


def block_end(kind: str) -> str:
    """The line that ends a generated block of ``kind`` ("tables", "coverage" or "findings")."""
    return f"<!-- /low_data {kind} -->"


def block_content(kind: str, summary: Path, name: str, link: str | None = None) -> str:
    """What a block of ``kind`` shows for ``summary`` (called ``name`` in the docs): where it was measured
    (:func:`measured_markdown`) and its tables (both models), or its findings (:func:`findings_markdown`), either
    :func:`not_measured` while it does not exist; or its coverage table. Protocol v3's blocks: its answers
    (:func:`answers_markdown`) or its tables (:func:`protocol3_markdown`), either :func:`not_run_yet` while it does not
    exist; a summary of a plan under way shows its finished units and says how many runs are missing. ``link``: the
    summary's path relative to the document (default ``name``).

    Raises:
        ValueError: for the tables or findings of a summary marked superseded (never shown as current) or not complete
            (a piece of its plan), or a coverage block of a summary without ``coverage``.
    """
    if kind in ("answers", "protocol3"):
        if not summary.is_file():
            return not_run_yet(name)
        result = json.loads(summary.read_text())
        if result.get("protocol") != 3:
            raise ValueError(f"{name} is no protocol v3 summary: its {kind} block cannot show it.")
        return answers_markdown(result, name, link) if kind == "answers" else protocol3_markdown(result)
    if kind in ("tables", "findings") and not summary.is_file():
        return not_measured(name)
    result = json.loads(summary.read_text())
    if kind == "coverage":
        if "coverage" not in result:
            raise ValueError(f"{name} has no coverage: python benchmarks/low_data.py --coverage {name} --results <its records>.")
        return coverage_markdown(result)
    if "superseded" in result:
        raise ValueError(f"{name} is superseded ({result['superseded']}): its tables are not shown as current.")
    if not result["complete"]:
        raise ValueError(f"{name} is not complete ({len(result['missing_runs'])} runs missing): run its plan to the end first.")
    return findings_markdown(result) if kind == "findings" else measured_markdown(result) + "\n" + markdown_tables(result)


def write_doc_tables(doc: Path, summary: Path) -> bool:
    """Replaces the generated blocks of ``summary`` in ``doc`` (between a :data:`BLOCKS` line naming it and
    :func:`block_end`) by :func:`block_content`; True when the file changed.

    Raises:
        ValueError: for a document without any block of this summary, or what :func:`block_content` refuses.
    """
    text = original = doc.read_text()
    resolved = summary.resolve()
    name = resolved.relative_to(REPO).as_posix() if resolved.is_relative_to(REPO) else summary.as_posix()
    found = False
    for kind, line in BLOCKS.items():
        begin = line.format(summary=name)
        if begin in text:
            head, rest = text.split(begin, 1)
            _, tail = rest.split(block_end(kind), 1)
            link = os.path.relpath(resolved, doc.resolve().parent)
            text = f"{head}{begin}\n\n{block_content(kind, summary, name, link).rstrip()}\n\n{block_end(kind)}{tail}"
            found = True
    if not found:
        raise ValueError(f"{doc} has no block of {name} (a line {TABLES_BLOCK.format(summary=name)!r}).")
    doc.write_text(text)
    return text != original


def plots(tables: dict, curves: dict, out: Path) -> None:
    """``low_data.png`` (held-out Dice of the selected models against k, per arm and set) and ``curves.png`` (the
    scratch and SSL arms' mean validation curves: does the budget let them converge) under ``out``."""
    fig, axes = pyplot().subplots(1, 2, figsize=(11, 4))
    for ax, held_out in zip(axes, HELD_OUT_SETS):
        for arm, per_k in tables.get(held_out, {}).get("selected", {}).items():
            ks = sorted(per_k, key=int)
            ax.errorbar([int(k) for k in ks], [per_k[k]["mean"] for k in ks], yerr=[per_k[k]["sd"] for k in ks],
                        marker="o", capsize=3, label=arm)  # fmt: skip
        ax.set_xscale("log", base=2)
        save_plot(fig, ax, out / "low_data.png", "labeled training volumes (k)", "held-out mean Dice",
                  f"{held_out} held-out set (selected models; mean, sd)", fontsize=7)  # fmt: skip
    fig, ax = pyplot().subplots(figsize=(6, 4))
    for k, entry in sorted(curves.get("scratch", {}).items(), key=lambda kv: int(kv[0])):
        ax.plot(*zip(*entry["mean_curve"]), marker="o", label=f"scratch, k = {k}")
    for k, entry in sorted(curves.get("ssl", {}).items(), key=lambda kv: int(kv[0])):
        ax.plot(*zip(*entry["mean_curve"]), "--", label=f"ssl, k = {k}")
    save_plot(fig, ax, out / "curves.png", "finetuning iteration", "validation mean Dice (mean over seeds)",
              "the finetuning budget: validation curves", fontsize=7)  # fmt: skip
