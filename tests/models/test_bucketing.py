"""Length-bucketed fit / evaluate / predict equal fixed-length padding, see
every example once per epoch in a seeded order, and make few shapes."""

import contextlib
import time

import keras
import numpy as np
import pytest

import kbert
from kbert.backend.state import state_of
from kbert.training import batching
from tests import harness
from tests.harness import TINY

N, T = 12, 32


def inputs(seed=0, choices=None):
    rng = np.random.default_rng(seed)
    shape = (N, T) if choices is None else (N, choices, T)
    lengths = rng.integers(3, 30, shape[:-1])
    mask = (np.arange(T) < lengths[..., None]).astype("int32")
    token_ids = rng.integers(5, 97, shape).astype("int32") * mask
    segment_ids = ((np.arange(T) >= lengths[..., None] // 2) * mask).astype("int32")
    return {"token_ids": token_ids, "segment_ids": segment_ids, "padding_mask": mask}


def backbone():
    keras.utils.set_random_seed(1)
    return kbert.BertBackbone(
        **{**TINY, "vocabulary_size": 97, "max_sequence_length": 32},
        dropout=0.0,
        attention_dropout=0.0,
    )


def task(name):
    """(model, x, y, sample_weight) with dropout off everywhere."""
    rng = np.random.default_rng(3)
    if name == "classifier":
        x = inputs()
        return kbert.BertClassifier(backbone(), 3, dropout=0.0), x, rng.integers(0, 3, N), None
    if name == "tagger":
        x = inputs()
        model = kbert.BertTokenClassifier(backbone(), 4, dropout=0.0)
        return model, x, rng.integers(0, 4, (N, T)), x["padding_mask"].astype("float32")
    if name == "qa":
        x = inputs()
        last = x["padding_mask"].sum(-1) - 1
        start = np.minimum(rng.integers(1, 6, N), last)
        y = {"start_logits": start, "end_logits": np.minimum(start + 2, last)}
        return kbert.BertQuestionAnswerer(backbone()), x, y, None
    if name == "choice":
        x = inputs(choices=2)
        return kbert.BertMultipleChoice(backbone(), 2, dropout=0.0), x, rng.integers(0, 2, N), None
    raise ValueError(name)


def run(name, bucket):
    model, x, y, weights = task(name)
    model.compile(optimizer=keras.optimizers.SGD(0.05))
    history = model.fit(
        x,
        y,
        sample_weight=weights,
        batch_size=4,
        epochs=2,
        shuffle=False,  # Keras' own order differs per backend
        verbose=0,
        bucket_lengths=bucket,
    ).history
    evaluation = model.evaluate(
        x,
        y,
        sample_weight=weights,
        batch_size=4,
        verbose=0,
        return_dict=True,
        bucket_lengths=bucket,
    )
    prediction = model.predict(x, batch_size=4, verbose=0, bucket_lengths=bucket)
    return model, x, history, evaluation, prediction


def compared(logs):
    """The logged values to compare. On TensorFlow, Keras weights each
    output's own loss tracker (`start_logits_loss`, ...) by the static batch
    size, which a dataset of variable-length batches leaves unknown: those
    logs differ while the total loss, the metrics and the weights agree."""
    multi_output = sum(key.endswith("_loss") for key in logs) > 0
    if keras.backend.backend() == "tensorflow" and multi_output:
        return [key for key in logs if not key.endswith("_loss")]
    return list(logs)


@pytest.mark.parametrize("name", ["classifier", "tagger", "qa", "choice"])
def test_bucketed_equals_fixed_length(name):
    fixed_model, x, fixed_history, fixed_eval, fixed_pred = run(name, False)
    model, _, history, evaluation, prediction = run(name, True)
    for key in compared(fixed_history):
        np.testing.assert_allclose(history[key], fixed_history[key], atol=1e-5, err_msg=key)
    for key in compared(fixed_eval):
        np.testing.assert_allclose(evaluation[key], fixed_eval[key], atol=1e-5, err_msg=key)
    for a, b in zip(model.weights, fixed_model.weights):
        np.testing.assert_allclose(
            keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b), atol=1e-5
        )
    real = x["padding_mask"] > 0

    def compare(a, b):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape
        if name in ("tagger", "qa"):  # per-token outputs: padding positions are not compared
            a, b = a[real], b[real]
        np.testing.assert_allclose(a, b, atol=1e-5)

    keras.tree.map_structure(compare, prediction, fixed_pred)


def test_predict_on_batch_pads_to_bucket_and_slices_back():
    model, x, _, _ = task("tagger")
    longest = int(x["padding_mask"][:6].sum(-1).max())
    assert longest % batching.MULTIPLE  # a length between buckets
    cut = {k: v[:6, :longest] for k, v in x.items()}  # padded to its longest, as users do
    out = model.predict_on_batch(cut)
    assert out.shape == (6, longest, 4)
    full = keras.Model.predict_on_batch(model, {k: v[:6] for k, v in x.items()})
    real = cut["padding_mask"] > 0
    np.testing.assert_allclose(out[real], full[:, :longest][real], atol=1e-5)


def test_cuts_keep_every_mask_position():
    """A padded prediction slot may point at padding: batches and predict
    groups keep the columns of every mask position."""
    x = inputs(seed=2)
    x["padding_mask"][:, 4:] = 0  # every row 4 tokens long
    x["mask_positions"] = np.tile([1, 2], (N, 1)).astype("int32")
    x["mask_positions"][5, 1] = 20  # a slot in the padding
    data = batching.BucketedBatches(x, batch_size=4, multiple=1)
    widths = []
    for i in range(len(data)):
        batch = data[i][0]
        width = batch["padding_mask"].shape[-1]
        assert batch["mask_positions"].max() < width
        widths.append(width)
    assert sorted(widths) == [4, 4, 21]  # the cut still happens elsewhere
    groups = batching.length_groups(x, 1, 32)
    assert all(x["mask_positions"][rows].max() < length for rows, length in groups)
    empty = {k: v[:0] for k, v in x.items()}  # no rows: one (empty) group
    assert [len(r) for r, _ in batching.length_groups(empty, 16, 32)] == [0]
    tf = pytest.importorskip("tensorflow")
    limits = dict(vocabulary_size=97, type_vocab_size=2, max_sequence_length=32)
    data = tf.data.Dataset.from_tensor_slices(x).batch(4)
    cut = list(batching.map_dataset(data, limits, multiple=1).as_numpy_iterator())
    assert [b["padding_mask"].shape[-1] for b in cut] == [4, 21, 4]  # tf.data cuts too


def test_length_groups_hold_every_row_once_at_its_bucket():
    rng = np.random.default_rng(5)
    lengths = np.concatenate([rng.integers(2, 9, 24), [64] * 8])  # short rows, a few long
    mask = (np.arange(64) < lengths[:, None]).astype("int32")
    x = {"token_ids": mask.copy(), "segment_ids": 0 * mask, "padding_mask": mask}
    groups = batching.length_groups(x, 16, 128)
    assert len(groups) == 4
    rows = np.concatenate([r for r, _ in groups])
    assert sorted(rows.tolist()) == list(range(32))
    for r, length in groups:
        assert len(r) == 8 and length % 16 == 0
        assert length >= lengths[r].max() and length - lengths[r].max() < 16
    # far less work than one batch at 64 columns
    assert sum(len(r) * n for r, n in groups) < 0.5 * 32 * 64
    # rows of one length, or too few rows: one group at the batch's bucket
    same = {k: v[24:] for k, v in x.items()}
    assert [n for _, n in batching.length_groups(same, 16, 128)] == [64]
    few = {k: v[20:30] for k, v in x.items()}
    assert len(batching.length_groups(few, 16, 128)) == 1
    assert len(batching.length_groups(x, 16, 128, split=False)) == 1


@pytest.mark.parametrize("name", ["backbone", "classifier", "tagger", "qa", "choice"])
def test_predict_on_batch_of_mixed_lengths_equals_one_padded_batch(name, monkeypatch):
    """Rows split into groups of similar length (forced here on every
    backend), each cut to its own bucket: the outputs at real tokens are
    those of the whole batch padded to one length, in the input order."""
    if name == "backbone":
        model = backbone()
        x = inputs(seed=4)
    else:
        model, _, _, _ = task(name)
        x = inputs(seed=4, choices=2 if name == "choice" else None)
    x = {k: np.concatenate([v, v[:4]]) for k, v in x.items()}  # 16 rows: 2 groups of 8
    x["padding_mask"][1::2, ..., 5:] = 0  # every other row short
    x["token_ids"] *= x["padding_mask"]
    monkeypatch.setattr(batching, "splits_batches", lambda model=None: True)
    groups = batching.length_groups(x, 16, 32)
    assert len(groups) > 1 and min(n for _, n in groups) < 32
    out = model.predict_on_batch(x)
    full = keras.Model.predict_on_batch(model, x)
    if name == "backbone":
        np.testing.assert_allclose(out["pooled_output"], full["pooled_output"], atol=1e-5)
        out, full = out["sequence_output"], full["sequence_output"]
    out, full = keras.tree.flatten(out), keras.tree.flatten(full)
    real = x["padding_mask"] > 0
    for a, b in zip(out, full):
        assert a.shape == b.shape
        if a.shape[:2] == real.shape:  # per token
            np.testing.assert_allclose(a[real], b[real], atol=1e-5)
        else:
            np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("group", [False, True])
def test_each_example_once_per_epoch_in_a_seeded_order(group):
    x = inputs()
    y = np.arange(N)

    def epochs(seed):
        np.random.seed(seed)
        data = batching.BucketedBatches(x, y, batch_size=4, shuffle=True, group_by_length=group)
        orders = []
        for _ in range(2):
            rows = [data[i][1] for i in range(len(data))]
            orders.append(np.concatenate(rows))
            for i in range(len(data)):
                batch = data[i][0]
                length = batch["padding_mask"].shape[-1]
                assert length % batching.MULTIPLE == 0 or length == T
                assert batch["padding_mask"][:, length - batching.MULTIPLE :].any() or length <= 16
            data.on_epoch_end()
        return orders

    first, again, other = epochs(0), epochs(0), epochs(1)
    for order in first:
        assert sorted(order.tolist()) == list(range(N))  # every example exactly once
    assert not np.array_equal(first[0], first[1])  # a new order each epoch
    np.testing.assert_array_equal(first[0], again[0])  # seeded
    assert not np.array_equal(first[0], other[0])


def _fit_shapes(model, *args, **kwargs):
    """The shape of `token_ids` in each training step of `model.fit(*args,
    **kwargs)` (on TensorFlow, of its traces: None for an unknown length)."""
    shapes = []
    original = model.train_step

    def train_step(*step_args):  # (data) or, on JAX, (state, data)
        shapes.append(tuple(step_args[-1][0]["token_ids"].shape))
        return original(*step_args)

    model.train_step = train_step
    try:
        model.fit(*args, **kwargs)
    finally:
        del model.train_step
    return shapes


def test_few_shapes_per_fit():
    model, x, y, _ = task("classifier")
    model.compile(optimizer=keras.optimizers.SGD(0.05))
    shapes = set(_fit_shapes(model, x, y, batch_size=4, epochs=2, verbose=0))
    lengths = {shape[-1] for shape in shapes if shape[-1] is not None}  # None: one TF trace
    multiple = batching.default_multiple(model)
    assert all(length % multiple == 0 or length == T for length in lengths)
    # one program per bucket length, plus one for the final partial batch
    assert len(shapes) <= len(lengths) + 1 and len(lengths) <= -(-T // multiple)


def _skewed(n=64, full=64, seed=0):
    """Inputs (n, full) of mostly short rows and a few long ones."""
    rng = np.random.default_rng(seed)
    lengths = np.where(rng.random(n) < 0.9, rng.integers(2, 16, n), rng.integers(17, full + 1, n))
    mask = (np.arange(full) < lengths[:, None]).astype("int32")
    ids = rng.integers(5, 97, (n, full)).astype("int32") * mask
    return {"token_ids": ids, "segment_ids": np.zeros_like(ids), "padding_mask": mask}


def test_rare_bucket_lengths_pad_up_where_a_new_shape_costs_more():
    """With a `shape_cost` (torch replaying CUDA graphs), the batches of a
    rare bucket length are padded up to a longer bucket where that costs
    fewer columns than one more shape: the cheapest set for the first
    epoch (`cheapest_buckets`), kept for later epochs; every example still
    once per epoch, with every real token."""
    x = _skewed()
    y = np.arange(64)

    def make(cost):
        np.random.seed(0)
        return batching.BucketedBatches(x, y, batch_size=4, shuffle=True, shape_cost=cost)

    plain = make(0)
    raw = list(plain.batch_lengths)
    assert len(set(raw)) >= 3  # several bucket lengths to merge
    for cost, kept in [(0.5, set(raw)), (10_000, {max(raw)})]:
        assert set(make(cost).batch_lengths) == kept  # nothing merged / all in one
    for cost in (8, 40):
        data = make(cost)
        buckets = batching.cheapest_buckets(raw, cost)
        assert data.length_buckets == buckets
        assert data.batch_lengths == [min(b for b in buckets if b >= n) for n in raw]
        assert [r.tolist() for r in data.batches] == [r.tolist() for r in plain.batches]
        for _ in range(2):  # this epoch and the next, in a new order
            seen = []
            for i in range(len(data)):
                (batch, labels) = data[i]
                assert batch["padding_mask"].shape[-1] in buckets
                np.testing.assert_array_equal(
                    batch["padding_mask"].sum(-1), x["padding_mask"][labels].sum(-1)
                )
                seen.extend(labels.tolist())
            assert sorted(seen) == list(range(64))
            data.on_epoch_end()
    # a new shape worth 8 columns: the padding it saves decides
    assert len(make(8).length_buckets) > len(make(40).length_buckets) >= 1


def test_fit_pads_rare_lengths_up_only_where_the_step_replays_cuda_graphs(monkeypatch):
    """`fit` merges rare bucket lengths only where torch replays its
    training step as CUDA graphs (forced here; the batching is the same
    code on a CPU): a shape costs `GRAPH_SHAPE_COST` positions, shared by
    the fit's epochs. Elsewhere each batch keeps its own bucket."""
    model = kbert.BertClassifier(backbone(), 3, dropout=0.0)
    model.compile(optimizer=keras.optimizers.SGD(0.05))
    assert batching.training_shape_cost(model, 4, 1) == 0.0  # SGD is not graph-safe: no graphs
    x = {k: v[:, :32] for k, v in _skewed(full=32).items()}
    y = np.zeros(64, "int32")

    def lengths_of_fit():
        shapes = _fit_shapes(model, x, y, batch_size=4, epochs=1, verbose=0, bucket_lengths=16)
        return [shape[-1] for shape in shapes]

    lengths = lengths_of_fit()
    if keras.backend.backend() == "tensorflow":
        assert set(lengths) == {None}  # one trace of unknown length serves every bucket
        return
    assert set(lengths) == {16, 32}
    if keras.backend.backend() != "torch":
        return
    from kbert.backend import torch_step

    monkeypatch.setattr(torch_step, "graphs_training", lambda model: True)
    cost = batching.GRAPH_SHAPE_COST
    assert batching.training_shape_cost(model, 4, 2) == cost / 4 / 2
    assert set(lengths_of_fit()) == {32}  # 16 columns x 16 batches < one more graph
    monkeypatch.setattr(batching, "GRAPH_SHAPE_COST", 4 * 15)  # a shape worth 15 columns
    assert set(lengths_of_fit()) == {16, 32}


def test_jax_on_an_accelerator_fits_one_shape(monkeypatch):
    """Where a new shape recompiles the step for no faster steps (JAX on a
    GPU or TPU), `fit` and `evaluate` cut every batch to one length: the
    longest sequence of the data rounded up to 16. Forced here on any
    backend; the rule is the same code on each."""
    monkeypatch.setattr(batching, "jax_on_accelerator", lambda: True)
    model, x, y, _ = task("classifier")
    assert 16 < x["padding_mask"].sum(-1).max() <= 32
    assert batching.training_multiple(model, x) == 32  # rounded up to 16
    short = {k: v[:, :24].copy() for k, v in x.items()}  # inputs padded to 24
    short["padding_mask"][:, 20:] = 0
    assert batching.training_multiple(model, short) == 24  # 20 -> 32, at most 24
    short["padding_mask"][:, 16:] = 0
    assert batching.training_multiple(model, short) == 16
    model.compile(optimizer=keras.optimizers.SGD(0.05))
    lengths = [shape[-1] for shape in _fit_shapes(model, short, y, batch_size=4, verbose=0)]
    assert set(lengths) <= {16, None}  # None: one TF trace of unknown length
    # tf.data batches and predict_on_batch there: buckets of 64 (fewer compilations)
    assert batching.default_multiple(model) == batching.ACCELERATOR_MULTIPLE == 64
    # predict on host arrays, its programs compiled ahead: buckets of 32
    assert batching.predict_multiple(model) == batching.ACCELERATOR_PREDICT_MULTIPLE == 32
    monkeypatch.setattr(batching, "jax_on_accelerator", lambda: False)
    assert batching.training_multiple(model, short) == batching.default_multiple(model)
    assert batching.default_multiple(model) in (1, batching.MULTIPLE)
    assert batching.predict_multiple(model) == batching.default_multiple(model)


def test_default_multiple_follows_what_a_new_length_costs():
    """Buckets of 16 where each new length is compiled or captured (JAX,
    TensorFlow with XLA, torch on a GPU or under torch.compile); on eager
    torch and on TensorFlow without XLA on a CPU each batch is cut to its
    longest sequence."""
    model, x, _, _ = task("classifier")
    name = keras.backend.backend()
    eager_cpu = (name == "torch" and not _cuda()) or (
        name == "tensorflow" and not model.jit_compile
    )
    assert batching.default_multiple(model) == (1 if eager_cpu else batching.MULTIPLE)
    if name in ("torch", "tensorflow"):
        model.compile(optimizer="sgd", jit_compile=True)
        assert batching.default_multiple(model) == batching.MULTIPLE
    # predict_on_batch pads a batch to the default bucket and slices it back
    cut = {k: v[:4, :11].copy() for k, v in x.items()}
    cut["padding_mask"][:, :3] = 1  # every row keeps a real token
    model.compile(optimizer="sgd")
    out = model.predict_on_batch(cut)
    full = {k: np.pad(v, ((0, 0), (0, T - 11))) for k, v in cut.items()}
    np.testing.assert_allclose(out, keras.Model.predict_on_batch(model, full), atol=1e-5)


def _cuda():
    if keras.backend.backend() != "torch":
        return False
    import torch

    return torch.cuda.is_available()


@contextlib.contextmanager
def step_compiles():
    """Within the block, the list of the threads that finish an XLA
    compilation of a Keras step (one name per compilation)."""
    import logging
    import threading

    import jax

    compiles = []

    class Steps(logging.Handler):
        def emit(self, record):
            text = record.getMessage()
            if text.startswith("Finished XLA compilation") and "_step)" in text:
                compiles.append(threading.current_thread().name)

    handler, logger = Steps(), logging.getLogger("jax")
    logger.addHandler(handler)
    jax.config.update("jax_log_compiles", True)
    try:
        yield compiles
    finally:
        jax.config.update("jax_log_compiles", False)
        logger.removeHandler(handler)


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX compiles per batch shape")
def test_jax_compiles_the_shapes_of_a_fit_ahead(monkeypatch):
    """On a GPU or TPU (forced here on the CPU), a JAX `fit` compiles every
    shape of its training and validation batches in background threads when
    it starts. The steps then run those executables: Keras compiles none of
    them again, and the training is the same as without."""
    from kbert.backend import jax_compile

    monkeypatch.setattr(batching, "packing_pays", lambda batches: False)  # as on a GPU
    histories, counts = [], []
    with step_compiles() as compiles:
        for ahead in (False, True):
            monkeypatch.setattr(jax_compile, "enabled", lambda ahead=ahead: ahead)
            model, x, y, _ = task("classifier")
            model.compile(optimizer=keras.optimizers.SGD(0.05))
            train = {k: v[:10] for k, v in x.items()}
            held_out = ({k: v[10:] for k, v in x.items()}, y[10:])
            compiles.clear()
            history = model.fit(
                train,
                y[:10],
                validation_data=held_out,
                batch_size=4,
                epochs=2,
                verbose=0,
                bucket_lengths=T,  # shapes (4, T), (2, T); validation (2, T)
            )
            histories.append(history.history)
            counts.append(list(compiles))
        # A later fit reuses Keras' jitted steps and their programs: nothing
        # compiles again; after `compile` (new steps) the shapes compile ahead.
        for recompile in (False, True):
            if recompile:
                model.compile(optimizer=keras.optimizers.SGD(0.05))
            compiles.clear()
            model.fit(
                train, y[:10], validation_data=held_out, batch_size=4, verbose=0, bucket_lengths=T
            )
            counts.append(list(compiles))
        # Weights change the training batches' structure: new programs for
        # the two training shapes, compiled ahead; validation is unchanged.
        compiles.clear()
        weights = np.ones(10, "float32")
        model.fit(
            train,
            y[:10],
            sample_weight=weights,
            validation_data=held_out,
            batch_size=4,
            verbose=0,
            bucket_lengths=T,
        )
        counts.append(list(compiles))
    assert counts[0] == ["MainThread"] * 3  # two training steps, one validation step
    for ahead in counts[1], counts[3]:
        assert len(ahead) == 3 and all(name.startswith("kbert-compile") for name in ahead)
    assert counts[2] == []
    assert len(counts[4]) == 2 and all(name.startswith("kbert-compile") for name in counts[4])
    for key in histories[0]:
        np.testing.assert_allclose(histories[1][key], histories[0][key], rtol=1e-6)


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX compiles per batch shape")
def test_jax_compiles_ahead_only_for_a_jitted_step_and_callbacks_in_a_list(monkeypatch):
    """No compilation ahead where Keras does not jit the step itself
    (`jit_compile=False`) or where callbacks come as a `CallbackList` (used
    as given); a single callback or a list gets the compiler added. The
    state the compiler traces with is Keras' (`_get_jax_state`)."""
    from kbert.backend import jax_compile, keras_internals

    monkeypatch.setattr(jax_compile, "enabled", lambda: True)
    model, x, y, _ = task("classifier")
    model.compile(optimizer=keras.optimizers.SGD(0.05))
    history = keras.callbacks.History()
    assert jax_compile.applies(model, None) and jax_compile.applies(model, [history])
    assert jax_compile.with_callback(history, "c") == [history, "c"]
    assert jax_compile.with_callback(None, "c") == ["c"]
    assert not jax_compile.applies(model, keras.callbacks.CallbackList([history]))
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    train = keras_internals.jax_step_state(model, "train")
    test = keras_internals.jax_step_state(model, "test")
    assert len(train) == 4 and len(test) == 3
    assert len(train[0]) == len(model.trainable_variables)
    model.compile(optimizer=keras.optimizers.SGD(0.05), jit_compile=False)
    assert not jax_compile.applies(model, None)


def test_the_number_of_batches_a_call_runs_where_it_is_known():
    """What the autotuning choice counts: given steps, a PyDataset's
    batches, arrays (dicts, tuples) in batches of batch_size; None for a
    generator or a dataset without a length."""
    from kbert.training.pipeline import _steps

    x = inputs()
    assert _steps(x, 4) == -(-N // 4)
    assert _steps(x, None) == -(-N // 32)
    assert _steps((x["token_ids"], x["segment_ids"]), 5) == -(-N // 5)
    assert _steps(x, 4, steps=7) == 7
    batches = batching.BucketedBatches(x, np.arange(N), batch_size=5)
    assert _steps(batches, None) == len(batches)
    assert _steps(iter([x]), 4) is None


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="XLA compiler options")
def test_jax_short_runs_on_a_gpu_compile_without_autotuning(monkeypatch):
    """On a GPU, step programs of a call of fewer than AUTOTUNE_MIN_STEPS
    batches compile without XLA's GEMM autotuning ("auto"); longer calls,
    calls of unknown length and other platforms keep XLA's defaults;
    `compile(autotune=...)` forces either."""
    import types

    import jax

    from kbert.backend import jax_compile

    model, _, _, _ = task("classifier")
    fast = jax_compile.FAST_COMPILE_OPTIONS
    few, many = 100, jax_compile.AUTOTUNE_MIN_STEPS
    for platform in ("gpu", "cpu"):
        device = types.SimpleNamespace(platform=platform)
        monkeypatch.setattr(jax, "devices", lambda device=device: [device])
        on_gpu = platform == "gpu"
        model.compile(optimizer=keras.optimizers.SGD(0.05))
        assert jax_compile.step_options(model, few) == (fast if on_gpu else None)
        assert jax_compile.step_options(model, many) is None
        assert jax_compile.step_options(model, None) is None
        model.compile(optimizer=keras.optimizers.SGD(0.05), autotune=False)
        assert jax_compile.step_options(model, many) == (fast if on_gpu else None)
        assert jax_compile.step_options(model, None) == (fast if on_gpu else None)
        model.compile(optimizer=keras.optimizers.SGD(0.05), autotune=True)
        assert jax_compile.step_options(model, few) is None
    with pytest.raises(ValueError, match="autotune must be"):
        model.compile(autotune="never")


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="XLA compiler options")
def test_jax_steps_and_their_ahead_compiled_programs_take_the_planned_options(
    monkeypatch, tmp_path
):
    """The compiler options planned for a call (forced here on the CPU, with
    an option whose effect shows: a dump directory) reach XLA for the
    training, validation and predict steps, and the programs compiled
    ahead carry them too: the steps run those (Keras compiles none on the
    main thread). The numbers are those of a `fit` without options. A step
    Keras has made keeps its options and programs."""
    import os

    from kbert.backend import jax_compile, keras_internals

    dump = tmp_path / "xla"
    monkeypatch.setattr(jax_compile, "enabled", lambda: True)
    monkeypatch.setattr(batching, "packing_pays", lambda batches: False)
    histories = []
    with step_compiles() as compiles:
        for options in (None, {"xla_dump_to": str(dump)}):
            # the options of calls of 3 steps or more: fit's (3 training
            # steps), not its validation's alone (2 batches)

            def step_options(model, steps, o=options):
                return o if steps is not None and steps >= 3 else None

            monkeypatch.setattr(jax_compile, "step_options", step_options)
            model, x, y, _ = task("classifier")
            model.compile(optimizer=keras.optimizers.SGD(0.05))
            train = {k: v[:10] for k, v in x.items()}
            held_out = ({k: v[10:] for k, v in x.items()}, y[10:])
            compiles.clear()
            history = model.fit(
                train, y[:10], validation_data=held_out, batch_size=4, verbose=0, bucket_lengths=T
            )
            histories.append(history.history)
        assert len(compiles) == 3 and all(name.startswith("kbert-compile") for name in compiles)
        assert keras_internals.step_compiler_options(model, "train") == {"xla_dump_to": str(dump)}
        model.predict(train, batch_size=4)
    files = os.listdir(dump)
    for step in ("train_step", "test_step", "predict_step"):
        assert any(step in name for name in files), step
    for key in histories[0]:
        np.testing.assert_allclose(histories[1][key], histories[0][key], rtol=1e-6)
    # a made step keeps its options; `compile` (new steps) forgets them,
    # and a step made without a plan gets those of an unknown length
    keras_internals.plan_step_compiler_options(model, "train", None)
    assert keras_internals.step_compiler_options(model, "train") == {"xla_dump_to": str(dump)}
    model.compile(optimizer=keras.optimizers.SGD(0.05), autotune="".join(["au", "to"]))
    assert model.autotune == "auto"
    assert not keras_internals.step_compiler_options_planned(model, "train")
    model.train_on_batch(train, y[:10])
    assert keras_internals.step_compiler_options_planned(model, "train")
    assert keras_internals.step_compiler_options(model, "train") is None


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="tf.data datasets")
def test_tensorflow_batches_run_without_autotuning():
    """tf.data's autotuning thread held the end of a `fit`: the iterator's
    destructor waited for its sleep to end. The batches themselves are the
    PyDataset's."""
    batches = batching.BucketedBatches(inputs(), np.arange(N), batch_size=5)
    dataset = batches.as_dataset()
    assert dataset.options().autotune.enabled is False
    for (x, y), (want_x, want_y) in zip(dataset, [batches[i] for i in range(len(batches))]):
        np.testing.assert_array_equal(y.numpy(), want_y)
        np.testing.assert_array_equal(x["token_ids"].numpy(), want_x["token_ids"])


def looping_task(share_layers=False):
    """A classifier with dropout on (the loop must advance each block's
    dropout generator as the blocks do), its batches and labels."""
    keras.utils.set_random_seed(0)
    backbone = kbert.BertBackbone(
        vocabulary_size=100,
        num_layers=3,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=16,
        share_layers=share_layers,
    )
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 17, 24)
    x = {
        "token_ids": rng.integers(3, 100, (24, 16)).astype("int32"),
        "segment_ids": np.zeros((24, 16), "int32"),
        "padding_mask": (np.arange(16)[None] < lengths[:, None]).astype("int32"),
    }
    return kbert.BertClassifier(backbone, num_classes=2), x, rng.integers(0, 2, 24)


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="a lax.scan over the blocks")
def test_jax_step_with_the_blocks_in_a_loop_is_the_same_step():
    """Traced with `layers_in_loop()`, the backbone runs its blocks as one
    `lax.scan` (a while loop in the program), and the training step is the
    same: losses, weights, optimizer and dropout-generator states."""
    import jax

    from kbert.backend import jax_compile, keras_internals

    model, x, y = looping_task()
    model.compile(optimizer="adam")
    data = ({k: v[:8] for k, v in x.items()}, y[:8])
    model.train_on_batch(*data)  # builds the optimizer and metrics
    state = keras_internals.jax_step_state(model)

    def loop(state, data):
        return model.train_step(state, data)

    with jax_compile._tracing_layers_in_loop():
        looped = jax.jit(loop).lower(state, data).compile()
    unrolled = jax.jit(model.train_step).lower(state, data).compile()
    loops = [program.as_text().count(" while(") for program in (looped, unrolled)]
    assert loops[0] == loops[1] + 2  # the blocks' forward and backward (+ the head dropout's)
    (logs, after), (want_logs, want) = looped(state, data), unrolled(state, data)
    np.testing.assert_allclose(float(logs["loss"]), float(want_logs["loss"]), rtol=1e-6)
    leaves, want_leaves = jax.tree_util.tree_leaves(after), jax.tree_util.tree_leaves(want)
    assert len(leaves) == len(want_leaves)
    for got, value in zip(leaves, want_leaves):
        np.testing.assert_allclose(np.asarray(got), np.asarray(value), rtol=1e-5, atol=1e-6)
    seeds = [v for v in model.non_trainable_variables if "seed" in v.path]
    assert seeds  # the dropout generators are in the state compared above


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX compiles per batch shape")
@pytest.mark.parametrize("case", ["blocks", "shared", "packed"])
def test_jax_fit_runs_its_first_steps_on_the_loop_program(monkeypatch, request, case):
    """With the step compiled ahead and without autotuning (as for a short
    run on a GPU; forced here), the steps run the program with the blocks
    in a loop until the step's own program is compiled (held here until
    step K), then that one; the training is the same as without. A second
    `fit` compiles nothing. Shared layers have no blocks to stack, and rows
    packing several examples do not run the backbone's call: no loop."""
    from concurrent.futures import wait as wait_futures

    from kbert.backend import jax_compile

    K = 3
    monkeypatch.setattr(jax_compile, "enabled", lambda: True)
    monkeypatch.setattr(jax_compile, "OWN_PROGRAM_MIN_STEPS", 0)  # every shape gets its own
    monkeypatch.setattr(batching, "packing_pays", lambda batches: case == "packed")
    monkeypatch.setattr(
        jax_compile, "step_options", lambda model, steps: {"xla_gpu_autotune_level": 0}
    )
    release = _hold_own_programs(monkeypatch, request, jax_compile)

    class Release(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            programs = jax_compile._first_programs(self.model)
            if batch == K and programs is not None:
                release.set()
                own = [entry[1] for entry in programs.programs.values()]
                assert own and all(f.done() for f in wait_futures(own, timeout=60).done)

    weights, runs = [], []
    with step_compiles() as compiles:
        for first in (False, True):
            monkeypatch.setattr(jax_compile, "FIRST_PROGRAMS", first)
            release.clear()
            if not first or case != "blocks":
                release.set()  # no loop program: the steps wait for their own
            model, x, y = looping_task(share_layers=case == "shared")
            model.compile(optimizer=keras.optimizers.SGD(0.05))
            kwargs = dict(batch_size=4, verbose=0, bucket_lengths=16)
            if case == "packed":
                kwargs["pack_rows"] = True
            model.fit(x, y, epochs=2, callbacks=[Release()], **kwargs)
            runs.append(jax_compile.first_program_steps(model))
            compiles.clear()
            model.fit(x, y, **kwargs)  # the programs of the first fit
            assert compiles == [], compiles
            weights.append([np.asarray(v) for v in model.trainable_variables])
    assert runs[0] is None
    assert runs[1] == {"blocks": K, "shared": None, "packed": 0}[case]
    for got, want in zip(*weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX compiles per batch shape")
def test_jax_ahead_compiled_fit_leaves_the_step_state_to_keras(monkeypatch):
    """The ahead compiler, before every step and in its compiling threads,
    uses the model without writing the step state into its variables
    (Keras' `Callback.model` does that on JAX: a write of every variable
    at each step, and from a compiling thread a state the running step
    then donates). Keras writes it once per epoch."""
    from kbert.backend import jax_compile

    monkeypatch.setattr(jax_compile, "enabled", lambda: True)
    monkeypatch.setattr(batching, "packing_pays", lambda batches: False)
    monkeypatch.setattr(
        jax_compile, "step_options", lambda model, steps: {"xla_gpu_autotune_level": 0}
    )
    model, x, y = looping_task()
    model.compile(optimizer=keras.optimizers.SGD(0.05))
    writes = harness.count_state_writes(model)
    model.fit(x, y, epochs=2, batch_size=4, verbose=0, bucket_lengths=16)
    assert jax_compile.compile_log(model)  # the ahead compiler ran
    assert len(writes) == 2  # Keras' own, at the end of each of the 2 epochs (12 steps)


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX compiles per batch shape")
def test_jax_fit_returns_before_unneeded_programs_compile(monkeypatch):
    """A short fit whose steps all ran on the loop program returns while
    its steps' own program is still compiling (that compile finishes in the
    background); the weights are those of a fit on the step's programs."""
    import threading

    from kbert.backend import jax_compile

    monkeypatch.setattr(jax_compile, "enabled", lambda: True)
    monkeypatch.setattr(batching, "packing_pays", lambda batches: False)
    monkeypatch.setattr(
        jax_compile, "step_options", lambda model, steps: {"xla_gpu_autotune_level": 0}
    )
    monkeypatch.setattr(jax_compile, "OWN_PROGRAM_MIN_STEPS", 0)
    release, compiling, compiled = threading.Event(), threading.Event(), threading.Event()
    compile_program = jax_compile._compile

    def slow_own_programs(lowered, loop=False):
        if loop:
            return compile_program(lowered, loop)
        compiling.set()  # the step's own programs compile until released
        release.wait(30)
        program = compile_program(lowered, loop)
        compiled.set()
        return program

    weights = []
    for first in (False, True):
        monkeypatch.setattr(jax_compile, "FIRST_PROGRAMS", first)
        monkeypatch.setattr(
            jax_compile, "_compile", slow_own_programs if first else compile_program
        )
        model, x, y = looping_task()
        model.compile(optimizer=keras.optimizers.SGD(0.05))
        model.fit(x, y, batch_size=8, verbose=0, bucket_lengths=16)
        weights.append([np.asarray(v) for v in model.trainable_variables])
    try:
        assert compiling.is_set() and not compiled.is_set()  # fit returned meanwhile
        assert jax_compile.first_program_steps(model) == 3  # every step on the loop program
    finally:
        release.set()
    # a later fit does not compile on the main thread: its steps run on that
    # program, or on a new loop program while it still compiles
    with step_compiles() as compiles:
        model.fit(x, y, batch_size=8, verbose=0, bucket_lengths=16)
    assert "MainThread" not in compiles and 3 <= jax_compile.first_program_steps(model) <= 6
    for got, want in zip(*weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def _hold_own_programs(monkeypatch, request, jax_compile):
    """The step's own programs compile only once the returned event is
    set (loop programs at once); set at the test's end in any case."""
    import threading

    release = threading.Event()
    request.addfinalizer(release.set)  # no worker left waiting if the test fails
    compile_program = jax_compile._compile

    def held_own_programs(lowered, loop=False):
        if not loop:
            release.wait(60)
        return compile_program(lowered, loop)

    monkeypatch.setattr(jax_compile, "_compile", held_own_programs)
    return release


def _fast_looping_fit(monkeypatch):
    from kbert.backend import jax_compile

    monkeypatch.setattr(jax_compile, "enabled", lambda: True)
    monkeypatch.setattr(batching, "packing_pays", lambda batches: False)
    monkeypatch.setattr(
        jax_compile, "step_options", lambda model, steps: {"xla_gpu_autotune_level": 0}
    )
    return jax_compile


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX compiles per batch shape")
def test_jax_short_fit_runs_every_shape_on_loop_programs(monkeypatch):
    """A fit of fewer than `OWN_PROGRAM_MIN_STEPS` steps of each shape
    compiles loop programs only: one per shape, the last partial batch's
    too (traced after the update's and the first batch's), and runs every step on them; a
    second fit compiles nothing. The training is that of Keras' step."""
    jax_compile = _fast_looping_fit(monkeypatch)
    weights = []
    for first in (False, True):
        monkeypatch.setattr(jax_compile, "FIRST_PROGRAMS", first)
        model, x, y = looping_task()  # 24 examples: 4 batches of 5 and one of 4
        model.compile(optimizer=keras.optimizers.SGD(0.05))
        with step_compiles() as compiles:
            model.fit(x, y, batch_size=5, epochs=2, verbose=0, bucket_lengths=16)
            if first:
                log = sorted(jax_compile.compile_log(model), key=lambda e: e["trace_begin"])
                assert [(e["shape"], e["loop"]) for e in log] == [
                    ([], True),  # the update program the loop programs share
                    ([5, 16], True),
                    ([4, 16], True),
                ]
                assert jax_compile.first_program_steps(model) == 10
                model.fit(x, y, batch_size=5, verbose=0, bucket_lengths=16)
                assert len(jax_compile.compile_log(model)) == 3
                assert jax_compile.first_program_steps(model) == 15
                model.fit(x, y, batch_size=5, verbose=0, bucket_lengths=16)
                assert compiles == []  # Keras' step compiled nothing, ahead or not
            else:
                model.fit(x, y, batch_size=5, verbose=0, bucket_lengths=16)
                model.fit(x, y, batch_size=5, verbose=0, bucket_lengths=16)
        weights.append([np.asarray(v) for v in model.trainable_variables])
    for got, want in zip(*weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX compiles per batch shape")
def test_jax_long_fit_compiles_its_main_shape_once_the_first_loop_program_has(monkeypatch):
    """A shape a fit runs `OWN_PROGRAM_MIN_STEPS` steps of (the full
    batches here) also gets the step's own program, traced after the loop
    programs and compiled once the first batch's loop program has (the
    program the first step waits for); the partial batch keeps its loop
    program."""
    jax_compile = _fast_looping_fit(monkeypatch)
    monkeypatch.setattr(jax_compile, "OWN_PROGRAM_MIN_STEPS", 8)
    model, x, y = looping_task()
    model.compile(optimizer=keras.optimizers.SGD(0.05))
    model.fit(x, y, batch_size=5, epochs=2, verbose=0, bucket_lengths=16)  # 8 full batches
    for loop, own in jax_compile._first_programs(model).programs.values():
        assert (loop is None) != (own is None)  # the own program, else the loop one, kept
        (own or loop).result(timeout=60)  # compiled (after the fit, if it was short)
    log = sorted(jax_compile.compile_log(model), key=lambda e: e["trace_begin"])
    assert [(e["shape"], e["loop"]) for e in log] == [
        ([], True),
        ([5, 16], True),
        ([4, 16], True),
        ([5, 16], False),
    ]
    update, lead, own = log[0], log[1], log[3]
    for first in (lead, update):  # the first step's programs compiled first
        assert own["compile_begin"] >= first["compile_begin"] + first["compile_seconds"]


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX compiles per batch shape")
def test_jax_short_fit_of_a_long_schedule_compiles_the_own_program_of_its_main_shape(monkeypatch):
    """A short fit that is a piece of a longer run (the optimizer's schedule
    runs 100 steps; the fit 5, as `fit_resumable`'s checkpoint-sized fits)
    counts each shape's steps over the run: the full batches (4 of 5) get
    their own program, the partial batch keeps its loop program."""
    jax_compile = _fast_looping_fit(monkeypatch)
    monkeypatch.setattr(jax_compile, "OWN_PROGRAM_MIN_STEPS", 50)
    model, x, y = looping_task()
    schedule = keras.optimizers.schedules.PolynomialDecay(0.05, 100)
    model.compile(optimizer=keras.optimizers.SGD(schedule))
    model.fit(x, y, batch_size=5, epochs=1, verbose=0, bucket_lengths=16)
    for loop, own in jax_compile._first_programs(model).programs.values():
        (own or loop).result(timeout=60)
    log = jax_compile.compile_log(model)
    assert sorted((e["shape"], e["loop"]) for e in log) == [
        ([], True),
        ([4, 16], True),
        ([5, 16], False),
        ([5, 16], True),
    ]


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX compiles per batch shape")
def test_jax_traces_switch_threads_often_and_leave_the_interval_as_it_was(monkeypatch):
    """While the ahead compiler traces, Python switches threads every
    `TRACE_SWITCH_INTERVAL` (the loop's thread waits less for the GIL);
    after the fit the interval is the caller's again."""
    import sys

    jax_compile = _fast_looping_fit(monkeypatch)
    seen = []
    loop_trace = jax_compile.AheadCompiler._loop_trace

    def recording(self, spec):
        trace = loop_trace(self, spec)

        def traced():
            seen.append(sys.getswitchinterval())
            return trace()

        return traced

    monkeypatch.setattr(jax_compile.AheadCompiler, "_loop_trace", recording)
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.004)
        model, x, y = looping_task()
        model.compile(optimizer=keras.optimizers.SGD(0.05))
        model.fit(x, y, batch_size=5, verbose=0, bucket_lengths=16)
        assert seen and all(v == pytest.approx(jax_compile.TRACE_SWITCH_INTERVAL) for v in seen)
        assert sys.getswitchinterval() == pytest.approx(0.004)
    finally:
        sys.setswitchinterval(before)


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX compiles per batch shape")
def test_jax_fit_runs_on_a_loop_program_while_an_earlier_fits_own_program_compiles(
    monkeypatch, request
):
    """A fit whose steps all ran on the loop program, its own program still
    compiling, leaves the shape unmarked: the next fit compiles a loop
    program again rather than wait for the own one."""

    jax_compile = _fast_looping_fit(monkeypatch)
    monkeypatch.setattr(jax_compile, "OWN_PROGRAM_MIN_STEPS", 0)
    _hold_own_programs(monkeypatch, request, jax_compile)
    model, x, y = looping_task()
    model.compile(optimizer=keras.optimizers.SGD(0.05))
    model.fit(x, y, batch_size=8, verbose=0, bucket_lengths=16)
    assert jax_compile.first_program_steps(model) == 3
    model.fit(x, y, batch_size=8, verbose=0, bucket_lengths=16)
    assert jax_compile.first_program_steps(model) == 6  # the own program is still held


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX compiles per batch shape")
def test_jax_predict_compiles_its_bucket_programs_ahead(monkeypatch):
    """On an accelerator (forced here), `predict` traces and compiles the
    program of each bucket ahead, in background threads, and runs the
    batches on them: Keras compiles none on the main thread, the outputs
    are those of a plain predict, and a second predict compiles nothing."""
    model, x, _ = looping_task()
    want = model.predict(x, batch_size=5, verbose=0, bucket_lengths=4)  # a plain predict
    assert state_of(model).ahead_predict is None
    jax_compile = _fast_looping_fit(monkeypatch)
    model, x, _ = looping_task()
    with step_compiles() as compiles:
        got = model.predict(x, batch_size=5, verbose=0, bucket_lengths=4)
        programs = state_of(model).ahead_predict.programs
        assert len(programs) >= 3  # several bucket lengths and a partial batch
        for _, own in programs.values():  # compiling on after the batches ran on loop programs
            own.result(timeout=60)
        deadline = time.monotonic() + 60
        logged = jax_compile.compile_log  # the loop programs are logged too
        while len([e for e in logged(model) if e["kind"] == "predict"]) < 2 * len(programs):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert compiles and all(name.startswith("kbert-compile") for name in compiles)
        logged = [e for e in jax_compile.compile_log(model) if e["kind"] == "predict"]
        # each bucket's program and its loop program, logged with its batch's (rows, length)
        for loop in (False, True):
            shapes = sorted(tuple(e["shape"]) for e in logged if e["loop"] == loop)
            assert shapes == sorted(k[1][0][0] for k in programs)
        compiles.clear()
        again = model.predict(x, batch_size=5, verbose=0, bucket_lengths=4)
        assert compiles == []
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(again, want, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX compiles per batch shape")
def test_jax_predict_runs_its_first_batches_on_loop_programs(monkeypatch, request):
    """While a shape's own predict program compiles (held here), its
    batches run on the program with the blocks in a loop, compiled
    first, with the same outputs; once the own programs are compiled, a
    second predict runs on them. Without first programs no loop program
    is made."""

    model, x, _ = looping_task()
    want = model.predict(x, batch_size=5, verbose=0, bucket_lengths=4)  # a plain predict
    jax_compile = _fast_looping_fit(monkeypatch)
    release = _hold_own_programs(monkeypatch, request, jax_compile)
    model, x, _ = looping_task()
    with step_compiles() as compiles:
        got = model.predict(x, batch_size=5, verbose=0, bucket_lengths=4)
        batches = jax_compile.predict_loop_batches(model)
        assert batches == 5  # every batch (24 rows in batches of 5), on a loop program
        programs = state_of(model).ahead_predict.programs
        assert all(loop is not None and not own.done() for loop, own in programs.values())
        assert len(compiles) == len(programs)  # the loop programs, in the compiling threads
        release.set()
        for _, own in programs.values():
            own.result(timeout=60)
        again = model.predict(x, batch_size=5, verbose=0, bucket_lengths=4)
        assert jax_compile.predict_loop_batches(model) == batches  # on the own programs
        assert all(loop is None for loop, _ in programs.values())
        assert "MainThread" not in compiles
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(again, want, rtol=1e-5, atol=1e-6)

    monkeypatch.setattr(jax_compile, "FIRST_PROGRAMS", False)
    model, x, _ = looping_task()
    np.testing.assert_allclose(
        model.predict(x, batch_size=5, verbose=0, bucket_lengths=4), want, rtol=1e-5, atol=1e-6
    )
    assert jax_compile.predict_loop_batches(model) == 0
    assert all(loop is None for loop, _ in state_of(model).ahead_predict.programs.values())


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="JAX compiles per batch shape")
@pytest.mark.parametrize("failing", ["loop", "own"])
def test_jax_predict_runs_on_the_program_that_compiled(monkeypatch, failing):
    """A loop program that fails to compile leaves the batches to the own
    program, and an own program that fails to the loop program: the same
    outputs either way."""
    model, x, _ = looping_task()
    want = model.predict(x, batch_size=5, verbose=0, bucket_lengths=4)  # a plain predict
    jax_compile = _fast_looping_fit(monkeypatch)
    compile_program = jax_compile._compile

    def failing_compile(lowered, loop=False):
        if loop == (failing == "loop"):
            raise RuntimeError("no program")
        return compile_program(lowered, loop)

    monkeypatch.setattr(jax_compile, "_compile", failing_compile)
    model, x, _ = looping_task()
    for _ in range(2):
        got = model.predict(x, batch_size=5, verbose=0, bucket_lengths=4)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert jax_compile.predict_loop_batches(model) == (0 if failing == "loop" else 10)


def test_buckets_cut_the_inputs_a_model_declares_token_aligned():
    """Length buckets cut the inputs the model names in `token_inputs()`
    (the backbone's three for kbert's tasks), and leave the others whole."""
    mask = (np.arange(32)[None] < np.array([[5], [9], [3], [7]])).astype("int32")
    x = {
        "token_ids": mask * 7,
        "segment_ids": 0 * mask,
        "padding_mask": mask,
        "word_starts": mask.copy(),  # token-aligned, for a model that declares it
    }
    plain = batching.BucketedBatches(x, batch_size=4, multiple=16)
    declared = batching.BucketedBatches(
        x, batch_size=4, multiple=16, token_inputs=(*batching.TOKEN_INPUTS, "word_starts")
    )
    assert plain[0][0]["token_ids"].shape == (4, 16) == declared[0][0]["word_starts"].shape
    assert plain[0][0]["word_starts"].shape == (4, 32)
    model = kbert.BertClassifier(kbert.BertBackbone(20, 1, 2, 8, 16), num_classes=2)
    assert model.token_inputs() == ("token_ids", "segment_ids", "padding_mask")
