"""Original Google BERT TF checkpoints, written here with the original
variable names from a random transformers model."""

import json

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import kbert
from tests import harness


def hf_name_to_tf(name):
    tf_name = name.replace(".", "/")
    for i in range(10):
        tf_name = tf_name.replace(f"layer/{i}/", f"layer_{i}/")
    transpose = False
    if tf_name.endswith("LayerNorm/weight"):
        tf_name = tf_name[: -len("weight")] + "gamma"
    elif tf_name.endswith("LayerNorm/bias"):
        tf_name = tf_name[: -len("bias")] + "beta"
    elif tf_name.startswith("bert/embeddings/") and tf_name.endswith("_embeddings/weight"):
        tf_name = tf_name[: -len("/weight")]
    elif tf_name == "cls/predictions/bias":
        tf_name = "cls/predictions/output_bias"
    elif tf_name == "cls/seq_relationship/weight":
        tf_name = "cls/seq_relationship/output_weights"
    elif tf_name == "cls/seq_relationship/bias":
        tf_name = "cls/seq_relationship/output_bias"
    elif tf_name.endswith("/weight"):
        tf_name, transpose = tf_name[: -len("weight")] + "kernel", True
    return tf_name, transpose


@pytest.fixture
def original_checkpoint(tmp_path):
    config = transformers.BertConfig(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    hf = transformers.BertForPreTraining(config).eval()
    directory = tmp_path / "uncased_L-2_H-32_A-4"
    directory.mkdir()
    skip = ("position_ids", "cls.predictions.decoder")
    with tf.Graph().as_default():
        variables = []
        for name, value in hf.state_dict().items():
            if any(s in name for s in skip):
                continue
            tf_name, transpose = hf_name_to_tf(name)
            array = value.numpy().T if transpose else value.numpy()
            variables.append(tf.compat.v1.get_variable(tf_name, initializer=array))
        variables.append(tf.compat.v1.get_variable("global_step", initializer=np.int64(7)))
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            saver.save(session, str(directory / "bert_model.ckpt"))
    (directory / "bert_config.json").write_text(
        json.dumps(
            {
                "vocab_size": 99,
                "hidden_size": 32,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "intermediate_size": 37,
                "hidden_act": "gelu",
                "hidden_dropout_prob": 0.1,
                "attention_probs_dropout_prob": 0.1,
                "max_position_embeddings": 64,
                "type_vocab_size": 2,
                "initializer_range": 0.02,
            }
        )
    )
    (directory / "vocab.txt").write_text(
        "\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(94)])
    )
    return hf, directory


def test_original_checkpoint_with_heads_matches(original_checkpoint):
    hf, directory = original_checkpoint
    model = kbert.BertPreTrainer.from_preset(directory)
    assert model.preprocessor is not None and model.preprocessor.tokenizer.lowercase
    x = harness.backbone_inputs(batch=3, length=10, vocabulary_size=99)
    x["mask_positions"] = np.array([[1, 2], [3, 4], [0, 3]], "int32")  # real tokens
    with torch.no_grad():
        ref = hf(
            input_ids=torch.tensor(x["token_ids"]).long(),
            token_type_ids=torch.tensor(x["segment_ids"]).long(),
            attention_mask=torch.tensor(x["padding_mask"]).long(),
        )
    y = harness.to_numpy(model(x))
    expected = np.take_along_axis(
        ref.prediction_logits.numpy(), x["mask_positions"][..., None], axis=1
    )
    assert np.max(np.abs(y["mlm_logits"] - expected)) <= 1e-5
    assert np.max(np.abs(y["nsp_logits"] - ref.seq_relationship_logits.numpy())) <= 1e-5


def test_cli_converts_an_original_checkpoint(original_checkpoint, tmp_path):
    from kbert.cli import main

    hf, directory = original_checkpoint
    assert main(["convert", str(directory), str(tmp_path / "kb")]) == 0
    converted = kbert.BertPreTrainer.from_preset(tmp_path / "kb")
    direct = kbert.BertPreTrainer.from_preset(directory)
    x = harness.backbone_inputs(batch=2, length=8, vocabulary_size=99)
    x["mask_positions"] = np.array([[1, 2], [3, 4]], "int32")
    assert harness.max_abs_diff(converted(x), direct(x)) == 0.0
    # the vocabulary and casing came along
    texts = ["w1 W2 w93", "[MASK] w5"]
    np.testing.assert_array_equal(
        converted.preprocessor(texts)["token_ids"], direct.preprocessor(texts)["token_ids"]
    )
    assert converted.preprocessor.tokenizer.lowercase


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_hidden_layers": 40}, "num_layers=40 but the weights hold 2"),
        ({"hidden_size": 1 << 20}, "hidden_dim=1048576 is beyond any BERT"),
        ({"vocab_size": 30522}, "vocabulary_size=30522 but the weights hold 99"),
    ],
)
def test_config_beyond_the_checkpoint_fails_before_building(
    original_checkpoint, monkeypatch, changes, message
):
    _, directory = original_checkpoint
    config = json.loads((directory / "bert_config.json").read_text())
    (directory / "bert_config.json").write_text(json.dumps({**config, **changes}))
    monkeypatch.setattr(kbert.BertBackbone, "from_config", None)  # building would fail apart
    with pytest.raises(kbert.presets.PresetError, match=message):
        kbert.BertPreTrainer.from_preset(directory)
