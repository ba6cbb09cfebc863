"""Loading a checkpoint draws no random value for a weight it sets, and the
real draw for each weight it does not (kbert.layers.initializers)."""

import keras
import numpy as np
import pytest

import kbert
from kbert.backend import keras_internals
from kbert.layers import initializers
from tests.harness import TINY


@pytest.fixture
def saved(tmp_path):
    keras.utils.set_random_seed(0)
    model = kbert.BertBackbone(**TINY)
    directory = tmp_path / "preset"
    model.save_to_preset(directory)
    return model, directory


@pytest.fixture
def draws(monkeypatch):
    """Shapes drawn by keras.initializers.TruncatedNormal, in order."""
    shapes = []
    call = keras.initializers.TruncatedNormal.__call__

    def counted(self, shape, dtype=None):
        shapes.append(tuple(shape))
        return call(self, shape, dtype=dtype)

    monkeypatch.setattr(keras.initializers.TruncatedNormal, "__call__", counted)
    return shapes


def _initializers(model):
    return [
        (layer.path, name, value)
        for layer in [model, *keras_internals.flatten_layers(model)]
        for name, value in vars(layer).items()
        if name.endswith("_initializer") and isinstance(value, keras.initializers.Initializer)
    ]


def test_a_preset_that_sets_every_weight_draws_none(saved, draws):
    model, directory = saved
    loaded = kbert.BertBackbone.from_preset(directory)
    assert draws == []
    for a, b in zip(model.weights, loaded.weights, strict=True):
        assert a.path == b.path
        np.testing.assert_array_equal(np.asarray(a.numpy()), np.asarray(b.numpy()))
    # the layers hold their real initializers again, for a later build
    held = _initializers(loaded)
    assert any(isinstance(i, keras.initializers.TruncatedNormal) for _, _, i in held)
    assert not [p for p, n, i in held if isinstance(i, initializers.Placeholder)]


def test_a_building_model_draws_as_before(draws):
    kbert.BertBackbone(**TINY)
    # token, segment and position tables, per block QKV, attention output,
    # FFN in and out, and the pooler
    assert len(draws) == 3 + 4 * TINY["num_layers"] + 1


def test_weights_the_preset_lacks_are_drawn(saved, draws):
    """New adapters on a preset saved without them: their down-projections
    are drawn from the truncated normal (their up-projections start at
    zero by design); every saved weight is the saved value."""
    model, directory = saved
    loaded = kbert.BertBackbone.from_preset(directory, adapter_size=4)
    down = [w for w in loaded.weights if "adapter" in w.path and w.path.endswith("down/kernel")]
    assert len(down) == 2 * TINY["num_layers"]
    assert sorted(draws) == sorted(tuple(w.shape) for w in down)
    for w in down:
        value = np.asarray(w.numpy())
        assert np.all(np.abs(value) <= 2 * 0.02 + 1e-6)  # truncated at two stddevs
        assert 0.01 < value.std() < 0.03
    saved_values = {w.path: np.asarray(w.numpy()) for w in model.weights}
    for w in loaded.weights:
        if w.path in saved_values:
            np.testing.assert_array_equal(np.asarray(w.numpy()), saved_values[w.path])


def test_a_pooler_the_checkpoint_lacks_is_drawn(tmp_path, draws):
    """A Hugging Face BertForMaskedLM directory has no pooler."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from tests.convert.test_huggingface import _hf_model

    _, directory = _hf_model(tmp_path, cls=transformers.BertForMaskedLM)
    backbone = kbert.BertBackbone.from_preset(directory)
    kernel = np.asarray(backbone.get_layer("pooler").weights[0].numpy())
    assert draws == [kernel.shape]  # the pooler's kernel only
    assert 0.01 < kernel.std() < 0.03 and np.all(np.abs(kernel) <= 2 * 0.02 + 1e-6)


def test_a_placeholder_weight_that_cannot_be_found_is_an_error():
    """A weight made by a placeholder that no `<name>_initializer` attribute
    names would keep its zeros: draw_unset refuses."""

    class Hidden(keras.layers.Layer):
        def build(self, shape):
            self.w = self.add_weight(
                name="w", shape=(3, 2), initializer=initializers.truncated_normal(0.02)
            )

        def call(self, x):
            return x

    with initializers.placeholders() as made:
        layer = Hidden()
        layer.build((1, 3))
    assert not np.any(np.asarray(layer.w.numpy()))
    with pytest.raises(RuntimeError, match="1 weights but 0 were found"):
        initializers.draw_unset(layer, set(), made)


def test_placeholders_only_within_and_on_this_thread():
    import threading

    seen = {}
    with initializers.placeholders():
        seen["here"] = initializers.truncated_normal(0.02)
        thread = threading.Thread(
            target=lambda: seen.update(other=initializers.truncated_normal(0.02))
        )
        thread.start()
        thread.join()
    seen["after"] = initializers.truncated_normal(0.02)
    assert isinstance(seen["here"], initializers.Placeholder)
    assert isinstance(seen["other"], keras.initializers.TruncatedNormal)
    assert isinstance(seen["after"], keras.initializers.TruncatedNormal)
