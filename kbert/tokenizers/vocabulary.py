"""Reading, checking and writing WordPiece vocabularies."""

import os

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def load_vocabulary(vocabulary):
    """A `vocab.txt` path or a list of tokens -> list of tokens (index = id)."""
    if isinstance(vocabulary, (str, os.PathLike)):
        path = os.fspath(vocabulary)
        if not os.path.isfile(path):
            raise ValueError(f"vocabulary file {path!r} does not exist")
        try:
            with open(path, encoding="utf-8") as f:
                tokens = [line.rstrip("\r\n") for line in f]
        except UnicodeDecodeError as e:
            raise ValueError(f"vocabulary file {path!r} is not UTF-8: {e}") from e
        while tokens and tokens[-1] == "":
            tokens.pop()
    else:
        tokens = list(vocabulary)
    for token in tokens:
        if not isinstance(token, str):
            raise ValueError(f"vocabulary entries must be strings, got {token!r}")
    if not tokens:
        raise ValueError("the vocabulary is empty")
    seen = {}
    for index, token in enumerate(tokens):
        if token in seen:
            raise ValueError(
                f"vocabulary token {token!r} appears twice (ids {seen[token]} and {index})"
            )
        seen[token] = index
    return tokens


def check_special_tokens(tokens, special_tokens=SPECIAL_TOKENS):
    for token in special_tokens:
        if not isinstance(token, str) or not token:
            raise ValueError(
                f"special tokens must be non-empty strings from the vocabulary, got "
                f"{token!r:.60}; BERT needs all five ([PAD], [UNK], [CLS], [SEP], [MASK], "
                "or your vocabulary's names for them)"
            )
    vocabulary = set(tokens)
    missing = [t for t in special_tokens if t not in vocabulary]
    if missing:
        raise ValueError(
            f"vocabulary has no {', '.join(missing)} token{'s' if len(missing) > 1 else ''}; "
            "add them (train_wordpiece_vocabulary puts them first) or pass the names "
            "your vocabulary uses, e.g. mask_token=..."
        )


def save_vocabulary(tokens, path):
    with open(path, "w", encoding="utf-8") as f:
        for token in tokens:
            f.write(token + "\n")
