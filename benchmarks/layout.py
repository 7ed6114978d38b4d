"""The results page's tables: each a definition of which figure every cell shows.

A cell's figure is chosen among the kept results by what the table, its row and its column say
together (benchmark, subject, unit, labels, host kind): in the newest result of the host kind
that matches, the one figure that matches. Nothing is typed into a cell but the words a
definition gives it; a cell whose figure no result holds stops the page (``Missing``), as do two
results of one date or two figures that both match, so that every number on the page comes
from one result, named under its table with the date, commit, host and command of the run.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

from etinfer.bench.common.results import Figure, Label, Result


class Missing(LookupError):
    """A cell whose figure no kept result holds."""


@dataclass(frozen=True, eq=False)
class Kept:
    """A kept result and its file's name under ``benchmarks/results/``."""

    name: str
    result: Result


@dataclass(frozen=True)
class Pick:
    """What a cell selects; fields left None are taken from the row, then from the table."""

    benchmark: str | None = None
    subject: str | None = None
    unit: str | None = None
    kind: str | None = None  # Host.kind: "AVX2", "AVX2 (held)", "AVX-512" or the GPU's name
    labels: Mapping[str, Label] = field(default_factory=dict)  # None: the label is absent
    decimals: int | None = None  # fixed decimals; the figure's shortest form otherwise
    note: str | None = None  # a label whose value follows the figure in parentheses
    prefix: str | None = None
    suffix: str | None = None
    bare: bool | None = None  # the value alone: no spread, no unit
    checked: bool | None = None  # False: shown beside the claim, not held to it
    # The kept result's name (``fidelity/2026-11-28-19b6207-passkeys-by-law.json``), where a
    # table shows one run among newer ones of the same figures under other settings.
    result: str | None = None

    def under(self, outer: Pick) -> Pick:
        """This pick, its unset fields taken from ``outer`` (labels from both, this one's first)."""
        taken = {}
        for f in fields(self):
            if f.name != "labels":
                value = getattr(self, f.name)
                taken[f.name] = getattr(outer, f.name) if value is None else value
        return Pick(**taken, labels={**outer.labels, **self.labels})

    def fits(self, kept: Kept, figure: Figure) -> bool:
        result = kept.result
        return (
            self.benchmark in (None, result.benchmark)
            and self.subject in (None, figure.subject)
            and self.unit in (None, figure.unit)
            and self.kind in (None, result.host.kind)
            and self.result in (None, kept.name)
            and all(figure.labels.get(k) == v for k, v in self.labels.items())
        )


@dataclass(frozen=True)
class Ratio:
    """One figure over another of the same result (for results that kept only the two)."""

    num: Pick
    den: Pick
    suffix: str = ""

    def under(self, outer: Pick) -> Ratio:
        return Ratio(self.num.under(outer), self.den.under(outer), self.suffix)


@dataclass(frozen=True)
class Parts:
    """Several figures in one cell."""

    parts: tuple[Pick | Ratio, ...]
    sep: str = " / "

    def under(self, outer: Pick) -> Parts:
        return Parts(tuple(p.under(outer) for p in self.parts), self.sep)


Cell = Pick | Ratio | Parts | str  # a string is shown as it is


@dataclass(frozen=True)
class Claim:
    """What a row's figure of one subject must satisfy for its claim to hold."""

    op: str  # "<=", ">=", "<" or ">"
    value: float | Pick  # a Pick compares with another figure


@dataclass(frozen=True)
class Column:
    header: str
    cell: Cell = field(default_factory=Pick)
    key: str = ""  # how rows name the column; its header unless given
    # A verdict: each group's figures (a column's name, or several checked together) against
    # the row's claims, "yes" or "no" a group.
    holds: tuple[str | tuple[str, ...], ...] = ()

    @property
    def name(self) -> str:
        return self.key or self.header


@dataclass(frozen=True)
class Row:
    lead: tuple[str, ...]  # the row's first cells, as written
    pick: Pick = field(default_factory=Pick)
    cells: Mapping[str, Cell] = field(default_factory=dict)  # by column name, over the column's
    claims: Mapping[str, Claim] = field(default_factory=dict)  # by subject


@dataclass(frozen=True)
class Table:
    name: str  # its placeholder in the page's prose
    lead: tuple[str, ...]  # the headers of the rows' first cells
    columns: tuple[Column, ...]
    rows: tuple[Row, ...]
    pick: Pick = field(default_factory=Pick)


def choose(pick: Pick, kept: Sequence[Kept]) -> tuple[Kept, Figure]:
    """The one figure ``pick`` selects: in the newest result of its host kind."""
    found = [(k, f) for k in kept for f in k.result.figures if pick.fits(k, f)]
    newest = _newest(pick, {k.name: k for k, _ in found}.values())
    figures = [f for k, f in found if k is newest]
    if len(figures) > 1:
        raise ValueError(f"{pick} matches {len(figures)} figures of {newest.name}")
    return newest, figures[0]


def choose_ratio(ratio: Ratio, kept: Sequence[Kept]) -> tuple[Kept, float]:
    both = [k for k in kept if _holds(ratio.num, k) and _holds(ratio.den, k)]
    newest = _newest(ratio.num, both)
    num = choose(ratio.num, [newest])[1].value
    return newest, num / choose(ratio.den, [newest])[1].value


def _holds(pick: Pick, kept: Kept) -> bool:
    return any(pick.fits(kept, f) for f in kept.result.figures)


def _newest(pick: Pick, candidates) -> Kept:
    candidates = list(candidates)
    if not candidates:
        raise Missing(f"no kept result holds {pick}")
    kinds = {k.result.host.kind for k in candidates}
    if len(kinds) > 1:
        raise ValueError(f"{pick} matches results of several host kinds {sorted(kinds)}: name one")
    date = max(k.result.date for k in candidates)
    top = [k for k in candidates if k.result.date == date]
    if len(top) > 1:
        raise ValueError(f"{pick}: {', '.join(k.name for k in top)} are of one date; keep one")
    return top[0]


@dataclass
class Shown:
    """A rendered cell: its text, the results it came from and the figures it shows."""

    text: str
    sources: list[Kept] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)


def show(cell: Cell, outer: Pick, kept: Sequence[Kept]) -> Shown:
    if isinstance(cell, str):
        return Shown(cell)
    cell = cell.under(outer)
    if isinstance(cell, Parts):
        shown = [show(p, Pick(), kept) for p in cell.parts]
        return Shown(
            cell.sep.join(s.text for s in shown),
            [k for s in shown for k in s.sources],
            [f for s in shown for f in s.figures],
        )
    if isinstance(cell, Ratio):
        source, value = choose_ratio(cell, kept)
        return Shown(f"{number(value, 2)}x{cell.suffix}", [source])
    source, figure = choose(cell, kept)
    return Shown(describe(figure, cell), [source], [] if cell.checked is False else [figure])


def describe(figure: Figure, pick: Pick) -> str:
    """A figure as a cell shows it: its value, unit, spread and the label the column notes."""
    unit = {"x": "x", "%": " %"}.get(figure.unit, "")

    def num(value: float) -> str:
        least = (2 if abs(value) < 10 else 1) if figure.unit == "x" else 0
        return number(value, pick.decimals, least)

    value, spread = num(figure.value), figure.spread or {}
    if pick.bare:
        text = value
    elif "min" in spread and spread["min"] != spread["max"]:
        low = f"{num(spread['min'])}-{num(spread['max'])}"
        text = f"{low}{unit}" if figure.value == spread["min"] else f"{value}{unit} ({low})"
    elif "ci95" in spread and (figure.n or 0) < 2:  # one repeat: its own interval, not an sd of 0
        text = f"{value}{unit} [{num(spread['ci95'][0])}, {num(spread['ci95'][1])}]"
    elif "sd" in spread:
        text = f"{value} ± {num(spread['sd'])}{unit}"
    elif "ci95" in spread:
        text = f"{value}{unit} [{num(spread['ci95'][0])}, {num(spread['ci95'][1])}]"
    elif figure.unit == "count" and figure.n is not None:
        text = f"{value}/{figure.n}"
    else:  # a range of one value is that value
        text = value + unit
    if pick.note:
        text += f" ({figure.labels[pick.note]})"
    return f"{pick.prefix or ''}{text}{pick.suffix or ''}"


def number(value: float, decimals: int | None = None, least: int = 0) -> str:
    """``decimals`` fixed, or the shortest form that reads back as ``value`` (at least
    ``least`` decimals), with thousands separated as the page writes them."""
    if decimals is not None:
        return f"{value:,.{decimals}f}"
    text = repr(float(value))
    if "e" in text:
        mantissa, exponent = text.split("e")
        return f"{mantissa.removesuffix('.0')}e{int(exponent)}"
    whole, _, frac = text.partition(".")
    frac = "" if frac == "0" else frac
    frac = frac.ljust(least, "0")
    return f"{int(whole):,}" + (f".{frac}" if frac else "")


_OPS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt}


def verdict(row: Row, outer: Pick, shown: Sequence[Shown], kept: Sequence[Kept]) -> str:
    """ "yes" where every figure of the shown cells that a claim names satisfies it."""
    checks = []
    for figure in (f for s in shown for f in s.figures):
        claim = row.claims.get(figure.subject)
        if claim is None:
            continue
        bound = claim.value
        if isinstance(bound, Pick):
            bound = choose(bound.under(outer), kept)[1].value
        checks.append(_OPS[claim.op](figure.value, bound))
    if not checks:
        return "-"
    return "yes" if all(checks) else "no"


def table_cells(table: Table, kept: Sequence[Kept]) -> list[list[Shown]]:
    """Every cell of the table, row by row: a row's pick or parts add to its column's pick,
    anything else it gives replaces it; a verdict column checks the cells it names."""
    cells = []
    for row in table.rows:
        outer = row.pick.under(table.pick)
        shown: dict[str, Shown] = {}
        for column in (c for c in table.columns if not c.holds):
            spec, base = row.cells.get(column.name), column.cell
            if spec is None:
                shown[column.name] = show(base, outer, kept)
            else:
                adds = isinstance(base, Pick) and isinstance(spec, Pick | Parts)
                shown[column.name] = show(spec, base.under(outer) if adds else outer, kept)
        for column in (c for c in table.columns if c.holds):
            if column.name in row.cells:  # the row's words in place of a verdict
                shown[column.name] = show(row.cells[column.name], outer, kept)
                continue
            groups = ((g,) if isinstance(g, str) else g for g in column.holds)
            checked = [verdict(row, outer, [shown[key] for key in group], kept) for group in groups]
            shown[column.name] = Shown(" / ".join(checked))
        cells.append([shown[c.name] for c in table.columns])
    return cells
