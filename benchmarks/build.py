"""BENCHMARKS.md, built: the page's prose with each table rendered in its place, the runs behind
every table named under it, and the list of every kept result at the end."""

from __future__ import annotations

import argparse
import difflib
import string
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.layout import Kept, Shown, Table, number, table_cells
from benchmarks.tables import TABLES
from etinfer.bench.common.results import Result

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
PAGE = HERE / "page"
TARGET = HERE.parent / "BENCHMARKS.md"
SUPERSCRIPT = str.maketrans("0123456789,", "⁰¹²³⁴⁵⁶⁷⁸⁹˒")


def kept_results(folder: Path = RESULTS) -> list[Kept]:
    return [
        Kept(path.relative_to(folder).as_posix(), Result.read(path))
        for path in sorted(folder.rglob("*.json"))
    ]


def render(results: Path = RESULTS, page: Path = PAGE) -> str:
    kept = kept_results(results)
    prose = "".join(p.read_text() for p in sorted(page.glob("*.md")))
    template = string.Template(prose)
    named = set(template.get_identifiers())
    unused = set(TABLES) - named
    if unused:
        raise ValueError(f"tables defined but placed nowhere on the page: {sorted(unused)}")
    fills = {name: render_table(table, kept) for name, table in TABLES.items()}
    return template.substitute(fills, runs=runs_list(kept))


def render_table(table: Table, kept: Sequence[Kept]) -> str:
    """The table in Markdown, then the run behind each figure: its date, commit, host kind, CPU,
    L3 and command (numbered by superscripts where the table shows several runs)."""
    cells = table_cells(table, kept)
    sources: list[Kept] = []
    for kept_one in (k for row in cells for s in row for k in s.sources):
        if kept_one not in sources:
            sources.append(kept_one)
    several = len(sources) > 1

    def text(s: Shown) -> str:
        marks = sorted({sources.index(k) + 1 for k in s.sources})
        mark = ",".join(map(str, marks)).translate(SUPERSCRIPT) if several and marks else ""
        return s.text + mark

    lines = [
        "| " + " | ".join([*table.lead, *(c.header for c in table.columns)]) + " |",
        "|" + "---|" * len(table.lead) + "---:|" * len(table.columns),
    ]
    for row, shown_row in zip(table.rows, cells, strict=True):
        lines.append("| " + " | ".join([*row.lead, *(text(s) for s in shown_row)]) + " |")
    if several:
        runs = (
            f"{str(i).translate(SUPERSCRIPT)} {source_line(k)}" for i, k in enumerate(sources, 1)
        )
        lines += ["", "Runs: " + "; ".join(runs) + "."]
    elif sources:
        lines += ["", f"Run: {source_line(sources[0])}."]
    else:
        raise ValueError(f"table {table.name} shows no figure")
    return "\n".join(lines)


def source_line(kept: Kept) -> str:
    result, host = kept.result, kept.result.host
    l3 = f"L3 {number(host.l3_mib)} MiB" if host.l3_mib else "L3 not recorded"
    parts = [
        result.date,
        f"commit `{result.commit}`" if result.commit else "commit not recorded",
        f"{host.kind}: {host.cpu or 'CPU not recorded'}, {l3}",
        f"`{result.command}`" if result.command else "command not recorded",
    ]
    if result.provenance:
        parts.append("[transcribed](#runs)")
    return ", ".join(parts)


def runs_list(kept: Sequence[Kept]) -> str:
    """Every kept result: its file, date, commit, host and where its figures came from."""
    lines = []
    for k in kept:
        result, host = k.result, k.result.host
        facts = [
            host.cpu or "CPU not recorded",
            f"{host.cores} cores" if host.cores else "cores not recorded",
            f"flags {host.flags}" if host.flags else "flags not recorded",
            f"L3 {number(host.l3_mib)} MiB" if host.l3_mib else "L3 not recorded",
        ]
        if host.isa_held:
            facts.append(f"held to {host.isa_held.upper()}")
        facts.append(f"torch {host.torch}" if host.torch else "torch not recorded")
        if host.device != "cpu":
            facts.append(host.device)
        commit = f"commit `{result.commit}`" if result.commit else "commit not recorded"
        line = f"- `{k.name}`: {result.date}, {commit}; {', '.join(facts)}."
        if result.provenance:
            line += f" {result.provenance[0].upper()}{result.provenance[1:]}."
        lines.append(line)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/render.py", description=__doc__)
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1, printing the difference, where BENCHMARKS.md differs",
    )
    args = parser.parse_args(argv)
    page = render()
    if not args.check:
        TARGET.write_text(page)
        return 0
    committed = TARGET.read_text() if TARGET.exists() else ""
    if committed == page:
        return 0
    diff = difflib.unified_diff(
        committed.splitlines(keepends=True),
        page.splitlines(keepends=True),
        "BENCHMARKS.md (committed)",
        "BENCHMARKS.md (from the results)",
    )
    sys.stdout.writelines(diff)
    return 1
