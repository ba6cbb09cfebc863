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

import numpy as np

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


def _runs(mask):
    """A boolean mask over code points -> [(start, end)] inclusive runs."""
    edges = np.flatnonzero(np.diff(np.concatenate(([False], mask, [False])).astype(np.int8)))
    return [(int(start), int(end) - 1) for start, end in zip(edges[::2], edges[1::2])]


@functools.lru_cache(maxsize=None)
def tables():
    n = sys.maxunicode + 1
    chars = list(map(chr, range(n)))
    # the category of every code point, computed by `map` in C; the classes
    # below are array operations on it
    categories = np.array(list(map(unicodedata.category, chars)))
    major = categories.astype("U1")
    cp = np.arange(n)
    whitespace = np.isin(cp, [ord(c) for c in " \t\n\r"]) | (categories == "Zs")
    special = (cp == 0) | (cp == 0xFFFD)
    ascii_punctuation = np.zeros(n, bool)
    for start, end in ((33, 47), (58, 64), (91, 96), (123, 126)):
        ascii_punctuation[start : end + 1] = True
    return {
        "delete": _runs(~whitespace & (special | (categories == "Cc") | (categories == "Cf"))),
        "delete_all_c": _runs(~whitespace & (special | (major == "C"))),
        "whitespace": _runs(whitespace),
        "punctuation": _runs(ascii_punctuation | (major == "P")),
        "mn": _runs(categories == "Mn"),
        "split_space": _runs(np.fromiter(map(str.isspace, chars), bool, count=n)),  # str.split
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
