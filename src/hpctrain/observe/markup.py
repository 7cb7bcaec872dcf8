"""Run text made inert in the report's HTML and SVG: the one escaping function they use.

A run directory is data someone else may have written (a shared project folder, a compromised
job): its names, hosts, reasons, event fields and file names must reach the page as text,
never as elements, attributes or a ``<meta http-equiv="refresh">``. Every value the report
and its charts put into markup, in element text or in a quoted attribute, goes through
:func:`esc`; numbers too, since a field read back as a number may be a string.
"""

from __future__ import annotations

import html


def esc(value: object) -> str:
    """``str(value)`` with ``& < > " '`` escaped: safe as element text and as a quoted attribute."""
    return html.escape(value if isinstance(value, str) else str(value), quote=True)
