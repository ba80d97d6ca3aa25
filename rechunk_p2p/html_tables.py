"""HTML tables for notebooks (``_repr_html_`` of plans and reports).

Where it runs: pure (string formatting; the caller's process).
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape


def table_html(
    title: str,
    rows: Sequence[tuple[str, str]],
    detail: tuple[Sequence[str], Sequence[Sequence[object]]] | None = None,
) -> str:
    """A titled two-column table of ``(label, value)`` rows, and optionally a second table
    ``(header, rows)`` below it. Every string is escaped.

    >>> table_html("Plan", [("chunks", "<4>")]).count("<tr>")
    1
    """
    parts = [
        '<div class="rechunk-p2p">',
        f"<strong>{escape(title)}</strong>",
        '<table style="text-align: left">',
    ]
    parts += [
        f'<tr><th style="text-align: left">{escape(k)}</th><td>{escape(v)}</td></tr>'
        for k, v in rows
    ]
    parts.append("</table>")
    if detail is not None:
        header, body = detail
        parts.append('<table style="text-align: left"><thead><tr>')
        parts += [f"<th>{escape(h)}</th>" for h in header]
        parts.append("</tr></thead><tbody>")
        for row in body:
            parts.append("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in row) + "</tr>")
        parts.append("</tbody></table>")
    parts.append("</div>")
    return "".join(parts)
