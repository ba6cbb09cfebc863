"""BertTokenizer: the reference BERT WordPiece tokenization, fast.

Two rule sets, chosen by `rules`:
- "original": google-research/bert `tokenization.py` (FullTokenizer): delete
  NUL, U+FFFD and Cc/Cf characters, map whitespace to spaces, put spaces around
  CJK ideographs, lowercase + strip accents (NFD, drop Mn) when uncased, split
  on whitespace and punctuation, then greedy longest-match-first WordPiece with
  `##` continuations and [UNK] for words longer than 200 characters or with no
  match. Unassigned, private-use and surrogate code points are kept (-> [UNK]).
- "transformers": transformers' Python `BertTokenizer` (BasicTokenizer +
  WordpieceTokenizer): the same, except that every C* character is deleted
  (Cn, Co and Cs too), the text is NFC-normalised after the CJK spacing, words
  longer than 100 characters are [UNK], and `strip_accents` /
  `tokenize_chinese_chars` can be set apart from the casing.
Under both, special-token strings written in the text (`"[SEP]"`) are plain
text, as in the original code (transformers reads them as the special tokens):
user text cannot inject them.

Normalisation and splitting run as compiled regular expressions built from the
references' own `unicodedata` character classes (`unicode_tables`); WordPiece
runs in the Rust `tokenizers` engine on the pre-split words. The tf.data path
(`tf_tokenize`) uses the same character classes as RE2 patterns.
"""

import itertools
import json
import os
import re
import unicodedata

import numpy as np

from kbert.tokenizers import unicode_tables as ut
from kbert.tokenizers.vocabulary import (
    check_special_tokens,
    load_vocabulary,
    save_vocabulary,
)
from kbert.utils.files import load_json, preset_file
from kbert.utils.host import with_gc_paused

_CACHE_SIZE = 1 << 20
# Texts per WordPiece call of `tokenize_with_offsets` on a list: each holds
# two Python ints per character until its spans are made.
_OFFSETS_CHUNK = 1024
VOCAB_FILE = "vocab.txt"
CONFIG_FILE = "tokenizer_config.json"
RULES = ("original", "transformers")
# WordpieceTokenizer's default word limit in each reference.
MAX_CHARS_PER_WORD = {"original": 200, "transformers": 100}
_SURROGATE = re.compile("[\ud800-\udfff]")


def _may_delete(text):
    """Whether the cleaning may delete or respace characters of `text`: only
    non-printable text holds C*/Z* characters; U+FFFD is printable but
    deleted by the references too."""
    return not text.isprintable() or "\ufffd" in text


class _Patterns:
    """Compiled Python regexes of the reference character classes (built once per rules)."""

    _instances = {}

    def __init__(self, rules):
        self.delete = re.compile(ut.char_class(ut.DELETE_TABLE[rules]) + "+")
        self.whitespace = re.compile(ut.char_class("whitespace"))
        self.cjk = re.compile(ut.char_class("cjk"))
        self.mn = re.compile(ut.char_class("mn") + "+")
        # A word: one punctuation mark, or a run of neither punctuation nor whitespace.
        self.words = re.compile(ut.word_pattern())
        # ASCII text (most text) needs none of the large Unicode classes.
        self.ascii_controls = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]+")
        self.ascii_whitespace = re.compile(r"[\t\n\r]")
        self.ascii_words = re.compile(r"[!-/:-@\[-`{-~]|[^\s!-/:-@\[-`{-~]+")

    @classmethod
    def get(cls, rules):
        if rules not in cls._instances:
            cls._instances[rules] = _Patterns(rules)
        return cls._instances[rules]


class BertTokenizer:
    """WordPiece tokenizer with the reference BERT rules.

    Args:
        vocabulary: str, path or list. a `vocab.txt` path or the tokens in id order.
        lowercase: bool. lowercase and strip accents (uncased checkpoints).
        max_input_chars_per_word: int or None. longer words become [UNK]; None
            takes the reference's own limit (200 "original", 100 "transformers").
        unk_token, cls_token, sep_token, pad_token, mask_token: str. special
            token names, which must be in the vocabulary.
        rules: str. "original" (google-research/bert `tokenization.py`) or
            "transformers" (transformers' Python `BertTokenizer`); see the module
            docstring for the differences.
        strip_accents: bool or None. None strips accents exactly when lowercasing
            (both references); True or False overrides it, as transformers'
            `strip_accents` does.
        tokenize_chinese_chars: bool. spaces around CJK ideographs (both
            references); False as transformers' `tokenize_chinese_chars=False`.

    Example:
    >>> vocabulary = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "!", "wor", "##ld"]
    >>> tok = BertTokenizer(vocabulary)
    >>> tok.tokenize("Hello world!")
    [5, 7, 8, 6]
    """

    def __init__(
        self,
        vocabulary,
        lowercase=True,
        max_input_chars_per_word=None,
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        mask_token="[MASK]",
        rules="original",
        strip_accents=None,
        tokenize_chinese_chars=True,
    ):
        if rules not in RULES:
            raise ValueError(
                f"rules={rules!r} is not a BERT rule set; pass rules='original' "
                "(google-research/bert tokenization.py) or rules='transformers' "
                "(transformers' BertTokenizer)"
            )
        self.vocabulary = load_vocabulary(vocabulary)
        self.special_tokens = {
            "pad": pad_token,
            "unk": unk_token,
            "cls": cls_token,
            "sep": sep_token,
            "mask": mask_token,
        }
        check_special_tokens(self.vocabulary, tuple(self.special_tokens.values()))
        self.rules = rules
        self.lowercase = bool(lowercase)
        self.strip_accents = None if strip_accents is None else bool(strip_accents)
        self.tokenize_chinese_chars = bool(tokenize_chinese_chars)
        if max_input_chars_per_word is None:
            max_input_chars_per_word = MAX_CHARS_PER_WORD[rules]
        self.max_input_chars_per_word = int(max_input_chars_per_word)
        # Both references strip accents after lowercasing only, unless told otherwise.
        self._strip = self.lowercase if self.strip_accents is None else self.strip_accents
        self._nfc = rules == "transformers"
        self._token_to_id = {t: i for i, t in enumerate(self.vocabulary)}
        self.pad_id = self._token_to_id[pad_token]
        self.unk_id = self._token_to_id[unk_token]
        self.cls_id = self._token_to_id[cls_token]
        self.sep_id = self._token_to_id[sep_token]
        self.mask_id = self._token_to_id[mask_token]
        # the pair layout [CLS] A [SEP] B [SEP], for code that packs pairs itself
        self.pair_separator_ids = [self.sep_id]
        self.second_segment_id = 1
        self._patterns = _Patterns.get(rules)
        self._engine = self._build_engine()
        self._cache = {}
        self._unit_pieces = {}  # normalisation unit -> its normalised text
        self._tf = None

    # --- construction -----------------------------------------------------

    def _build_engine(self):
        from tokenizers import Tokenizer
        from tokenizers.models import WordPiece

        model = WordPiece(
            {t: i for t, i in self._token_to_id.items() if not _SURROGATE.search(t)},
            unk_token=self.special_tokens["unk"],
            continuing_subword_prefix="##",
            max_input_chars_per_word=self.max_input_chars_per_word,
        )
        return Tokenizer(model)

    @property
    def vocabulary_size(self):
        return len(self.vocabulary)

    def get_config(self):
        return {
            "lowercase": self.lowercase,
            "do_lower_case": self.lowercase,
            "max_input_chars_per_word": self.max_input_chars_per_word,
            "rules": self.rules,
            "strip_accents": self.strip_accents,
            "tokenize_chinese_chars": self.tokenize_chinese_chars,
            **{f"{k}_token": v for k, v in self.special_tokens.items()},
        }

    def save(self, directory):
        """Writes vocab.txt and tokenizer_config.json; returns the file names."""
        os.makedirs(directory, exist_ok=True)
        save_vocabulary(self.vocabulary, os.path.join(directory, VOCAB_FILE))
        with open(os.path.join(directory, CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(self.get_config(), f, indent=2, sort_keys=True)
        return [VOCAB_FILE, CONFIG_FILE]

    @classmethod
    def load(cls, directory, rules=None):
        """From a kbert preset, Hugging Face or original TF checkpoint directory.

        The rules are the recorded ones (kbert presets), "transformers" for a
        Hugging Face directory, "original" otherwise (see `detect_rules`);
        `rules` overrides them.
        """
        vocab = preset_file(directory, VOCAB_FILE)
        if not os.path.isfile(vocab):
            raise ValueError(f"{directory!r} has no {VOCAB_FILE}")
        config = _read_json(directory, CONFIG_FILE) or {}
        if not isinstance(config, dict):
            raise ValueError(f"{os.path.join(directory, CONFIG_FILE)} is not a JSON object")
        rules = rules or detect_rules(directory)
        # transformers' tokenizer.json holds the casing in its BertNormalizer.
        tokenizer_json = _read_json(directory, "tokenizer.json")
        normalizer = tokenizer_json.get("normalizer") if isinstance(tokenizer_json, dict) else None
        if isinstance(normalizer, dict) and normalizer.get("type") == "BertNormalizer":
            config = {
                "do_lower_case": normalizer.get("lowercase"),
                "strip_accents": normalizer.get("strip_accents"),
                "tokenize_chinese_chars": normalizer.get("handle_chinese_chars"),
                **{k: v for k, v in config.items() if v is not None},
            }
        # Original Google releases carry the casing only in their name (cased_L-12_H-768_A-12).
        name = os.path.basename(os.path.normpath(directory)).lower()
        default = not (name.startswith("cased") or "_cased" in name or "-cased" in name)
        lowercase = config.get("lowercase", config.get("do_lower_case"))
        kwargs = {"lowercase": default if lowercase is None else lowercase, "rules": rules}
        for key in ("unk_token", "cls_token", "sep_token", "pad_token", "mask_token"):
            if isinstance(config.get(key), str):
                kwargs[key] = config[key]
        for key in ("max_input_chars_per_word", "strip_accents", "tokenize_chinese_chars"):
            if config.get(key) is not None:
                kwargs[key] = config[key]
        return cls(vocab, **kwargs)

    # --- text -> ids --------------------------------------------------------

    def normalize(self, text):
        """The reference's text cleaning, CJK spacing, (NFC,) lowercasing and accent stripping."""
        if not isinstance(text, str):
            raise TypeError(f"tokenizer input must be str, got {type(text).__name__}")
        p = self._patterns
        if text.isascii():
            # ASCII holds no Zs, Cf, Cn, Co or Cs, is NFC, and has no accents.
            if not text.isprintable():
                text = p.ascii_whitespace.sub(" ", p.ascii_controls.sub("", text))
            return text.lower() if self.lowercase else text
        if _may_delete(text):
            text = p.whitespace.sub(" ", p.delete.sub("", text))
        if self.tokenize_chinese_chars:
            text = p.cjk.sub(r" \g<0> ", text)
        if self._nfc and not unicodedata.is_normalized("NFC", text):
            text = unicodedata.normalize("NFC", text)
        if self.lowercase:
            text = text.lower()
        if self._strip:
            text = p.mn.sub("", unicodedata.normalize("NFD", text))
        return text

    def split_words(self, text):
        """Normalised words and punctuation marks, before WordPiece."""
        text = self.normalize(text)
        if text.isascii():
            return self._patterns.ascii_words.findall(text)
        return self._patterns.words.findall(text)

    def tokenize(self, inputs):
        """Text -> ids (no special tokens); a list of texts -> a list of id lists."""
        if isinstance(inputs, str):
            return self._tokenize_batch([inputs])[0]
        inputs = list(inputs)
        return self._tokenize_batch(inputs)

    def _encode_words(self, words, offsets=False):
        """WordPiece ids (and piece offsets) of each word, in Rust; in Python for
        words with lone surrogates (kept by the original rules), which Rust
        strings cannot hold."""
        if not _SURROGATE.search("".join(words)):
            rust, python = words, []
        else:
            rust = [w for w in words if not _SURROGATE.search(w)]
            python = [w for w in words if _SURROGATE.search(w)]
        encodings = self._engine.encode_batch(
            [[w] for w in rust], is_pretokenized=True, add_special_tokens=False
        )
        if offsets:
            out = {w: (e.ids, e.offsets) for w, e in zip(rust, encodings)}
        else:
            out = {w: e.ids for w, e in zip(rust, encodings)}
        for word in python:
            ids, spans = self._python_wordpiece(word)
            out[word] = (ids, spans) if offsets else ids
        return [out[w] for w in words]

    def _python_wordpiece(self, word):
        """(ids, offsets) of greedy longest-match-first WordPiece (the reference loop)."""
        if len(word) > self.max_input_chars_per_word:
            return [self.unk_id], [(0, len(word))]
        ids, offsets, start = [], [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in self._token_to_id:
                    break
                end -= 1
            if end == start:
                return [self.unk_id], [(0, len(word))]
            ids.append(self._token_to_id[piece])
            offsets.append((start, end))
            start = end
        return ids, offsets

    def _word_ids(self, words):
        """Fills the word -> ids cache for `words` (WordPiece in Rust for new words)."""
        cache = self._cache
        new = list({w for w in words if w not in cache})
        if new:
            if len(cache) + len(new) > _CACHE_SIZE:
                cache.clear()
                new = list(set(words))  # the batch's cached words too
            cache.update(zip(new, self._encode_words(new)))
        return cache

    @with_gc_paused
    def _tokenize_batch(self, texts):
        words = [self.split_words(t) for t in texts]
        cache = self._word_ids([w for row in words for w in row])
        return [[i for w in row for i in cache[w]] for row in words]

    def tokenize_split_words(self, words):
        """Ids of each word of a pre-split sentence (word-aligned tagging)."""
        return self.tokenize(list(words))

    def tokenize_words(self, text):
        """[(word, [ids])] for each normalised word of `text` (word-aligned tasks)."""
        words = self.split_words(text)
        cache = self._word_ids(words)
        return [(w, list(cache[w])) for w in words]

    def tokenize_with_offsets(self, inputs):
        """(ids, starts, ends): each token's character span in the original text;
        a list of texts -> a list of them (the words of all WordPiece'd in
        one call).

        Spans cover the characters the token came from ([UNK] words cover the
        whole word); continuation pieces cover their part of the word.
        """
        if isinstance(inputs, str):
            return self._tokenize_with_offsets([inputs])[0]
        texts = list(inputs)
        out = []
        for begin in range(0, len(texts), _OFFSETS_CHUNK):  # bounds the character maps held
            out += self._tokenize_with_offsets(texts[begin : begin + _OFFSETS_CHUNK], begin)
        return out

    @with_gc_paused
    def _tokenize_with_offsets(self, texts, first=0):
        # Printable ASCII text normalises character by character in place
        # (`_normalize_with_origin`): its words, ids and spans come from one
        # pass. Other text is tokenized as `tokenize` does, and its spans
        # from the normalisation unit by unit, checked against those ids.
        plain = [text.isascii() and text.isprintable() for text in texts]
        other = [text for text, is_plain in zip(texts, plain) if not is_plain]
        other_ids = iter(self._tokenize_batch(other) if other else [])
        p = self._patterns
        lower = self.lowercase
        prepared = []  # (ids or None, normalized, origin, origin_end or None, word spans)
        for text, is_plain in zip(texts, plain):
            if is_plain:
                normalized = text.lower() if lower else text
                spans = [m.span() for m in p.ascii_words.finditer(normalized)]
                prepared.append((None, normalized, None, None, spans))
            else:
                normalized, origin, origin_end = self._normalize_with_origin(text)
                spans = [m.span() for m in p.words.finditer(normalized)]
                prepared.append((next(other_ids), normalized, origin, origin_end, spans))
        words = list({n[s:e] for _, n, _, _, row in prepared for s, e in row})
        pieces = dict(zip(words, self._encode_words(words, True)))
        out = []
        for index, (text_ids, text, origin, origin_end, row) in enumerate(prepared):
            starts, ends = [], []
            if origin is None:  # each character its own origin
                text_ids = []
                for start, end in row:
                    word_ids, offsets = pieces[text[start:end]]
                    text_ids += word_ids
                    starts += [start + piece_start for piece_start, _ in offsets]
                    ends += [start + piece_end for _, piece_end in offsets]
            else:
                for start, end in row:
                    for piece_start, piece_end in pieces[text[start:end]][1]:
                        starts.append(origin[start + piece_start])
                        ends.append(origin_end[start + piece_end - 1])
                if len(starts) != len(text_ids):  # per-character normalisation diverged (rare)
                    raise AssertionError(f"offset alignment failed (text {first + index})")
            out.append((list(text_ids), np.asarray(starts, "int64"), np.asarray(ends, "int64")))
        return out

    def _normalize_with_origin(self, text):
        """Normalisation unit by unit, with the source span of each output char.

        A unit is one character, or under NFC a character and those that may
        compose with it. Lowercasing in context (a word-final Σ becomes ς)
        changes characters, not lengths: the whole text's normalisation then
        replaces the per-unit one.
        """
        if text.isascii() and text.isprintable():
            # each character normalises to itself (or its lower case), as
            # `_normalize_units` would find one by one
            normalized = text.lower() if self.lowercase else text
            return normalized, list(range(len(text))), list(range(1, len(text) + 1))
        return self._normalize_units(text)

    def _normalize_units(self, text):
        """`_normalize_with_origin`, unit by unit."""
        known = self._unit_pieces
        if len(known) > _CACHE_SIZE:
            known.clear()
        return self._normalize_in_units(text, self._units(text))

    def _normalize_in_units(self, text, units, joined=False):
        """`text` normalised unit by unit (`units`: None for one per
        character), with each output character's source span; where that
        disagrees in length with the whole text's normalisation, again with
        deleted characters joined to the unit before them (`_units`)."""
        known = self._unit_pieces
        if units is None:  # one unit per character
            pieces = [
                piece if (piece := known.get(c)) is not None else self._unit_piece(c) for c in text
            ]
            if all(len(piece) == 1 for piece in pieces):
                origin, origin_end = list(range(len(text))), list(range(1, len(text) + 1))
            else:
                origin, origin_end = [], []
                for start, piece in enumerate(pieces):
                    origin.extend([start] * len(piece))
                    origin_end.extend([start + 1] * len(piece))
        else:
            pieces, origin, origin_end = [], [], []
            for start, end in units:
                unit = text[start:end]
                piece = known.get(unit)
                if piece is None:
                    piece = self._unit_piece(unit)
                pieces.append(piece)
                origin.extend([start] * len(piece))
                origin_end.extend([end] * len(piece))
        normalized = "".join(pieces)
        if not text.isascii():
            whole = self.normalize(text)
            if len(whole) == len(normalized):
                normalized = whole
            elif not joined and (coarse := self._units(text, join_deleted=True)) is not None:
                # characters the cleaning deletes kept apart two that NFC composes
                return self._normalize_in_units(text, coarse, joined=True)
        return normalized, origin, origin_end

    def _unit_piece(self, unit):
        """A normalisation unit's normalised text, kept for the next time."""
        if unit.isascii() and unit.isalnum():
            piece = unit.lower() if self.lowercase else unit
        else:
            piece = self.normalize(unit)
        self._unit_pieces[unit] = piece
        return piece

    def _units(self, text, join_deleted=False):
        """(start, end) of each normalisation unit of `text`; None where each
        character is one. `join_deleted`: a run of characters the cleaning
        deletes belongs to the unit before it where the character after it
        may compose with the one before it (the cleaning deletes before NFC
        composes: a Hangul lead consonant and vowel around a U+200B become
        one syllable); else it is a unit of its own."""
        if not self._nfc or text.isascii():
            return None
        deleted = set()
        if join_deleted and _may_delete(text):
            for match in self._patterns.delete.finditer(text):
                deleted.update(range(match.start(), match.end()))
        cleaned = "".join(c for i, c in enumerate(text) if i not in deleted) if deleted else text
        if unicodedata.is_normalized("NFC", cleaned):
            return None
        second = ut.composing_second()
        starts = [not unicodedata.combining(c) and c not in second for c in text]
        cuts, follows = [], True  # whether the text after position i starts a unit
        for i in range(len(text) - 1, -1, -1):
            if i not in deleted:
                follows = starts[i]
            if follows and (i not in deleted or i == 0 or i - 1 not in deleted):
                cuts.append(i)
        cuts.reverse()
        cuts = ([0] if not cuts or cuts[0] else []) + cuts + [len(text)]
        return list(zip(cuts[:-1], cuts[1:]))

    def token_to_id(self, token):
        if token not in self._token_to_id:
            raise KeyError(f"token {token!r} is not in the vocabulary")
        return self._token_to_id[token]

    def id_to_token(self, token_id):
        if not 0 <= int(token_id) < len(self.vocabulary):
            raise ValueError(f"id {token_id} is outside the vocabulary [0, {len(self.vocabulary)})")
        return self.vocabulary[int(token_id)]

    def detokenize(self, ids):
        """Ids -> text: `##` pieces joined to their word, special tokens dropped."""
        if len(ids) and not isinstance(ids[0], (int, np.integer)):
            return [self.detokenize(row) for row in ids]
        special = {self.pad_id, self.cls_id, self.sep_id, self.mask_id}
        text = []
        for token_id in ids:
            if int(token_id) in special:
                continue
            token = self.id_to_token(token_id)
            if token.startswith("##") and text:
                text[-1] += token[2:]
            else:
                text.append(token)
        return " ".join(text)

    # --- tf.data ------------------------------------------------------------

    def tf_tokenize(self, strings):
        """In-graph tokenization for tf.data: tf.string [B] -> ragged int32 [B, (T)]
        (a scalar string gives [T]). Same ids as `tokenize`."""
        if self._tf is None:
            import tensorflow as tf

            from kbert.tokenizers.tf_ops import TFWordpiece  # imports TensorFlow

            # Built eagerly, so that its tables outlive the first tf.data graph.
            with tf.init_scope():
                self._tf = TFWordpiece(
                    self.vocabulary,
                    self.lowercase,
                    self.special_tokens["unk"],
                    self.max_input_chars_per_word,
                    rules=self.rules,
                    strip_accents=self._strip,
                    tokenize_chinese_chars=self.tokenize_chinese_chars,
                )
        return self._tf(strings)

    def tf_pack(self, first, second=None, sequence_length=128):
        """In-graph `pack`: ragged ids -> dict of int32 (B, T) tensors."""
        from kbert.tokenizers.tf_ops import pack  # imports TensorFlow

        return pack(first, second, sequence_length, self.cls_id, self.sep_id, self.pad_id)

    def tf_call(self, texts, pairs=None, sequence_length=128):
        """In-graph `__call__`: tf.string [B] (and pairs) -> packed model inputs."""
        second = self.tf_tokenize(pairs) if pairs is not None else None
        return self.tf_pack(self.tf_tokenize(texts), second, sequence_length)

    # --- packing ----------------------------------------------------------

    def pack(self, first, second=None, sequence_length=128):
        """Id lists -> model inputs `[CLS] A [SEP] (B [SEP])`, truncated longest-first.

        Args:
            first: list of id lists. segment A of each example.
            second: list of id lists or None. segment B (sentence pairs).
            sequence_length: int. output length T (padded with [PAD]).

        Returns:
            dict of int32 arrays (B, T): token_ids, segment_ids, padding_mask.
        """
        specials = 3 if second is not None else 2
        if sequence_length < specials:
            raise ValueError(
                f"sequence_length={sequence_length} cannot hold the {specials} special tokens"
            )
        batch = len(first)
        if second is not None and len(second) != batch:
            raise ValueError(f"got {batch} first segments but {len(second)} second segments")
        token_ids = np.full((batch, sequence_length), self.pad_id, "int32")
        segment_ids = np.zeros((batch, sequence_length), "int32")
        padding_mask = np.zeros((batch, sequence_length), "int32")
        if second is None and batch:
            return self._pack_single(first, sequence_length, token_ids, segment_ids, padding_mask)
        for row in range(batch):
            a = list(first[row])
            b = list(second[row]) if second is not None else None
            a, b = truncate_pair(a, b, sequence_length - specials)
            ids = [self.cls_id] + a + [self.sep_id]
            segments = [0] * len(ids)
            if b is not None:
                ids += b + [self.sep_id]
                segments += [1] * (len(b) + 1)
            token_ids[row, : len(ids)] = ids
            segment_ids[row, : len(ids)] = segments
            padding_mask[row, : len(ids)] = 1
        return {"token_ids": token_ids, "segment_ids": segment_ids, "padding_mask": padding_mask}

    def _pack_single(self, first, sequence_length, token_ids, segment_ids, padding_mask):
        """`pack` of single segments, with array operations: each row's
        first T - 2 ids between [CLS] and [SEP]."""
        batch = len(first)
        lengths = np.fromiter(map(len, first), np.int64, batch)
        flat = np.fromiter(itertools.chain.from_iterable(first), np.int64, int(lengths.sum()))
        kept = np.minimum(lengths, sequence_length - 2)
        rows = np.repeat(np.arange(batch), lengths)
        columns = np.arange(flat.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        inside = columns < kept[rows]
        token_ids[rows[inside], columns[inside] + 1] = flat[inside]
        token_ids[:, 0] = self.cls_id
        token_ids[np.arange(batch), kept + 1] = self.sep_id
        padding_mask[np.arange(sequence_length)[None, :] < (kept + 2)[:, None]] = 1
        return {"token_ids": token_ids, "segment_ids": segment_ids, "padding_mask": padding_mask}

    def __call__(self, texts, pairs=None, sequence_length=128):
        """Raw text (or text pairs) -> packed model inputs; see `pack`."""
        if isinstance(texts, str):
            texts = [texts]
            pairs = [pairs] if isinstance(pairs, str) else pairs
        first = self.tokenize(list(texts))
        second = self.tokenize(list(pairs)) if pairs is not None else None
        return self.pack(first, second, sequence_length)


def _read_json(directory, name):
    path = preset_file(directory, name)
    return load_json(path) if os.path.exists(path) else None


def detect_rules(directory):
    """The rules a tokenizer directory was made with.

    The recorded `rules` of a kbert preset; "original" for a kbert preset that
    predates them (its tokenizer_config.json has kbert's `lowercase` key, or the
    directory has kbert's metadata.json / preprocessor.json); "transformers" for
    a Hugging Face directory (a transformers tokenizer_config.json or
    tokenizer.json, or a config.json with `model_type: bert`); "original"
    otherwise (an original TF checkpoint: vocab.txt + bert_config.json).
    """
    config = _read_json(directory, CONFIG_FILE)
    if isinstance(config, dict) and config.get("rules") is not None:
        if config["rules"] not in RULES:
            raise ValueError(
                f"{os.path.join(directory, CONFIG_FILE)} records rules={config['rules']!r}; "
                f"expected one of {RULES}: fix the file or pass rules=..."
            )
        return config["rules"]
    kbert_files = ("metadata.json", "preprocessor.json")
    if (isinstance(config, dict) and "lowercase" in config) or any(
        os.path.isfile(preset_file(directory, f)) for f in kbert_files
    ):
        return "original"
    if isinstance(config, dict):
        return "transformers"
    tokenizer_json = _read_json(directory, "tokenizer.json")
    if isinstance(tokenizer_json, dict) and "model" in tokenizer_json:
        return "transformers"
    model_config = _read_json(directory, "config.json")
    if isinstance(model_config, dict) and model_config.get("model_type") == "bert":
        return "transformers"
    return "original"


def truncate_pair(a, b, max_tokens):
    """Longest-first truncation from the end, as the original `_truncate_seq_pair`."""
    a = list(a)
    if b is None:
        return a[:max_tokens], None
    b = list(b)
    while len(a) + len(b) > max_tokens:
        if len(a) > len(b):
            a.pop()
        else:
            b.pop()
    return a, b
