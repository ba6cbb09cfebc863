"""transformers Longformer directories load into a windowed `BertBackbone`
with global projections, with transformers' outputs (fp32, 1e-5) for every
choice of global tokens."""

import keras
import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import kbert
from kbert.presets import PresetError
from tests import harness

TINY = dict(
    vocab_size=97,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=37,
    max_position_embeddings=66,  # 64 positions after the two Longformer reserves
    attention_window=8,
    type_vocab_size=1,
    initializer_range=0.2,  # larger than the default: differences show
)


def _longformer(directory, **kwargs):
    """A random transformers LongformerModel saved to `directory`; its
    global projections differ from the local ones (as after training)."""
    config = transformers.LongformerConfig(**{**TINY, **kwargs})
    torch.manual_seed(0)
    model = transformers.LongformerModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name:
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(directory)
    return model


def _inputs(batch=3, length=29, seed=0):
    """Random ids (never the pad id 1, which Longformer's positions skip)
    with ragged padding."""
    rng = np.random.default_rng(seed)
    padding = np.ones((batch, length), "int32")
    padding[1, 20:] = 0
    padding[2, 5:] = 0
    ids = rng.integers(3, TINY["vocab_size"], (batch, length)).astype("int32")
    ids[padding == 0] = 1
    return {"token_ids": ids, "segment_ids": np.zeros_like(ids), "padding_mask": padding}


def _reference(model, x, global_mask):
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(x["token_ids"]).long(),
            attention_mask=torch.tensor(x["padding_mask"]).long(),
            global_attention_mask=torch.tensor(global_mask).long(),
        )
    return out.last_hidden_state.numpy(), out.pooler_output.numpy()


def _masked(a, x):
    return np.asarray(a) * x["padding_mask"][..., None]


def _task_reference(directory, architecture, **kwargs):
    """A random transformers Longformer task model saved to `directory`,
    its biases and norms away from their initial values."""
    config = transformers.LongformerConfig(**TINY, **kwargs)
    torch.manual_seed(1)
    reference = getattr(transformers, architecture)(config).eval()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if p.ndim == 1:
                p.add_(0.2 * torch.randn_like(p))
    reference.save_pretrained(directory)
    return reference


@pytest.fixture(scope="module")
def longformer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("longformer")
    return directory, _longformer(directory)


def test_longformer_loads_with_transformers_outputs(longformer):
    directory, reference = longformer
    backbone = kbert.BertBackbone.from_preset(directory)
    config = backbone.get_config()
    assert (config["attention_window"], config["global_tokens"]) == (8, 1)
    assert config["global_projections"] and backbone.max_sequence_length == 64
    x = _inputs()
    rng = np.random.default_rng(1)
    user = (rng.random(x["token_ids"].shape) < 0.2).astype("int32")
    first = np.zeros_like(user)
    first[:, 0] = 1
    cases = [
        ("[CLS] by the global_tokens rule", {}, first),
        ("a global_attention_mask", {"global_attention_mask": user}, user),
        ("no global token", {"global_attention_mask": np.zeros_like(user)}, np.zeros_like(user)),
    ]
    outputs = []
    for case, extra, global_mask in cases:
        got = backbone({**x, **extra})
        want_sequence, want_pooled = _reference(reference, x, global_mask)
        sequence = keras.ops.convert_to_numpy(got["sequence_output"])
        assert harness.max_abs_diff(_masked(sequence, x), _masked(want_sequence, x)) <= 1e-5, case
        pooled = keras.ops.convert_to_numpy(got["pooled_output"])
        assert harness.max_abs_diff(pooled, want_pooled) <= 1e-5, case
        outputs.append(sequence)
    # the global tokens matter: each choice gives other outputs
    assert np.abs(_masked(outputs[0] - outputs[1], x)).max() > 1e-3
    assert np.abs(_masked(outputs[0] - outputs[2], x)).max() > 1e-3


def test_global_mask_in_predict_needs_a_static_count(longformer):
    directory, _ = longformer
    x = _inputs()
    x["global_attention_mask"] = np.zeros_like(x["token_ids"])
    x["global_attention_mask"][:, :3] = 1
    x["global_attention_mask"][0, 10] = 1
    backbone = kbert.BertBackbone.from_preset(directory, max_global_tokens=4)
    eager = _masked(keras.ops.convert_to_numpy(backbone(x)["sequence_output"]), x)
    predicted = backbone.predict(x, batch_size=3, verbose=0)["sequence_output"]
    assert harness.max_abs_diff(_masked(predicted, x), eager) <= 1e-5
    on_batch = backbone.predict_on_batch(x)["sequence_output"]
    assert harness.max_abs_diff(_masked(on_batch, x), eager) <= 1e-5
    with pytest.raises(ValueError, match="max_global_tokens=4"):
        backbone({**x, "global_attention_mask": np.ones_like(x["token_ids"])})
    unbounded = kbert.BertBackbone.from_preset(directory)
    with pytest.raises(ValueError, match="max_global_tokens"):
        unbounded.predict(x, verbose=0)
    with pytest.raises(ValueError, match="shape"):
        unbounded({**x, "global_attention_mask": x["global_attention_mask"][:, :5]})
    with pytest.raises(ValueError, match="0 and 1"):
        unbounded({**x, "global_attention_mask": 2 * x["global_attention_mask"]})


def test_longformer_preset_round_trip_and_longer_positions(longformer, tmp_path):
    directory, _ = longformer
    backbone = kbert.BertBackbone.from_preset(directory)
    x = _inputs()
    before = _masked(keras.ops.convert_to_numpy(backbone(x)["sequence_output"]), x)
    backbone.save_to_preset(tmp_path / "preset")
    again = kbert.BertBackbone.from_preset(tmp_path / "preset")
    assert again.global_projections and again.attention_window == 8
    after = _masked(keras.ops.convert_to_numpy(again(x)["sequence_output"]), x)
    assert harness.max_abs_diff(after, before) <= 1e-6
    longer = kbert.BertBackbone.from_preset(directory, max_sequence_length=200)
    assert longer.max_sequence_length == 200
    out = _masked(keras.ops.convert_to_numpy(longer(x)["sequence_output"]), x)
    assert harness.max_abs_diff(out, before) <= 1e-5  # the first 64 positions are kept
    with pytest.raises(ValueError, match="global projections"):
        kbert.convert.huggingface.export_to_huggingface(backbone, tmp_path / "hf")


def test_longformer_configs_kbert_cannot_take_are_refused(tmp_path):
    _longformer(tmp_path / "mixed", attention_window=[8, 4])
    with pytest.raises(PresetError, match="attention_window differs between layers"):
        kbert.BertBackbone.from_preset(tmp_path / "mixed")


def test_longformer_directory_with_its_tokenizer_reads_raw_text(tmp_path):
    """A Longformer directory's byte-level BPE tokenizer.json comes with it:
    a classifier from the directory packs raw text as transformers'
    tokenizer does, the backbone then gives LongformerModel's outputs, and a
    saved preset keeps the tokenizer."""
    from tests.tokenizers.test_bpe import PAIRS, TEXTS, bpe_json

    (tmp_path / "lf").mkdir()
    (tmp_path / "lf" / "tokenizer.json").write_text(bpe_json(400), encoding="utf-8")
    reference = _longformer(tmp_path / "lf", vocab_size=400)
    names = dict(bos_token="<s>", eos_token="</s>", sep_token="</s>", cls_token="<s>")
    names.update(pad_token="<pad>", unk_token="<unk>", mask_token="<mask>")
    their_tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "lf" / "tokenizer.json"), **names
    )
    model = kbert.BertClassifier.from_preset(tmp_path / "lf", num_classes=2)
    length = model.preprocessor.sequence_length
    assert length == 64  # the backbone's positions, under the default 128
    theirs = their_tokenizer(
        TEXTS, PAIRS, truncation="longest_first", max_length=length, padding="max_length"
    )
    x = model.preprocessor(TEXTS, PAIRS)
    np.testing.assert_array_equal(x["token_ids"], theirs["input_ids"])
    np.testing.assert_array_equal(x["padding_mask"], theirs["attention_mask"])
    first = np.zeros_like(x["token_ids"])
    first[:, 0] = 1
    sequence, pooled = _reference(reference, x, first)
    out = {k: keras.ops.convert_to_numpy(v) for k, v in model.backbone(x).items()}
    np.testing.assert_allclose(_masked(out["sequence_output"], x), _masked(sequence, x), atol=1e-5)
    np.testing.assert_allclose(out["pooled_output"], pooled, atol=1e-5)
    # one token type: Keras' symbolic build on torch (tensors of ones where a
    # meta kernel is missing) must not read its segment ids as real input
    model.compile(learning_rate=1e-3)
    model.fit(TEXTS, np.array([0, 1, 0, 1, 0]), batch_size=5, epochs=1, verbose=0)
    model.save_to_preset(tmp_path / "preset")
    again = kbert.BertClassifier.from_preset(tmp_path / "preset")
    np.testing.assert_array_equal(again.preprocessor(TEXTS, PAIRS)["token_ids"], x["token_ids"])
    np.testing.assert_allclose(
        again.predict(TEXTS, verbose=0), model.predict(TEXTS, verbose=0), atol=1e-5
    )


def test_longformer_question_answerer_packs_questions_as_roberta(tmp_path):
    """A question answerer on a Longformer directory packs `<s> q </s></s>
    context </s>` with one token type, as transformers' tokenizer packs the
    pair, and maps its windows' tokens back to the context's characters."""
    from tests.tokenizers.test_bpe import bpe_json

    (tmp_path / "tokenizer.json").write_text(bpe_json(400), encoding="utf-8")
    _longformer(tmp_path, vocab_size=400)
    names = dict(bos_token="<s>", eos_token="</s>", sep_token="</s>", cls_token="<s>")
    names.update(pad_token="<pad>", unk_token="<unk>", mask_token="<mask>")
    theirs = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "tokenizer.json"), **names
    )
    qa = kbert.BertQuestionAnswerer.from_preset(tmp_path)
    question, context = "Who observes?", "Nobody by any chance ever observes the world."
    answer = {"text": "Nobody", "answer_start": 0}
    features = qa.prepare_features([question], [context], [answer])
    expected = theirs(question, context, max_length=64, padding="max_length")["input_ids"]
    np.testing.assert_array_equal(features.x["token_ids"][0], expected)
    assert not features.x["segment_ids"].any()
    first = int(np.argmax(features.context_mask[0]))  # the context's first token
    start, end = features.y["start_positions"][0], features.y["end_positions"][0]
    assert start == first and features.token_starts[0][first] == 0
    assert context[features.token_starts[0][start] : features.token_ends[0][end]] == "Nobody"
    assert len(qa.predict_answers([question], [context])) == 1
    # one token type: the question is what comes before the first </s>
    # ("first_segment", by token type, would make the context global too)
    windowed = kbert.BertQuestionAnswerer.from_preset(tmp_path, attention_window=16)
    config = windowed.backbone.get_config()
    assert (config["global_tokens"], config["max_global_tokens"]) == ("before_separator", 66)
    from kbert.layers.banded_attention import separator_rule_mask

    ids = features.x["token_ids"]
    glob = keras.ops.convert_to_numpy(separator_rule_mask("before_separator", ids, 2))[0]
    question = theirs(question)["input_ids"]  # <s> question </s>
    assert glob.sum() == len(question) - 1 and glob[: len(question) - 1].all()


@pytest.mark.parametrize(
    "architecture, task, global_tokens",
    [
        ("LongformerForSequenceClassification", kbert.BertClassifier, 1),
        ("LongformerForTokenClassification", kbert.BertTokenClassifier, 0),
        ("LongformerForMaskedLM", kbert.BertMaskedLM, 0),
    ],
)
def test_longformer_task_directories_load_with_their_heads(
    tmp_path, architecture, task, global_tokens
):
    """A transformers Longformer task directory loads as its kbert task with
    the head's weights and the global tokens transformers' class uses when
    given no `global_attention_mask` ([CLS] for the classifier, none for
    the others): its outputs (fp32, 1e-5) on ragged padding; the held
    model (class and classes) is read from config.json."""
    from kbert.models.preset_io import held_model

    reference = _task_reference(tmp_path, architecture, num_labels=5)
    x = _inputs()
    with torch.no_grad():
        want = reference(
            input_ids=torch.tensor(x["token_ids"]).long(),
            attention_mask=torch.tensor(x["padding_mask"]).long(),
        ).logits.numpy()
    name, kwargs = held_model(tmp_path)
    assert name == task.__name__
    assert kwargs == ({} if task is kbert.BertMaskedLM else {"num_classes": 5})
    model = task.from_preset(tmp_path, **kwargs)
    assert model.backbone.get_config()["global_tokens"] == global_tokens
    if task is kbert.BertMaskedLM:
        positions = np.array([[0, 3, 7], [1, 2, 19], [0, 1, 4]], "int32")
        got = model({**x, "mask_positions": positions})["mlm_logits"]
        want = np.take_along_axis(want, positions[..., None], axis=1)
    else:
        got = model(x)
    got = keras.ops.convert_to_numpy(got)
    if task is kbert.BertTokenClassifier:
        got, want = _masked(got, x), _masked(want, x)
    assert harness.max_abs_diff(got, want) <= 1e-5


def test_longformer_head_for_another_task_is_left_fresh(tmp_path):
    """A classifier asked of a token-classification directory takes its
    encoder, a fresh head (transformers' heads differ in shape and
    meaning) and [CLS] global, as a classifier is trained: the directory's
    "no global token" belongs to its own head."""
    config = transformers.LongformerConfig(**TINY, num_labels=3)
    transformers.LongformerForTokenClassification(config).save_pretrained(tmp_path)
    model = kbert.BertClassifier.from_preset(tmp_path, num_classes=2)
    assert model.num_classes == 2
    assert tuple(model.get_layer("logits").kernel.shape) == (TINY["hidden_size"], 2)
    assert model.backbone.get_config()["global_tokens"] == 1
    assert kbert.BertBackbone.from_preset(tmp_path).get_config()["global_tokens"] == 1
    tagger = kbert.BertTokenClassifier.from_preset(tmp_path, num_classes=3, global_tokens=2)
    assert tagger.backbone.get_config()["global_tokens"] == 2  # the caller's setting wins


@pytest.mark.parametrize("case", ["relu", "untied"])
def test_longformer_lm_heads_kbert_would_compute_otherwise_are_refused(tmp_path, case):
    """transformers' Longformer LM head applies GELU whatever hidden_act
    says, and may be untied from the token embeddings; kbert's masked-LM
    head applies the encoder's activation and is always tied: such heads
    are refused with the reason (the encoder still loads)."""
    extra = {"hidden_act": "relu"} if case == "relu" else {"tie_word_embeddings": False}
    config = transformers.LongformerConfig(**TINY, **extra)
    transformers.LongformerForMaskedLM(config).save_pretrained(tmp_path)
    match = "applies GELU" if case == "relu" else "untied"
    with pytest.raises(PresetError, match=match):
        kbert.BertMaskedLM.from_preset(tmp_path)
    assert kbert.BertBackbone.from_preset(tmp_path).num_layers == TINY["num_hidden_layers"]


def _pairs(rows, length=29, seed=2):
    """RoBERTa-packed pairs `<s> a </s></s> b </s>` (ids 0, 2; padding 1) of
    ragged lengths: (token ids, padding mask)."""
    rng = np.random.default_rng(seed)
    ids = np.ones((rows, length), "int32")
    for r in range(rows):
        first, second = 2 + r % 5, 3 + (3 * r) % 11
        words = rng.integers(3, TINY["vocab_size"], first + second)
        row = [0, *words[:first], 2, 2, *words[first:], 2]
        ids[r, : len(row)] = row
    return ids, (ids != 1).astype("int32")


@pytest.mark.parametrize("rule", ["before_separator", "after_separators"])
def test_separator_rules_are_transformers_global_masks(rule):
    """The separator rules give the global tokens transformers' Longformer
    computes from `input_ids` (question answering: before the first `</s>`;
    multiple choice: after the first `</s></s>`), on rows of one example and
    on rows holding several (positions restart at each example)."""
    from transformers.models.longformer.modeling_longformer import (
        _compute_global_attention_mask,
    )

    from kbert.layers.banded_attention import separator_rule_mask

    ids, padding = _pairs(6)
    want = (
        _compute_global_attention_mask(
            torch.tensor(ids).long(), 2, before_sep_token=rule == "before_separator"
        ).numpy()
        * padding
    )
    got = keras.ops.convert_to_numpy(separator_rule_mask(rule, ids, 2)) * padding
    np.testing.assert_array_equal(got, want)
    assert 0 < want.sum() < padding.sum()
    # two examples per row: the second's positions restart at 0
    lengths = padding.sum(axis=1)
    packed = np.ones((3, 2 * ids.shape[1]), "int32")
    positions = np.zeros_like(packed)
    expected = np.zeros_like(packed)
    for r in range(3):
        a, b = lengths[2 * r], lengths[2 * r + 1]
        packed[r, :a], packed[r, a : a + b] = ids[2 * r, :a], ids[2 * r + 1, :b]
        positions[r, :a], positions[r, a : a + b] = np.arange(a), np.arange(b)
        expected[r, :a], expected[r, a : a + b] = want[2 * r, :a], want[2 * r + 1, :b]
    got = keras.ops.convert_to_numpy(separator_rule_mask(rule, packed, 2, positions))
    real = packed != 1
    np.testing.assert_array_equal(got * real, expected)


@pytest.mark.parametrize(
    "architecture, task",
    [
        ("LongformerForQuestionAnswering", kbert.BertQuestionAnswerer),
        ("LongformerForMultipleChoice", kbert.BertMultipleChoice),
    ],
)
def test_longformer_span_and_choice_heads_load_with_their_global_rules(
    tmp_path, architecture, task
):
    """Longformer question answering and multiple choice directories load
    with their heads, and make global the tokens transformers' classes pick
    from the token ids when given no `global_attention_mask` (the
    question; each ending): transformers' outputs (fp32, 1e-5) on ragged
    RoBERTa-packed pairs, in a call and in `predict`. From a plain
    `LongformerModel` directory the task takes the same rule."""
    reference = _task_reference(tmp_path, architecture)
    config = reference.config
    choice = task is kbert.BertMultipleChoice
    ids, padding = _pairs(6 if choice else 4)
    x = {"token_ids": ids, "segment_ids": np.zeros_like(ids), "padding_mask": padding}
    if choice:  # (B, N, T): 3 questions of 2 endings
        x = {k: v.reshape(3, 2, -1) for k, v in x.items()}
    with torch.no_grad():
        out = reference(
            input_ids=torch.tensor(x["token_ids"]).long(),
            attention_mask=torch.tensor(x["padding_mask"]).long(),
        )
    model = task.from_preset(tmp_path, **({"num_choices": 2} if choice else {}))
    rule = "after_separators" if choice else "before_separator"
    assert model.backbone.get_config()["global_tokens"] == rule
    assert model.backbone.get_config()["separator_token_id"] == 2
    for got in (model(x), model.predict(x, batch_size=len(ids), verbose=0)):
        got = harness.to_numpy(got)
        if choice:
            assert harness.max_abs_diff(got, out.logits.numpy()) <= 1e-5
            continue
        for name in ("start_logits", "end_logits"):
            want = getattr(out, name).numpy()
            assert harness.max_abs_diff(got[name] * padding, want * padding) <= 1e-5
    # the rule matters: [CLS] alone gives other outputs
    cls_only = task.from_preset(tmp_path, global_tokens=1, **({"num_choices": 2} if choice else {}))
    other = harness.to_numpy(cls_only(x))
    other = other if choice else other["start_logits"] * padding
    want = out.logits.numpy() if choice else out.start_logits.numpy() * padding
    assert harness.max_abs_diff(other, want) > 1e-3
    # a LongformerModel directory: the task's rule, a fresh head
    base = tmp_path / "base"
    transformers.LongformerModel(config).save_pretrained(base)
    fresh = task.from_preset(base, **({"num_choices": 2} if choice else {}))
    assert fresh.backbone.get_config()["global_tokens"] == rule
