"""A SavedModel that takes raw strings: the task's preprocessor in the graph.

The serving signatures take batches of strings and return the task's
outputs; tokenization runs in TensorFlow ops (tf.strings and
tensorflow-text), so serving needs TensorFlow and `tensorflow-text` of the
same minor version, and no kbert.

Signatures by task (B batch, T tokens, C classes, H hidden):
- classifier: `serve(texts)` and `serve_pairs(texts, pairs)` -> `logits` (B, C)
- text embedder: `serve(texts)` -> `embeddings` (B, H)
- token classifier: `serve(texts)` -> `logits` (B, T, C), `word_ids` (B, T):
  the index of the word (as `BertTokenizer.split_words` splits the text)
  each token comes from, -1 for [CLS], [SEP] and padding; a word's label is
  its first token's
- question answerer: `serve(questions, contexts)` -> `start_logits`,
  `end_logits` (B, T), `token_starts`, `token_ends` (B, T): each token's
  character span in its context (Python string indices), -1 outside the
  context; the answer is `context[token_starts[s]:token_ends[e]]`
"""

from kbert import backend as kbert_backend
from kbert.backend.ops import portable_graph
from kbert.export.process import in_tensorflow
from kbert.tokenizers import BertTokenizer


def task_kind(model):
    """The kbert task class `model` is (or derives from), by name: a key of `ENDPOINTS`."""
    for cls in type(model).__mro__:
        if cls.__name__ in ENDPOINTS:
            return cls.__name__
    raise ValueError(
        f"export_text_model takes a {', '.join(ENDPOINTS)}; got {type(model).__name__} "
        "(export it with export_model and tokenize with export_tokenizer_json)"
    )


def export_text_model(model, filepath, verbose=False):
    """Writes a SavedModel whose signatures take raw strings.

    Works from every backend (from JAX and torch the model is rebuilt in a
    TensorFlow-backend process). The tokenizer and packing are those of the
    model's preprocessor, at its `sequence_length`.

    Args:
        model: a kbert `BertClassifier`, `BertTextEmbedder`,
            `BertTokenClassifier` or `BertQuestionAnswerer` with a preprocessor.
        filepath: str. the SavedModel directory.
        verbose: bool. print Keras' export summary.

    Example:
    >>> export_text_model(classifier, "/tmp/sentiment")
    >>> served = tf.saved_model.load("/tmp/sentiment")
    >>> served.serve(tf.constant(["a fine film"]))["logits"]
    """
    kind = task_kind(model)
    if getattr(model, "preprocessor", None) is None:
        raise ValueError(
            f"{model.name} has no preprocessor to put in the graph; attach one: "
            "model.preprocessor = kbert.BertPreprocessor(tokenizer, sequence_length)"
        )
    if not isinstance(model.preprocessor.tokenizer, BertTokenizer):
        raise ValueError(
            f"{model.name}'s tokenizer is {type(model.preprocessor.tokenizer).__name__}: a "
            "SavedModel taking raw strings holds WordPiece only (tensorflow-text has no "
            "byte-level BPE). Export the model on token ids (kbert.export.export_model) with "
            "the tokenizer as tokenizer.json (kbert.export.export_tokenizer_json)"
        )
    if kbert_backend.name() != "tensorflow":
        return in_tensorflow(model, filepath, "text", verbose=verbose)
    import tensorflow as tf

    endpoints = ENDPOINTS[kind](model)
    module = tf.Module()
    module.model_variables = list(model.variables)  # saved with the graph
    signatures = {}
    with portable_graph():  # a saved graph runs anywhere: no token packing, no oneDNN-only ops
        for name, (fn, signature) in endpoints.items():
            function = tf.function(fn, input_signature=signature, autograph=False)
            setattr(module, name, function)
            signatures[name] = function.get_concrete_function()  # one trace each
        signatures["serving_default"] = signatures["serve"]
        tf.saved_model.save(module, filepath, signatures=signatures)
    if verbose:
        print(f"Saved {model.name} taking raw strings at {filepath}: {sorted(endpoints)}")
    return filepath


def _strings(name):
    import tensorflow as tf

    return tf.TensorSpec([None], tf.string, name=name)


def _trimmed(x):
    """Columns past the longest row are padding everywhere: the same
    outputs for one-vector tasks, less work on short texts."""
    import tensorflow as tf

    longest = tf.maximum(tf.reduce_max(tf.reduce_sum(x["padding_mask"], axis=1)), 1)
    return {k: v[:, :longest] for k, v in x.items()}


def _one_vector_endpoints(output, pairs):
    """Signatures of a task with one output row per text (or text pair)."""

    def endpoints(model):
        pre = model.preprocessor

        def run(*texts):
            return {output: model(_trimmed(pre(*texts)), training=False)}

        signatures = {"serve": (lambda texts: run(texts), [_strings("texts")])}
        if pairs:
            signatures["serve_pairs"] = (
                lambda texts, pairs: run(texts, pairs),
                [_strings("texts"), _strings("pairs")],
            )
        return signatures

    return endpoints


def _token_classifier_endpoints(model):
    pre = model.preprocessor

    def tag(texts):
        x = pre(texts)
        return {
            "logits": model(x, training=False),
            "word_ids": _word_ids(pre.tokenizer, texts, pre.sequence_length),
        }

    return {"serve": (tag, [_strings("texts")])}


def _question_answerer_endpoints(model):
    from kbert.tokenizers import tf_ops

    pre = model.preprocessor

    def answer(questions, contexts):
        x = pre(questions, contexts)
        outputs = model(x, training=False)
        starts, ends = _context_offsets(pre.tokenizer, contexts, x, pre.sequence_length, tf_ops)
        return {
            "start_logits": outputs["start_logits"],
            "end_logits": outputs["end_logits"],
            "token_starts": starts,
            "token_ends": ends,
        }

    return {"serve": (answer, [_strings("questions"), _strings("contexts")])}


# kbert task class -> its serving signatures: {name: (function, input signature)}.
# A task that serves raw strings adds one line here.
ENDPOINTS = {
    "BertClassifier": _one_vector_endpoints("logits", pairs=True),
    "BertTextEmbedder": _one_vector_endpoints("embeddings", pairs=False),
    "BertTokenClassifier": _token_classifier_endpoints,
    "BertQuestionAnswerer": _question_answerer_endpoints,
}


def _rules(tokenizer):
    """The tokenizer's rule-set keywords of `tf_ops.normalize` / `split_words`."""
    return {
        "rules": getattr(tokenizer, "rules", "original"),
        "strip_accents": getattr(tokenizer, "strip_accents", None),
        "tokenize_chinese_chars": getattr(tokenizer, "tokenize_chinese_chars", True),
    }


def _pad_packed(ragged, sequence_length, fill):
    """(B, (n)) int32 -> (B, T): `fill` for [CLS], then the values, [SEP], padding."""
    import tensorflow as tf

    ragged = ragged[:, : sequence_length - 2]
    edge = tf.fill([ragged.nrows(), 1], tf.constant(fill, ragged.dtype))
    packed = tf.concat([edge, ragged, edge], axis=1)
    return packed.to_tensor(default_value=fill, shape=[None, sequence_length])


def _word_ids(tokenizer, texts, sequence_length):
    """(B, T) int32: each token's word index in its text, -1 off words."""
    import tensorflow as tf

    from kbert.tokenizers import tf_ops

    words = tf_ops.split_words(texts, tokenizer.lowercase, **_rules(tokenizer))  # (B, W)
    # A word alone tokenizes to its pieces in the text.
    pieces = tokenizer.tf_tokenize(words.flat_values).row_lengths()  # (sum W,)
    index = tf.ragged.range(words.row_lengths()).flat_values  # word index in its text
    flat = tf.repeat(tf.cast(index, tf.int32), pieces)
    per_text = tf.math.segment_sum(pieces, words.value_rowids())
    per_text = tf.concat(
        [per_text, tf.zeros([words.nrows() - tf.shape(per_text, out_type=tf.int64)[0]], tf.int64)],
        axis=0,
    )  # texts with no words at the end
    ragged = tf.RaggedTensor.from_row_lengths(flat, per_text)
    return _pad_packed(ragged, sequence_length, -1)


def _context_offsets(tokenizer, contexts, x, sequence_length, tf_ops):
    """(token_starts, token_ends) (B, T) int32 of the context tokens in `x`.

    Each character is normalised on its own (as `tokenize_with_offsets`
    does), so every normalised byte knows the character it came from.
    """
    import tensorflow as tf
    import tensorflow_text as tf_text

    chars = tf.strings.unicode_split(contexts, "UTF-8")  # (B, C)
    rules = _rules(tokenizer)
    normalized = tf_ops.normalize(chars.flat_values, tokenizer.lowercase, **rules)  # per char
    char_index = tf.ragged.range(chars.row_lengths()).flat_values
    nbytes = tf.strings.length(normalized)
    byte_origin = tf.RaggedTensor.from_row_lengths(
        tf.repeat(tf.cast(char_index, tf.int32), nbytes),
        tf.math.unsorted_segment_sum(nbytes, chars.value_rowids(), chars.nrows()),
    )  # (B, bytes of the normalised text)
    text = tf.strings.reduce_join(chars.with_flat_values(normalized), axis=1)
    patterns = tf_ops._patterns(rules["rules"])
    words, word_starts, _ = tf_text.regex_split_with_offsets(
        text, patterns["separators"], patterns["punctuation"]
    )  # (B, W)
    too_long = tf.strings.length(words.flat_values, unit="UTF8_CHAR") > (
        tokenizer.max_input_chars_per_word
    )
    unk = tokenizer.special_tokens["unk"]
    wordpiece = tf_text.FastWordpieceTokenizer(
        vocab=list(tokenizer.vocabulary),
        suffix_indicator="##",
        max_bytes_per_word=4 * tokenizer.max_input_chars_per_word + 4,
        unknown_token=unk,
        no_pretokenization=True,
    )
    _, piece_starts, piece_ends = wordpiece.tokenize_with_offsets(
        tf.where(too_long, unk, words.flat_values)
    )  # (sum W, P)
    word_of_piece = piece_starts.value_rowids()
    # The [UNK] of a too-long word covers the whole word.
    long_piece = tf.gather(too_long, word_of_piece)
    word_bytes = tf.gather(tf.strings.length(words.flat_values), word_of_piece)
    piece_first = tf.cast(piece_starts.flat_values, tf.int32)
    first = tf.where(long_piece, tf.zeros_like(word_bytes), piece_first)
    last = tf.where(long_piece, word_bytes, tf.cast(piece_ends.flat_values, tf.int32)) - 1
    token_rows = tf.gather(words.value_rowids(), word_of_piece)
    word_start = tf.cast(tf.gather(word_starts.flat_values, word_of_piece), tf.int32)
    row_base = tf.cast(tf.gather(byte_origin.row_starts(), token_rows), tf.int32)
    origin_flat = byte_origin.flat_values
    starts = tf.gather(origin_flat, row_base + word_start + first)
    ends = tf.gather(origin_flat, row_base + word_start + last) + 1
    per_row = tf.math.unsorted_segment_sum(tf.ones_like(token_rows), token_rows, chars.nrows())
    starts = tf.RaggedTensor.from_row_lengths(starts, per_row)
    ends = tf.RaggedTensor.from_row_lengths(ends, per_row)
    # Place them at the context's positions: [CLS] question [SEP] context [SEP].
    mask = tf.cast(x["padding_mask"], tf.int64)
    context_length = tf.reduce_sum(tf.cast(x["segment_ids"], tf.int64) * mask, axis=1) - 1
    offset = tf.reduce_sum(mask, axis=1) - context_length - 1
    positions = tf.range(sequence_length, dtype=tf.int64)[None, :]
    inside = (positions >= offset[:, None]) & (positions < (offset + context_length)[:, None])
    index = tf.maximum(positions - offset[:, None], 0)

    def place(values):
        dense = values.to_tensor(default_value=-1, shape=[None, sequence_length])
        picked = tf.gather(dense, tf.minimum(index, sequence_length - 1), batch_dims=1)
        return tf.where(inside, picked, -1)

    return place(starts), place(ends)
