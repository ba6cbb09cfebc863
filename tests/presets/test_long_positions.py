"""Loading a checkpoint with more (or fewer) positions than it learned:
the learned rows tiled (Longformer's conversion) or cut, the preprocessor
following, and the result a normal preset."""

import numpy as np
import pytest

import kbert
from kbert.presets.positions import resize_positions
from tests import harness
from tests.harness import TINY

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + "the a movie was good bad".split()
P = TINY["max_sequence_length"]


@pytest.fixture
def preset(tmp_path):
    backbone = kbert.BertBackbone(**{**TINY, "num_layers": 1, "vocabulary_size": len(VOCAB)})
    preprocessor = kbert.BertPreprocessor(kbert.BertTokenizer(VOCAB), sequence_length=12)
    model = kbert.BertClassifier(backbone, 2, preprocessor=preprocessor)
    model.save_to_preset(tmp_path / "short")
    return model, tmp_path / "short"


def _positions(backbone):
    return np.asarray(backbone.get_layer("embeddings").position_embeddings.numpy())


def test_resize_positions_tiles_and_cuts():
    table = np.arange(10, dtype="float32").reshape(5, 2)
    longer = resize_positions(table, 12)
    np.testing.assert_array_equal(longer, np.concatenate([table, table, table[:2]]))
    np.testing.assert_array_equal(resize_positions(table, 3), table[:3])
    with pytest.raises(ValueError, match="max_sequence_length"):
        resize_positions(table, 0)


@pytest.mark.parametrize("length", [2 * P + 5, P // 2])
def test_backbone_loads_with_other_lengths(preset, length):
    model, directory = preset
    backbone = kbert.BertBackbone.from_preset(directory, max_sequence_length=length)
    assert backbone.max_sequence_length == length
    learned, table = _positions(model.backbone), _positions(backbone)
    assert table.shape == (length, TINY["hidden_dim"])
    for start in range(0, length, P):  # every copy is the learned rows, exactly
        rows = table[start : start + P]
        np.testing.assert_array_equal(rows, learned[: len(rows)])
    # inputs the old table covered give the outputs they gave
    x = harness.backbone_inputs(batch=2, length=min(length, P), vocabulary_size=len(VOCAB))
    assert harness.max_abs_diff(backbone(x), model.backbone(x)) == 0.0
    if length > P:  # and longer inputs run
        x = harness.backbone_inputs(batch=2, length=length, vocabulary_size=len(VOCAB))
        assert backbone(x)["sequence_output"].shape == (2, length, TINY["hidden_dim"])


def test_task_preset_extended_round_trips(preset, tmp_path):
    model, directory = preset
    long = kbert.BertClassifier.from_preset(directory, num_classes=2, max_sequence_length=2 * P)
    assert long.backbone.max_sequence_length == 2 * P
    assert long.preprocessor.sequence_length == 2 * P  # the preprocessor follows
    texts = ["the movie was good", "bad " * (2 * P)]
    # the head came with the preset; short texts classify as before
    np.testing.assert_allclose(
        long.predict(texts[:1], verbose=0), model.predict(texts[:1], verbose=0), atol=1e-6
    )
    long.save_to_preset(tmp_path / "long")  # a normal preset from here on
    again = kbert.BertClassifier.from_preset(tmp_path / "long")
    assert again.backbone.max_sequence_length == 2 * P
    assert again.preprocessor.sequence_length == 2 * P
    np.testing.assert_array_equal(_positions(again.backbone), _positions(long.backbone))
    np.testing.assert_allclose(
        again.predict(texts, verbose=0), long.predict(texts, verbose=0), atol=1e-6
    )
    # loading shorter than the saved preprocessor's length cuts it too
    short = kbert.BertClassifier.from_preset(tmp_path / "long", max_sequence_length=8)
    assert short.preprocessor.sequence_length == 8


def test_hugging_face_checkpoint_extends(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    config = transformers.BertConfig(
        vocab_size=99,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    hf = transformers.BertModel(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    backbone = kbert.BertBackbone.from_preset(tmp_path / "hf", max_sequence_length=40)
    learned = hf.embeddings.position_embeddings.weight.detach().numpy()
    table = _positions(backbone)
    for start in (0, 16, 32):  # the learned rows, then copies (outputs: see above)
        np.testing.assert_array_equal(table[start : start + 16], learned[: len(table[start:])])
