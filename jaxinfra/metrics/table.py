"""The one table formatter: `jaxinfra info`, `jaxinfra sweep --dry-run`, `jaxinfra bench` and
benchmarks/*.py all print their tables with `format_table`.

Styles: `plain`, aligned columns joined by `sep`, and `markdown`, GitHub pipe tables (as
benchmarks/RESULTS.md records them). A plain column is as wide as the widest of its header, its
cells and its `width`; so a benchmark that prints rows as they are measured (`header=False`, one
row at a time) stays aligned under a header printed first, as long as its cells fit `width`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, Literal

Style = Literal["plain", "markdown"]


@dataclasses.dataclass(frozen=True)
class Column:
    name: str
    fmt: str = ""  # format spec for cells that are not strings, e.g. ".3f" or "," (thousands)
    align: Literal["<", ">"] = "<"
    width: int = 0  # minimum width (plain style)


def _cell(value: Any, column: Column) -> str:
    if value is None:
        return "-"
    return value if isinstance(value, str) else format(value, column.fmt)


def _markdown_line(texts: Iterable[str]) -> str:
    return "| " + " | ".join(texts) + " |"


def format_table(rows: Iterable[Sequence[Any]], columns: Sequence[Column | str], *, style: Style = "plain",
                 sep: str = "  ", header: bool = True, rule: bool = False) -> str:
    """Rows (one value per column; None prints as '-') under the columns' names.

    `rule` adds a line of dashes under a plain header; a string column is `Column(name)`.
    """
    cols = [c if isinstance(c, Column) else Column(c) for c in columns]
    cells = [[_cell(v, c) for v, c in zip(row, cols, strict=True)] for row in rows]
    names = [c.name for c in cols]
    if style == "markdown":
        head = [_markdown_line(names), "|" + "---|" * len(cols)] if header else []
        return "\n".join(head + [_markdown_line(r) for r in cells])
    widths = [max(c.width, len(c.name), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]

    def line(texts: Sequence[str]) -> str:
        return sep.join(format(t, f"{c.align}{w}") for t, c, w in zip(texts, cols, widths)).rstrip()

    head = [line(names)] if header else []
    if header and rule:
        head.append("-" * len(head[0]))
    return "\n".join(head + [line(r) for r in cells])
