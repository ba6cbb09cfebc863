"""Training a WordPiece vocabulary with the Rust `tokenizers` trainer.

The trainer sees words split by kbert's own reference normalisation, so the
vocabulary fits exactly the words the tokenizer will look up.
"""

import os

from kbert.tokenizers.vocabulary import SPECIAL_TOKENS, save_vocabulary
from kbert.tokenizers.wordpiece import BertTokenizer


def _texts(files_or_texts):
    """Yields text lines from file paths, or the given strings."""
    if isinstance(files_or_texts, (str, os.PathLike)):
        files_or_texts = [files_or_texts]
    for item in files_or_texts:
        if isinstance(item, os.PathLike) or (isinstance(item, str) and os.path.isfile(item)):
            with open(item, encoding="utf-8-sig") as f:
                yield from f
        elif isinstance(item, str):
            yield item
        else:
            raise ValueError(f"expected file paths or strings, got {type(item).__name__}")


def train_wordpiece_vocabulary(
    files_or_texts,
    vocabulary_size,
    output=None,
    lowercase=True,
    min_frequency=2,
    special_tokens=SPECIAL_TOKENS,
    limit_alphabet=1000,
):
    """Learns a WordPiece vocabulary; special tokens take ids 0, 1, 2, ...

    Args:
        files_or_texts: path, or list of paths and/or strings.
        vocabulary_size: int. size of the vocabulary, special tokens included.
        output: str or None. where to write `vocab.txt`.
        lowercase: bool. train on lowercased, accent-stripped text (uncased).
        min_frequency: int. pieces seen fewer times are not merged.
        special_tokens: tuple of str. put first, in this order.
        limit_alphabet: int. most single characters kept.

    Returns:
        list of str: the vocabulary in id order.

    Example:
    >>> vocab = train_wordpiece_vocabulary(["a cat sat", "a cat ran"] * 5, 40)
    >>> vocab[:5]
    ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]']
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    if vocabulary_size <= len(special_tokens):
        raise ValueError(
            f"vocabulary_size={vocabulary_size} leaves no room beyond the special tokens"
        )
    splitter = BertTokenizer(list(special_tokens), lowercase=lowercase)
    tokenizer = Tokenizer(
        models.WordPiece(unk_token=special_tokens[1], continuing_subword_prefix="##")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocabulary_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),
        limit_alphabet=limit_alphabet,
        continuing_subword_prefix="##",
        show_progress=False,
    )
    seen = 0

    def lines():
        nonlocal seen
        for line in _texts(files_or_texts):
            words = splitter.split_words(line)
            if words:
                seen += 1
                yield " ".join(words)

    tokenizer.train_from_iterator(lines(), trainer=trainer)
    if not seen:
        raise ValueError("no text to train a vocabulary on (inputs are empty)")
    learned = tokenizer.get_vocab()
    vocabulary = list(special_tokens) + [
        t for t, _ in sorted(learned.items(), key=lambda kv: kv[1]) if t not in special_tokens
    ]
    if output is not None:
        save_vocabulary(vocabulary, output)
    return vocabulary
