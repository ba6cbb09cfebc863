"""Character classes of the two BERT tokenization rule sets, from Python's `unicodedata`.

Both rule sets decide per character with `unicodedata`, as their Python code does:
- deleted: NUL, U+FFFD and "control" characters except \\t \\n \\r. The original
  BERT `tokenization.py` counts categories Cc and Cf as control (`delete`), so
  unassigned (Cn), private-use (Co) and surrogate (Cs) code points stay and end
  up as [UNK]; transformers' `BasicTokenizer` counts every C* category
  (`delete_all_c`);
- whitespace (mapped to a space): space, \\t, \\n, \\r and category Zs;
- CJK ideographs get spaces around them (the ranges below);
- punctuation (a token on its own): ASCII 33-47, 58-64, 91-96, 123-126, and P*;
- accents stripped when lowercasing: category Mn after NFD.
The classes are built from the same `unicodedata` the references use, then
written both as Python `re` and as RE2 (tf.data) patterns, so that the two
paths cannot drift apart on any code point.
"""

import functools
import sys
import unicodedata

CJK_RANGES = (
    (0x4E00, 0x9FFF),
    (0x3400, 0x4DBF),
    (0x20000, 0x2A6DF),
    (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F),
    (0x2B820, 0x2CEAF),
    (0xF900, 0xFAFF),
    (0x2F800, 0x2FA1F),
)

# The deletion table of each rule set (see the module docstring).
DELETE_TABLE = {"original": "delete", "transformers": "delete_all_c"}


def _ranges(codepoints):
    """Sorted code points -> [(start, end)] inclusive runs."""
    runs = []
    for cp in codepoints:
        if runs and runs[-1][1] == cp - 1:
            runs[-1][1] = cp
        else:
            runs.append([cp, cp])
    return [tuple(r) for r in runs]


@functools.lru_cache(maxsize=None)
def tables():
    delete, delete_all_c, whitespace, punctuation, mn, split_space = [], [], [], [], [], []
    for cp in range(sys.maxunicode + 1):
        char = chr(cp)
        category = unicodedata.category(char)
        if char in " \t\n\r" or category == "Zs":
            whitespace.append(cp)
        else:
            if cp == 0 or cp == 0xFFFD or category in ("Cc", "Cf"):
                delete.append(cp)
            if cp == 0 or cp == 0xFFFD or category.startswith("C"):
                delete_all_c.append(cp)
        if (
            (33 <= cp <= 47)
            or (58 <= cp <= 64)
            or (91 <= cp <= 96)
            or (123 <= cp <= 126)
            or category.startswith("P")
        ):
            punctuation.append(cp)
        if category == "Mn":
            mn.append(cp)
        if char.isspace():  # what str.split() splits on
            split_space.append(cp)
    return {
        "delete": _ranges(delete),
        "delete_all_c": _ranges(delete_all_c),
        "whitespace": _ranges(whitespace),
        "punctuation": _ranges(punctuation),
        "mn": _ranges(mn),
        "split_space": _ranges(split_space),
        "cjk": list(CJK_RANGES),
    }


@functools.lru_cache(maxsize=None)
def composing_second():
    """Characters of combining class 0 that NFC may compose with the one before
    (second halves of canonical pairs, Hangul vowels and trailing consonants)."""
    second = {chr(cp) for cp in range(0x1161, 0x1176)} | {chr(cp) for cp in range(0x11A8, 0x11C3)}
    for cp in range(sys.maxunicode + 1):
        parts = unicodedata.decomposition(chr(cp)).split()
        if len(parts) == 2 and not parts[0].startswith("<"):
            char = chr(int(parts[1], 16))
            if not unicodedata.combining(char):
                second.add(char)
    return frozenset(second)


def _char(cp, flavor):
    if flavor == "re2":
        return f"\\x{{{cp:X}}}"
    return f"\\U{cp:08X}"


def char_class(name, flavor="python", negate=False):
    """A `[...]` pattern for table `name`, in Python-`re` or RE2 syntax."""
    parts = []
    for start, end in tables()[name]:
        parts.append(
            _char(start, flavor) if start == end else f"{_char(start, flavor)}-{_char(end, flavor)}"
        )
    return "[" + ("^" if negate else "") + "".join(parts) + "]"


def word_pattern(flavor="python"):
    """One punctuation mark, or a run of characters that are neither
    punctuation nor whitespace (as `str.split` sees it)."""
    punct = char_class("punctuation", flavor)
    separators = char_class("punctuation", flavor)[1:-1] + char_class("split_space", flavor)[1:-1]
    return f"{punct}|[^{separators}]+"
