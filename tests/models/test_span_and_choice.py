"""BertQuestionAnswerer, BertMultipleChoice and adapters on all backends."""

import keras
import numpy as np
import pytest

import kbert
from tests import harness
from tests.harness import TINY

VOCAB = (
    ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    + ("the cat sat on mat who where what is a dog ran park in paris france capital of".split())
    + ["##s"]
)
CONTEXTS = ["the cat sat on the mat in the park in paris", "paris is the capital of france"]
QUESTIONS = ["where is the cat", "what is paris"]
ANSWERS = [
    {"text": "the mat", "answer_start": CONTEXTS[0].index("the mat")},
    {"text": "the capital of france", "answer_start": CONTEXTS[1].index("the capital")},
]


@pytest.fixture
def preprocessor():
    return kbert.BertPreprocessor(kbert.BertTokenizer(VOCAB), sequence_length=16)


@pytest.fixture
def backbone():
    return kbert.BertBackbone(**{**TINY, "vocabulary_size": len(VOCAB)})


def test_qa_features_use_doc_stride_and_mark_answers(backbone, preprocessor):
    qa = kbert.BertQuestionAnswerer(backbone, preprocessor, doc_stride=4, max_query_length=4)
    f = qa.prepare_features(QUESTIONS, CONTEXTS, ANSWERS)
    # context 0 has 11 tokens, 16 - 4 - 3 = 9 fit: windows at 0 and 4; context 1 fits in one
    assert f.example_index.tolist() == [0, 0, 1]
    tok = preprocessor.tokenizer
    for row in range(3):
        s, e = f.y["start_positions"][row], f.y["end_positions"][row]
        context = CONTEXTS[f.example_index[row]]
        # the labelled tokens map back to exactly the answer text
        assert (
            context[f.token_starts[row, s] : f.token_ends[row, e]]
            == ANSWERS[f.example_index[row]]["text"]
        )
        assert f.x["segment_ids"][row, s] == 1 and f.context_mask[row, s] == 1
    # a window that misses the answer points at [CLS]
    f = qa.prepare_features(
        ["where is the cat"], CONTEXTS[:1], [{"text": "paris", "answer_start": 38}]
    )
    assert f.y["start_positions"].tolist()[0] == 0 and f.y["start_positions"].tolist()[1] > 0
    assert (
        tok.detokenize(f.x["token_ids"][1][f.y["start_positions"][1] : f.y["end_positions"][1] + 1])
        == "paris"
    )
    with pytest.raises(ValueError, match="not the answer text"):
        qa.prepare_features(QUESTIONS[:1], CONTEXTS[:1], [{"text": "dog", "answer_start": 4}])
    with pytest.raises(ValueError, match="no room for the context"):
        kbert.BertQuestionAnswerer(
            backbone, kbert.BertPreprocessor(tok, 6), max_query_length=4
        ).prepare_features(QUESTIONS, CONTEXTS)


def test_qa_features_tokenize_each_distinct_context_once(backbone, preprocessor, monkeypatch):
    """Questions on the same context (SQuAD has about five per context) get
    the features each would alone; the context is tokenized once, with the
    others in one call."""
    qa = kbert.BertQuestionAnswerer(backbone, preprocessor, doc_stride=4, max_query_length=4)
    questions = ["where is the cat", "what is the cat on", "what is paris"]
    contexts = [CONTEXTS[0], CONTEXTS[0], CONTEXTS[1]]
    alone = [qa.prepare_features([q], [c]) for q, c in zip(questions, contexts)]
    tokenizer = preprocessor.tokenizer
    calls = []
    tokenize = tokenizer.tokenize_with_offsets

    def counted(texts):
        calls.append(texts)
        return tokenize(texts)

    monkeypatch.setattr(tokenizer, "tokenize_with_offsets", counted)
    together = qa.prepare_features(questions, contexts)
    assert calls == [[CONTEXTS[0], CONTEXTS[1]]]  # one call, each context once
    for name in ("token_starts", "token_ends", "context_mask"):
        np.testing.assert_array_equal(
            getattr(together, name), np.concatenate([getattr(f, name) for f in alone])
        )
    for key in together.x:
        np.testing.assert_array_equal(together.x[key], np.concatenate([f.x[key] for f in alone]))
    assert together.example_index.tolist() == [0, 0, 1, 1, 2]


def test_qa_postprocessing_picks_best_valid_span(backbone, preprocessor):
    qa = kbert.BertQuestionAnswerer(backbone, preprocessor, max_answer_length=3)
    f = qa.prepare_features(QUESTIONS[1:], CONTEXTS[1:])
    start = np.full((1, 16), -5.0)
    end = np.full((1, 16), -5.0)
    # best start is in the question (not allowed); next is "the" (pos 7); best end "france" (pos 10)
    start[0, 2], start[0, 7], end[0, 10] = 9.0, 3.0, 4.0
    answers, scores = qa.postprocess(
        f, {"start_logits": start, "end_logits": end}, CONTEXTS[1:], return_scores=True
    )
    # span 7..10 is 4 tokens > max_answer_length=3; 8..10 (-5 + 4) beats 7..7 (3 - 5)
    assert answers == ["capital of france"] and scores == [-1.0]
    qa.max_answer_length = 30
    assert qa.postprocess(f, {"start_logits": start, "end_logits": end}, CONTEXTS[1:]) == [
        "the capital of france"
    ]
    # SQuAD v2: a strong [CLS] score gives "" once a threshold is set
    start[0, 0], end[0, 0] = 8.0, 8.0
    assert qa.postprocess(f, {"start_logits": start, "end_logits": end}, CONTEXTS[1:]) == [
        "the capital of france"
    ]
    qa.null_score_threshold = 0.0
    assert qa.postprocess(f, {"start_logits": start, "end_logits": end}, CONTEXTS[1:]) == [""]


def test_qa_fits_on_raw_text_and_round_trips(backbone, preprocessor, tmp_path):
    qa = kbert.BertQuestionAnswerer(backbone, preprocessor, doc_stride=4, max_query_length=4)
    qa.compile(learning_rate=1e-3)
    history = qa.fit(
        (QUESTIONS * 4, CONTEXTS * 4), ANSWERS * 4, epochs=8, batch_size=4, verbose=0
    ).history
    assert history["loss"][-1] < history["loss"][0]
    answers = qa.predict_answers(QUESTIONS, CONTEXTS)
    assert all(a in c for a, c in zip(answers, CONTEXTS))  # always a substring of its context
    path = str(tmp_path / "qa.keras")
    qa.save(path)
    restored = keras.saving.load_model(path)
    assert restored.doc_stride == 4 and restored.predict_answers(QUESTIONS, CONTEXTS) == answers
    qa.save_to_preset(tmp_path / "preset")
    again = kbert.BertQuestionAnswerer.from_preset(tmp_path / "preset")
    assert again.predict_answers(QUESTIONS, CONTEXTS) == answers
    with pytest.raises(ValueError, match="outside the 16 token positions"):
        qa.fit(
            qa.prepare_features(QUESTIONS, CONTEXTS).x,
            {"start_positions": np.array([0, 0, 99]), "end_positions": np.array([0, 0, 0])},
            verbose=0,
        )


def test_multiple_choice_fits_on_raw_text_and_round_trips(backbone, preprocessor, tmp_path):
    mc = kbert.BertMultipleChoice(backbone, num_choices=3, preprocessor=preprocessor, dropout=0.0)
    contexts = ["the cat sat", "the dog ran"] * 4
    choices = [["on the mat", "in paris", "of france"], ["in the park", "the cat", "is a"]] * 4
    labels = np.array([0, 0, 0, 0, 0, 0, 0, 0])
    x = mc.preprocess_samples((contexts, choices))
    assert x["token_ids"].shape == (8, 3, 16)
    # each choice is packed as its own [CLS] context [SEP] choice [SEP]
    single = preprocessor(contexts[:1], choices[0][1:2])
    np.testing.assert_array_equal(x["token_ids"][0, 1], single["token_ids"][0])
    mc.compile(learning_rate=3e-3)
    history = mc.fit((contexts, choices), labels, epochs=8, batch_size=4, verbose=0).history
    assert history["loss"][-1] < history["loss"][0]
    scores = mc.predict((contexts[:2], choices[:2]), verbose=0)
    assert scores.shape == (2, 3) and scores.dtype == np.float32
    restored = keras.saving.load_model(harness.check_keras_round_trip(mc, x, tmp_path))
    np.testing.assert_allclose(
        restored.predict((contexts[:2], choices[:2]), verbose=0), scores, atol=1e-6
    )
    with pytest.raises(ValueError, match="label 3 is outside"):
        mc.fit((contexts, choices), np.array([3] * 8), verbose=0)
    with pytest.raises(ValueError, match="has 2 choices"):
        mc.predict((["the cat"], [["a", "b"]]), verbose=0)


def test_multiple_choice_scores_each_choice_independently(backbone):
    mc = kbert.BertMultipleChoice(backbone, num_choices=2, dropout=0.0)
    x = {
        k: np.stack([v[:2], v[1:3]])
        for k, v in harness.backbone_inputs(batch=3, length=8, vocabulary_size=len(VOCAB)).items()
    }
    scores = harness.to_numpy(mc(x))
    swapped = harness.to_numpy(mc({k: v[:, ::-1] for k, v in x.items()}))
    np.testing.assert_allclose(scores[:, ::-1], swapped, atol=1e-5)


def test_adapters_start_as_identity_and_train_alone(backbone, preprocessor, tmp_path):
    x = harness.backbone_inputs(batch=2, length=8, vocabulary_size=len(VOCAB))
    with_adapters = kbert.BertBackbone(**{**TINY, "vocabulary_size": len(VOCAB), "adapter_size": 4})
    weights = {v.path: v.numpy() for v in backbone.weights}
    from kbert.presets.weights import assign_weights

    assign_weights(with_adapters, weights, allow_missing=("attention_adapter/", "output_adapter/"))
    assert harness.max_abs_diff(backbone(x), with_adapters(x)) == 0.0  # identity at initialisation

    model = kbert.BertClassifier(
        with_adapters, 2, preprocessor=preprocessor, freeze_backbone="adapters"
    )
    trainable = {v.path for v in model.trainable_weights}
    assert trainable and all(
        "adapter" in p or "layer_norm" in p or p.startswith("logits/") for p in trainable
    )
    assert any("adapter" in p for p in trainable)
    before = {v.path: v.numpy().copy() for v in model.weights}
    model.compile(learning_rate=1e-2)
    model.fit(["the cat sat", "the dog ran"] * 2, np.array([0, 1] * 2), epochs=2, verbose=0)
    for v in model.weights:
        if v.path not in trainable:
            np.testing.assert_array_equal(before[v.path], v.numpy(), err_msg=v.path)  # frozen
    assert not np.array_equal(before["logits/kernel"], model.get_layer("logits").kernel.numpy())
    assert any(
        not np.array_equal(before[v.path], v.numpy())
        for v in model.weights
        if "adapter/up" in v.path
    )
    restored = keras.saving.load_model(harness.check_keras_round_trip(model, x, tmp_path))
    assert {v.path for v in restored.trainable_weights} == trainable
    with pytest.raises(ValueError, match="no adapters"):
        kbert.BertClassifier(backbone, 2, freeze_backbone="adapters")


def test_adapters_added_when_loading_a_preset(backbone, tmp_path):
    backbone.save_to_preset(tmp_path / "p")
    model = kbert.BertClassifier.from_preset(
        tmp_path / "p", num_classes=2, adapter_size=8, freeze_backbone="adapters", preprocessor=None
    )
    assert model.backbone.adapter_size == 8
    x = harness.backbone_inputs(batch=2, length=8, vocabulary_size=len(VOCAB))
    assert harness.max_abs_diff(model.backbone(x), backbone(x)) == 0.0


transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


def _hf(tmp_path, cls):
    config = transformers.BertConfig(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = cls(config).eval()
    model.save_pretrained(tmp_path / cls.__name__)
    return model, tmp_path / cls.__name__


def _torch(x):
    return dict(
        input_ids=torch.tensor(x["token_ids"]).long(),
        token_type_ids=torch.tensor(x["segment_ids"]).long(),
        attention_mask=torch.tensor(x["padding_mask"]).long(),
    )


def test_question_answering_head_matches_transformers_both_ways(tmp_path):
    from kbert.convert.huggingface import export_to_huggingface

    hf, directory = _hf(tmp_path, transformers.BertForQuestionAnswering)
    model = kbert.BertQuestionAnswerer.from_preset(directory)
    x = harness.backbone_inputs(batch=3, length=10, vocabulary_size=99)
    out = harness.to_numpy(model(x))
    with torch.no_grad():
        ref = hf(**_torch(x))
    mask = x["padding_mask"]
    assert np.max(np.abs((out["start_logits"] - ref.start_logits.numpy()) * mask)) <= 1e-5
    assert np.max(np.abs((out["end_logits"] - ref.end_logits.numpy()) * mask)) <= 1e-5
    export_to_huggingface(model, tmp_path / "back")
    again = transformers.BertForQuestionAnswering.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        np.testing.assert_allclose(
            again(**_torch(x)).start_logits.numpy(), ref.start_logits.numpy(), atol=1e-6
        )


def test_multiple_choice_head_matches_transformers_both_ways(tmp_path):
    from kbert.convert.huggingface import export_to_huggingface

    hf, directory = _hf(tmp_path, transformers.BertForMultipleChoice)
    model = kbert.BertMultipleChoice.from_preset(directory, num_choices=3)
    flat = harness.backbone_inputs(batch=6, length=10, vocabulary_size=99)
    x = {k: v.reshape(2, 3, 10) for k, v in flat.items()}
    with torch.no_grad():
        ref = hf(**_torch(x)).logits.numpy()
    assert np.max(np.abs(harness.to_numpy(model(x)) - ref)) <= 1e-5
    export_to_huggingface(model, tmp_path / "back")
    again = transformers.BertForMultipleChoice.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        np.testing.assert_allclose(again(**_torch(x)).logits.numpy(), ref, atol=1e-6)
