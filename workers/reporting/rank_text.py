"""Text that comes from a rank is made storable and harmless to show before it goes anywhere.

A rank writes whatever bytes it likes: its output, and the strings of the events it writes (metric
names, warnings, error types, messages, tracebacks), all of which become text in SQL and, later, on
someone's terminal (`dptrain logs`). PostgreSQL refuses NUL in text and JSONB, no UTF-8 encoder
takes a lone surrogate (JSON's `\\ud800` parses to one), and control characters move a terminal's
cursor, clear its screen or rewrite its title. So every such character is replaced by a visible
escape (`\\x00`, `\\x1b`, `\\x85`, `\\ud800`): what the rank wrote stays readable and nothing of it
acts. Tabs stay, and so do newlines where a text is several lines (a traceback, a message).

A backslash is left as it is: the aim is text a database and a terminal can hold, not a reversible
encoding, and escaping it would mangle every Windows path and regular expression in a log.
"""

from __future__ import annotations

import re
from typing import Any

# C0 controls but tab and newline; DEL; C1 controls; surrogates (in a Python str every surrogate is
# lone: a valid pair decodes to one character).
_UNSAFE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\ud800-\udfff]")
_UNSAFE_IN_LINES = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


def _escaped(m: re.Match[str]) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def escape_text(text: str, *, newlines: bool = False) -> str:
    """`text` with every character a database or a terminal cannot hold written as a visible escape.

    `newlines`: keep line breaks (a traceback); otherwise they are escaped too (one log line).
    """
    pattern = _UNSAFE_IN_LINES if newlines else _UNSAFE
    # Most text is clean: one scan, and the same object back.
    if pattern.search(text) is None:
        return text
    return pattern.sub(_escaped, text)


def is_clean(text: str) -> bool:
    """Whether `escape_text(text)` (one line) would leave `text` as it is."""
    return _UNSAFE.search(text) is None


def escape_strings(value: Any) -> Any:
    """`value` (JSON-like: dicts, lists, strings, numbers) with `escape_text` applied to every string.

    Keys too, and line breaks are kept: for a whole record such as an error body or a stack dump.
    """
    if isinstance(value, str):
        return escape_text(value, newlines=True)
    if isinstance(value, dict):
        return {escape_strings(k): escape_strings(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [escape_strings(v) for v in value]
    return value
