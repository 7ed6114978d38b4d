"""BENCHMARKS.md is built from the kept results: the committed page is what they give, byte for
byte; every kept result reads back in the result schema; every figure a table shows comes from a
result, and a missing one stops the page; the page dates its figures by date, commit and host,
never by the order in which the work was done."""

import json
import re
from pathlib import Path

import pytest

from benchmarks.build import PAGE, RESULTS, TARGET, kept_results, render
from benchmarks.layout import Column, Kept, Missing, Pick, Row, Table, choose, table_cells
from benchmarks.tables import TABLES
from etinfer.bench.common.results import Figure, Host, Result

ORDER_WORDS = re.compile(r"\b(session|issue \d+|first day|sixth|seventh|eighth|ninth)\b", re.I)


def test_the_committed_page_is_what_the_results_give():
    assert render() == TARGET.read_text(), "run `python benchmarks/render.py` and commit the page"


def test_every_kept_result_parses_in_the_schema():
    paths = sorted(RESULTS.rglob("*.json"))
    assert paths
    for path in paths:
        result = Result.from_dict(json.loads(path.read_text()))
        assert result.figures, path


def test_every_cell_a_definition_does_not_word_shows_figures_of_results():
    kept = kept_results()
    for table in TABLES.values():
        for row, cells in zip(table.rows, table_cells(table, kept), strict=True):
            for column, shown in zip(table.columns, cells, strict=True):
                worded = isinstance(row.cells.get(column.name, column.cell), str)
                if column.holds or worded:
                    assert not shown.sources
                else:
                    assert shown.sources, (table.name, row.lead, column.header)


def test_a_cell_whose_figure_no_result_holds_stops_the_page():
    nowhere = Column("value", Pick(subject="no such subject"))
    table = Table("t", ("row",), (nowhere,), (Row(("r",)),))
    with pytest.raises(Missing):
        table_cells(table, kept_results())


def test_no_line_of_the_page_dates_a_figure_by_the_order_of_the_work():
    page = TARGET.read_text()
    found = [line for line in page.splitlines() if ORDER_WORDS.search(line)]
    assert not found
    prose = "".join(p.read_text() for p in sorted(PAGE.glob("*.md")))
    assert not ORDER_WORDS.search(prose)


def _kept(name: str, date: str, value: float, flags: str = "avx2 avx512f") -> Kept:
    host = Host("a CPU", flags, None, 2, None, "2.13.0+cpu", "cpu", "3.11")
    figure = Figure("decode", value, "tok/s", {"batch": 1})
    return Kept(name, Result("speed", "etinfer bench speed", date, "abc", host, [figure]))


def test_the_newest_result_of_a_host_kind_wins_and_ties_or_mixed_kinds_stop_the_page():
    older, newer = _kept("a", "2026-11-27", 1.0), _kept("b", "2026-12-01T10:00:00Z", 2.0)
    assert choose(Pick(subject="decode"), [older, newer])[1].value == 2.0
    with pytest.raises(ValueError, match="one date"):
        choose(Pick(subject="decode"), [older, _kept("c", "2026-11-27", 3.0)])
    avx2 = _kept("d", "2026-12-02", 4.0, flags="avx2")
    with pytest.raises(ValueError, match="host kinds"):
        choose(Pick(subject="decode"), [newer, avx2])
    assert choose(Pick(subject="decode", kind="AVX2"), [newer, avx2])[1].value == 4.0


def test_the_readmes_pointers_name_sections_of_the_page():
    lines = TARGET.read_text().splitlines()
    headings = [line.lstrip("#").strip() for line in lines if line.startswith("#")]
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    quoted = re.findall(r'BENCHMARKS\.md, "([^"]+)"|BENCHMARKS\.md \("([^"]+)"', readme)
    names = [a or b for a, b in quoted]
    assert names
    for name in names:
        assert any(h.lower().startswith(name.lower()) for h in headings), name
