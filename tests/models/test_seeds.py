"""`keras.utils.set_random_seed` reaches every random source of fine-tuning:
the head's initial weights, the dropout masks (eager, and step to step inside
a compiled `fit`) and the batch order of `fit` on raw text. The same seed
reproduces each; another seed changes it."""

import keras
import numpy as np
import pytest

import kbert
import kbert.layers.dropout
from tests.harness import TINY

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + (
    "the a movie was good bad great awful not plot actors film , . !".split()
)
TEXTS = [
    "the movie was good",
    "the film was awful",
    "great actors !",
    "not good , bad plot",
    "a great film .",
    "the plot was bad",
    "awful actors , awful film",
    "not a bad movie",
]
LABELS = np.array([0, 1, 2, 1, 0, 2, 1, 0])


def classifier(seed, dropout=0.1):
    keras.utils.set_random_seed(seed)
    backbone = kbert.BertBackbone(
        **{
            **TINY,
            "vocabulary_size": len(VOCAB),
            "dropout": dropout,
            "attention_dropout": dropout,
        }
    )
    preprocessor = kbert.BertPreprocessor(kbert.BertTokenizer(VOCAB), sequence_length=8)
    return kbert.BertClassifier(backbone, 3, preprocessor=preprocessor, dropout=dropout)


@pytest.fixture(scope="module")
def models():
    """Classifiers built after seeds 0, 0 and 1."""
    return [classifier(seed) for seed in (0, 0, 1)]


def head_kernel(model):
    return keras.ops.convert_to_numpy(model.get_layer("logits").kernel)


def step_losses(model, seed, epochs=1, batch_size=4, texts=TEXTS, labels=LABELS):
    """The loss of each training step of a `fit` with learning rate 0 (the
    weights stay put, so each loss depends only on the batch and the dropout
    masks), after `set_random_seed(seed)`."""
    if getattr(model, "optimizer", None) is None:
        model.compile(
            optimizer=keras.optimizers.SGD(learning_rate=0.0),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    running = []
    logger = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: running.append(float(logs["loss"]))
    )
    keras.utils.set_random_seed(seed)
    model.fit(texts, labels, batch_size=batch_size, epochs=epochs, verbose=0, callbacks=[logger])
    return per_step(np.array(running), len(running) // epochs)


def per_step(running_means, steps_per_epoch):
    """Each step's own loss from the running means `fit` logs (reset each epoch)."""
    means = running_means.reshape(-1, steps_per_epoch)
    totals = means * np.arange(1, steps_per_epoch + 1)
    return np.diff(totals, axis=1, prepend=0.0).reshape(-1)


def test_seed_sets_head_initialisation(models):
    first, again, other = (head_kernel(m) for m in models)
    np.testing.assert_array_equal(first, again)
    assert np.abs(first - other).max() > 1e-3


def test_seed_sets_dropout_masks(models):
    ones = keras.ops.ones((8, 32))

    def masks(model, seed):
        # The head's keras Dropout and one of the backbone's kbert Dropouts
        # (the backend's fused path), each called twice. The seed is set
        # again first: on torch, unseeded dropout draws from torch's global
        # generator, which `set_random_seed` seeds.
        fused = next(
            layer
            for layer in model.backbone._flatten_layers()
            if isinstance(layer, kbert.layers.dropout.Dropout)
        )
        layers = [model.get_layer("classifier_dropout"), fused]
        keras.utils.set_random_seed(seed)
        return [keras.ops.convert_to_numpy(d(ones, training=True)) == 0 for d in layers * 2]

    first, again, other = (masks(m, s) for m, s in zip(models, (0, 0, 1)))
    for a, b, c in zip(first, again, other):
        assert 0 < a.mean() < 0.5
        np.testing.assert_array_equal(a, b)
        assert (a != c).any(), "another seed gave the same mask"
    assert (first[0] != first[2]).any() and (first[1] != first[3]).any(), "a mask repeated"
    # The whole model (every dropout layer) reproduces under the same seed.
    x = models[0].preprocess_samples(TEXTS)
    outputs = []
    for model in models[:2]:
        keras.utils.set_random_seed(0)
        outputs.append(keras.ops.convert_to_numpy(model(x, training=True)))
    np.testing.assert_array_equal(*outputs)


def test_dropout_masks_change_each_step_in_compiled_fit(models):
    # Every batch holds the same examples: losses differ only by the masks.
    texts, labels = [TEXTS[0]] * 12, np.zeros(12, "int32")
    losses = step_losses(models[2], 0, texts=texts, labels=labels)
    assert np.ptp(losses) > 1e-4, f"the same loss at every step: {losses}"


def test_seed_sets_batch_order_of_fit_on_raw_text():
    # No dropout and learning rate 0: each step's loss identifies its batch.
    model = classifier(0, dropout=0.0)
    first, again, other = (step_losses(model, s, epochs=2, batch_size=2) for s in (0, 0, 1))
    np.testing.assert_allclose(first, again, rtol=1e-5)
    assert np.abs(first - other).max() > 1e-4, "another seed gave the same batch order"
    epochs = first.reshape(2, 4)
    assert np.abs(epochs[0] - epochs[1]).max() > 1e-4, "both epochs in the same order"


def test_seed_sets_batch_order_of_seq2seq_fit_on_text_pairs():
    # BertSeq2SeqLM batches text pairs itself (length buckets on both
    # sides); its order follows the seed like the tasks' own batching.
    keras.utils.set_random_seed(0)
    backbone = kbert.BertBackbone(
        **{**TINY, "vocabulary_size": len(VOCAB), "dropout": 0.0, "attention_dropout": 0.0}
    )
    preprocessor = kbert.BertPreprocessor(kbert.BertTokenizer(VOCAB), sequence_length=8)
    model = kbert.BertSeq2SeqLM.from_backbone(
        backbone, "bert2bert", decoder="same", preprocessor=preprocessor
    )
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.0))
    targets = TEXTS[::-1]

    def losses(seed):
        running = []
        logger = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: running.append(float(logs["loss"]))
        )
        keras.utils.set_random_seed(seed)
        model.fit(TEXTS, targets, batch_size=2, epochs=1, verbose=0, callbacks=[logger])
        return per_step(np.array(running), len(running))

    first, again, other = losses(0), losses(0), losses(1)
    np.testing.assert_allclose(first, again, rtol=1e-5)
    assert np.abs(first - other).max() > 1e-4, "another seed gave the same batch order"
