"""Text cleaning applied to every text field before dedup and tokenizing.

Cleaning is conservative on purpose: it must not change what a sentence or a code block means, only
remove the invisible differences (Unicode forms, odd spaces, CR/LF, control characters, trailing
blanks) that would otherwise make duplicates look distinct and waste tokens.
"""

from __future__ import annotations

import re
import unicodedata

# Line breaks in all their spellings become "\n" (NEL is a C1 control, so this runs before _CONTROL).
_LINE_BREAKS = re.compile("\r\n?|[\u2028\u2029\x85]")
# C0/C1 controls except tab and newline. Format characters (ZWJ in emoji sequences, RTL marks) stay.
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
# Characters that render as a space but are not U+0020 (NBSP, en/em/thin spaces, ideographic space).
_ODD_SPACES = re.compile("[\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]")
_TRAILING_BLANKS = re.compile("[ \t]+\n")
_BLANK_LINE_RUNS = re.compile("\n{3,}")
# Anything any rule above would change: most text has none, and one scan is cheaper than five. For
# ASCII text the scan runs on bytes, which Python's regex engine does several times faster.
_ASCII_DIRTY = re.compile(b"[\x00-\x08\x0b-\x1f\x7f]|[ \t]\n|\n\n\n")
_DIRTY = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"
                    "|[ \t]\n|\n\n\n")
# json.loads accepts "\ud800" escapes, but a lone surrogate cannot be encoded as UTF-8 or tokenized.
_SURROGATE = re.compile("[\ud800-\udfff]")


def clean_text(text: str, unicode_form: str = "NFC") -> str:
    """Normalise Unicode (`NFC`, `NFKC` or `none`), line breaks and odd spaces; drop control characters,
    trailing blanks on each line and runs of more than one empty line; strip the ends."""
    if text.isascii():
        if text.isprintable() or _ASCII_DIRTY.search(text.encode()) is None:
            return text.strip()
    elif _DIRTY.search(text) is None and (unicode_form == "none" or unicodedata.is_normalized(unicode_form, text)):
        return text.strip()
    if not text.isascii():
        if unicode_form != "none":
            text = unicodedata.normalize(unicode_form, text)
        text = _ODD_SPACES.sub(" ", text)
    text = _LINE_BREAKS.sub("\n", text)
    text = _CONTROL.sub("", text)
    text = _TRAILING_BLANKS.sub("\n", text)
    text = _BLANK_LINE_RUNS.sub("\n\n", text)
    return text.strip()


def has_surrogate(text: str) -> bool:
    return not text.isascii() and _SURROGATE.search(text) is not None
