"""Position tables resized on load: a checkpoint read with a different
`max_sequence_length` than it was trained with.

Shapes: P learned positions, N asked positions, E table width.

Longer tables are the learned rows tiled (Longformer's conversion, Beltagy
et al. 2020: position P + i starts as position i, which keeps the local
structure attention learned; random new rows cost the model most of its
language modelling). Shorter tables are the first N rows, so inputs of at
most N tokens give the outputs they gave before.
"""

import numpy as np

POSITION_TABLE = "embeddings/position_embeddings"


def resize_positions(table, length):
    """The (P, E) position table as (N, E): the first N rows when N <= P,
    else the P rows repeated until N rows are filled.

    Args:
        table: array (P, E). the learned position embeddings.
        length: int. N, the number of positions wanted.

    Example:
    >>> resize_positions(np.arange(3)[:, None], 7)[:, 0].tolist()
    [0, 1, 2, 0, 1, 2, 0]
    """
    table = np.asarray(table)
    if table.ndim != 2 or table.shape[0] < 1:
        raise ValueError(f"a position table is (positions, width), got shape {table.shape}")
    if not isinstance(length, (int, np.integer)) or isinstance(length, bool) or length < 1:
        raise ValueError(f"max_sequence_length must be a positive int, got {length!r}")
    held = table.shape[0]
    if length <= held:
        return table[:length].copy()
    return np.tile(table, (-(-length // held), 1))[:length]


def resize_position_weights(weights, length):
    """`weights` ({kbert path: array}) with the backbone's position table
    resized to `length` rows (`resize_positions`); unchanged without one or
    when it already has `length` rows."""
    table = weights.get(POSITION_TABLE)
    if table is None or np.shape(table)[0] == length:
        return weights
    return {**weights, POSITION_TABLE: resize_positions(table, length)}
