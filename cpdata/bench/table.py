"""Plain-text tables: aligned columns, numbers formatted for reading."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

__all__ = ["format_table", "format_value", "markdown_table"]


def format_value(value: object) -> str:
    """Human formatting: ints with separators, floats to 4 significant digits (min 1 decimal)."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if value == 0:
            return "0"
        mag = abs(value)
        if mag >= 1e5:
            return f"{value:,.0f}"
        digits = max(1, 3 - int(math.floor(math.log10(mag))))
        return f"{value:.{min(digits, 6)}f}"
    return str(value)


def format_table(rows: Sequence[Mapping[str, object]], columns: Sequence[str]) -> str:
    """Render ``rows`` as an aligned text table of ``columns`` (text left, numbers right)."""
    cells = [[format_value(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    numeric = [all(isinstance(r.get(c), (int, float)) and not isinstance(r.get(c), bool) for r in rows)
               for c in columns]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True))

    out = [line(list(columns)).rstrip(), "  ".join("-" * w for w in widths)]
    return "\n".join(out + [line(row).rstrip() for row in cells])


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table: strings as they are, other values through :func:`format_value`."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(format_value(v) for v in row) + " |" for row in rows])
