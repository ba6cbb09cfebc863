"""BertTokenClassifier: a label for every word (NER, POS), from its first WordPiece.

Shapes: B batch, T tokens, C classes.
"""

import keras
import numpy as np

from kbert.models.task import Task
from kbert.training import raw_text
from kbert.utils import checks
from kbert.utils.host import with_gc_paused


@keras.saving.register_keras_serializable(package="kbert")
class BertTokenClassifier(Task):
    """Per-token classification, trained on word-level labels.

    `fit`, `evaluate` and `predict` take pre-split sentences (lists of
    words), `fit` and `evaluate` with one label id per word; each label
    goes to the word's first WordPiece and the other pieces are left out of
    the loss (sample weight 0), as in the paper's CoNLL-2003 set-up.
    `predict_words` maps predictions back to words.

    Args:
        backbone: `kbert.BertBackbone`.
        num_classes: int. C.
        preprocessor: `kbert.BertPreprocessor` (its tokenizer and sequence_length).
        dropout: float. dropout before the classifier.
        freeze_backbone: False, True or "adapters" (see `BertClassifier`).

    Example:
    >>> model = BertTokenClassifier(
    ...     kbert.BertBackbone(100, 2, 2, 16, 32, max_sequence_length=16), num_classes=5
    ... )
    """

    def __init__(
        self, backbone, num_classes, preprocessor=None, dropout=0.1, freeze_backbone=False, **kwargs
    ):
        if not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"num_classes must be an int ≥ 2, got {num_classes!r}")
        inputs = self.backbone_inputs(backbone)
        logits = self.logits_head(
            backbone(inputs)["sequence_output"], backbone, num_classes, dropout
        )
        config = dict(num_classes=num_classes, dropout=dropout, freeze_backbone=freeze_backbone)
        self._init_task(inputs, logits, backbone, preprocessor, config, kwargs)

    config_names = ("num_classes", "dropout", "freeze_backbone")

    def compile_defaults(self, given):
        # Loss and metrics are weighted: only first pieces of words count, and
        # the loss is their mean (as transformers' ignore_index=-100), not a
        # mean over every token slot. Metrics given are weighted ones.
        metrics = given.pop("metrics", None)
        return {
            "loss": keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, reduction="mean_with_sample_weight"
            ),
            "weighted_metrics": metrics
            or [keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
        }

    @with_gc_paused
    def encode_words(self, sentences, labels=None):
        """Word lists (and word labels) -> (x, y, sample_weight, first_piece_positions);
        y and sample_weight are None without labels."""
        if self.preprocessor is None:
            raise ValueError("BertTokenClassifier needs a preprocessor to take words")
        tokenizer = self.preprocessor.tokenizer
        length = self.preprocessor.sequence_length
        batch = len(sentences)
        token_ids = np.full((batch, length), tokenizer.pad_id, "int32")
        mask = np.zeros((batch, length), "int32")
        y = np.zeros((batch, length), "int32")
        weights = np.zeros((batch, length), "float32")
        firsts = []
        if labels is not None and len(labels) != len(sentences):
            raise ValueError(f"got {len(sentences)} sentences but {len(labels)} label lists")
        for row, words in enumerate(sentences):
            if isinstance(words, str) or not all(isinstance(w, str) for w in words):
                raise ValueError(
                    f"sentence {row} must be a list of word strings, got {words!r}"[:200]
                )
            if labels is not None and (
                isinstance(labels[row], str) or not hasattr(labels[row], "__len__")
            ):
                raise ValueError(
                    f"the labels of sentence {row} must be a list with one label per word, "
                    f"got {labels[row]!r:.60}"
                )
            if labels is not None and len(labels[row]) != len(words):
                raise ValueError(
                    f"sentence {row} has {len(words)} words but {len(labels[row])} labels"
                )
        if labels is not None:
            checks.check_class_ids(
                np.concatenate([np.asarray(l).reshape(-1) for l in labels])
                if batch
                else np.zeros(0, "int64"),
                self.num_classes,
                kind="token",
            )
        # each distinct word tokenized once, in one batch
        distinct = list(dict.fromkeys(w for words in sentences for w in words))
        word_pieces = dict(zip(distinct, tokenizer.tokenize_split_words(distinct)))
        for row, words in enumerate(sentences):
            ids, positions = [tokenizer.cls_id], []
            for word in words:
                pieces = word_pieces[word] or [tokenizer.unk_id]  # a word of deleted characters
                if len(ids) + len(pieces) > length - 1:
                    break  # truncated: later words get no prediction
                positions.append(len(ids))
                ids.extend(pieces)
            ids.append(tokenizer.sep_id)
            token_ids[row, : len(ids)] = ids
            mask[row, : len(ids)] = 1
            if labels is not None:
                for position, label in zip(positions, labels[row]):
                    y[row, position] = label
                    weights[row, position] = 1.0
            firsts.append(positions)
        x = {"token_ids": token_ids, "segment_ids": np.zeros_like(token_ids), "padding_mask": mask}
        if labels is None:
            return x, None, None, firsts
        return x, y, weights, firsts

    @staticmethod
    def _is_word_lists(x):
        if isinstance(x, tuple) and len(x) == 2 and raw_text.is_text(x[0]):
            return False  # (texts, pairs)
        return (
            isinstance(x, (list, tuple))
            and len(x) > 0
            and all(isinstance(s, (list, tuple)) for s in x)
        )

    token_targets = True  # labels and weights per token
    token_outputs = True  # logits per token

    def fit(self, x=None, y=None, *args, **kwargs):
        if self._is_word_lists(x):
            x, y, weights, _ = self.encode_words(x, y)
            kwargs["sample_weight"] = weights
        return super().fit(x, y, *args, **kwargs)

    def evaluate(self, x=None, y=None, *args, **kwargs):
        if self._is_word_lists(x):
            x, y, weights, _ = self.encode_words(x, y)
            kwargs["sample_weight"] = weights
        return super().evaluate(x, y, *args, **kwargs)

    def predict(self, x=None, *args, **kwargs):
        """Keras `predict`; pre-split sentences give the logits of each
        WordPiece (N, T, C), as `encode_words` places them (`predict_words`
        gives one label per word)."""
        if self._is_word_lists(x):
            x = self.encode_words(x)[0]
        return super().predict(x, *args, **kwargs)

    def predict_words(self, sentences, **kwargs):
        """Pre-split sentences -> one predicted label id per word (truncated
        words get -1)."""
        x, _, _, firsts = self.encode_words(sentences)
        logits = self.predict(x, verbose=0, **kwargs)
        out = []
        for row, words in enumerate(sentences):
            labels = [int(np.argmax(logits[row, p])) for p in firsts[row]]
            out.append(labels + [-1] * (len(words) - len(labels)))
        return out
