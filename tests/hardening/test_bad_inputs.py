"""The catalogue of bad inputs through every public entry point (README:
"N inputs tried, 0 crashes, 0 silent NaN"), and property-based fuzzing from
raw text to model outputs.

Each case gives either a defined result (checked: ids in range, finite
outputs) or a ValueError whose message names the problem. Anything else
(a backend crash, a different exception, NaN) fails the case.
"""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kbert
from kbert.tokenizers import BertTokenizer
from tests.harness import TINY

VOCAB = (
    ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    + "the cat dog sat on mat ##s , . !".split()
    + list("abcdefghij")
)

TEXTS = {
    "empty": "",
    "whitespace": " \t\n\r  \u3000",
    "zero_width": "\u200b\u200c\u200d\ufeff\u2060",
    "control": "\x00\x01\x07\x1b\x7f\x9f",
    "one_megabyte": "the cat " * 131072,
    "mixed_scripts_emoji": "the cat 混合 мир עברית العربية हिन्दी 🙂👍🏽🏳️‍🌈 sat",
    "lone_surrogate": "the \udcff cat \ud800",
    "combining_marks": "e\u0301\u0301\u0301\u0301 cat",
    "bidi_override": "\u202ethe cat\u202c",
    "special_token_strings": "[CLS] [SEP] [MASK] [PAD] ##s",
    "one_long_word": "x" * 5000,
    "punctuation_only": "!!!...,,,!!!",
}


@pytest.fixture(scope="module")
def models():
    tokenizer = BertTokenizer(VOCAB)
    pre = kbert.BertPreprocessor(tokenizer, sequence_length=16)
    backbone = kbert.BertBackbone(**{**TINY, "vocabulary_size": len(VOCAB)})
    tasks = {
        "classifier": kbert.BertClassifier(backbone, 3, preprocessor=pre),
        "regressor": kbert.BertClassifier(backbone, 1, preprocessor=pre),
        "tagger": kbert.BertTokenClassifier(backbone, 3, preprocessor=pre),
        "qa": kbert.BertQuestionAnswerer(backbone, pre, doc_stride=8, max_query_length=4),
        "mc": kbert.BertMultipleChoice(backbone, 2, preprocessor=pre),
        "embedder": kbert.BertTextEmbedder(backbone, preprocessor=pre),
    }
    for name, task in tasks.items():  # fit and evaluate need a compiled model with a loss
        task.compile(loss="mse") if name == "embedder" else task.compile()
    return {"tokenizer": tokenizer, "preprocessor": pre, **tasks}


def _finite(values):
    for v in values if isinstance(values, (list, tuple)) else [values]:
        v = np.asarray(v)
        assert v.dtype.kind == "f" and np.all(np.isfinite(v)), "non-finite output"


def _text_entry_points(text):
    """(name, call(models) -> None) for every entry point that takes raw text."""

    def tokenizer(m):
        ids = m["tokenizer"].tokenize(text)
        assert all(0 <= i < len(VOCAB) for i in ids)

    def pair(m):
        x = m["preprocessor"]([text], [""])
        assert x["token_ids"].shape == (1, 16) and x["padding_mask"].sum() >= 3

    def classifier(m):
        _finite(m["classifier"].predict([text, "the cat"], verbose=0))

    def embedder(m):
        _finite(m["embedder"].embed([text]))

    def tagger(m):
        words = text.split() or [text]
        labels = m["tagger"].predict_words([words])
        assert len(labels[0]) == len(words) and all(-1 <= l < 3 for l in labels[0])

    def qa(m):
        answers, scores = m["qa"].predict_answers([text], [text + " the cat"], return_scores=True)
        assert isinstance(answers[0], str) and not math.isnan(scores[0])

    def mc(m):
        _finite(m["mc"].predict(([text], [[text, "the cat"]]), verbose=0))

    return [
        ("tokenizer", tokenizer),
        ("pair_with_empty_side", pair),
        ("classifier", classifier),
        ("embedder", embedder),
        ("tagger", tagger),
        ("question_answerer", qa),
        ("multiple_choice", mc),
    ]


def _error_cases():
    """(name, call(models, tmp_path), message regex) that must raise ValueError."""

    def long_sequence(m, tmp):
        backbone = m["classifier"].backbone
        x = {
            k: np.ones((1, TINY["max_sequence_length"] + 1), "int32")
            for k in ("token_ids", "segment_ids", "padding_mask")
        }
        backbone.predict(x, verbose=0)

    def create_data(path_text, encoding="utf-8"):
        def call(m, tmp):
            corpus = tmp / "corpus.txt"
            corpus.write_bytes(path_text.encode(encoding))
            (tmp / "vocab.txt").write_text("\n".join(VOCAB))
            from kbert.data import read_documents

            read_documents([str(corpus)])

        return call

    def cli_empty_corpus(m, tmp):
        from kbert import cli

        (tmp / "empty.txt").write_text("")
        (tmp / "vocab.txt").write_text("\n".join(VOCAB))
        code = cli.main(
            [
                "create-pretraining-data",
                "--input",
                str(tmp / "empty.txt"),
                "--vocab",
                str(tmp / "vocab.txt"),
                "--output",
                str(tmp / "out"),
            ]
        )
        if code == 2:
            raise ValueError("the corpus is empty (CLI exit code 2)")

    return [
        (
            "classifier_label_too_big",
            lambda m, t: m["classifier"].fit(["a"], np.array([3]), verbose=0),
            "outside",
        ),
        (
            "classifier_label_negative",
            lambda m, t: m["classifier"].fit(["a"], np.array([-1]), verbose=0),
            "outside",
        ),
        (
            "classifier_fractional_label",
            lambda m, t: m["classifier"].fit(["a"], np.array([0.5]), verbose=0),
            "integers",
        ),
        (
            "regression_nan_target",
            lambda m, t: m["regressor"].fit(["a"], np.array([np.nan]), verbose=0),
            "nan",
        ),
        (
            "regression_inf_target",
            lambda m, t: m["regressor"].fit(["a"], np.array([np.inf]), verbose=0),
            "inf",
        ),
        (
            "tagger_label_out_of_range",
            lambda m, t: m["tagger"].fit([["a"]], [[7]], verbose=0),
            "outside",
        ),
        (
            "tagger_label_count_mismatch",
            lambda m, t: m["tagger"].fit([["a", "b"]], [[1]], verbose=0),
            "labels",
        ),
        (
            "mc_label_out_of_range",
            lambda m, t: m["mc"].fit((["a"], [["a", "b"]]), np.array([2]), verbose=0),
            "outside",
        ),
        (
            "mc_wrong_choice_count",
            lambda m, t: m["mc"].predict((["a"], [["a"]]), verbose=0),
            "choices",
        ),
        (
            "qa_answer_not_in_context",
            lambda m, t: m["qa"].prepare_features(
                ["a"], ["the cat"], [{"text": "dog", "answer_start": 0}]
            ),
            "answer",
        ),
        ("text_not_a_string", lambda m, t: m["preprocessor"]([None]), "strings"),
        ("pairs_count_mismatch", lambda m, t: m["preprocessor"](["a", "b"], ["a"]), "pairs"),
        (
            "vocabulary_without_mask",
            lambda m, t: BertTokenizer([v for v in VOCAB if v != "[MASK]"]),
            "MASK",
        ),
        ("sequence_longer_than_model", long_sequence, "sequence"),
        ("empty_corpus_file", create_data(""), "empty"),
        ("corpus_not_utf8", create_data("caf\u00e9 cr\u00e8me", "latin-1"), "UTF-8"),
        ("cli_empty_corpus", cli_empty_corpus, "empty"),
    ]


CASES = [
    (f"{entry}[{name}]", call, None)
    for name, text in TEXTS.items()
    for entry, call in _text_entry_points(text)
]
CASES += [(name, call, message) for name, call, message in _error_cases()]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(case, models, tmp_path):
    name, call, message = case
    if message is None:
        call(models)  # a defined result, checked inside the call
        return
    with pytest.raises(ValueError, match=f"(?i){message}"):
        call(models, tmp_path)


# --- property-based fuzzing: raw text -> model outputs ----------------------------

texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=60) | st.sampled_from(
    list(TEXTS.values())[:-3]
)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=texts, others=st.lists(texts, min_size=1, max_size=3))
def test_fuzzed_text_gives_finite_batch_invariant_outputs(models, text, others):
    model = models["classifier"]
    alone = model.predict([text], verbose=0)
    batched = model.predict([text] + others, verbose=0)
    _finite(batched)
    np.testing.assert_allclose(batched[0], alone[0], atol=1e-5, rtol=0)  # its batch does not matter
    embedded = models["embedder"].embed([text] + others)
    _finite(embedded)
