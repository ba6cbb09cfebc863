"""Beam search as transformers' `generate(num_beams=...)` computes it.

Shapes: B batch, K beams, V vocabulary, L max_length, C = 2K candidates.

Each step scores every continuation of every running beam (accumulated
log-probabilities), keeps the best C, continues the best K that did not
just end, and adds those among the best K that ended (with the end token,
or at max_length) to the K finished hypotheses, scored by their log
probability divided by (generated length ** length_penalty). The loop ends
as transformers' does: when no running beam can beat the finished ones
(`early_stopping` False: judged at the current length; "never": at
max_length for a positive penalty), when every row holds K finished
hypotheses (`early_stopping=True`), or at max_length. The output is each
row's best hypothesis; as in transformers, positions after it hold the pad
token, or the end token when the pad token id is 0.
"""

from keras import ops

from kbert.backend.decoding import decode_loop

_NEG = -1.0e9  # transformers' "impossible" score


def _gather(tensor, indices):
    """tensor (B, N, ...) rows picked per batch row by indices (B, M)."""
    while len(indices.shape) < len(tensor.shape):
        indices = indices[..., None]
    return ops.take_along_axis(tensor, ops.cast(indices, "int32"), axis=1)


def beam_search(
    step,
    constants,
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
    """Beam search over a cache of B * K rows (each source repeated K
    times, beams of a source adjacent). Returns (ids (B, max_length),
    length) as `kbert.generation.search.greedy_search` does.

    Args:
        step: callable. (constants, cache, token_ids (B K, 1), index) ->
            (logits (B K, V), cache).
        constants: what `step` reads and never changes (nested tensors).
        cache: the decoding state of the B * K rows.
        start_ids: int tensor (B K,). the decoder start token of each row.
        max_length: int. the longest output, start token included.
        end_token_id, pad_token_id: int. the end and pad tokens.
        reorder: callable. (cache, rows (B K,)) -> the cache with its rows
            taken in that order.
        num_beams: int. K.
        length_penalty: float. exponent of the length dividing a finished
            hypothesis' log probability.
        early_stopping: True, False or "never". see the module docstring.
    """
    k = num_beams
    candidates = 2 * k
    rows = ops.shape(start_ids)[0]
    batch = rows // k
    fill = pad_token_id if pad_token_id else end_token_id  # transformers' `pad or eos`
    positions = ops.arange(max_length, dtype="int32")[None, None, :]  # (1, 1, L)
    start = ops.reshape(ops.cast(start_ids, "int32"), (batch, k, 1))
    running = ops.where(positions == 0, start, ops.full((batch, k, max_length), fill, "int32"))
    running_scores = ops.concatenate(
        [ops.zeros((batch, 1), "float32"), ops.full((batch, k - 1), _NEG, "float32")], axis=1
    )
    finished = running
    scores = ops.full((batch, k), _NEG, "float32")
    lengths = ops.zeros((batch, k), "int32")  # generated tokens of each finished hypothesis
    is_finished = ops.zeros((batch, k), "bool")
    unsatisfied = ops.ones((batch, 1), "bool")
    hits = ops.zeros((batch, candidates), "bool")
    top_mask = ops.arange(candidates, dtype="int32")[None, :] < k  # (1, C)
    offsets = ops.arange(batch, dtype="int32")[:, None] * k  # (B, 1)

    def cond(length, running, running_scores, finished, scores, lengths, is_finished,
             unsatisfied, hits, cache):  # fmt: skip
        keep = ops.logical_and(ops.any(unsatisfied), ops.logical_not(ops.all(hits)))
        if early_stopping is True:
            keep = ops.logical_and(keep, ops.logical_not(ops.all(is_finished)))
        return ops.logical_and(keep, length < max_length)

    def body(constants, length, running, running_scores, finished, scores, lengths, is_finished,
             unsatisfied, hits, cache):  # fmt: skip
        # `length`: tokens so far (start included); the last sits at length - 1
        last = ops.zeros((batch, k, 1), "int32") + (length - 1)
        token = ops.reshape(ops.take_along_axis(running, last, axis=2), (rows, 1))
        logits, cache = step(constants, cache, token, length - 1)
        vocabulary = ops.shape(logits)[-1]
        log_probs = ops.log_softmax(ops.cast(logits, "float32"), axis=-1)
        log_probs = ops.reshape(log_probs, (batch, k, vocabulary)) + running_scores[:, :, None]
        top_scores, top_indices = ops.top_k(
            ops.reshape(log_probs, (batch, k * vocabulary)), candidates
        )  # (B, C)
        top_indices = ops.cast(top_indices, "int32")
        source_beam = top_indices // vocabulary
        token_ids = top_indices % vocabulary
        top_sequences = ops.where(
            positions == length, token_ids[:, :, None], _gather(running, source_beam)
        )  # (B, C, L)
        hits = ops.logical_or(ops.equal(token_ids, end_token_id), length + 1 >= max_length)

        # the best K that go on
        going = top_scores + ops.cast(hits, "float32") * _NEG
        _, keep = ops.top_k(going, k)
        running = _gather(top_sequences, keep)
        running_scores = _gather(going, keep)
        cache = reorder(cache, ops.reshape(_gather(source_beam, keep) + offsets, (rows,)))

        # the best K that ended join the finished hypotheses
        ended = ops.logical_and(hits, top_mask)
        ended_scores = top_scores / ops.power(ops.cast(length, "float32"), length_penalty)
        if early_stopping is True:
            full = ops.all(is_finished, axis=-1, keepdims=True)
            ended_scores = ended_scores + ops.cast(full, "float32") * _NEG
        ended_scores = ended_scores + ops.cast(ops.logical_not(unsatisfied), "float32") * _NEG
        ended_scores = ended_scores + ops.cast(ops.logical_not(ended), "float32") * _NEG
        merged_scores = ops.concatenate([scores, ended_scores], axis=1)  # (B, K + C)
        _, best = ops.top_k(merged_scores, k)
        finished = _gather(ops.concatenate([finished, top_sequences], axis=1), best)
        scores = _gather(merged_scores, best)
        new_lengths = ops.zeros_like(token_ids) + length
        lengths = _gather(ops.concatenate([lengths, new_lengths], axis=1), best)
        is_finished = _gather(ops.concatenate([is_finished, ended], axis=1), best)

        # can a running beam still beat the worst finished hypothesis?
        length = length + 1
        if early_stopping == "never" and length_penalty > 0.0:
            hypothetical = ops.cast(max_length - 1, "float32")
        else:
            hypothetical = ops.cast(length - 1, "float32")
        best_possible = running_scores[:, :1] / ops.power(hypothetical, length_penalty)
        worst = ops.where(is_finished, ops.min(scores, axis=1, keepdims=True), _NEG)
        improvable = ops.any(best_possible > worst, axis=-1, keepdims=True)
        unsatisfied = ops.logical_and(unsatisfied, improvable)
        return (length, running, running_scores, finished, scores, lengths, is_finished,
                unsatisfied, hits, cache)  # fmt: skip

    state = (
        ops.convert_to_tensor(1, "int32"),
        running,
        running_scores,
        finished,
        scores,
        lengths,
        is_finished,
        unsatisfied,
        hits,
        cache,
    )
    state = decode_loop(cond, body, state, constants, max_length - 1)
    finished, lengths = state[3], state[5]
    return finished[:, 0], 1 + ops.max(lengths[:, 0])
