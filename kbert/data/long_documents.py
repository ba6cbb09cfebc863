"""Long documents as windows of a BERT input: each text's WordPiece ids cut
into consecutive windows of T - 2 ids, each framed `[CLS] ... [SEP]`.

Shapes: B documents, C windows (chunks) per document, T tokens per window.
"""

import numpy as np


def chunk_documents(tokenizer, texts, sequence_length, max_chunks):
    """Model inputs (B, C, T) for `texts`: window c of document b holds its
    ids [c (T - 2), (c + 1)(T - 2)) between [CLS] and [SEP]; documents with
    fewer than C windows get windows of padding only (padding_mask all 0),
    longer ones keep their first C windows. An empty text is one window
    `[CLS] [SEP]`.

    Args:
        tokenizer: `kbert.BertTokenizer`.
        texts: list of str. the documents.
        sequence_length: int. T, tokens per window (the model's length).
        max_chunks: int. C, windows per document.

    Returns:
        dict of int32 arrays (B, C, T): token_ids, segment_ids, padding_mask.

    Example:
    >>> from kbert.tokenizers import BertTokenizer
    >>> tok = BertTokenizer(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b"])
    >>> chunk_documents(tok, ["a b a"], 4, 3)["token_ids"][0].tolist()
    [[2, 5, 6, 3], [2, 5, 3, 0], [0, 0, 0, 0]]
    """
    if not isinstance(sequence_length, int) or sequence_length < 3:
        raise ValueError(
            "sequence_length must be an int >= 3 ([CLS], one token, [SEP]), "
            f"got {sequence_length!r}"
        )
    if not isinstance(max_chunks, int) or isinstance(max_chunks, bool) or max_chunks < 1:
        raise ValueError(f"max_chunks must be a positive int, got {max_chunks!r}")
    width = sequence_length - 2
    ids = tokenizer.tokenize(list(texts))
    shape = (len(ids), max_chunks, sequence_length)
    token_ids = np.full(shape, tokenizer.pad_id, "int32")
    padding_mask = np.zeros(shape, "int32")
    for row, pieces in enumerate(ids):
        count = min(max_chunks, max(1, -(-len(pieces) // width)))
        for chunk in range(count):
            window = pieces[chunk * width : (chunk + 1) * width]
            framed = [tokenizer.cls_id, *window, tokenizer.sep_id]
            token_ids[row, chunk, : len(framed)] = framed
            padding_mask[row, chunk, : len(framed)] = 1
    return {
        "token_ids": token_ids,
        "segment_ids": np.zeros(shape, "int32"),
        "padding_mask": padding_mask,
    }
