"""kbert's tokenizer as a Hugging Face `tokenizer.json` (the `tokenizers` library).

The file describes what `tokenizers.BertWordPieceTokenizer` builds:
BertNormalizer (clean_text, handle_chinese_chars, lowercase and
strip_accents when uncased), BertPreTokenizer, WordPiece with `##` pieces and
[UNK], and a TemplateProcessing post-processor for `[CLS] A [SEP] (B [SEP])`
with segment ids; truncation (longest first) and padding to the
preprocessor's sequence length when one is given. ONNX serving tokenizes
with it in any language that has a `tokenizers` binding.
"""

import json
import os

from kbert.tokenizers.bpe import ByteLevelBPETokenizer, with_length


def tokenizer_json(preprocessor_or_tokenizer, sequence_length=None):
    """The `tokenizer.json` content (a dict) for a `BertPreprocessor` or
    `BertTokenizer`.

    Args:
        preprocessor_or_tokenizer: `kbert.BertPreprocessor` or `kbert.BertTokenizer`.
        sequence_length: int or None. truncate and pad to this length;
            default: the preprocessor's, none for a bare tokenizer.
    """
    tokenizer = getattr(preprocessor_or_tokenizer, "tokenizer", preprocessor_or_tokenizer)
    if sequence_length is None:
        sequence_length = getattr(preprocessor_or_tokenizer, "sequence_length", None)
    if isinstance(tokenizer, ByteLevelBPETokenizer):
        return tokenizer.serving_json(sequence_length)
    for attribute in ("vocabulary", "special_tokens", "lowercase", "max_input_chars_per_word"):
        if not hasattr(tokenizer, attribute):
            raise TypeError(
                f"expected a kbert BertPreprocessor or BertTokenizer, got "
                f"{type(preprocessor_or_tokenizer).__name__} (no {attribute!r})"
            )
    special = tokenizer.special_tokens
    vocab = {token: index for index, token in enumerate(tokenizer.vocabulary)}
    cls, sep, pad = special["cls"], special["sep"], special["pad"]
    added = [
        {
            "id": vocab[token],
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for token in dict.fromkeys(special.values())
    ]
    config = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": sorted(added, key=lambda t: t["id"]),
        "normalizer": {
            "type": "BertNormalizer",
            "clean_text": True,
            "handle_chinese_chars": getattr(tokenizer, "tokenize_chinese_chars", True),
            "strip_accents": tokenizer.lowercase
            if getattr(tokenizer, "strip_accents", None) is None
            else tokenizer.strip_accents,
            "lowercase": tokenizer.lowercase,
        },
        "pre_tokenizer": {"type": "BertPreTokenizer"},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": cls, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": sep, "type_id": 0}},
            ],
            "pair": [
                {"SpecialToken": {"id": cls, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": sep, "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 1}},
                {"SpecialToken": {"id": sep, "type_id": 1}},
            ],
            "special_tokens": {
                token: {"id": token, "ids": [vocab[token]], "tokens": [token]}
                for token in (cls, sep)
            },
        },
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": True},
        "model": {
            "type": "WordPiece",
            "unk_token": special["unk"],
            "continuing_subword_prefix": "##",
            "max_input_chars_per_word": tokenizer.max_input_chars_per_word,
            "vocab": vocab,
        },
    }
    return with_length(config, sequence_length, vocab[pad], pad)


def export_tokenizer_json(preprocessor_or_tokenizer, path, sequence_length=None):
    """Writes `tokenizer.json` for the `tokenizers` library; returns its path.

    `path` is a file, or a directory to write `tokenizer.json` into. The
    result gives kbert's token ids, segment ids and padding mask
    (`encoding.ids`, `.type_ids`, `.attention_mask`).

    Args:
        preprocessor_or_tokenizer: `kbert.BertPreprocessor` or `kbert.BertTokenizer`.
        path: str. output file or directory.
        sequence_length: int or None. see `tokenizer_json`.

    Example:
    >>> tok = kbert.BertTokenizer(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hi"])
    >>> path = export_tokenizer_json(tok, "/tmp/tokenizer.json")
    >>> tokenizers.Tokenizer.from_file(path).encode("Hi!").ids
    [2, 5, 1, 3]
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    config = tokenizer_json(preprocessor_or_tokenizer, sequence_length)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=1)
    return path
