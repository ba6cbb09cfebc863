"""Several examples per row (`fit(pack_rows=...)`): every example placed
once, attention inside each example, the same losses and weights as
length buckets, few row counts."""

import itertools

import keras
import numpy as np
import pytest

import kbert
from kbert.training import batching
from tests.harness import TINY

N, T = 24, 32


def inputs(seed=0, n=N):
    """Text pairs of mixed length: [CLS] a [SEP] b [SEP], segment ids 0 / 1."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, T + 1, n)
    lengths[0] = T  # one example fills a whole row
    mask = (np.arange(T) < lengths[:, None]).astype("int32")
    token_ids = rng.integers(5, 97, (n, T)).astype("int32") * mask
    token_ids[:, 0] = 2
    segment_ids = ((np.arange(T) >= lengths[:, None] // 2) * mask).astype("int32")
    return {"token_ids": token_ids, "segment_ids": segment_ids, "padding_mask": mask}


def classifier(dropout=0.0):
    keras.utils.set_random_seed(1)
    backbone = kbert.BertBackbone(
        **{**TINY, "vocabulary_size": 97, "max_sequence_length": T},
        dropout=dropout,
        attention_dropout=dropout,
    )
    return kbert.BertClassifier(backbone, 3, dropout=dropout)


def test_pack_rows_places_every_example_once_inside_its_row():
    rng = np.random.default_rng(0)
    for _ in range(50):
        row_length = int(rng.integers(8, 40))
        lengths = rng.integers(1, row_length + 1, int(rng.integers(1, 40)))
        row, start, rows = batching.pack_rows(lengths, row_length)
        taken = np.zeros((rows, row_length), int)
        for r, s, n in zip(row, start, lengths):
            assert 0 <= r < rows and s + n <= row_length
            taken[r, s : s + n] += 1
        assert taken.max() == 1  # no two examples share a column
        assert taken.sum() == lengths.sum()
        assert rows >= -(-lengths.sum() // row_length) and rows <= len(lengths)
        # first fit: no example would have fitted in an earlier row's free end
        free = (taken == 0).sum(axis=1)
        assert all((free[:r] < n).all() for r, n in zip(row, lengths))


def test_cheapest_buckets_are_the_cheapest_set():
    rng = np.random.default_rng(1)
    for _ in range(30):
        counts = rng.integers(3, 12, int(rng.integers(1, 30)))
        shape_cost = float(rng.uniform(0, 40))

        def cost(buckets):
            rows = [min(b for b in buckets if b >= c) for c in counts]
            return len(buckets) * shape_cost + sum(rows)

        values = sorted(set(counts.tolist()))
        best = min(
            cost(list(subset) + [values[-1]])
            for k in range(len(values))
            for subset in itertools.combinations(values[:-1], k)
        )
        buckets = batching.cheapest_buckets(counts, shape_cost)
        assert buckets[-1] == values[-1]
        assert cost(buckets) == pytest.approx(best)


def test_packed_rows_give_each_example_its_own_outputs():
    model = classifier()
    x = inputs()
    alone = model.predict_on_batch(x)  # each example in its own padded row
    data = batching.PackedBatches(x, np.zeros(N, "int32"), batch_size=8, row_length=T)
    for index in range(len(data)):
        batch, _ = data[index]
        assert batch["token_ids"].shape[0] < 8  # fewer rows than examples
        assert sorted(batch[batching.PACKED_KEY] % T) != [0] * 8  # examples side by side
        packed = keras.ops.convert_to_numpy(model(batch, training=False))
        np.testing.assert_allclose(packed, alone[data.batches[index]], atol=1e-5)


def fitted(pack, sample_weight=None, x=None):
    model = classifier()
    model.compile(optimizer=keras.optimizers.SGD(0.05))
    x, y = inputs() if x is None else x, np.random.default_rng(2).integers(0, 3, N)
    seen = []
    original = model.train_step

    def train_step(*args):  # (data) or, on JAX, (state, data)
        seen.append(batching.PACKED_KEY in args[-1][0])
        return original(*args)

    model.train_step = train_step
    np.random.seed(5)  # the batch order
    history = model.fit(
        x, y, sample_weight=sample_weight, batch_size=5, epochs=3, verbose=0, pack_rows=pack
    ).history
    return model, history, seen


@pytest.mark.parametrize("weighted", [False, True])
def test_packed_fit_equals_length_buckets(weighted):
    weights = np.linspace(0.5, 2.0, N).astype("float32") if weighted else None
    packed, packed_history, seen = fitted(True, weights)
    assert seen and all(seen)
    bucketed, history, seen = fitted(False, weights)
    assert not any(seen)
    for key in history:
        np.testing.assert_allclose(packed_history[key], history[key], atol=1e-5, err_msg=key)
    for a, b in zip(packed.weights, bucketed.weights):
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b), atol=1e-5
        )


def test_packed_fit_trains_with_dropout_and_sees_every_example_once():
    x = inputs()
    data = batching.PackedBatches(x, np.arange(N), batch_size=5, shuffle=True)
    for _ in range(2):
        order = np.concatenate([data[i][1] for i in range(len(data))])
        assert sorted(order.tolist()) == list(range(N))
        for i in range(len(data)):
            batch, y = data[i]
            ids = batch["example_ids"]
            assert sorted(set(ids[ids > 0].tolist())) == list(range(1, len(y) + 1))
            for k, row in enumerate(y):  # each example's tokens, in order, from its [CLS]
                tokens = batch["token_ids"][ids == k + 1]
                n = x["padding_mask"][row].sum()
                np.testing.assert_array_equal(tokens, x["token_ids"][row, :n])
                assert batch["token_ids"].reshape(-1)[batch[batching.PACKED_KEY][k]] == 2
            assert data.batch_rows[i] in data.buckets or data.batch_rows[i] > max(data.buckets)
        data.on_epoch_end()
    model = classifier(dropout=0.1)
    model.compile(learning_rate=1e-3)
    y = np.random.default_rng(2).integers(0, 3, N)
    losses = model.fit(x, y, batch_size=6, epochs=4, verbose=0, pack_rows=True).history["loss"]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]


def test_pack_rows_errors_name_the_problem():
    x = inputs(n=8)
    tagger = kbert.BertTokenClassifier(classifier().backbone, 4)
    tagger.compile()
    with pytest.raises(ValueError, match="one output per example"):
        tagger.fit(x, np.zeros((8, T), "int32"), epochs=1, verbose=0, pack_rows=True)
    model = classifier()
    model.compile()
    with pytest.raises(ValueError, match="pack_rows=True needs length buckets"):
        model.fit(x, np.zeros(8, "int32"), verbose=0, bucket_lengths=False, pack_rows=True)
    empty = {**x, "padding_mask": x["padding_mask"].copy()}
    empty["padding_mask"][3] = 0  # all padding: would attend to its row's other examples
    with pytest.raises(ValueError, match="at least one real token"):
        model.fit(empty, np.zeros(8, "int32"), verbose=0, pack_rows=True)
    with pytest.raises(ValueError, match="shorter than the longest example"):
        batching.PackedBatches(x, batch_size=4, row_length=T - 1)
    if keras.backend.backend() == "jax":
        with keras.distribution.DataParallel().scope():
            with pytest.raises(ValueError, match="runs on one device"):
                model.fit(x, np.zeros(8, "int32"), verbose=0, pack_rows=True)


def test_fit_packs_by_default_where_it_pays():
    short = inputs()
    short["padding_mask"][:, 6:] = 0  # every example at most 6 tokens of 32
    data = batching.PackedBatches(short, batch_size=8)
    packed, bucketed = data.positions()
    assert packed <= bucketed / 2
    jax_cpu = keras.backend.backend() == "jax" and not kbert.backend.on_accelerator()
    assert batching.packing_pays(data) == jax_cpu
    long = inputs()
    long["padding_mask"][:] = 1  # every example a full row: nothing to gain
    assert not batching.packing_pays(batching.PackedBatches(long, batch_size=8))
    _, _, seen = fitted(None, x=short)
    assert seen and all(seen) == jax_cpu and any(seen) == jax_cpu
