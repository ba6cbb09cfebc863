"""`generate_ids`: encoder ids -> generated ids for a model that decodes
with a cache, one compiled program per (batch, source length, options).

The model supplies `generation_start(encoder_token_ids,
encoder_padding_mask, max_length, num_beams) -> (constants, cache)` (the
cache with `num_beams` rows per source) and
`generation_step(constants, cache, token_ids, index) -> (logits, cache)`
(`index` a scalar tensor; on torch the step runs once per token, replayed
as a CUDA graph on a GPU: `kbert.backend.torch_decoding`),
and the token ids `start_token_id`, `end_token_id`, `pad_token_id`.
"""

import weakref

import numpy as np
from keras import ops

from kbert.backend.decoding import compile_decoding, decoding_path_name, weight_casts
from kbert.generation import beam, search

# model -> {program key: (compiled function, path)}; dropped with the model
_PROGRAMS = weakref.WeakKeyDictionary()
# model -> the kept weight casts its programs share (torch; `weight_casts`)
_CASTS = weakref.WeakKeyDictionary()
# source lengths are padded to a multiple of this (one program per bucket)
LENGTH_MULTIPLE = 16


def decoding_options(
    num_beams=1,
    do_sample=False,
    temperature=1.0,
    top_k=None,
    top_p=None,
    seed=None,
    length_penalty=1.0,
    early_stopping=False,
):
    """The strategy and its options, checked: ("greedy" | "sample" | "beam", dict)."""
    if not isinstance(num_beams, int) or isinstance(num_beams, bool) or num_beams < 1:
        raise ValueError(f"num_beams must be a positive int, got {num_beams!r}")
    if do_sample and num_beams > 1:
        raise ValueError("sampling with beams is not supported: use num_beams=1 with do_sample")
    if temperature is None or not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 0):
        raise ValueError(f"top_k must be a non-negative int or None, got {top_k!r}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if do_sample:
        return "sample", {
            "seed": 0 if seed is None else int(seed),
            "temperature": float(temperature),
            "top_k": top_k,
            "top_p": top_p,
        }
    if num_beams > 1:
        if early_stopping not in (True, False, "never"):
            raise ValueError(
                f"early_stopping must be True, False or 'never', got {early_stopping!r}"
            )
        return "beam", {
            "num_beams": num_beams,
            "length_penalty": float(length_penalty),
            "early_stopping": early_stopping,
        }
    return "greedy", {}


def _program(model, strategy, options, max_length):
    key = (strategy, tuple(sorted(options.items())), max_length)
    programs = _PROGRAMS.setdefault(model, {})
    if key in programs:
        return programs[key]

    def run(encoder_token_ids, encoder_padding_mask):
        # beam search: the cache holds each source's K beams (adjacent); the
        # source is read once
        beams = options["num_beams"] if strategy == "beam" else 1
        constants, cache = model.generation_start(
            encoder_token_ids, encoder_padding_mask, max_length, num_beams=beams
        )
        batch = ops.shape(encoder_token_ids)[0] * beams
        start = ops.full((batch,), model.start_token_id, "int32")
        ids = (model.end_token_id, model.pad_token_id)
        step, reorder = model.generation_step, model.generation_reorder
        if strategy == "beam":
            return beam.beam_search(
                step, constants, cache, start, max_length, *ids, reorder=reorder, **options
            )
        if strategy == "sample":
            return search.sample_search(step, constants, cache, start, max_length, *ids, **options)
        return search.greedy_search(step, constants, cache, start, max_length, *ids)

    if model not in _CASTS:
        _CASTS[model] = weight_casts(model.variables)
    programs[key] = compile_decoding(run, model.variables, _CASTS[model])
    return programs[key]


def decoding_path(model):
    """How the model's decode loops run ("jax.jit", "tf.function",
    "torch-cuda-graph": each token one replay of a captured step, or
    "eager": the step called per token), and how many programs it holds."""
    programs = _PROGRAMS.get(model, {})
    return sorted({decoding_path_name(path) for _, path in programs.values()}), len(programs)


def decoding_stats(model):
    """Per program on torch with graphs: how many steps were replayed, run
    eagerly, and captured, and why a capture failed (None: no failure);
    an empty list elsewhere."""
    programs = _PROGRAMS.get(model, {})
    return [path.stats() for _, path in programs.values() if hasattr(path, "stats")]


def generate_ids(
    model,
    encoder_token_ids,
    encoder_padding_mask,
    max_length,
    strategy,
    options,
    batch_size=None,
    max_source_length=None,
):
    """Generated ids (B, L) as numpy, laid out as transformers' `generate`
    returns them; rows run in batches of `batch_size` (all at once by
    default), each source padded to a multiple of `LENGTH_MULTIPLE` (at
    most `max_source_length`)."""
    encoder_token_ids = np.asarray(encoder_token_ids, "int32")
    encoder_padding_mask = np.asarray(encoder_padding_mask, "int32")
    rows, length = encoder_token_ids.shape
    bucket = -(-length // LENGTH_MULTIPLE) * LENGTH_MULTIPLE
    if max_source_length is not None:
        bucket = max(length, min(bucket, max_source_length))
    pad = ((0, 0), (0, bucket - length))
    encoder_token_ids = np.pad(encoder_token_ids, pad)
    encoder_padding_mask = np.pad(encoder_padding_mask, pad)
    batch_size = batch_size or rows
    fn, _ = _program(model, strategy, options, max_length)
    parts = []
    for start in range(0, rows, batch_size):
        ids, used = fn(
            ops.convert_to_tensor(encoder_token_ids[start : start + batch_size]),
            ops.convert_to_tensor(encoder_padding_mask[start : start + batch_size]),
        )
        parts.append(np.asarray(ops.convert_to_numpy(ids))[:, : int(ops.convert_to_numpy(used))])
    longest = max(p.shape[1] for p in parts)
    fill = model.pad_token_id
    if strategy == "beam" and not fill:  # what beam search writes after the end
        fill = model.end_token_id
    return np.concatenate(
        [np.pad(p, ((0, 0), (0, longest - p.shape[1])), constant_values=fill) for p in parts]
    )
