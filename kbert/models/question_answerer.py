"""BertQuestionAnswerer: extractive question answering (SQuAD v1.1 / v2.0).

Shapes: B features (question + one window of the context), T tokens.

A long context becomes several features: windows of the context tokens that
start `doc_stride` tokens apart (the original `run_squad.py` rule). Each
feature predicts start and end logits over its tokens; `predict_answers`
combines every window of a question, takes the `n_best_size` best starts and
ends, keeps spans inside the context of at most `max_answer_length` tokens,
and maps the best one back to the original text through character offsets.
"""

import collections

import keras
import numpy as np

from kbert.backend.ops import fill_padding
from kbert.layers.banded_attention import FIRST_SEGMENT
from kbert.models.preprocessor import BertPreprocessor
from kbert.models.task import Task
from kbert.utils import checks
from kbert.utils.host import with_gc_paused

QAFeatures = collections.namedtuple(
    "QAFeatures", ["x", "y", "example_index", "token_starts", "token_ends", "context_mask"]
)


# The span logit of a padding position: no answer starts or ends there, and
# the softmax over positions does not depend on how much padding a batch has.
PADDING_LOGIT = -1e9


@keras.saving.register_keras_serializable(package="kbert")
class PaddingMasked(keras.layers.Layer):
    """(B, T) logits -> the same with padding positions set to `PADDING_LOGIT`."""

    def call(self, logits, padding_mask):
        return fill_padding(logits, padding_mask, PADDING_LOGIT)

    def compute_output_spec(self, logits, padding_mask):
        return keras.KerasTensor(logits.shape, dtype=logits.dtype)


@keras.saving.register_keras_serializable(package="kbert")
class BertQuestionAnswerer(Task):
    """Answer-span prediction: a start and an end vector over every token.

    Train with `fit((questions, contexts), answers)` where `answers[i]` is a
    SQuAD answer dict `{"text": str, "answer_start": int}` (character offset
    in the context) or None / `{"text": ""}` for an unanswerable question
    (SQuAD v2; the target is then [CLS]). Windows that do not contain the
    answer are also trained to point at [CLS], as in the original code.
    Predict with `predict_answers(questions, contexts)`.

    The model maps inputs to `{"start_logits": (B, T), "end_logits": (B, T)}`
    (float32); targets are `{"start_positions": (B,), "end_positions": (B,)}`.
    The loss is the mean of the two cross-entropies (as `transformers`'
    `BertForQuestionAnswering`).

    Args:
        backbone: `kbert.BertBackbone`.
        preprocessor: `kbert.BertPreprocessor` (tokenizer and sequence length).
        doc_stride: int. tokens between the starts of two context windows.
        max_query_length: int. question tokens kept (the rest is cut).
        n_best_size: int. start and end candidates considered per window.
        max_answer_length: int. longest answer, in tokens.
        null_score_threshold: float or None. SQuAD v2: answer "" when the
            [CLS] score beats the best span by more than this; None never
            answers "" (SQuAD v1.1).
        freeze_backbone: False, True or "adapters" (see `BertClassifier`).

    Example:
    >>> qa = BertQuestionAnswerer(kbert.BertBackbone(100, 2, 2, 16, 32, max_sequence_length=32))
    """

    def __init__(
        self,
        backbone,
        preprocessor=None,
        doc_stride=128,
        max_query_length=64,
        n_best_size=20,
        max_answer_length=30,
        null_score_threshold=None,
        freeze_backbone=False,
        **kwargs,
    ):
        checks.check_positive_ints(
            locals(), "doc_stride", "max_query_length", "n_best_size", "max_answer_length"
        )
        inputs = self.backbone_inputs(backbone)
        logits = self.logits_head(
            backbone(inputs)["sequence_output"], backbone, 2, 0.0
        )  # (B, T, 2)
        mask = inputs["padding_mask"]
        outputs = {
            "start_logits": PaddingMasked(name="start_logits")(logits[:, :, 0], mask),
            "end_logits": PaddingMasked(name="end_logits")(logits[:, :, 1], mask),
        }
        config = dict(
            doc_stride=doc_stride,
            max_query_length=max_query_length,
            n_best_size=n_best_size,
            max_answer_length=max_answer_length,
            null_score_threshold=null_score_threshold,
            freeze_backbone=freeze_backbone,
        )
        self._init_task(inputs, outputs, backbone, preprocessor, config, kwargs)

    @classmethod
    def window_defaults(cls, kwargs):
        """With `attention_window`, the question attends globally
        ([CLS], the question, [SEP]: Longformer's choice for QA)."""
        query = kwargs.get("max_query_length", 64)
        return {"global_tokens": FIRST_SEGMENT, "max_global_tokens": query + 2}

    config_names = (
        "doc_stride",
        "max_query_length",
        "n_best_size",
        "max_answer_length",
        "null_score_threshold",
        "freeze_backbone",
    )

    def compile_defaults(self, given):
        def each(make):
            return {"start_logits": make(), "end_logits": make()}

        return {
            "loss": each(lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True)),
            "loss_weights": {"start_logits": 0.5, "end_logits": 0.5},
            "metrics": each(lambda: [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]),
        }

    # --- features ----------------------------------------------------------

    def prepare_features(self, questions, contexts, answers=None):
        """Questions, contexts (and answers) -> `QAFeatures`, one row per window.

        Returns `x` (model inputs), `y` (targets or None), `example_index`
        (the question each row belongs to), each token's character span in
        its context (`token_starts`, `token_ends`; -1 outside the context) and
        `context_mask` (1 on context tokens).
        """
        if self.preprocessor is None:
            raise ValueError("BertQuestionAnswerer needs a preprocessor to take raw text")
        questions, contexts = (
            BertPreprocessor._texts(questions, "questions"),
            BertPreprocessor._texts(contexts, "contexts"),
        )
        if len(questions) != len(contexts):
            raise ValueError(f"got {len(questions)} questions but {len(contexts)} contexts")
        if answers is not None and len(answers) != len(questions):
            raise ValueError(f"got {len(answers)} answers for {len(questions)} questions")
        return self._features(questions, contexts, answers)

    @with_gc_paused
    def _features(self, questions, contexts, answers):
        """`prepare_features` of checked lists of texts."""
        tokenizer = self.preprocessor.tokenizer
        length = self.preprocessor.sequence_length
        rows = collections.defaultdict(list)
        question_ids = tokenizer.tokenize(questions)
        # each distinct context tokenized once (SQuAD: ~5 questions each), all in one call
        distinct = list(dict.fromkeys(contexts))
        context_tokens = dict(zip(distinct, tokenizer.tokenize_with_offsets(distinct)))
        # between the segments: [SEP] (BERT), </s></s> (RoBERTa's packing, one token type)
        between, second = list(tokenizer.pair_separator_ids), tokenizer.second_segment_id
        for index, (question, context) in enumerate(zip(questions, contexts)):
            query = question_ids[index][: self.max_query_length]
            room = length - len(query) - 2 - len(between)
            if room < 1:
                raise ValueError(
                    f"sequence_length={length} leaves no room for the context after a "
                    f"{len(query)}-token question; raise sequence_length or lower max_query_length"
                )
            ids, starts, ends = context_tokens[context]
            span = self._answer_tokens(
                answers[index] if answers is not None else None, context, starts, ends, index
            )
            window_start = 0
            while True:
                window = slice(window_start, min(window_start + room, len(ids)))
                piece = ids[window]
                offset = len(query) + 1 + len(between)
                token_ids = [tokenizer.cls_id] + query + between + list(piece) + [tokenizer.sep_id]
                n = len(token_ids)
                rows["token_ids"].append(token_ids + [tokenizer.pad_id] * (length - n))
                segments = [0] * offset + [second] * (n - offset) + [0] * (length - n)
                rows["segment_ids"].append(segments)
                rows["padding_mask"].append([1] * n + [0] * (length - n))
                token_starts = np.full(length, -1, "int64")
                token_ends = np.full(length, -1, "int64")
                token_starts[offset : offset + len(piece)] = starts[window]
                token_ends[offset : offset + len(piece)] = ends[window]
                rows["token_starts"].append(token_starts)
                rows["token_ends"].append(token_ends)
                rows["context_mask"].append((token_starts >= 0).astype("int32"))
                rows["example_index"].append(index)
                start = end = 0  # [CLS]: no answer in this window
                if span is not None and span[0] >= window.start and span[1] < window.stop:
                    start, end = span[0] - window.start + offset, span[1] - window.start + offset
                rows["start"].append(start)
                rows["end"].append(end)
                if window.stop >= len(ids):
                    break
                window_start += min(room, self.doc_stride)
        x = {
            k: np.asarray(rows[k], "int32").reshape(-1, length)
            for k in ("token_ids", "segment_ids", "padding_mask")
        }
        y = None
        if answers is not None:
            y = {
                "start_positions": np.asarray(rows["start"], "int32"),
                "end_positions": np.asarray(rows["end"], "int32"),
            }
        return QAFeatures(
            x,
            y,
            np.asarray(rows["example_index"], "int64"),
            np.asarray(rows["token_starts"]).reshape(-1, length),
            np.asarray(rows["token_ends"]).reshape(-1, length),
            np.asarray(rows["context_mask"]).reshape(-1, length),
        )

    @staticmethod
    def _answer_tokens(answer, context, starts, ends, index):
        """Character answer -> (first token, last token), or None (no answer)."""
        if answer is None:
            return None
        form = '{"text": ..., "answer_start": <its character offset in the context>}'
        if isinstance(answer, dict):
            text, char_start = answer.get("text", ""), answer.get("answer_start")
            if text and char_start is None:
                raise ValueError(f"answer {index} ({text!r:.60}) has no answer_start: {form}")
        elif isinstance(answer, (list, tuple)) and len(answer) == 2:
            text, char_start = answer
        else:
            raise ValueError(
                f"answer {index} must be {form}, a (text, answer_start) pair or None, "
                f"got {answer!r:.60}"
            )
        if not text:
            return None
        if (
            not isinstance(char_start, (int, np.integer))
            or char_start < 0
            or char_start + len(text) > len(context)
        ):
            raise ValueError(f"answer {index} ({text!r} at {char_start}) is not inside its context")
        if context[char_start : char_start + len(text)] != text:
            raise ValueError(
                f"answer {index}: context[{char_start}:{char_start + len(text)}] is "
                f"{context[char_start : char_start + len(text)]!r}, not the answer text {text!r}"
            )
        char_end = char_start + len(text)
        inside = np.nonzero((ends > char_start) & (starts < char_end))[0]
        if inside.size == 0:  # the answer is only characters the tokenizer drops
            return None
        return int(inside[0]), int(inside[-1])

    # --- fit / evaluate on raw text ----------------------------------------------

    @staticmethod
    def _is_qa_text(x):
        return (
            isinstance(x, tuple)
            and len(x) == 2
            and all(
                isinstance(v, (list, tuple, np.ndarray))
                and len(v)
                and isinstance(np.asarray(v).reshape(-1)[0], str)
                for v in x
            )
        )

    def _features_and_targets(self, x, y):
        if self._is_qa_text(x):
            features = self.prepare_features(x[0], x[1], y)
            x, y = features.x, features.y
        if isinstance(y, dict) and set(y) == {"start_positions", "end_positions"}:
            length = self.preprocessor.sequence_length if self.preprocessor is not None else None
            for key in y:
                values = np.asarray(y[key])
                if values.size and (
                    values.min() < 0 or (length is not None and values.max() >= length)
                ):
                    raise ValueError(
                        f"{key} holds {values.min() if values.min() < 0 else values.max()}, "
                        f"outside the {length} token positions"
                    )
            y = {"start_logits": y["start_positions"], "end_logits": y["end_positions"]}
        return x, y

    token_outputs = True  # start/end logits per token
    token_output_fill = PADDING_LOGIT

    def fit(self, x=None, y=None, *args, validation_data=None, **kwargs):
        x, y = self._features_and_targets(x, y)
        if isinstance(validation_data, tuple) and len(validation_data) == 2:
            validation_data = self._features_and_targets(*validation_data)
        return super().fit(x, y, *args, validation_data=validation_data, **kwargs)

    def evaluate(self, x=None, y=None, *args, **kwargs):
        x, y = self._features_and_targets(x, y)
        return super().evaluate(x, y, *args, **kwargs)

    def predict_answers(self, questions, contexts, batch_size=32, return_scores=False):
        """Raw questions and contexts -> answer strings (substrings of the
        contexts; "" for no answer when `null_score_threshold` is set)."""
        features = self.prepare_features(questions, contexts)
        outputs = self.predict(features.x, batch_size=batch_size, verbose=0)
        return self.postprocess(features, outputs, contexts, return_scores=return_scores)

    def postprocess(self, features, outputs, contexts, return_scores=False):
        """Start/end logits of every window -> the best answer per question."""
        contexts = BertPreprocessor._texts(contexts, "contexts")
        start_logits = np.asarray(outputs["start_logits"], "float64")
        end_logits = np.asarray(outputs["end_logits"], "float64")
        best = [(-np.inf, "")] * len(contexts)
        null = [np.inf] * len(contexts)
        for row, index in enumerate(features.example_index):
            starts, ends = start_logits[row], end_logits[row]
            null[index] = min(null[index], starts[0] + ends[0])
            context = features.context_mask[row] > 0
            candidates_s = [i for i in np.argsort(-starts)[: self.n_best_size] if context[i]]
            candidates_e = [i for i in np.argsort(-ends)[: self.n_best_size] if context[i]]
            for s in candidates_s:
                for e in candidates_e:
                    if e < s or e - s + 1 > self.max_answer_length:
                        continue
                    score = starts[s] + ends[e]
                    if score > best[index][0]:
                        text = contexts[index][
                            features.token_starts[row, s] : features.token_ends[row, e]
                        ]
                        best[index] = (score, text)
        answers, scores = [], []
        for index, (score, text) in enumerate(best):
            if (
                self.null_score_threshold is not None
                and null[index] - score > self.null_score_threshold
            ):
                text, score = "", null[index]
            answers.append(text)
            scores.append(float(score) if np.isfinite(score) else float("-inf"))
        return (answers, scores) if return_scores else answers
