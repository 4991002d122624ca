"""Plain-text tables for the terminal: aligned columns, numbers right-aligned."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

NUMERIC_CELL = re.compile(r"^(-|[-+]?(\d+\.?\d*|\.\d+)(e[-+]?\d+)?|[-+]?inf)( \(\d+\))?$")


def format_number(value: Any) -> str:
    """Compact text for a table cell: '-' for None/NaN, 4 significant digits."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return _format_value(value)
    if not math.isfinite(value):
        return "-" if math.isnan(value) else str(value)
    if float(value).is_integer() and abs(value) < 1e6:
        return str(int(value))
    return f"{value:.4g}"


def _format_value(value: Any) -> str:
    """Config values: short lists in full, long integer lists as count and bounds."""
    if isinstance(value, list) and len(value) > 6:
        return f"[{len(value)} items: {value[0]} .. {value[-1]}]"
    return str(value)


def format_table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """Plain-text table: numbers (optionally followed by a rank in brackets) right-aligned,
    text left-aligned."""
    rows = [list(headers), *[list(row) for row in rows]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(headers))]
    numeric = [all(NUMERIC_CELL.match(row[i]) for row in rows[1:]) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        cells = [cell.rjust(w) if right else cell.ljust(w) for cell, w, right in zip(row, widths, numeric, strict=True)]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(rows[0]), rule, *(line(row) for row in rows[1:])])
