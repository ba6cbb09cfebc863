"""Decoding loops: greedy search and top-k / top-p sampling.

Shapes: B batch, V vocabulary, L the longest output (decoder start token
included).

A loop drives a `step(constants, cache, token_ids, index) -> (logits,
cache)`: the float32 logits (B, V) of the token after `token_ids` (B, 1),
which sits at decoder position `index` (a scalar tensor), and the cache
with that token's keys and values written; `constants` (what the step
reads and never changes, e.g. the encoder's keys and values) are passed
through. The cache keeps its shapes from step to step, so the loop is one
`kbert.backend.decoding.decode_loop`: on JAX and TensorFlow a
`keras.ops.while_loop` traced once inside the program `compile_decoding`
compiles; on torch one step function called per token (a CUDA graph
replayed per token on a GPU). Positions are read and written with
tensor-indexed operations (no host round trip per token).

Outputs are laid out as transformers' `generate` lays them out: the start
token, the generated tokens up to and including the end token, then the
pad token; the loop stops once every row has ended, and the caller cuts
the (B, max_length) ids to the `length` returned.
"""

from keras import ops

from kbert.backend.decoding import decode_loop


def _loop(step, constants, cache, start_ids, max_length, end_token_id, pad_token_id, choose):
    """The shared loop: `choose(logits, index)` picks each next token (B,)."""
    batch = ops.shape(start_ids)[0]
    columns = ops.arange(max_length, dtype="int32")[None, :]  # (1, L)
    ids = ops.where(
        columns == 0,
        ops.reshape(ops.cast(start_ids, "int32"), (batch, 1)),
        ops.full((batch, max_length), pad_token_id, "int32"),
    )
    done = ops.zeros((batch,), "bool")

    def cond(index, ids, done, cache):
        return ops.logical_and(index < max_length - 1, ops.logical_not(ops.all(done)))

    def body(constants, index, ids, done, cache):
        token = ops.take_along_axis(ids, ops.zeros((batch, 1), "int32") + index, axis=1)  # (B, 1)
        logits, cache = step(constants, cache, token, index)
        chosen = ops.cast(choose(logits, index), "int32")  # (B,)
        chosen = ops.where(done, ops.zeros_like(chosen) + pad_token_id, chosen)
        ids = ops.where(columns == index + 1, chosen[:, None], ids)
        done = ops.logical_or(done, ops.equal(chosen, end_token_id))
        return index + 1, ids, done, cache

    index = ops.convert_to_tensor(0, "int32")
    index, ids, done, cache = decode_loop(
        cond, body, (index, ids, done, cache), constants, max_length - 1
    )
    return ids, index + 1


def greedy_search(step, constants, cache, start_ids, max_length, end_token_id, pad_token_id):
    """The most likely next token at each step. Returns (ids (B, max_length),
    length): the ids up to `length` are the output.

    Args:
        step: callable. (constants, cache, token_ids (B, 1), index) ->
            (logits (B, V), cache).
        constants: what `step` reads and never changes (nested tensors).
        cache: the decoding state `step` carries (nested tensors).
        start_ids: int tensor (B,). the decoder start token of each row.
        max_length: int. the longest output, start token included.
        end_token_id: int. the token that ends a row.
        pad_token_id: int. the id after a row's end.
    """
    return _loop(
        step,
        constants,
        cache,
        start_ids,
        max_length,
        end_token_id,
        pad_token_id,
        lambda logits, index: ops.argmax(logits, axis=-1),
    )


def filter_logits(logits, temperature=1.0, top_k=None, top_p=None):
    """Logits (B, V) with tokens outside the top k, or beyond the smallest
    set whose probability reaches `top_p`, set to -inf after dividing by
    `temperature` (transformers' order: temperature, top-k, top-p; the most
    likely token always stays)."""
    logits = ops.cast(logits, "float32")
    if temperature != 1.0:
        logits = logits / temperature
    # (not `full_like`: on torch it reads the number back from the device)
    low = ops.zeros_like(logits) - float("inf")
    if top_k is not None and top_k > 0:
        k = min(int(top_k), logits.shape[-1])
        kth = ops.top_k(logits, k, sorted=True)[0][:, -1:]  # (B, 1)
        logits = ops.where(logits < kth, low, logits)
    if top_p is not None and top_p < 1.0:
        order = ops.argsort(-logits, axis=-1)  # descending
        ranked = ops.take_along_axis(logits, order, axis=-1)
        probs = ops.softmax(ranked, axis=-1)
        # a token is dropped when the tokens ranked before it already hold top_p
        before = ops.cumsum(probs, axis=-1) - probs
        drop_ranked = ops.greater(before, top_p)
        drop_ranked = ops.concatenate(
            [ops.zeros_like(drop_ranked[:, :1]), drop_ranked[:, 1:]], axis=-1
        )
        inverse = ops.argsort(order, axis=-1)
        drop = ops.take_along_axis(drop_ranked, inverse, axis=-1)
        logits = ops.where(drop, low, logits)
    return logits


_MIX = (-2048144789, -1028477387)  # murmur3's finalizer constants, as int32


def _shift(h, bits):
    """h >>> bits on int32 (a logical shift)."""
    return ops.bitwise_and(ops.right_shift(h, bits), (1 << (32 - bits)) - 1)


def uniform_noise(seed, index, shape):
    """Uniform (0, 1) float32 noise of `shape` (B, V), a function of
    (`seed`, `index`, position) only: the same on every backend and inside
    compiled loops, where a stateful generator would repeat itself."""
    rows, cols = shape
    position = ops.arange(rows, dtype="int32")[:, None] * cols + ops.arange(cols, dtype="int32")
    seed_term = (int(seed) * 1274126177 + (1 << 31)) % (1 << 32) - (1 << 31)  # int32 wrap
    h = position * 668265263 + ops.cast(index, "int32") * 374761393 + seed_term
    h = ops.bitwise_xor(h, _shift(h, 16))
    h = h * _MIX[0]
    h = ops.bitwise_xor(h, _shift(h, 13))
    h = h * _MIX[1]
    h = ops.bitwise_xor(h, _shift(h, 16))
    return (ops.cast(_shift(h, 8), "float32") + 0.5) / float(1 << 24)


def sample_search(
    step,
    constants,
    cache,
    start_ids,
    max_length,
    end_token_id,
    pad_token_id,
    seed=0,
    temperature=1.0,
    top_k=None,
    top_p=None,
):
    """Sampling from the filtered distribution (`filter_logits`) at each
    step, by the Gumbel-max trick on `uniform_noise`: the same `seed` gives
    the same ids. Arguments and returns as `greedy_search`'s, plus
    `seed` (int), `temperature`, `top_k`, `top_p`."""
    seed = int(seed) % (1 << 31)

    def choose(logits, index):
        logits = filter_logits(logits, temperature, top_k, top_p)
        gumbel = -ops.log(-ops.log(uniform_noise(seed, index, ops.shape(logits))))
        return ops.argmax(logits + gumbel, axis=-1)

    return _loop(step, constants, cache, start_ids, max_length, end_token_id, pad_token_id, choose)
