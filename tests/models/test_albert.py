"""ALBERT's parameter reductions as BertBackbone options: factorized
embeddings (`embedding_dim`), one shared block (`share_layers`), and the SOP
pre-training head."""

import json
import os
import types

import keras
import numpy as np
import pytest

import kbert
from kbert.presets import PresetError
from kbert.presets.architectures import check_backbone_config, parameter_count
from tests import harness

ALBERT = dict(harness.TINY, embedding_dim=8, share_layers=True)


@pytest.fixture(scope="module")
def x():
    return harness.backbone_inputs()


@pytest.fixture(scope="module")
def albert():
    keras.utils.set_random_seed(0)
    return kbert.BertBackbone(
        **ALBERT, dropout=0.0, attention_dropout=0.0, output_hidden_states=True
    )


def _numpy_weights(model):
    return {v.path: keras.ops.convert_to_numpy(v) for v in model.weights}


def test_one_set_of_block_weights(albert):
    block = kbert.layers.TransformerEncoderBlock(4, 32, 37)
    block.build((None, None, 32))
    shared = [w for w in albert.weights if w.path.startswith("shared_transformer_layer/")]
    assert len(shared) == len(block.weights)
    assert sum(int(np.prod(w.shape)) for w in shared) == block.count_params()
    assert not any(w.path.startswith("transformer_layer_") for w in albert.weights)
    layers = albert.transformer_layers
    assert len(layers) == ALBERT["num_layers"]
    assert all(layer is layers[0] for layer in layers)
    # V E + E H + H (projection) in place of V H; one block instead of L.
    v, e, h, p, t = 97, 8, 32, 24, 2
    embeddings = (v + p + t + 2) * e + e * h + h
    assert albert.count_params() == embeddings + block.count_params() + h * h + h
    assert parameter_count(albert.get_config()) == albert.count_params()


def test_factorized_embeddings_and_shared_hidden_states(albert, x):
    """Embeddings: LayerNorm(token + segment + position) at width E, then
    the projection to H; each hidden state is the one block applied to the
    one before."""
    y = harness.to_numpy(albert(x))
    states = y["hidden_states"]
    assert states.shape == (3, ALBERT["num_layers"] + 1, 10, 32)
    w = _numpy_weights(albert)
    summed = (
        w["embeddings/token_embedding/embeddings"][x["token_ids"]]
        + w["embeddings/segment_embedding/embeddings"][x["segment_ids"]]
        + w["embeddings/position_embeddings"][:10]
    )  # (B, T, E)
    normed = (summed - summed.mean(-1, keepdims=True)) / np.sqrt(
        summed.var(-1, keepdims=True) + 1e-12
    )
    normed = normed * w["embeddings/layer_norm/gamma"] + w["embeddings/layer_norm/beta"]
    expected = normed @ w["embeddings/projection/kernel"] + w["embeddings/projection/bias"]
    assert np.max(np.abs(states[:, 0] - expected)) <= 1e-5
    block = albert.get_layer("shared_transformer_layer")
    for i in range(ALBERT["num_layers"]):
        step = keras.ops.convert_to_numpy(block(states[:, i], x["padding_mask"]))
        assert np.max(np.abs(states[:, i + 1] - step)) <= 1e-5
    assert np.max(np.abs(states[:, -1] - y["sequence_output"])) <= 1e-5


def test_sop_pretrainer(albert, x, tmp_path):
    model = kbert.BertPreTrainer(albert, sentence_task="sop")
    head = model.get_layer("mlm_head")
    assert tuple(head.transform.kernel.shape) == (32, 8)  # H -> E, decoder tied at E
    assert head.token_embedding is albert.token_embedding
    batch = {**x, "mask_positions": np.array([[1, 2], [1, 3], [2, 0]], "int32")}
    y = harness.to_numpy(model(batch))
    assert set(y) == {"mlm_logits", "sop_logits"}
    assert y["mlm_logits"].shape == (3, 2, 97)
    targets = {
        "mask_ids": np.array([[5, 6], [7, 8], [9, 0]], "int32"),
        "mask_weights": np.array([[1, 1], [1, 1], [1, 0]], "float32"),
        "next_sentence_labels": np.array([0, 1, 1], "int32"),
    }
    model.compile()
    assert {"sop_loss", "sop_accuracy"} <= {m.name for m in model.metrics}
    loss = float(keras.ops.convert_to_numpy(model.compute_loss(batch, targets, y)))

    def cross_entropy(logits, labels):
        logits = logits - logits.max(-1, keepdims=True)
        log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        return -np.take_along_axis(log_p, labels[..., None], -1)[..., 0]

    mlm = cross_entropy(y["mlm_logits"], targets["mask_ids"])
    mlm = (mlm * targets["mask_weights"]).sum() / (targets["mask_weights"].sum() + 1e-5)
    sop = cross_entropy(y["sop_logits"], targets["next_sentence_labels"]).mean()
    assert abs(loss - (mlm + sop)) <= 1e-5
    assert model.get_config()["sentence_task"] == "sop"
    harness.check_preset_round_trip(model, batch, tmp_path)


def test_round_trips(albert, x, tmp_path):
    config = albert.get_config()
    assert config["embedding_dim"] == 8 and config["share_layers"] is True
    harness.check_config_round_trip(albert)
    harness.check_keras_round_trip(albert, x, tmp_path)
    directory = harness.check_preset_round_trip(albert, x, tmp_path)

    # A config that does not describe the weights is refused before building.
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        saved = json.load(f)
    for change, message in [
        ({"share_layers": False}, "share_layers=false but the weights hold one shared block"),
        ({"embedding_dim": 16}, "embedding_dim=16 but the weights hold factorized embeddings"),
        ({"embedding_dim": None}, "embedding_dim=None but the weights hold factorized"),
    ]:
        with open(path, "w") as f:
            json.dump({**saved, "config": {**saved["config"], **change}}, f)
        kbert.presets.io.write_metadata(directory, albert, ["config.json", "model.safetensors"])
        with pytest.raises(PresetError, match=message):
            kbert.BertBackbone.from_preset(directory)


@pytest.mark.filterwarnings("ignore:Gradients do not exist")  # the unused poolers
def test_a_gradient_step_updates_the_shared_block_once(albert, x):
    """SGD moves the shared block by the sum of what the same block copied
    into L unshared layers receives: one update, of the summed gradient."""
    config = {**albert.get_config(), "share_layers": False, "name": "unshared"}
    unshared = kbert.BertBackbone.from_config(config)
    weights = _numpy_weights(albert)
    for variable in unshared.weights:
        path = variable.path.replace("unshared/", "")
        if path.startswith("transformer_layer_"):
            path = "shared_transformer_layer/" + path.split("/", 1)[1]
        variable.assign(weights[path])
    # Both in one model (no weight in common): one compiled step updates both.
    inputs = {name: keras.Input((None,), dtype="int32", name=name) for name in x}
    pair = keras.Model(
        inputs,
        {
            "shared": albert(inputs)["sequence_output"],
            "unshared": unshared(inputs)["sequence_output"],
        },
    )
    target = np.random.default_rng(0).normal(size=(3, 10, 32)).astype("float32")
    pair.compile(optimizer=keras.optimizers.SGD(0.5), loss={"shared": "mse", "unshared": "mse"})
    pair.fit(x, {"shared": target, "unshared": target}, batch_size=3, shuffle=False, verbose=0)
    after_shared, after_unshared = _numpy_weights(albert), _numpy_weights(unshared)
    assert len(after_shared) == len(weights)
    moved = 0.0
    for path, old in weights.items():
        if not path.startswith("shared_transformer_layer/"):
            continue
        rest = path.split("/", 1)[1]
        summed = sum(
            after_unshared[f"transformer_layer_{i}/{rest}"] - old
            for i in range(ALBERT["num_layers"])
        )
        delta = after_shared[path] - old
        assert np.allclose(delta, summed, atol=1e-6), path
        moved = max(moved, float(np.max(np.abs(delta))))
    assert moved > 1e-4


def test_bad_options_raise(albert):
    for overrides, message in [
        ({"embedding_dim": 0}, "embedding_dim must be a positive int"),
        ({"share_layers": "yes"}, "share_layers must be True or False"),
    ]:
        with pytest.raises(ValueError, match=message):
            kbert.BertBackbone(**{**harness.TINY, **overrides})
    with pytest.raises(ValueError, match="sentence_task must be 'nsp'"):
        kbert.BertPreTrainer(albert, sentence_task="order")
    with pytest.raises(ValueError, match="BertMaskedLM trains no sentence task"):
        kbert.BertMaskedLM(albert, sentence_task="sop")
    for overrides, message in [
        ({"share_layers": "yes"}, "share_layers must be true or false"),
        ({"embedding_dim": 0}, "embedding_dim must be a positive integer"),
        ({"embedding_dim": 1 << 20}, "embedding_dim=1048576 is beyond any BERT"),
    ]:
        with pytest.raises(PresetError, match=message):
            check_backbone_config({**ALBERT, **overrides}, "config.json")
    one_option = types.SimpleNamespace(embedding_dim=8, share_layers=False)
    with pytest.raises(ValueError, match="a Hugging Face BERT holds neither option"):
        kbert.convert.huggingface.is_albert_style(one_option)
