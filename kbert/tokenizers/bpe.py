"""Byte-level BPE (RoBERTa, Longformer) from a Hugging Face `tokenizer.json`.

An adapter, not a second tokenizer implementation: the `tokenizers`
library runs the BPE model the file describes (its pre-tokenizer, merges
and byte-level decoder); this class gives it the interface kbert's
preprocessors and task models use (`tokenize`, `pack`, special ids,
`detokenize`, `tokenize_with_offsets`, a tf.data path) and RoBERTa's
packing:

    single:  <s> A </s>
    pair:    <s> A </s></s> B </s>

with segment ids 0 everywhere (RoBERTa has one token type) and the
original BERT's longest-first truncation, as transformers'
`RobertaTokenizerFast` and `LongformerTokenizerFast` pack.

The file's own post-processor, truncation and padding are switched off:
packing is kbert's. Loading parses JSON only; nothing in the file runs.
"""

import json
import os
import re

import numpy as np

from kbert.tokenizers.wordpiece import BertTokenizer, truncate_pair
from kbert.utils.files import load_json, preset_file

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
KIND = "byte_level_bpe"
# RoBERTa's names; tokenizer_config.json (transformers) or the arguments override them
DEFAULT_SPECIAL = {
    "cls": "<s>",
    "sep": "</s>",
    "pad": "<pad>",
    "unk": "<unk>",
    "mask": "<mask>",
}
# transformers' tokenizer_config.json keys for each role (first found wins)
CONFIG_KEYS = {
    "cls": ("cls_token", "bos_token"),
    "sep": ("sep_token", "eos_token"),
    "pad": ("pad_token",),
    "unk": ("unk_token",),
    "mask": ("mask_token",),
}


def is_bpe_tokenizer_json(content):
    """Whether a parsed tokenizer.json holds a BPE model."""
    model = content.get("model") if isinstance(content, dict) else None
    return isinstance(model, dict) and model.get("type") == "BPE"


def load_if_present(directory):
    """The `ByteLevelBPETokenizer` of `directory`'s tokenizer.json when that
    holds a BPE model, else None."""
    path = preset_file(directory, TOKENIZER_FILE)
    if os.path.isfile(path) and is_bpe_tokenizer_json(load_json(path)):
        return ByteLevelBPETokenizer.load(directory)
    return None


def with_length(config, sequence_length, pad_id, pad):
    """A tokenizer.json dict truncating (longest first) and padding to
    `sequence_length` (None: neither)."""
    if sequence_length is not None:
        config["truncation"] = {
            "direction": "Right",
            "max_length": int(sequence_length),
            "strategy": "LongestFirst",
            "stride": 0,
        }
        config["padding"] = {
            "strategy": {"Fixed": int(sequence_length)},
            "direction": "Right",
            "pad_to_multiple_of": None,
            "pad_id": pad_id,
            "pad_type_id": 0,
            "pad_token": pad,
        }
    return config


_SURROGATE = re.compile("[\ud800-\udfff]")


def _texts(inputs):
    """A list of str for the Rust tokenizer: lone surrogates (which it
    cannot hold) become U+FFFD, one character for one, so offsets stay."""
    out = []
    for text in inputs:
        if not isinstance(text, str):
            raise ValueError(f"texts must be strings, got {type(text).__name__}: {text!r:.60}")
        out.append(_SURROGATE.sub("\ufffd", text) if not text.isascii() else text)
    return out


def _token_name(value):
    """A tokenizer_config.json special token: a string or transformers'
    AddedToken dict ({"content": ...})."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ByteLevelBPETokenizer:
    """RoBERTa-style byte-level BPE with RoBERTa's packing.

    Args:
        tokenizer_json: str. the contents of a Hugging Face `tokenizer.json`
            whose model is BPE (not a path: a saved artifact embeds it).
        cls_token, sep_token, pad_token, unk_token, mask_token: str. special
            token names, which must be in the vocabulary.

    Example:
    >>> tok = ByteLevelBPETokenizer.load("path/to/longformer")  # doctest: +SKIP
    >>> tok(["Hello world"], sequence_length=6)["token_ids"]  # doctest: +SKIP
    array([[    0, 31414,   232,     2,     1,     1]], dtype=int32)
    """

    kind = KIND
    lowercase = False  # read by code that asks about casing; BPE keeps the text's

    def __init__(
        self,
        tokenizer_json,
        cls_token="<s>",
        sep_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        mask_token="<mask>",
    ):
        from tokenizers import Tokenizer

        if not isinstance(tokenizer_json, str):
            raise ValueError(
                "tokenizer_json must be the text of a tokenizer.json, got "
                f"{type(tokenizer_json).__name__}; use ByteLevelBPETokenizer.load(directory) "
                "for a directory"
            )
        try:
            content = json.loads(tokenizer_json)
        except ValueError as e:
            raise ValueError(f"tokenizer_json is not valid JSON: {e}") from None
        if not is_bpe_tokenizer_json(content):
            model = content.get("model") if isinstance(content, dict) else None
            found = model.get("type") if isinstance(model, dict) else type(model).__name__
            raise ValueError(f"tokenizer.json holds a {found!s:.40} model, not BPE")
        try:
            engine = Tokenizer.from_str(tokenizer_json)
        except Exception as e:  # the Rust parser's own error type
            raise ValueError(f"tokenizer.json could not be read as a tokenizer: {e}") from None
        engine.no_truncation()
        engine.no_padding()
        self._engine = engine
        self.tokenizer_json = tokenizer_json
        vocab = engine.get_vocab(with_added_tokens=True)
        size = engine.get_vocab_size(with_added_tokens=True)
        if sorted(vocab.values()) != list(range(size)):
            raise ValueError("tokenizer.json's vocabulary ids are not 0..N-1 without gaps")
        self.vocabulary = [None] * size
        for token, index in vocab.items():
            self.vocabulary[index] = token
        self.special_tokens = {
            "pad": pad_token,
            "unk": unk_token,
            "cls": cls_token,
            "sep": sep_token,
            "mask": mask_token,
        }
        missing = [t for t in self.special_tokens.values() if t not in vocab]
        if missing:
            raise ValueError(
                f"special tokens {missing} are not in tokenizer.json's vocabulary; pass the "
                "names it uses (cls_token=..., sep_token=..., pad_token=..., unk_token=..., "
                "mask_token=...)"
            )
        self._token_to_id = vocab
        self.pad_id = vocab[pad_token]
        self.unk_id = vocab[unk_token]
        self.cls_id = vocab[cls_token]
        self.sep_id = vocab[sep_token]
        self.mask_id = vocab[mask_token]
        # RoBERTa's pair layout, for code that packs pairs itself (question answering)
        self.pair_separator_ids = [self.sep_id, self.sep_id]
        self.second_segment_id = 0

    # --- construction -----------------------------------------------------

    @classmethod
    def load(cls, directory):
        """From a directory with a BPE `tokenizer.json` (a transformers
        RoBERTa or Longformer directory, or a kbert preset saved with one);
        special token names from its tokenizer_config.json where it has one."""
        path = preset_file(directory, TOKENIZER_FILE)
        if not os.path.isfile(path):
            raise ValueError(f"{directory!r} has no {TOKENIZER_FILE}")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        kwargs = {}
        config_path = preset_file(directory, CONFIG_FILE)
        config = load_json(config_path) if os.path.isfile(config_path) else {}
        if not isinstance(config, dict):
            raise ValueError(f"{config_path} is not a JSON object")
        for role, keys in CONFIG_KEYS.items():
            for key in keys:
                name = _token_name(config.get(key))
                if name is not None:
                    kwargs[f"{role}_token"] = name
                    break
        return cls(text, **kwargs)

    @property
    def vocabulary_size(self):
        return len(self.vocabulary)

    def get_config(self):
        """What a saved artifact embeds (the file's text, not its path)."""
        return {
            "kind": KIND,
            "tokenizer_json": self.tokenizer_json,
            **{f"{k}_token": v for k, v in self.special_tokens.items()},
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if config.pop("kind", KIND) != KIND:
            raise ValueError(f"not a {KIND} tokenizer config")
        return cls(**config)

    def save(self, directory):
        """Writes tokenizer.json and tokenizer_config.json; returns the file names."""
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, TOKENIZER_FILE), "w", encoding="utf-8") as f:
            f.write(self.tokenizer_json)
        config = {"kind": KIND, **{f"{k}_token": v for k, v in self.special_tokens.items()}}
        with open(os.path.join(directory, CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        return [TOKENIZER_FILE, CONFIG_FILE]

    def serving_json(self, sequence_length=None):
        """The file as a dict with kbert's packing as its post-processor
        (`<s> A </s>`, `<s> A </s></s> B </s>`, one token type) and, with
        `sequence_length`, longest-first truncation and padding to it: the
        ids `__call__` gives, from the `tokenizers` library alone."""
        config = json.loads(self.tokenizer_json)
        cls, sep = self.special_tokens["cls"], self.special_tokens["sep"]
        processor = config.get("post_processor") or {}
        if (
            processor.get("type") == "RobertaProcessing"
            and processor.get("cls", [None])[0] == cls
            and processor.get("sep", [None])[0] == sep
        ):
            # kbert's packing already, and it trims the spaces off offsets
            config["truncation"] = config["padding"] = None
            return with_length(config, sequence_length, self.pad_id, self.special_tokens["pad"])

        def token(name):
            return {"SpecialToken": {"id": name, "type_id": 0}}

        def sequence(name):
            return {"Sequence": {"id": name, "type_id": 0}}

        config["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [token(cls), sequence("A"), token(sep)],
            "pair": [token(cls), sequence("A"), token(sep), token(sep), sequence("B"), token(sep)],
            "special_tokens": {
                name: {"id": name, "ids": [self._token_to_id[name]], "tokens": [name]}
                for name in (cls, sep)
            },
        }
        config["truncation"] = config["padding"] = None
        return with_length(config, sequence_length, self.pad_id, self.special_tokens["pad"])

    # --- text -> ids --------------------------------------------------------

    def tokenize(self, inputs):
        """Text -> ids (no special tokens); a list of texts -> a list of id lists."""
        if isinstance(inputs, str):
            return self.tokenize([inputs])[0]
        encodings = self._engine.encode_batch(_texts(inputs), add_special_tokens=False)
        return [list(e.ids) for e in encodings]

    def tokenize_split_words(self, words):
        """Ids of each word of a pre-split sentence (word-aligned tagging):
        each word as it reads after a space (`Ġword`), as transformers'
        RoBERTa tokenizers give words with `add_prefix_space=True`."""
        return self.tokenize([" " + w for w in _texts(words)])

    def tokenize_with_offsets(self, inputs):
        """(ids, starts, ends): each token's character span in the text; a
        list of texts -> a list of them."""
        if isinstance(inputs, str):
            return self.tokenize_with_offsets([inputs])[0]
        out = []
        for e in self._engine.encode_batch(_texts(inputs), add_special_tokens=False):
            spans = np.asarray(e.offsets, "int64").reshape(-1, 2)
            out.append((list(e.ids), spans[:, 0].copy(), spans[:, 1].copy()))
        return out

    # the vocabulary lookups and text -> packed inputs are WordPiece's, over
    # this class's `_token_to_id`, `vocabulary`, `tokenize` and `pack`
    token_to_id = BertTokenizer.token_to_id
    id_to_token = BertTokenizer.id_to_token
    __call__ = BertTokenizer.__call__

    def detokenize(self, ids):
        """Ids -> text (the file's byte-level decoder), special tokens dropped."""
        if len(ids) and not isinstance(ids[0], (int, np.integer)):
            return [self.detokenize(row) for row in ids]
        for token_id in ids:
            self.id_to_token(token_id)  # a clear error for an id out of range
        return self._engine.decode([int(i) for i in ids], skip_special_tokens=True)

    # --- packing ----------------------------------------------------------

    def pack(self, first, second=None, sequence_length=128):
        """Id lists -> `<s> A </s>` or `<s> A </s></s> B </s>`, truncated
        longest-first, padded; dict of int32 arrays (B, T): token_ids,
        segment_ids (all 0), padding_mask."""
        specials = 4 if second is not None else 2
        if sequence_length < specials:
            raise ValueError(
                f"sequence_length={sequence_length} cannot hold the {specials} special tokens"
            )
        batch = len(first)
        if second is not None and len(second) != batch:
            raise ValueError(f"got {batch} first segments but {len(second)} second segments")
        token_ids = np.full((batch, sequence_length), self.pad_id, "int32")
        padding_mask = np.zeros((batch, sequence_length), "int32")
        for row in range(batch):
            a, b = truncate_pair(
                first[row], second[row] if second is not None else None, sequence_length - specials
            )
            ids = [self.cls_id, *a, self.sep_id]
            if b is not None:
                ids += [self.sep_id, *b, self.sep_id]
            token_ids[row, : len(ids)] = ids
            padding_mask[row, : len(ids)] = 1
        return {
            "token_ids": token_ids,
            "segment_ids": np.zeros_like(token_ids),
            "padding_mask": padding_mask,
        }

    # --- tf.data ------------------------------------------------------------

    def tf_call(self, texts, pairs=None, sequence_length=128):
        """`__call__` inside tf.data: tf.string [B] (and pairs) -> packed
        inputs, through `tf.numpy_function` (the BPE runs in Python, so a
        SavedModel cannot hold it)."""
        import tensorflow as tf  # the caller passed TensorFlow tensors

        def packed(*strings):
            decoded = [[s.decode("utf-8", errors="replace") for s in x] for x in strings]
            out = self(decoded[0], decoded[1] if len(decoded) > 1 else None, sequence_length)
            return out["token_ids"], out["segment_ids"], out["padding_mask"]

        inputs = [texts] if pairs is None else [texts, pairs]
        outputs = tf.numpy_function(packed, inputs, [tf.int32] * 3, stateful=False)
        names = ("token_ids", "segment_ids", "padding_mask")
        result = {}
        for name, value in zip(names, outputs):
            value.set_shape([None, sequence_length])
            result[name] = value
        return result
