"""The in-graph (tf.data) path of BertTokenizer: tf.strings + tensorflow-text.

Same character classes as the Python path (RE2 syntax), then
FastWordpieceTokenizer on the pre-split words. Three things differ between the
engines and are corrected here:
- TensorFlow's ICU may be older than Python's Unicode tables, so a few
  characters do not lowercase the same; those are found once per process by
  comparing both and fixed with explicit replacements;
- tensorflow-text's ICU may be newer than Python's Unicode tables, so a few
  code points unassigned for Python (kept by the original rules) decompose
  under its NFD; those are found once per process the same way and kept out of
  the NFD;
- FastWordpieceTokenizer limits words in bytes; the reference limits them in
  characters, so long words are replaced by [UNK] here by character count.
Imported lazily: `import kbert` does not import TensorFlow.
"""

import functools
import re
import sys
import unicodedata

import tensorflow as tf
import tensorflow_text as tf_text

from kbert.tokenizers import unicode_tables as ut


@functools.lru_cache(maxsize=None)
def _patterns(rules):
    return {
        "delete": ut.char_class(ut.DELETE_TABLE[rules], "re2"),
        "whitespace": ut.char_class("whitespace", "re2"),
        "cjk": ut.char_class("cjk", "re2"),
        "mn": ut.char_class("mn", "re2"),
        "punctuation": ut.char_class("punctuation", "re2"),
        "separators": "["
        + ut.char_class("punctuation", "re2")[1:-1]
        + ut.char_class("split_space", "re2")[1:-1]
        + "]",
    }


@functools.lru_cache(maxsize=None)
def _kept_chars():
    """Every code point some rule set keeps: all but surrogates and Cc/Cf."""
    return [
        chr(cp)
        for cp in range(sys.maxunicode + 1)
        if not (0xD800 <= cp < 0xE000) and unicodedata.category(chr(cp)) not in ("Cc", "Cf")
    ]


@functools.lru_cache(maxsize=None)
def lowercase_fixups():
    """[(char, python_lower)] where tf.strings.lower disagrees with str.lower."""
    chars = _kept_chars()
    with tf.init_scope():  # eager, also when first called inside tf.data / tf.function
        lowered = tf.strings.lower(tf.constant(chars), encoding="utf-8").numpy()
    fixups = tuple((c, c.lower()) for c, l in zip(chars, lowered) if l.decode("utf-8") != c.lower())
    # The replacement runs after tf.strings.lower, so it must have left these alone.
    changed = [c for c, _ in fixups if _tf_lower_changes(c)]
    if changed:
        raise NotImplementedError(
            f"tf.strings.lower changes {changed[:5]!r} differently from str.lower; "
            "this TensorFlow/Python pair needs a new lowercase correction"
        )
    return fixups


def _tf_lower_changes(char):
    with tf.init_scope():
        return tf.strings.lower(char, encoding="utf-8").numpy().decode("utf-8") != char


@functools.lru_cache(maxsize=None)
def nfd_exceptions():
    """Characters whose tensorflow-text NFD differs from unicodedata's (which leaves them)."""
    chars = _kept_chars()
    with tf.init_scope():
        decomposed = tf_text.normalize_utf8(tf.constant(chars), "NFD").numpy()
    out = []
    for c, d in zip(chars, decomposed):
        if d.decode("utf-8") != unicodedata.normalize("NFD", c):
            if unicodedata.normalize("NFD", c) != c:
                raise NotImplementedError(
                    f"tensorflow-text's NFD of U+{ord(c):04X} differs from unicodedata's; "
                    "this TensorFlow/Python pair needs a new NFD correction"
                )
            out.append(c)
    return tuple(out)


def _nfd(x, exceptions):
    """tf_text NFD that leaves the `exceptions` characters as they are."""
    if not exceptions:
        return tf_text.normalize_utf8(x, "NFD")
    keep = "[" + "".join(_escape(c) for c in exceptions) + "]"

    def guarded(y):
        # Split around each exception, decompose the other pieces, join again.
        pieces = tf_text.regex_split(y, keep, keep)  # (B, (S))
        flat = pieces.flat_values
        is_kept = tf.strings.regex_full_match(flat, keep)
        flat = tf.where(is_kept, flat, tf_text.normalize_utf8(flat, "NFD"))
        return tf.strings.reduce_join(pieces.with_flat_values(flat), axis=-1)

    needed = tf.reduce_any(tf.strings.regex_full_match(x, f"(?s).*{keep}.*"))
    return tf.cond(needed, lambda: guarded(x), lambda: tf_text.normalize_utf8(x, "NFD"))


def _escape(char):
    return f"\\x{{{ord(char):X}}}"


def normalize(
    strings, lowercase, rules="original", strip_accents=None, tokenize_chinese_chars=True
):
    """tf.string tensor -> the reference normalisation (see BertTokenizer.normalize)."""
    p = _patterns(rules)
    strip = lowercase if strip_accents is None else strip_accents
    x = tf.strings.regex_replace(strings, p["delete"], "")
    x = tf.strings.regex_replace(x, p["whitespace"], " ")
    if tokenize_chinese_chars:
        x = tf.strings.regex_replace(x, p["cjk"], " \\0 ")
    if rules == "transformers":
        x = tf_text.normalize_utf8(x, "NFC")
    if lowercase:
        x = tf.strings.lower(x, encoding="utf-8")
        fixups = lowercase_fixups()
        if fixups:
            needs = "[" + "".join(_escape(c) for c, _ in fixups) + "]"

            def fix(y):
                for char, lower in fixups:
                    y = tf.strings.regex_replace(y, _escape(char), lower)
                return y

            any_needed = tf.reduce_any(tf.strings.regex_full_match(x, f"(?s).*{needs}.*"))
            x = tf.cond(any_needed, lambda: fix(x), lambda: x)
    if strip:
        # Characters deleted by the rules never reach the NFD.
        exceptions = tuple(c for c in nfd_exceptions() if not re.fullmatch(_deleted(rules), c))
        x = _nfd(x, exceptions)
        x = tf.strings.regex_replace(x, p["mn"], "")
    return x


@functools.lru_cache(maxsize=None)
def _deleted(rules):
    return ut.char_class(ut.DELETE_TABLE[rules])


def split_words(strings, lowercase, **rules):
    """[B] strings -> [B, (W)] ragged words and punctuation marks."""
    p = _patterns(rules.get("rules", "original"))
    x = normalize(strings, lowercase, **rules)
    words = tf_text.regex_split(x, p["separators"], p["punctuation"])
    return words


class TFWordpiece:
    """[B] strings -> [B, (T)] ragged int32 ids; built once per tokenizer."""

    def __init__(
        self,
        vocabulary,
        lowercase,
        unk_token,
        max_input_chars_per_word,
        rules="original",
        strip_accents=None,
        tokenize_chinese_chars=True,
    ):
        self.lowercase = lowercase
        self.rules = {
            "rules": rules,
            "strip_accents": strip_accents,
            "tokenize_chinese_chars": tokenize_chinese_chars,
        }
        self.unk_token = unk_token
        self.max_chars = max_input_chars_per_word
        self.wordpiece = tf_text.FastWordpieceTokenizer(
            vocab=list(vocabulary),
            suffix_indicator="##",
            # The character limit below is the binding one (4 bytes a character).
            max_bytes_per_word=4 * max_input_chars_per_word + 4,
            unknown_token=unk_token,
            no_pretokenization=True,
            token_out_type=tf.int32,
        )

    def __call__(self, strings):
        strings = tf.convert_to_tensor(strings, tf.string)
        scalar = strings.shape.rank == 0
        if scalar:
            strings = strings[None]
        words = split_words(strings, self.lowercase, **self.rules)  # (B, W)
        too_long = tf.strings.length(words.flat_values, unit="UTF8_CHAR") > self.max_chars
        flat = tf.where(too_long, self.unk_token, words.flat_values)
        words = words.with_flat_values(flat)
        ids = self.wordpiece.tokenize(words)  # (B, W, P)
        ids = ids.merge_dims(1, 2)  # (B, T)
        return ids[0] if scalar else ids


def truncate_pair_lengths(len_a, len_b, max_tokens):
    """Lengths after longest-first truncation (closed form of `truncate_pair`)."""
    m = max_tokens
    keep = len_a + len_b <= m
    b_short = len_b <= m // 2
    a_short = len_a <= (m + 1) // 2
    new_a = tf.where(
        keep, len_a, tf.where(b_short, m - len_b, tf.where(a_short, len_a, (m + 1) // 2))
    )
    new_b = tf.where(keep, len_b, tf.where(b_short, len_b, tf.where(a_short, m - len_a, m // 2)))
    return new_a, new_b


def _keep_first(ragged, lengths):
    positions = tf.ragged.range(ragged.row_lengths())
    return tf.ragged.boolean_mask(ragged, positions < tf.expand_dims(lengths, 1))


def pack(first, second, sequence_length, cls_id, sep_id, pad_id):
    """Ragged ids (B, (n)) -> dict of dense int32 (B, T) model inputs, in-graph:
    `[CLS] A [SEP] (B [SEP])`, longest-first truncation, [PAD] padding."""
    first = tf.cast(first, tf.int32)
    batch = first.nrows()
    cls = tf.fill([batch, 1], tf.constant(cls_id, tf.int32))
    sep = tf.fill([batch, 1], tf.constant(sep_id, tf.int32))
    if second is None:
        first = first[:, : sequence_length - 2]
        ids = tf.concat([cls, first, sep], axis=1)
        segments = tf.zeros_like(ids)
    else:
        second = tf.cast(second, tf.int32)
        len_a, len_b = truncate_pair_lengths(
            first.row_lengths(), second.row_lengths(), sequence_length - 3
        )
        first, second = _keep_first(first, len_a), _keep_first(second, len_b)
        ids = tf.concat([cls, first, sep, second, sep], axis=1)
        segments = tf.concat(
            [
                tf.zeros_like(cls),
                tf.zeros_like(first),
                tf.zeros_like(sep),
                tf.ones_like(second),
                tf.ones_like(sep),
            ],
            axis=1,
        )
    shape = [batch, sequence_length]
    return {
        "token_ids": ids.to_tensor(default_value=pad_id, shape=shape),
        "segment_ids": segments.to_tensor(default_value=0, shape=shape),
        "padding_mask": tf.ones_like(ids).to_tensor(default_value=0, shape=shape),
    }
