"""What a person reads of a name the plugin read from disk (a file of the lock or state directory, a field of a
record in it): :func:`shown`. Another user of a shared lock directory chooses those names; printed raw, one holding
terminal escapes clears the screen or recolours the output, one holding a newline forges a line of the plugin's
own ("ended ..."). Plain Python, imports nothing."""

from __future__ import annotations

__all__ = ["shown"]


def shown(text: str) -> str:
    """``text`` with every character that is not printable (terminal escapes, a newline or carriage return, a
    bidirectional override, bytes that were not UTF-8) written as its Python escape (``\\x1b``, ``\\n``,
    ``\\u202e``, ``\\udcff``); printable text, other scripts included, is unchanged."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode("ascii")
                   for c in text)
