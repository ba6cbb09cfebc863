"""Sliding-window + global attention through torch's FlexAttention: the
"torch-flex" attention implementation (registered on import).

FlexAttention runs flash-style tiles of queries and keys and skips the
tiles the mask leaves empty, with the mask description's rules evaluated
inside the tiles (`kbert.backend.torch_flex`): memory linear in length,
and the band's work only. It takes any `AttentionMask` on the torch
backend (padding, segments, causal with a prefix, window, global tokens)
and attention dropout (computed from two kernel calls: see
`kbert.backend.torch_flex`). "auto" takes it first for windowed masks on
torch with a GPU, where the kernel is compiled; on a CPU torch runs
FlexAttention's reference implementation (slower than "banded", which
"auto" keeps there) and has no backward pass for it: training on a CPU
needs another implementation.

A query that sees no key (only padding can be one) gets zeros.
"""

from kbert import backend
from kbert.backend import ops as kernels
from kbert.layers import attention

NAME = "torch-flex"


def supports(mask, dtype, rate):
    """Any mask description on the torch backend."""
    return backend.is_torch()


def preferred(mask, dtype, rate):
    """Where "auto" takes it: windowed masks on a GPU (the others go to
    torch's SDPA kernels)."""
    return mask.window is not None and kernels.flex_attention_preferred()


def flex_attention(query, key, value, mask, scale, dropout):
    """softmax(Q K^T * scale) V over the keys `mask` lets each query see,
    through FlexAttention. `query` (B, T, N, D), `key`, `value` (B, S, N, D).

    Example:
    >>> import numpy as np
    >>> from kbert.layers import AttentionMask
    >>> from kbert.layers.attention import AttentionDropout
    >>> q = np.random.default_rng(0).normal(size=(1, 10, 2, 4)).astype("float32")
    >>> mask = AttentionMask(padding=np.ones((1, 10), "int32"), window=2)
    >>> if backend.is_torch():
    ...     out = flex_attention(q, q, q, mask, 0.5, AttentionDropout(0.0, None))
    ...     assert tuple(out.shape) == (1, 10, 2, 4)
    """
    if not backend.is_torch():
        raise ValueError(
            f'attention_implementation="{NAME}" runs on the torch backend only (this is '
            f'{backend.name()}); use "auto" or "banded"'
        )
    return kernels.flex_attention(query, key, value, mask, scale, dropout.rate)


attention.register_attention(NAME, flex_attention, supports, auto_position=0, prefer=preferred)
