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


def _assert_same_weights(a, b):
    assert [w.path for w in a.weights] == [w.path for w in b.weights]
    for x, y in zip(a.weights, b.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(x.numpy()), np.asarray(y.numpy()), x.path)


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "int8"])
def test_load_model_draws_none_and_sets_every_weight(tmp_path, draws, quantized):
    """keras.saving.load_model sets every weight from the file (or fails):
    the build within it draws nothing, and the layers hold their real
    initializers after."""
    keras.utils.set_random_seed(1)
    model = kbert.BertClassifier(kbert.BertBackbone(**TINY), num_classes=3)
    if quantized:
        model.quantize("int8")
    model.save(tmp_path / "model.keras")
    del draws[:]
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    assert draws == []
    _assert_same_weights(model, loaded)
    held = _initializers(loaded)
    assert any(isinstance(i, keras.initializers.TruncatedNormal) for _, _, i in held)
    assert not [p for p, n, i in held if isinstance(i, initializers.Placeholder)]


def test_a_build_outside_a_load_still_draws(draws):
    """from_config and clone_model give freshly drawn weights, as before."""
    model = kbert.BertClassifier(kbert.BertBackbone(**TINY), num_classes=3)
    del draws[:]
    fresh = kbert.BertClassifier.from_config(model.get_config())
    assert len(draws) == 3 + 4 * TINY["num_layers"] + 2  # the backbone's and the logits'
    clone = keras.models.clone_model(model)
    assert len(draws) == 2 * (3 + 4 * TINY["num_layers"] + 2)
    for other in (fresh, clone):
        kernel = next(w for w in other.weights if "pooler" in w.path and len(w.shape) == 2)
        assert 0.01 < np.asarray(kernel.numpy()).std() < 0.03


def test_a_file_missing_a_weight_fails_the_load(tmp_path):
    """The guarantee the build within a load relies on: Keras refuses a
    file that does not set every weight, so no placeholder zeros survive."""
    import zipfile

    import h5py

    model = kbert.BertClassifier(kbert.BertBackbone(**TINY), num_classes=3)
    model.save(tmp_path / "model.keras")
    with zipfile.ZipFile(tmp_path / "model.keras") as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    weights = tmp_path / "model.weights.h5"
    weights.write_bytes(members["model.weights.h5"])
    with h5py.File(weights, "r+") as f:
        found = []
        f.visititems(lambda name, item: found.append(name) if name.endswith("vars/0") else None)
        pooler = next(name for name in found if "pooler" in name)
        del f[pooler]
    members["model.weights.h5"] = weights.read_bytes()
    with zipfile.ZipFile(tmp_path / "broken.keras", "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    with pytest.raises(ValueError, match="could not be loaded"):
        keras.saving.load_model(tmp_path / "broken.keras")
