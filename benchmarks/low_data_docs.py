"""The low-data protocol's Markdown tables, the generated blocks of the docs, and the plots."""

from __future__ import annotations

import json
from pathlib import Path

from components.demo import pyplot, save_plot
from low_data_protocol import HELD_OUT_SETS, MODELS, REPO
from low_data_stats import T_MIN_PAIRS, seeds_for_half_width

def _signed(value: float) -> str:
    return f"{value:+.3f}"


def markdown_tables(result: dict, model: str = "selected") -> str:
    """The result's tables in Markdown, as README.md and benchmarks/README.md show them (a test compares them):
    held-out mean Dice per arm and k (mean +- sd, seeds), then the paired differences with their 95 % t-interval (the
    range [min, max] below :data:`~low_data_stats.T_MIN_PAIRS` pairs) and the seeds the target half-width would take
    (:func:`seeds_for_half_width`), for both held-out sets, for ``model`` ("selected" or "last")."""
    ks = [str(k) for k in result["settings"]["ks"]]
    target = result["settings"]["target_half_width"]
    header = "| " + " | ".join(["", *(f"k = {k}" for k in ks)]) + " |\n| " + " | ".join(["---"] * (len(ks) + 1)) + " |"
    lines = []
    for held_out in HELD_OUT_SETS:
        lines += [f"Held-out mean Dice, {held_out.replace('_', '-')} set, {model} models (mean +- sd over seeds, n seeds):", "",
                  header.replace("|  |", f"| {held_out.replace('_', '-')} |", 1)]  # fmt: skip
        for arm, per_k in result["table"].get(held_out, {}).get(model, {}).items():
            cells = [f"{per_k[k]['mean']:.3f} +- {per_k[k]['sd']:.3f} ({per_k[k]['n']})" if k in per_k else "not run" for k in ks]
            lines.append("| " + " | ".join([arm, *cells]) + " |")
        lines += ["", f"Paired differences, {held_out.replace('_', '-')} set, {model} models: mean [95 % t-interval from "
                      f"{T_MIN_PAIRS} pairs, the range [min, max] below] (n pairs; ~ the seeds a half-width of {target} would "
                      "take):", "",
                  header.replace("|  |", "| contrast |", 1)]  # fmt: skip
        for contrast, per_k in result["paired"].get(held_out, {}).get(model, {}).items():
            cells = []
            for k in ks:
                entry = per_k.get(k)
                if entry is None:
                    cells.append("not run")
                elif entry["interval"] is None:
                    cells.append(f"{_signed(entry['mean'])} (n = {entry['n']}: no interval)")
                else:
                    low, high = entry["interval"]
                    kind = "range " if entry["interval_kind"] == "range" else ""
                    need = seeds_for_half_width(entry["differences"], target)
                    cells.append(f"{_signed(entry['mean'])} {kind}[{_signed(low)}, {_signed(high)}] ({entry['n']}; ~{need})")
            lines.append("| " + " | ".join([contrast, *cells]) + " |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


DOC_BLOCK = "<!-- low_data {model} tables: python benchmarks/low_data.py --markdown {summary} --write_docs ... -->"
DOC_BLOCK_END = "<!-- /low_data {model} tables -->"


def write_doc_tables(doc: Path, summary: Path) -> bool:
    """Replaces the generated table blocks of ``doc`` (between :data:`DOC_BLOCK` and :data:`DOC_BLOCK_END` markers,
    one per model) by the tables of ``summary``; True when the file changed.

    Raises:
        ValueError: for a document without any block of this summary.
    """
    text = original = doc.read_text()
    result = json.loads(summary.read_text())
    name = summary.resolve().relative_to(REPO).as_posix() if summary.resolve().is_relative_to(REPO) else summary.as_posix()
    found = False
    for model in MODELS:
        begin, end = DOC_BLOCK.format(model=model, summary=name), DOC_BLOCK_END.format(model=model)
        if begin in text:
            head, rest = text.split(begin, 1)
            _, tail = rest.split(end, 1)
            text = f"{head}{begin}\n\n{markdown_tables(result, model)}\n{end}{tail}"
            found = True
    if not found:
        raise ValueError(f"{doc} has no block of {name} (a line {DOC_BLOCK.format(model='selected', summary=name)!r}).")
    doc.write_text(text)
    return text != original


def plots(tables: dict, intervals: dict, curves: dict, out: Path) -> None:
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
