"""Text from a rank is escaped before it is stored: nothing a database or a terminal cannot hold is left."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from workers.reporting.rank_text import escape_strings, escape_text

# What may not survive: C0 controls but tab (and newline, where kept), DEL, C1, surrogates.
UNSAFE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\ud800-\udfff]")
UNSAFE_BUT_NEWLINE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")
# Any character at all, lone surrogates included (what `json.loads` of a rank's event may give).
ANY_TEXT = st.text(alphabet=st.characters(codec=None, exclude_categories=()))


class TestEscapeText:
    @given(ANY_TEXT)
    def test_nothing_unsafe_survives_and_the_result_is_utf8_without_nul(self, text: str) -> None:
        out = escape_text(text)
        assert UNSAFE.search(out) is None, repr(out)
        assert b"\x00" not in out.encode("utf-8"), "PostgreSQL text takes no NUL"

    @given(ANY_TEXT)
    def test_with_newlines_only_line_breaks_and_tabs_stay(self, text: str) -> None:
        out = escape_text(text, newlines=True)
        assert UNSAFE_BUT_NEWLINE.search(out) is None, repr(out)
        assert out.count("\n") == text.count("\n"), "every line break kept"

    @given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cc", "Cs"))))
    def test_clean_text_comes_back_unchanged(self, text: str) -> None:
        assert escape_text(text) == text

    @given(st.lists(st.sampled_from(["a", "é", "\\", "\t", "\x00", "\x1b", "\x7f", "\x85", "\ud800", "\n"])))
    def test_every_unsafe_character_is_shown_by_its_code_and_the_rest_kept_in_order(
        self, chars: list[str]
    ) -> None:
        shown = {"\x00": "\\x00", "\x1b": "\\x1b", "\x7f": "\\x7f", "\x85": "\\x85", "\ud800": "\\ud800"}
        shown["\n"] = "\\x0a"
        assert escape_text("".join(chars)) == "".join(shown.get(c, c) for c in chars)

    def test_a_terminal_escape_is_visible_not_acted_on(self) -> None:
        assert (
            escape_text("x\x00y \x1b[2J\x1b]0;owned\x07 end\r")
            == "x\\x00y \\x1b[2J\\x1b]0;owned\\x07 end\\x0d"
        )


class TestEscapeStrings:
    def test_every_string_of_a_record_is_escaped_keys_too_and_line_breaks_stay(self) -> None:
        record = {
            "type": "Bad\x00Error",
            "message": "line one\nline\x07 two",
            "rank": 3,
            "frames": [{"name\x1b": "f\ud800", "line": 7}],
            "traceback": None,
        }
        assert escape_strings(record) == {
            "type": "Bad\\x00Error",
            "message": "line one\nline\\x07 two",
            "rank": 3,
            "frames": [{"name\\x1b": "f\\ud800", "line": 7}],
            "traceback": None,
        }
