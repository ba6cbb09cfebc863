"""Sliding-window + global attention whose memory is linear in length:
the "banded" attention implementation.

Shapes: B batch, T tokens, N heads, D head size, W window radius
(`AttentionMask.window`), C block size, K = T_pad / C blocks, G global
slots (`AttentionMask.max_global`).

Queries are cut into K blocks of C = min(W, T) tokens; block i attends to
key blocks i - 1, i and i + 1 (3 C keys, which hold every key within W of
each of its queries), so scores take (B, N, K, C, 3 C) = 3 T C entries, not
T^2 (the blocked local attention of BigBird and LSG; Longformer's
`sliding_chunks` overlaps chunks of 2 W instead). Global tokens
(`AttentionMask.global_tokens`) are gathered into G slots: every query
also scores the G global keys (one softmax over band and global keys, a
global key inside the band counted once), and the G global queries attend
to all T keys, (B, N, G, T) scores, their outputs written back over the
banded ones. Everything is the mask description's rules (`kbert.layers.masks`)
applied to the keys each query can reach, so outputs equal "explicit"'s
to float rounding; the exception is a query that sees no key at all (only
padding can be one), which the dense rule lets see every key and which gets
some finite output here instead.

The gather and scatter of global tokens are one-hot products (B, T, G):
exact, differentiable, and the same op on every backend.
"""

from keras import ops

from kbert.layers import attention
from kbert.layers.masks import AttentionMask
from kbert.utils import checks

NAME = "banded"
# `global_tokens` for the tokens of the first segment: [CLS], a question, [SEP]
FIRST_SEGMENT = "first_segment"
# `global_tokens` rules of one-token-type (RoBERTa-style) packing `<s> A </s></s> B
# </s>`, read from the token ids (the backbone's `separator_token_id`), as
# transformers' Longformer classes without a `global_attention_mask`: the
# tokens before the first separator (question answering: `<s>` and the
# question) and those after the first separator pair (multiple choice: the
# choice and its `</s>`)
BEFORE_SEPARATOR = "before_separator"
AFTER_SEPARATORS = "after_separators"
SEPARATOR_RULES = (BEFORE_SEPARATOR, AFTER_SEPARATORS)
RULES = (FIRST_SEGMENT, *SEPARATOR_RULES)


def supports(mask, dtype, rate):
    """Windowed self-attention whose global slots have a static size."""
    return mask.window is not None and mask.global_slots() is not None


def _pad_tokens(x, before, after):
    """`x` (B, T, ...) with `before` and `after` zeros on the token axis."""
    widths = [(0, 0)] * len(x.shape)
    widths[1] = (before, after)
    return ops.pad(x, widths)


def _blocks(x, blocks, size):
    """(B, K C, ...) -> (B, K, C, ...)."""
    return ops.reshape(x, (ops.shape(x)[0], blocks, size, *x.shape[2:]))


def _band(x, blocks, size, pad):
    """(B, T, ...) -> (B, K, 3 C, ...): for each query block, the key
    blocks before, at and after it (zeros beyond the ends)."""
    x = _blocks(_pad_tokens(x, size, pad + size), blocks + 2, size)  # (B, K + 2, C, ...)
    return ops.concatenate([x[:, :-2], x[:, 1:-1], x[:, 2:]], axis=2)  # (B, K, 3C, ...)


def banded_attention(query, key, value, mask, scale, dropout):
    """softmax(Q K^T * scale) V over the keys `mask` lets each query see,
    computed on the band of 3 C keys around each block of C queries plus the
    global tokens. `query`, `key`, `value` (B, T, N, D), self-attention.

    Example:
    >>> import numpy as np
    >>> from kbert.layers import AttentionMask
    >>> from kbert.layers.attention import AttentionDropout
    >>> q = np.random.default_rng(0).normal(size=(1, 10, 2, 4)).astype("float32")
    >>> mask = AttentionMask(padding=np.ones((1, 10), "int32"), window=2)
    >>> out = banded_attention(q, q, q, mask, 0.5, AttentionDropout(0.0, None))
    >>> tuple(out.shape)
    (1, 10, 2, 4)
    """
    if mask.window is None:
        raise ValueError(f'"{NAME}" attention needs a window in the mask, got {mask!r}')
    if query.shape[1] is not None and key.shape[1] is not None and query.shape[1] != key.shape[1]:
        raise ValueError(
            f'"{NAME}" attention is self-attention; got {query.shape[1]} queries and '
            f"{key.shape[1]} keys"
        )
    slots = mask.global_slots()
    if slots is None:
        raise ValueError(
            f'"{NAME}" attention needs a static number of global tokens: build the '
            "AttentionMask with max_global=..."
        )
    batch, length = ops.shape(query)[0], ops.shape(query)[1]
    static_length = query.shape[1]
    size = max(1, mask.window)
    if isinstance(static_length, int):
        size = max(1, min(size, static_length))  # one block when the window spans the row
    blocks = (length + size - 1) // size
    pad = blocks * size - length

    # positions: queries (K, C), band keys (K, 3C); band keys beyond the row are invalid
    q_pos = ops.reshape(ops.arange(blocks * size, dtype="int32"), (blocks, size))
    k_pos = ops.reshape(ops.arange(-size, (blocks + 1) * size, dtype="int32"), (blocks + 2, size))
    k_pos = ops.concatenate([k_pos[:-2], k_pos[1:-1], k_pos[2:]], axis=1)  # (K, 3C)
    delta = q_pos[:, :, None] - k_pos[:, None, :]  # (K, C, 3C)
    sees = ops.logical_and(
        ops.less_equal(ops.abs(delta), mask.window),
        ops.logical_and(ops.greater_equal(k_pos, 0), ops.less(k_pos, length))[:, None, :],
    )[None]  # (1, K, C, 3C)
    if mask.causal:
        before = ops.greater_equal(delta, 0)[None]  # (1, K, C, 3C)
        if mask.prefix_lengths is not None:
            prefix = ops.cast(mask.prefix_lengths, "int32")[:, None, None, None]
            before = ops.logical_or(before, ops.less(k_pos[None, :, None, :], prefix))
        sees = ops.logical_and(sees, before)
    if mask.padding is not None:
        real = ops.cast(mask.padding, "int32")
        sees = ops.logical_and(sees, ops.cast(_band(real, blocks, size, pad), "bool")[:, :, None])
    if mask.segments is not None:
        segments = ops.cast(mask.segments, "int32")
        q_seg = _blocks(_pad_tokens(segments, 0, pad), blocks, size)  # (B, K, C)
        k_seg = _band(segments, blocks, size, pad)  # (B, K, 3C)
        sees = ops.logical_and(sees, ops.equal(q_seg[:, :, :, None], k_seg[:, :, None, :]))
    if slots:
        is_global = ops.cast(ops.cast(mask.global_tokens, "bool"), "int32")  # (B, T)
        # a global key is one of the G global columns; leaving it out of the band counts it once
        k_global = ops.cast(_band(is_global, blocks, size, pad), "bool")  # (B, K, 3C)
        sees = ops.logical_and(sees, ops.logical_not(k_global)[:, :, None])

    q_blocks = _blocks(_pad_tokens(query, 0, pad), blocks, size)  # (B, K, C, N, D)
    k_band = _band(key, blocks, size, pad)  # (B, K, 3C, N, D)
    v_band = _band(value, blocks, size, pad)  # (B, K, 3C, N, D)
    scores = ops.einsum("bicnd,bijnd->bnicj", q_blocks, k_band)  # (B, N, K, C, 3C)
    scores = ops.cast(scores, "float32") * scale
    # masked keys get -1e30, as in "explicit": exp underflows to exactly 0
    scores = scores + (ops.cast(sees, "float32")[:, None] - 1.0) * 1e30
    band_keys = 3 * size

    if slots:
        select = mask.global_selection(slots, query.dtype)  # (B, T, G) one-hot
        select32 = ops.cast(select, "float32")
        g_query = ops.einsum("btg,btnd->bgnd", select, query)  # (B, G, N, D)
        g_key = ops.einsum("btg,btnd->bgnd", select, key)
        g_value = ops.einsum("btg,btnd->bgnd", select, value)
        g_seen = ops.sum(select32, axis=1)  # (B, G): 1 where a slot holds a token
        if mask.padding is not None:
            g_seen = g_seen * ops.einsum("btg,bt->bg", select32, ops.cast(real, "float32"))
        g_sees = ops.broadcast_to(
            ops.cast(g_seen, "bool")[:, None, None, :], (batch, blocks, size, slots)
        )  # (B, K, C, G)
        if mask.segments is not None:
            g_seg = ops.einsum("btg,bt->bg", select32, ops.cast(segments, "float32"))
            same = ops.equal(ops.cast(q_seg, "float32")[:, :, :, None], g_seg[:, None, None, :])
            g_sees = ops.logical_and(g_sees, same)
        g_scores = ops.einsum("bicnd,bgnd->bnicg", q_blocks, g_key)  # (B, N, K, C, G)
        g_scores = ops.cast(g_scores, "float32") * scale
        g_scores = g_scores + (ops.cast(g_sees, "float32")[:, None] - 1.0) * 1e30
        scores = ops.concatenate([scores, g_scores], axis=-1)  # (B, N, K, C, 3C + G)

    probs = ops.cast(ops.softmax(scores, axis=-1), query.dtype)
    if dropout.rate:
        probs = dropout.apply(probs)
    context = ops.einsum("bnicj,bijnd->bicnd", probs[..., :band_keys], v_band)  # (B, K, C, N, D)
    if slots:
        context = context + ops.einsum("bnicg,bgnd->bicnd", probs[..., band_keys:], g_value)
    context = ops.reshape(context, (batch, blocks * size, *query.shape[2:]))[:, :length]

    if not slots:
        return context  # (B, T, N, D)
    # the global queries see every key (padding and segments apply)
    return attention.global_rows(g_query, key, value, mask, select, context, scale, dropout)


attention.register_attention(NAME, banded_attention, supports, auto_position=0)


def check_window(
    attention_window,
    global_tokens,
    max_global_tokens=None,
    global_projections=False,
    separator_token_id=None,
):
    """Raises a ValueError naming the setting unless `attention_window` is
    None or a positive even int, `global_tokens` a non-negative int or
    one of `RULES` (which need `max_global_tokens`; the separator rules
    `separator_token_id` too), `max_global_tokens` None or a positive int,
    `separator_token_id` None or a non-negative int and
    `global_projections` a bool (True only with a window)."""
    if attention_window is not None and (
        not isinstance(attention_window, int)
        or isinstance(attention_window, bool)
        or attention_window < 2
        or attention_window % 2
    ):
        raise ValueError(
            "attention_window must be None (full attention) or a positive even int W "
            f"(each token sees W / 2 tokens on each side, as in Longformer), "
            f"got {attention_window!r}"
        )
    if global_tokens not in RULES and (
        not isinstance(global_tokens, int) or isinstance(global_tokens, bool) or global_tokens < 0
    ):
        raise ValueError(
            f"global_tokens must be a non-negative int (the first tokens of each example that "
            f'attend everywhere; 1: [CLS]), "{FIRST_SEGMENT}" ([CLS], the first segment and '
            f'its [SEP]: a question), "{BEFORE_SEPARATOR}" or "{AFTER_SEPARATORS}" (the tokens '
            f"before the first separator token, or after the first pair: RoBERTa-style "
            f"packing), got {global_tokens!r}"
        )
    if separator_token_id is not None and (
        not isinstance(separator_token_id, int)
        or isinstance(separator_token_id, bool)
        or separator_token_id < 0
    ):
        raise ValueError(
            f"separator_token_id must be None or a token id, got {separator_token_id!r}"
        )
    if global_tokens in SEPARATOR_RULES and separator_token_id is None:
        raise ValueError(
            f'global_tokens="{global_tokens}" reads the separator tokens: set '
            "separator_token_id (the id of `</s>` or [SEP])"
        )
    if max_global_tokens is not None and (
        not isinstance(max_global_tokens, int)
        or isinstance(max_global_tokens, bool)
        or max_global_tokens < 1
    ):
        raise ValueError(
            "max_global_tokens must be None or a positive int (the most global tokens a "
            f"row's global_attention_mask may hold), got {max_global_tokens!r}"
        )
    if global_tokens in RULES and max_global_tokens is None:
        raise ValueError(
            f'global_tokens="{global_tokens}" needs max_global_tokens: the most global tokens '
            "a row may hold (e.g. a question answerer's max_query_length + 2)"
        )
    if not isinstance(global_projections, bool):
        raise ValueError(f"global_projections must be True or False, got {global_projections!r}")
    if global_projections and attention_window is None:
        raise ValueError(
            "global_projections gives the global tokens of sliding-window attention "
            "projections of their own; set attention_window too"
        )


def window_mask(
    padding_mask,
    attention_window,
    global_tokens,
    position_ids=None,
    segments=None,
    global_mask=None,
    max_global=None,
    segment_ids=None,
    token_ids=None,
    separator_id=None,
):
    """The `AttentionMask` of sliding-window attention: each token sees
    `attention_window // 2` tokens on each side; the first `global_tokens`
    tokens of each example ([CLS] for 1; for "first_segment", the tokens of
    segment 0), or the tokens `global_mask` marks, see and are seen by
    every token.

    Args:
        padding_mask: int tensor (B, T). 1 for real tokens.
        attention_window: int. W, the whole window (Longformer's
            `attention_window`).
        global_tokens: int or "first_segment". global tokens at the start
            of each example: this many, or those of segment 0 ([CLS], a
            question and its [SEP]; at most `max_global` of them).
        position_ids: int tensor (B, T) or None. each token's position in
            its example, for rows holding several (`segments` then says which).
        segments: int tensor (B, T) or None. the example of each token.
        global_mask: int tensor (B, T) or None. 1 for global tokens, in
            place of the `global_tokens` rule (padding is never global).
        max_global: int or None. the static number of global slots; a row
            of `global_mask` (or a first segment) with more keeps its first
            `max_global` (the others attend locally). None: `global_tokens`
            for the int rule; counted from `global_mask`'s values where
            they are known.
        segment_ids: int tensor (B, T) or None. for "first_segment".
        token_ids: int tensor (B, T) or None. for the separator rules.
        separator_id: int or None. the separator token's id, for the
            separator rules.

    Example:
    >>> import numpy as np
    >>> mask = window_mask(np.ones((1, 6), "int32"), 2, 1)
    >>> mask.window, mask.max_global
    (1, 1)
    """
    parts = {"padding": padding_mask, "window": attention_window // 2}
    if segments is not None:
        parts["segments"] = segments
    if global_tokens in RULES and global_mask is None:
        if global_tokens == FIRST_SEGMENT:
            if segment_ids is None:
                raise ValueError(f'global_tokens="{FIRST_SEGMENT}" needs the segment ids')
            global_mask = ops.cast(ops.equal(segment_ids, 0), "int32")
        else:
            if token_ids is None or separator_id is None:
                raise ValueError(
                    f'global_tokens="{global_tokens}" needs the token ids and the separator id'
                )
            global_mask = separator_rule_mask(global_tokens, token_ids, separator_id, position_ids)
        if segments is not None:  # rows of several examples: one first segment each
            length = padding_mask.shape[1]
            if not isinstance(length, int):
                raise ValueError("rows holding several examples need a static length")
            max_global = length
    if global_mask is not None:
        is_global = ops.logical_and(
            ops.cast(global_mask, "bool"), ops.cast(padding_mask, "bool")
        )  # (B, T)
        is_global = ops.cast(is_global, "int32")
        if max_global is None and not checks.is_concrete(is_global):
            raise ValueError(
                "a global_attention_mask inside a compiled call needs a static number of "
                "global tokens: set max_global_tokens on the backbone"
            )
        if max_global is not None:
            # the first max_global of each row: the slots the kernels gather into
            is_global = is_global * ops.cast(
                ops.less_equal(ops.cumsum(is_global, axis=1), max_global), "int32"
            )
            parts["max_global"] = max_global
        parts["global_tokens"] = is_global
    elif global_tokens:
        if position_ids is None:
            position_ids = ops.cumsum(ops.ones_like(padding_mask), axis=1) - 1  # (B, T)
            parts["max_global"] = global_tokens
        else:  # one set per example: at most one example per token
            length = padding_mask.shape[1]
            if not isinstance(length, int):
                raise ValueError("rows holding several examples need a static length")
            parts["max_global"] = length
        parts["global_tokens"] = ops.cast(ops.less(position_ids, global_tokens), "int32")
    return AttentionMask(**parts)


def separator_rule_mask(rule, token_ids, separator_id, position_ids=None):
    """(B, T) int32, 1 for the global tokens of a separator rule
    (`BEFORE_SEPARATOR`: positions before the example's first separator;
    `AFTER_SEPARATORS`: positions more than one past it, as transformers'
    Longformer computes them from `input_ids`). `position_ids`: each
    token's position in its example, for rows holding several (None: one
    example per row)."""
    is_sep = ops.cast(ops.equal(token_ids, separator_id), "int32")  # (B, T)
    index = ops.cumsum(ops.ones_like(is_sep), axis=1) - 1  # (B, T)
    if position_ids is None:
        position_ids = index
    start = index - ops.cast(position_ids, "int32")  # each token's example start

    def in_example(inclusive, flags):
        """A running count restarted at each example's first token."""
        base = ops.take_along_axis(inclusive - flags, start, axis=1)
        return inclusive - base

    seen = in_example(ops.cumsum(is_sep, axis=1), is_sep)  # separators up to the token
    before = ops.cast(ops.equal(seen, 0), "int32")
    if rule == BEFORE_SEPARATOR:
        return before
    # the example's first separator's position: the length of its prefix
    # of `before` tokens (counted at or after that prefix's end)
    first = in_example(ops.cumsum(before, axis=1), before)
    after = ops.logical_and(ops.greater(seen, 0), ops.greater(position_ids, first + 1))
    return ops.cast(after, "int32")
