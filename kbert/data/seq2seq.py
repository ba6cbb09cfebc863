"""Sequence-to-sequence features: (source, target) texts -> model inputs
and shifted labels.

Shapes: N examples, S source tokens, T target tokens.
"""

import numpy as np


def seq2seq_features(
    tokenizer, sources, targets, source_length, target_length, start_token_id, end_token_id
):
    """Teacher-forcing inputs and labels for `BertSeq2SeqLM`.

    The source is `[CLS] source [SEP]` (truncated to `source_length`); the
    decoder reads `start target` and learns `target end`: `labels[t]` is
    the token after `decoder_token_ids[t]`, the target truncated to
    `target_length - 1` tokens. Returns (inputs, labels): the four model
    inputs, (N, S) and (N, T) int32 (T the longest target + 1), and labels
    (N, T) (0 at padding, which the decoder padding mask weights out).

    Args:
        tokenizer: `kbert.BertTokenizer`.
        sources: list of str.
        targets: list of str, as many.
        source_length: int. longest packed source, special tokens included.
        target_length: int. longest decoder row (start token included).
        start_token_id: int. the decoder start token.
        end_token_id: int. the token that ends a target.

    Example:
    >>> tokenizer = kbert.BertTokenizer(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b"])
    >>> x, y = seq2seq_features(tokenizer, ["a b"], ["b"], 8, 8, 2, 3)
    >>> x["decoder_token_ids"].tolist(), y.tolist()
    ([[2, 6]], [[6, 3]])
    """
    sources, targets = list(sources), list(targets)
    if len(sources) != len(targets):
        raise ValueError(f"got {len(sources)} sources but {len(targets)} targets")
    if target_length < 2:
        raise ValueError(
            f"target_length={target_length} cannot hold the start token and one more token"
        )
    empty = [i for i, s in enumerate(sources) if not str(s).strip()]
    if empty:
        raise ValueError(f"sources {empty[:5]} are empty: there is nothing to learn from")
    packed = tokenizer.pack(tokenizer.tokenize(sources), sequence_length=source_length)
    lengths = packed["padding_mask"].sum(axis=1)
    longest = max(int(lengths.max()), 1) if len(lengths) else 1
    pieces = [ids[: target_length - 1] for ids in tokenizer.tokenize(targets)]
    width = max([len(p) + 1 for p in pieces] or [1])
    decoder = np.zeros((len(pieces), width), "int32")
    labels = np.zeros((len(pieces), width), "int32")
    mask = np.zeros((len(pieces), width), "int32")
    for row, ids in enumerate(pieces):
        decoder[row, : len(ids) + 1] = [start_token_id, *ids]
        labels[row, : len(ids) + 1] = [*ids, end_token_id]
        mask[row, : len(ids) + 1] = 1
    inputs = {
        "encoder_token_ids": packed["token_ids"][:, :longest],
        "encoder_padding_mask": packed["padding_mask"][:, :longest],
        "decoder_token_ids": decoder,
        "decoder_padding_mask": mask,
    }
    return inputs, labels
