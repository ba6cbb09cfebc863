"""Beam search (transformers' semantics: length penalty, early stopping)."""


def beam_search(
    step,
    cache,
    start_ids,
    max_length,
    end_token_id,
    pad_token_id,
    reorder,
    num_beams,
    length_penalty=1.0,
    early_stopping=False,
):
    raise NotImplementedError("beam search")
