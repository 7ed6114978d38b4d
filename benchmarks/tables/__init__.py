"""The page's table definitions, by subject; each module lists its tables in ``TABLES``."""

from benchmarks.layout import Table
from benchmarks.tables import (
    claims,
    cpu,
    formats,
    gpu,
    headline,
    laws,
    one_call,
    pruning_laws,
    seeds,
    serving,
    table1,
    token_selection,
)


def _by_name(*modules) -> dict[str, Table]:
    tables: dict[str, Table] = {}
    for module in modules:
        for table in module.TABLES:
            if table.name in tables:
                raise ValueError(f"two tables named {table.name}")
            tables[table.name] = table
    return tables


TABLES = _by_name(
    headline,
    claims,
    cpu,
    one_call,
    gpu,
    formats,
    laws,
    pruning_laws,
    token_selection,
    table1,
    seeds,
    serving,
)
