"""BertPreprocessor: raw strings (or pairs) -> model inputs, attached to tasks."""

import json
import os

import keras
import numpy as np

from kbert.presets.loader import loader_for
from kbert.tokenizers import BertTokenizer, bpe
from kbert.tokenizers.bpe import ByteLevelBPETokenizer
from kbert.utils.files import load_json, preset_file

PREPROCESSOR_FILE = "preprocessor.json"


@keras.saving.register_keras_serializable(package="kbert")
class BertPreprocessor(keras.layers.Layer):
    """Tokenizes and packs text for a task model.

    In Python (`__call__` on str / lists / numpy string arrays) it uses the
    tokenizer's fast Python path; on tf.string tensors (inside tf.data) the
    in-graph path. Both give the same ids.

    Args:
        tokenizer: `kbert.BertTokenizer`, or `kbert.tokenizers.ByteLevelBPETokenizer`
            (RoBERTa / Longformer `tokenizer.json`, RoBERTa's packing).
        sequence_length: int. packed length T.
        truncate: str. only "longest_first" (the original BERT rule).

    Example:
    >>> tokenizer = BertTokenizer(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hi"])
    >>> pre = BertPreprocessor(tokenizer, 8)
    >>> pre(["hi"])["token_ids"].tolist()
    [[2, 5, 3, 0, 0, 0, 0, 0]]
    """

    def __init__(self, tokenizer, sequence_length=128, truncate="longest_first", **kwargs):
        kwargs.pop("dtype", None)
        super().__init__(trainable=False, dtype="int32", **kwargs)
        if isinstance(tokenizer, dict) and tokenizer.get("kind") == bpe.KIND:
            # embeds the tokenizer.json text itself, never a path
            tokenizer = ByteLevelBPETokenizer.from_config(tokenizer)
        elif isinstance(tokenizer, dict):
            # A config (from a .keras file or preset) must carry the vocabulary
            # itself: a string there would make loading read a file named by
            # the artifact.
            vocabulary = tokenizer.get("vocabulary")
            if not isinstance(vocabulary, (list, tuple)) or not all(
                isinstance(t, str) for t in vocabulary
            ):
                raise ValueError(
                    "preprocessor config must embed its vocabulary as a list of token strings, got "
                    f"{type(vocabulary).__name__} {str(vocabulary)[:80]!r}; refusing to read a "
                    "vocabulary file named by a saved artifact"
                )
            tokenizer = BertTokenizer(**tokenizer)
        if truncate != "longest_first":
            raise ValueError(f"truncate={truncate!r}: only 'longest_first' is supported")
        self.tokenizer = tokenizer
        self.sequence_length = int(sequence_length)
        self.truncate = truncate
        # No weights to create. Left unbuilt, it would make Keras'
        # `predict_on_batch` on the task that owns it run a full eager
        # forward pass before every batch ("build the model first").
        self.built = True

    @staticmethod
    def _texts(values, what):
        if isinstance(values, str):
            return [values]
        if isinstance(values, np.ndarray):
            values = values.reshape(-1).tolist()
        out = []
        for value in values:
            if isinstance(value, bytes):
                value = value.decode("utf-8", errors="replace")
            if not isinstance(value, str):
                raise ValueError(
                    f"{what} must be strings, got {type(value).__name__}: {value!r}"[:200]
                )
            out.append(value)
        return out

    def call(self, texts, pairs=None):
        if _is_tf_tensor(texts):
            import tensorflow as tf  # already imported: `texts` is a TensorFlow tensor

            # The in-graph tokenizer has no tensor-dependent Python control flow;
            # autograph's conversion of it would only cost the first tf.data trace
            # seconds.
            tf_call = tf.autograph.experimental.do_not_convert(self.tokenizer.tf_call)
            return tf_call(texts, pairs, self.sequence_length)
        texts = self._texts(texts, "texts")
        pairs = self._texts(pairs, "text pairs") if pairs is not None else None
        if pairs is not None and len(pairs) != len(texts):
            raise ValueError(f"got {len(texts)} texts but {len(pairs)} pairs")
        return self.tokenizer(texts, pairs, self.sequence_length)

    def __call__(self, texts, pairs=None):
        # Plain Python/NumPy in, NumPy out: no backend tensors, no tracing.
        return self.call(texts, pairs)

    def get_config(self):
        config = super().get_config()
        config.pop("dtype", None)
        config.pop("trainable", None)
        tok = self.tokenizer
        if isinstance(tok, ByteLevelBPETokenizer):
            embedded = tok.get_config()
        else:
            embedded = {
                "vocabulary": tok.vocabulary,
                "lowercase": tok.lowercase,
                "max_input_chars_per_word": tok.max_input_chars_per_word,
                "rules": tok.rules,
                "strip_accents": tok.strip_accents,
                "tokenize_chinese_chars": tok.tokenize_chinese_chars,
                **{f"{k}_token": v for k, v in tok.special_tokens.items()},
            }
        config.update(
            tokenizer=embedded,
            sequence_length=self.sequence_length,
            truncate=self.truncate,
        )
        return config

    def save_to_directory(self, directory):
        files = self.tokenizer.save(directory)
        with open(os.path.join(directory, PREPROCESSOR_FILE), "w") as f:
            json.dump(
                {"sequence_length": self.sequence_length, "truncate": self.truncate}, f, indent=2
            )
        return files + [PREPROCESSOR_FILE]

    @classmethod
    def from_directory(cls, directory, default_sequence_length=128, rules=None):
        """From tokenizer files in a preset, Hugging Face, original TF checkpoint or
        keras-hub directory, or None.

        The tokenization rules are those recorded in a kbert preset ("original"
        when it records none), "transformers" for a Hugging Face directory and
        "original" for an original TF checkpoint; `rules` overrides them (see
        `kbert.tokenizers.wordpiece.detect_rules`).
        """
        sequence_length = default_sequence_length
        path = preset_file(directory, PREPROCESSOR_FILE)
        if os.path.exists(path):
            sequence_length = load_json(path).get("sequence_length", sequence_length)
        if not os.path.isfile(os.path.join(directory, "vocab.txt")):
            # keras-hub's own vocabulary, a BPE tokenizer.json (RoBERTa, Longformer)
            loader = loader_for(directory, required=False)
            if loader is not None:
                tokenizer = loader.tokenizer(rules)
            else:  # tokenizer files alone
                tokenizer = bpe.load_if_present(directory)
            return cls(tokenizer, sequence_length) if tokenizer is not None else None
        return cls(BertTokenizer.load(directory, rules=rules), sequence_length)


def _is_tf_tensor(value):
    import sys

    if "tensorflow" not in sys.modules:
        return False
    import tensorflow as tf

    return isinstance(value, (tf.Tensor, tf.RaggedTensor)) and value.dtype == tf.string
