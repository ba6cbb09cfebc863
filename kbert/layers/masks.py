"""What each query may attend to, described as data.

Shapes: B batch, T query tokens, S key tokens.

An `AttentionMask` says which keys a query sees without building the dense
(B, T, S) matrix: the attention implementations (`kbert.layers.attention`)
each turn the description into what their kernel takes (per-row key
lengths, variable-length segments, a boolean mask), and only those that
need a dense mask build one (`AttentionMask.dense`).

The parts, each optional, combine as follows. A key s is visible to query t
when:
- `padding[b, s]` is nonzero (real key; padding keys are never seen);
- `segments[b, t] == segments[b, s]` (rows that hold several examples:
  attention stays inside each example);
- `causal`: s <= t + offset, where offset = S - T (the queries are the last
  T of the S positions, as in cached decoding), or s < `prefix_lengths[b]`
  (a bidirectional prefix: UniLM's sequence-to-sequence mask);
- `window`: |t + offset - s| <= window (a radius: a query sees `window`
  keys on each side and itself; Longformer's `attention_window` W, the
  whole span, is `window = W // 2`);
- `global_tokens[b, .]` (self-attention): a global query sees every key and
  a global key is seen by every query, whatever `causal` and `window` say
  (padding and segments still apply).
A query that would see no key sees every key instead: a softmax over
nothing is NaN, and such queries are padding, whose outputs are unspecified
(a real token always sees itself); implementations that never form the
whole row ("banded", "torch-flex") give these queries some finite output
instead.
`max_global` bounds the global tokens of a row, a static size for
implementations that gather them.

Cross-attention is the same description with `padding` for the other
sequence's keys (T and S differ, no `segments`, `causal` or `window`).
"""

from keras import ops

from kbert.utils import checks

PARTS = ("padding", "segments", "prefix_lengths", "global_tokens")


class AttentionMask:
    """Which keys each query sees, as padding, segments, causal, window and
    global parts (see the module docstring for how they combine).

    Args:
        padding: int or bool tensor (B, S) or None. 1 for real keys.
        segments: int tensor (B, T) or None. example id of each token of a
            packed row (self-attention only).
        causal: bool. queries see only keys at or before their position.
        prefix_lengths: int tensor (B,) or None. with `causal`, the first
            `prefix_lengths[b]` keys are seen by every query.
        window: int or None. keys at most this many positions away.
        global_tokens: int or bool tensor (B, T) or None. tokens that see and
            are seen by every token (self-attention only).
        max_global: int or None. at most this many global tokens in any
            row: the static size implementations that gather the global
            tokens use ("banded"); None: counted from `global_tokens` where
            its values are known (eager calls).

    Example:
    >>> import numpy as np
    >>> mask = AttentionMask(padding=np.array([[1, 1, 0]]), causal=True)
    >>> keras.ops.convert_to_numpy(mask.dense(3, 3)).astype(int).tolist()
    [[[1, 0, 0], [1, 1, 0], [1, 1, 1]]]
    """

    def __init__(
        self,
        padding=None,
        segments=None,
        causal=False,
        prefix_lengths=None,
        window=None,
        global_tokens=None,
        max_global=None,
    ):
        if window is not None and (
            not isinstance(window, int) or isinstance(window, bool) or window < 0
        ):
            raise ValueError(f"window must be a non-negative int or None, got {window!r}")
        if max_global is not None and (
            not isinstance(max_global, int) or isinstance(max_global, bool) or max_global < 1
        ):
            raise ValueError(f"max_global must be a positive int or None, got {max_global!r}")
        if prefix_lengths is not None and not causal:
            raise ValueError("prefix_lengths describes a causal mask's prefix: set causal=True")
        self.padding = padding
        self.segments = segments
        self.causal = bool(causal)
        self.prefix_lengths = prefix_lengths
        self.window = window
        self.global_tokens = global_tokens
        self.max_global = max_global
        self._dense = {}

    @classmethod
    def of(cls, value):
        """An `AttentionMask` from one, from a padding mask (B, S), or from a
        dict of its parts (`padding_mask` is read as `padding`; with
        `prefix_lengths`, `causal` defaults to True)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            parts = dict(value)
            if "padding_mask" in parts:
                parts["padding"] = parts.pop("padding_mask")
            if parts.get("prefix_lengths") is not None:
                # a prefix is a causal mask's: a dict of tensors only (as a
                # functional graph passes) can describe UniLM's mask
                parts.setdefault("causal", True)
            return cls(**parts)
        if value is None or len(value.shape) != 2:
            shape = None if value is None else tuple(value.shape)
            raise ValueError(
                f"attention takes an AttentionMask or a (batch, keys) padding mask, got shape "
                f"{shape}; describe rows holding several examples with "
                "AttentionMask(padding=..., segments=...) rather than a dense mask"
            )
        return cls(padding=value)

    @property
    def kind(self):
        """ "padding" when `padding` is the only part set (per-row key
        lengths say it all), else "general"."""
        general = (
            self.padding is None
            or self.segments is not None
            or self.causal
            or self.window is not None
            or self.global_tokens is not None
        )
        return "general" if general else "padding"

    def keep_keys(self):
        """The padding part as bool (B, S), or None."""
        return None if self.padding is None else ops.cast(self.padding, "bool")

    def dense(self, query_length, key_length):
        """The description as a bool (B, T, S) tensor (B is 1 when no part
        has a batch axis); computed once per static (T, S) and kept. The
        lengths may be scalar tensors (a graph traced for any length)."""
        if not (isinstance(query_length, int) and isinstance(key_length, int)):
            return self._build_dense(query_length, key_length)
        key = (query_length, key_length)
        if key not in self._dense:
            self._dense[key] = self._build_dense(*key)
        return self._dense[key]

    def _build_dense(self, query_length, key_length):
        offset = key_length - query_length
        queries = ops.arange(query_length, dtype="int32")[:, None] + offset  # (T, 1)
        keys = ops.arange(key_length, dtype="int32")[None, :]  # (1, S)
        allowed = ops.ones((1, query_length, key_length), "bool")
        if self.causal:
            sees = ops.less_equal(keys, queries)[None]  # (1, T, S)
            if self.prefix_lengths is not None:
                prefix = ops.cast(self.prefix_lengths, "int32")[:, None, None]
                sees = ops.logical_or(sees, ops.less(keys[None], prefix))
            allowed = ops.logical_and(allowed, sees)
        if self.window is not None:
            near = ops.less_equal(ops.abs(queries - keys), self.window)[None]
            allowed = ops.logical_and(allowed, near)
        if self.global_tokens is not None:
            g = ops.cast(self.global_tokens, "bool")  # (B, T), self-attention: T == S
            allowed = ops.logical_or(allowed, ops.logical_or(g[:, :, None], g[:, None, :]))
        if self.segments is not None:
            s = self.segments
            allowed = ops.logical_and(allowed, ops.equal(s[:, :, None], s[:, None, :]))
        if self.padding is not None:
            allowed = ops.logical_and(allowed, self.keep_keys()[:, None, :])
        empty = ops.logical_not(ops.any(allowed, axis=-1, keepdims=True))
        return ops.logical_or(allowed, empty)

    def global_slots(self):
        """G: the static number of global slots a call needs (`max_global`,
        or the most global tokens of any row where their values are known;
        0 without global tokens), or None when it cannot be known."""
        if self.global_tokens is None:
            return 0
        if self.max_global is not None:
            return self.max_global
        if checks.is_concrete(self.global_tokens):
            counts = ops.convert_to_numpy(ops.sum(ops.cast(self.global_tokens, "int32"), axis=1))
            return max(1, int(counts.max()) if counts.size else 1)
        return None

    def global_selection(self, slots, dtype="float32"):
        """The one-hot (B, T, G) that gathers the global tokens into `slots`
        slots: token t fills slot j when it is the (j+1)-th global token of
        its row. An exact, differentiable gather and scatter (products with
        it), the same op on every backend."""
        is_global = ops.cast(ops.cast(self.global_tokens, "bool"), "int32")  # (B, T)
        rank = ops.cumsum(is_global, axis=1) - 1  # (B, T)
        onehot = ops.logical_and(
            ops.equal(rank[:, :, None], ops.arange(slots, dtype="int32")[None, None]),
            ops.cast(is_global, "bool")[:, :, None],
        )
        return ops.cast(onehot, dtype)

    def __repr__(self):
        parts = [p for p in PARTS if getattr(self, p) is not None]
        flags = [f"causal={self.causal}"] + ([f"window={self.window}"] if self.window else [])
        return f"AttentionMask({', '.join(parts + flags)})"
