"""Plain-text tables for notebooks and the terminal (pandas is not part of the course environment)."""

from __future__ import annotations

from dlo.estimates import significant


def format_cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return significant(value) if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def format_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """Aligned columns (numbers right-aligned); `columns` defaults to every key, in first-seen order."""
    if not rows:
        return "(no rows)"
    if columns is None:
        columns = []
        for r in rows:
            columns += [c for c in r if c not in columns]
    cells = [[format_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(line[i]) for line in cells]) for i, c in enumerate(columns)]
    numeric = [all(isinstance(r.get(c), (int, float)) and not isinstance(r.get(c), bool) or r.get(c) is None
                   for r in rows) for c in columns]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()
    return "\n".join([line(columns), line(["-" * w for w in widths])] + [line(v) for v in cells])
