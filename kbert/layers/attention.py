"""Multi-head attention: one layer, and a table of implementations.

Shapes: B batch, T query tokens, S key tokens, N heads, D head size,
H hidden (= N * D).

Every implementation computes softmax(Q K^T * scale) V over the keys an
`AttentionMask` (`kbert.layers.masks`) lets each query see, with inverted
dropout on the probabilities in training where the layer asks for it. They
are registered by name in `ATTENTION_IMPLEMENTATIONS`, each saying whether
it can take a call (`supports(mask, dtype, dropout)`): a layer's
`attention_implementation` names one, or "auto" (the default) takes the
first in `AUTO_ORDER` that can. `MultiHeadSelfAttention.attention_path`
reports which one a call takes. A new kind of attention (a windowed kernel,
a cached decoder's) is one `register_attention` call and its tests against
"explicit".

- "jax-cudnn-flash": cuDNN flash attention (JAX on a GPU, 16-bit inputs),
  padding-only masks, no dropout.
- "torch-sdpa": torch's `scaled_dot_product_attention` (FlashAttention,
  memory-efficient or math kernel, torch's pick), any mask, dropout in the
  kernel.
- "keras": `keras.ops.dot_product_attention`, any mask, no dropout.
- "explicit": the einsum, softmax and dropout written out; any mask, any
  dropout (the paper's recipe: probability dropout 0.1 in training).
- "banded" (`kbert.layers.banded_attention`, registered on import):
  sliding-window + global attention over blocks of queries, memory linear
  in length; first for windowed masks.
- "torch-flex" (`kbert.layers.flex_attention`, registered on import):
  torch's FlexAttention over the mask description, any mask, dropout from
  two kernel calls; first in "auto" for windowed masks on torch with a
  GPU.
"""

import math

import keras
from keras import ops

from kbert import backend
from kbert.backend import ops as kernels
from kbert.backend.ops import sublayer_call
from kbert.layers.config import ArgumentsConfig
from kbert.layers.dense import Dense
from kbert.layers.dropout import Dropout
from kbert.layers.initializers import truncated_normal
from kbert.layers.masks import AttentionMask


class AttentionImplementation:
    """One entry of the table: `attend(query, key, value, mask, scale,
    dropout)` -> (B, T, N, D) for query (B, T, N, D) and key/value
    (B, S, N, D), `mask` an `AttentionMask` and `dropout` an
    `AttentionDropout` (rate 0 outside training); `supports(mask, dtype,
    rate)` says whether it computes that call exactly; `prefer(mask, dtype,
    rate)`, if given, whether "auto" takes it for a call it supports (an
    implementation exact everywhere but fast only on some devices)."""

    def __init__(self, name, attend, supports, prefer=None):
        self.name = name
        self.attend = attend
        self.supports = supports
        self.prefer = prefer

    def __repr__(self):
        return f"AttentionImplementation({self.name!r})"


class AttentionDropout:
    """The dropout a call asks for: `rate` (0 outside training) and `apply`,
    which drops attention probabilities with the layer's own generator (for
    implementations that compute the probabilities themselves)."""

    def __init__(self, rate, apply):
        self.rate = rate
        self.apply = apply


ATTENTION_IMPLEMENTATIONS = {}
# "auto" takes the first of these that supports the call.
AUTO_ORDER = ["jax-cudnn-flash", "torch-sdpa", "keras", "explicit"]


def register_attention(name, attend, supports, auto_position=None, prefer=None):
    """Adds an implementation to the table; with `auto_position`, also to
    "auto"'s order at that index (None: only chosen by name); with
    `prefer`, "auto" passes it over for the calls `prefer` declines."""
    if name == "auto":
        raise ValueError('"auto" is not a name an implementation can take')
    ATTENTION_IMPLEMENTATIONS[name] = AttentionImplementation(name, attend, supports, prefer)
    if auto_position is not None and name not in AUTO_ORDER:
        AUTO_ORDER.insert(auto_position, name)
    return ATTENTION_IMPLEMENTATIONS[name]


def select_implementation(name, mask, dtype, rate):
    """The implementation that runs a call: `name`'s, or for "auto" the first
    in `AUTO_ORDER` that supports it. A named one that cannot is an error
    naming why."""
    if name == "auto":
        for candidate in AUTO_ORDER:
            implementation = ATTENTION_IMPLEMENTATIONS.get(candidate)
            if implementation is None or not implementation.supports(mask, dtype, rate):
                continue
            if implementation.prefer is None or implementation.prefer(mask, dtype, rate):
                return implementation
        raise ValueError(f"no attention implementation supports {mask!r}")  # "explicit" does
    check_implementation_name(name)
    implementation = ATTENTION_IMPLEMENTATIONS[name]
    if not implementation.supports(mask, dtype, rate):
        raise ValueError(
            f"attention_implementation={name!r} cannot compute this call on the "
            f"{backend.name()} backend ({mask!r}, dtype {dtype}, attention dropout {rate}); "
            'use "auto" or "explicit"'
        )
    return implementation


# --- the implementations -------------------------------------------------


def _explicit(query, key, value, mask, scale, dropout):
    scores = ops.einsum("btnd,bsnd->bnts", query, key)  # (B, N, T, S)
    scores = ops.cast(scores, "float32") * scale
    keep = _keep(mask, query, key)  # (B, 1, 1, S) or (B, 1, T, S)
    # Masked keys get -1e30 (exp underflows to exactly 0). An additive bias
    # rather than where(keep, scores, full_like(-1e30)): the filled constant
    # is a host-to-device copy per layer on torch, which synchronises the
    # stream.
    scores = scores + (ops.cast(keep, "float32") - 1.0) * 1e30
    probs = ops.cast(ops.softmax(scores, axis=-1), query.dtype)
    if dropout.rate:
        probs = dropout.apply(probs)
    return ops.einsum("bnts,bsnd->btnd", probs, value)  # (B, T, N, D)


def _keep(mask, query, key):
    """The boolean mask (B, 1, 1, S) or (B, 1, T, S) for a kernel taking one."""
    if mask.kind == "padding":
        return kernels.attention_keep(mask.padding)
    return mask.dense(ops.shape(query)[1], ops.shape(key)[1])[:, None]


def _keras(query, key, value, mask, scale, dropout):
    return ops.dot_product_attention(query, key, value, mask=_keep(mask, query, key), scale=scale)


def _torch_sdpa(query, key, value, mask, scale, dropout):
    padding = mask.padding if mask.kind == "padding" else None
    return kernels.torch_sdpa(
        query, key, value, _keep(mask, query, key), scale, dropout.rate, padding_mask=padding
    )


def _cudnn(query, key, value, mask, scale, dropout):
    return kernels.cudnn_attention(query, key, value, mask.keep_keys(), scale)


def global_rows(g_query, key, value, mask, select, context, scale, dropout):
    """`context` (B, T, N, D) with the rows of the global tokens replaced:
    each of the G global queries `g_query` (B, G, N, D) attends to every
    key (B, S, N, D) its row's padding and segments allow. `select` is
    `mask.global_selection(G)`, the one-hot (B, T, G) of the slots."""
    batch, slots, length = ops.shape(select)[0], ops.shape(select)[2], ops.shape(key)[1]
    select32 = ops.cast(select, "float32")
    scores = ops.einsum("bgnd,bsnd->bngs", g_query, key)  # (B, N, G, S)
    scores = ops.cast(scores, "float32") * scale
    keep = ops.ones((batch, slots, length), "bool")
    if mask.padding is not None:
        keep = ops.logical_and(keep, mask.keep_keys()[:, None, :])
    if mask.segments is not None:
        segments = ops.cast(mask.segments, "float32")
        g_segments = ops.einsum("btg,bt->bg", select32, segments)  # (B, G)
        keep = ops.logical_and(keep, ops.equal(g_segments[:, :, None], segments[:, None, :]))
    keep = ops.logical_or(keep, ops.logical_not(ops.any(keep, axis=-1, keepdims=True)))
    scores = scores + (ops.cast(keep, "float32")[:, None] - 1.0) * 1e30
    probs = ops.cast(ops.softmax(scores, axis=-1), g_query.dtype)
    if dropout.rate:
        probs = dropout.apply(probs)
    g_context = ops.einsum("bngs,bsnd->bgnd", probs, value)  # (B, G, N, D)
    g_context = ops.einsum("btg,bgnd->btnd", select, g_context)  # (B, T, N, D), zeros elsewhere
    is_global = ops.cast(mask.global_tokens, "bool")[:, :, None, None]
    return ops.where(is_global, g_context, context)


register_attention("explicit", _explicit, lambda mask, dtype, rate: True)
register_attention("keras", _keras, lambda mask, dtype, rate: not rate)
register_attention(
    "torch-sdpa",
    _torch_sdpa,
    lambda mask, dtype, rate: backend.is_torch(),
)
register_attention(
    "jax-cudnn-flash",
    _cudnn,
    lambda mask, dtype, rate: (
        not rate and mask.kind == "padding" and kernels.cudnn_attention_available(dtype)
    ),
)


# --- the layer -----------------------------------------------------------


@keras.saving.register_keras_serializable(package="kbert")
class MultiHeadSelfAttention(ArgumentsConfig, keras.layers.Layer):
    """Multi-head self-attention with a fused QKV projection.

    `attention_mask` is a (B, S) padding mask (1 = real token), or an
    `AttentionMask` or a dict of its parts given as a keyword argument
    (Keras takes only tensors positionally).

    Args:
        num_heads: int. number of heads N.
        hidden_dim: int. model width H, divisible by `num_heads`.
        attention_dropout: float. dropout on attention probabilities.
        initializer_range: float. stddev of the truncated-normal init.
        attention_implementation: str. a name in `ATTENTION_IMPLEMENTATIONS`,
            or "auto": the fastest that can take each call.
        global_projections: bool. the global tokens of a mask
            (`AttentionMask.global_tokens`) attend with projections of their
            own (Longformer's `query_global`, `key_global`, `value_global`:
            the Dense layers `global_query` and `global_key_value`): a
            global token's output is its `global_query` projection's
            attention over every token's `global_key_value` projections.
            The other tokens see global keys through the shared `qkv`, as
            in Longformer. False: one set of projections for all tokens.

    Example:
    >>> layer = MultiHeadSelfAttention(num_heads=2, hidden_dim=8)
    >>> x = keras.ops.ones((2, 5, 8))
    >>> tuple(layer(x, keras.ops.ones((2, 5), "int32")).shape)
    (2, 5, 8)
    """

    config_omitted = {"global_projections": False}

    def __init__(
        self,
        num_heads,
        hidden_dim,
        attention_dropout=0.1,
        initializer_range=0.02,
        attention_implementation="auto",
        global_projections=False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if hidden_dim % num_heads:
            raise ValueError(f"hidden_dim={hidden_dim} is not divisible by num_heads={num_heads}")
        check_implementation_name(attention_implementation)
        if not isinstance(global_projections, bool):
            raise ValueError(
                f"global_projections must be True or False, got {global_projections!r}"
            )
        self.store_arguments(locals())
        self.head_dim = hidden_dim // num_heads
        init = truncated_normal(initializer_range)
        self.qkv = Dense(
            3 * hidden_dim, kernel_initializer=init, dtype=self.dtype_policy, name="qkv"
        )
        self.output_dense = Dense(
            hidden_dim, kernel_initializer=init, dtype=self.dtype_policy, name="output"
        )
        self.probs_dropout = Dropout(
            attention_dropout, dtype=self.dtype_policy, name="probs_dropout"
        )
        self.global_query = self.global_key_value = None
        if global_projections:
            self.global_query = Dense(
                hidden_dim, kernel_initializer=init, dtype=self.dtype_policy, name="global_query"
            )
            self.global_key_value = Dense(
                2 * hidden_dim,
                kernel_initializer=init,
                dtype=self.dtype_policy,
                name="global_key_value",
            )

    def build(self, inputs_shape, attention_mask_shape=None):
        self.qkv.build(inputs_shape)
        self.output_dense.build(tuple(inputs_shape[:-1]) + (self.hidden_dim,))
        if self.global_projections:
            self.global_query.build(inputs_shape)
            self.global_key_value.build(inputs_shape)
        self.built = True

    def attention_path(self, training=None, attention_mask=None, dtype=None):
        """The name of the implementation a call takes (padding-only mask
        when `attention_mask` is None; the layer's compute dtype by default)."""
        mask = AttentionMask(padding=ops.ones((1, 1))) if attention_mask is None else attention_mask
        rate = self.attention_dropout if training else 0.0
        dtype = dtype or self.compute_dtype
        return select_implementation(
            self.attention_implementation, AttentionMask.of(mask), dtype, rate
        ).name

    def call(self, inputs, attention_mask, training=None):
        mask = AttentionMask.of(attention_mask)
        qkv = sublayer_call(self.qkv, inputs, training=training)  # (B, T, 3H)
        context = self._attend(qkv, mask, training)
        if self.global_projections and mask.global_tokens is not None:
            context = self._global_rows(inputs, context, mask, training)
        return sublayer_call(self.output_dense, context, training=training)

    def call_packed(self, tokens, packing, training=None):
        """`call` on the real tokens only: `tokens` (n, H) are the rows
        `packing.gather` took from a padded batch. The projections run on
        them; attention runs per group of rows of similar length
        (`packing.attention_groups()`), each padded to its own longest.
        Returns (n, H)."""
        qkv = sublayer_call(self.qkv, tokens, training=training)  # (n, 3H)
        groups = packing.attention_groups()
        parts = [
            group.gather(
                self._attend(
                    group.scatter(qkv), AttentionMask(padding=group.padding_mask), training
                )
            )
            for group in groups
        ]  # (n_g, H) each
        context = packing.merge(parts, groups)  # (n, H)
        return sublayer_call(self.output_dense, context, training=training)

    def _attend(self, qkv, mask, training):
        """(B, T, 3H) projections -> (B, T, H) attention context."""
        batch, length = ops.shape(qkv)[0], ops.shape(qkv)[1]
        qkv = ops.reshape(qkv, (batch, length, 3, self.num_heads, self.head_dim))  # (B, T, 3, N, D)
        # unstack, not three slices: on torch each slice's gradient is a zero
        # (B, T, 3, N, D) tensor with its part copied in, and the three are
        # summed; unbind's gradient is one stack.
        query, key, value = ops.unstack(qkv, num=3, axis=2)  # (B, T, N, D) each
        rate = self.attention_dropout if training else 0.0
        implementation = select_implementation(
            self.attention_implementation, mask, query.dtype, rate
        )
        dropout = AttentionDropout(
            rate, lambda probs: sublayer_call(self.probs_dropout, probs, training=training)
        )
        scale = 1.0 / math.sqrt(self.head_dim)
        context = implementation.attend(query, key, value, mask, scale, dropout)  # (B, T, N, D)
        return ops.reshape(context, (batch, length, self.hidden_dim))  # (B, T, H)

    def _global_rows(self, inputs, context, mask, training):
        """(B, T, H) `context` with the global tokens' rows from the global
        projections: their queries (only theirs are projected) over every
        token's global keys and values."""
        slots = mask.global_slots()
        if slots is None:
            raise ValueError(
                "global projections need a static number of global tokens: build the "
                "AttentionMask with max_global=..."
            )
        batch, length = ops.shape(inputs)[0], ops.shape(inputs)[1]
        heads = (self.num_heads, self.head_dim)
        select = mask.global_selection(slots, inputs.dtype)  # (B, T, G)
        g_inputs = ops.einsum("btg,bth->bgh", select, inputs)  # (B, G, H)
        g_query = sublayer_call(self.global_query, g_inputs, training=training)
        g_query = ops.reshape(g_query, (batch, slots, *heads))  # (B, G, N, D)
        key_value = sublayer_call(self.global_key_value, inputs, training=training)  # (B, T, 2H)
        key_value = ops.reshape(key_value, (batch, length, 2, *heads))  # (B, T, 2, N, D)
        key, value = ops.unstack(key_value, num=2, axis=2)  # (B, T, N, D) each
        rate = self.attention_dropout if training else 0.0
        dropout = AttentionDropout(
            rate, lambda probs: sublayer_call(self.probs_dropout, probs, training=training)
        )
        context = ops.reshape(context, (batch, length, *heads))  # (B, T, N, D)
        scale = 1.0 / math.sqrt(self.head_dim)
        context = global_rows(g_query, key, value, mask, select, context, scale, dropout)
        return ops.reshape(context, (batch, length, self.hidden_dim))  # (B, T, H)

    def compute_output_shape(self, inputs_shape, attention_mask_shape=None):
        return tuple(inputs_shape)


def check_implementation_name(name):
    """Raises a ValueError unless `name` is "auto" or a registered name."""
    if name != "auto" and name not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"unknown attention_implementation {name!r}; known: "
            f"{['auto', *ATTENTION_IMPLEMENTATIONS]}"
        )
