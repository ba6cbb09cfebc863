import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import kbert
from kbert.models.progressive import LayerTransfer
from kbert.training import (
    NonFiniteLossError,
    WarmupLinearDecay,
    create_optimizer,
    fit_resumable,
    latest_checkpoint,
)
from tests import harness
from tests.harness import TINY
from tests.models.test_pretrainer import batch


def test_schedule_matches_the_original():
    schedule = WarmupLinearDecay(1e-3, total_steps=100, warmup_steps=10)
    values = [float(keras.ops.convert_to_numpy(schedule(s))) for s in (0, 5, 10, 50, 100, 150)]
    np.testing.assert_allclose(values, [0.0, 5e-4, 9e-4, 5e-4, 0.0, 0.0], atol=1e-9)


def test_schedule_from_peak_matches_transformers_linear_warmup():
    """transformers' `get_linear_schedule_with_warmup`: warm-up to the peak,
    then a line from the peak to 0 at the last step."""
    total, warmup, peak = 100, 10, 1e-3
    schedule = WarmupLinearDecay(peak, total_steps=total, warmup_steps=warmup, from_peak=True)
    steps = (0, 5, 10, 55, 99, 100, 150)
    expected = [
        peak * (s / warmup if s < warmup else max(0.0, (total - s) / (total - warmup)))
        for s in steps
    ]
    values = [float(keras.ops.convert_to_numpy(schedule(s))) for s in steps]
    np.testing.assert_allclose(values, expected, atol=1e-9)
    assert WarmupLinearDecay.from_config(schedule.get_config()).from_peak
    with pytest.raises(ValueError, match="from_peak needs warmup_steps"):
        WarmupLinearDecay(peak, total_steps=10, warmup_steps=10, from_peak=True)


def _decayed_after_compile(optimizer):
    """{variable path: whether `optimizer`, given to a classifier's
    `compile`, decays it} for one kernel, one bias and one LayerNorm scale."""
    classifier = kbert.BertClassifier(kbert.BertBackbone(**TINY), 2)
    classifier.compile(optimizer=optimizer)
    picked = {}
    for v in classifier.trainable_variables:
        kind = v.name if v.name in ("kernel", "bias", "gamma") else None
        if kind and kind not in picked:
            picked[kind] = v
    inner = classifier.optimizer
    return {kind: bool(inner._use_weight_decay(v)) for kind, v in picked.items()}


def test_compile_keeps_the_callers_weight_decay_exclusions():
    """`compile` pins an optimizer's own exclusions to the model's variables;
    it adds none to an optimizer that has none (transformers' recipe decays
    every weight) and does not replace the caller's with kbert's."""
    assert _decayed_after_compile("adamw") == {"kernel": True, "bias": False, "gamma": False}
    everything = keras.optimizers.AdamW(1e-4, weight_decay=0.01)
    assert _decayed_after_compile(everything) == {"kernel": True, "bias": True, "gamma": True}
    own = keras.optimizers.AdamW(1e-4, weight_decay=0.01)
    own.exclude_from_weight_decay(var_names=["kernel"])
    assert _decayed_after_compile(own) == {"kernel": False, "bias": True, "gamma": True}
    recipe = create_optimizer(1e-4, 100, 10, epsilon=1e-8, no_decay=(), from_peak=True)
    assert _decayed_after_compile(recipe) == {"kernel": True, "bias": True, "gamma": True}
    assert _decayed_after_compile(create_optimizer(1e-4, 100, 10)) == {
        "kernel": True,
        "bias": False,
        "gamma": False,
    }


def test_compile_epsilon_default_per_task_and_checked():
    """`compile`'s Adam epsilon: the task's `adam_epsilon` (the original
    BERT's 1e-6; 1e-8 where new weights get tiny gradients), or the
    caller's; an optimizer of the caller's keeps its own."""
    backbone = kbert.BertBackbone(**TINY)
    classifier = kbert.BertClassifier(backbone, 2)
    classifier.compile()
    assert classifier.optimizer.epsilon == 1e-6
    classifier.compile(optimizer="lamb", epsilon=1e-7)
    assert classifier.optimizer.epsilon == 1e-7
    for architecture, epsilon in (("bert2bert", 1e-8), ("unilm", 1e-6)):
        seq2seq = kbert.BertSeq2SeqLM(
            kbert.BertBackbone(**TINY), start_token_id=2, end_token_id=3, architecture=architecture
        )
        seq2seq.compile()
        assert seq2seq.optimizer.epsilon == epsilon  # new cross-attention: 1e-8
    stage = LayerTransfer(
        kbert.BertBackbone(100, 2, 2, 16, 32, max_sequence_length=16),
        kbert.MobileBertBackbone(
            100, 2, 2, 16, 16, max_sequence_length=16, embedding_dim=8, bottleneck_dim=8
        ),
        block=1,
        teacher_block=1,
    )
    stage.compile()
    assert stage.optimizer.epsilon == 1e-8
    with pytest.raises(ValueError, match="give your optimizer its own epsilon"):
        classifier.compile(optimizer=keras.optimizers.Adam(), epsilon=1e-8)
    for bad in (0, -1e-8, float("nan"), "1e-8", True):
        with pytest.raises(ValueError, match="epsilon must be a positive number"):
            classifier.compile(epsilon=bad)


def test_weight_decay_skips_layer_norm_and_bias():
    optimizer = create_optimizer(
        learning_rate=0.1, num_train_steps=10, num_warmup_steps=0, weight_decay=0.5, clipnorm=None
    )
    kernel = keras.Variable(np.ones((2, 2), "float32"), name="kernel")
    bias = keras.Variable(np.ones((2,), "float32"), name="bias")
    gamma = keras.Variable(np.ones((2,), "float32"), name="gamma")
    optimizer.build([kernel, bias, gamma])
    zeros = [keras.ops.zeros((2, 2)), keras.ops.zeros((2,)), keras.ops.zeros((2,))]
    optimizer.apply(zeros, [kernel, bias, gamma])
    assert np.all(keras.ops.convert_to_numpy(kernel) < 1.0)  # decayed
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(bias), 1.0)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(gamma), 1.0)


@pytest.mark.parametrize("corrected", [False, True])
def test_adamw_matches_a_numpy_reference(corrected):
    """Clipping, decoupled decay (not on bias), bias-corrected Adam and the
    schedule, over three steps; on torch this runs Keras' multi-tensor path
    (torch's fused kernel on a CPU), on TensorFlow its fused kernel.
    `corrected_epsilon` adds epsilon after the bias correction, as
    torch.optim.AdamW; a large epsilon makes the two conventions differ."""
    rng = np.random.default_rng(0)
    lr, total, wd, clip, eps = 0.1, 10, 0.1, 1.0, 0.3
    optimizer = create_optimizer(
        learning_rate=lr,
        num_train_steps=total,
        num_warmup_steps=0,
        weight_decay=wd,
        clipnorm=clip,
        epsilon=eps,
        corrected_epsilon=corrected,
    )
    values = [rng.normal(size=(3, 2)).astype("float32"), rng.normal(size=(2,)).astype("float32")]
    variables = [keras.Variable(values[0], name="kernel"), keras.Variable(values[1], name="bias")]
    optimizer.build(variables)
    m = [np.zeros_like(v) for v in values]
    v = [np.zeros_like(v) for v in values]
    for step in range(3):
        grads = [rng.normal(size=x.shape).astype("float32") for x in values]
        optimizer.apply([keras.ops.convert_to_tensor(g) for g in grads], variables)
        norm = np.sqrt(sum((g.astype("float64") ** 2).sum() for g in grads))
        grads = [g * clip / max(norm, clip) for g in grads]
        rate = lr * (1 - step / total)
        t = step + 1
        for i, g in enumerate(grads):
            if i == 0:  # kernel: decayed; bias: not
                values[i] = values[i] - values[i] * wd * rate
            m[i] = m[i] + (g - m[i]) * 0.1
            v[i] = v[i] + (g * g - v[i]) * 0.001
            if corrected:  # torch.optim.AdamW's arithmetic
                denominator = np.sqrt(v[i]) / np.sqrt(1 - 0.999**t) + eps
                values[i] = values[i] - rate / (1 - 0.9**t) * m[i] / denominator
            else:
                rate_t = rate * np.sqrt(1 - 0.999**t) / (1 - 0.9**t)
                values[i] = values[i] - rate_t * m[i] / (np.sqrt(v[i]) + eps)
    for var, expected in zip(variables, values):
        np.testing.assert_allclose(keras.ops.convert_to_numpy(var), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="TensorFlow's fused kernel")
def test_tensorflow_adamw_runs_the_fused_kernel_with_keras_arithmetic(monkeypatch):
    """kbert's AdamW on TensorFlow updates through `ResourceApplyAdam`, in
    a compiled `fit` too, with an embedding's sparse gradient, decay and
    clipping: the weights of Keras' own AdamW."""
    from kbert.backend import tensorflow as tf_backend

    applied = []
    fused = tf_backend.fused_adam_update

    def spy(*args):
        applied.append(fused(*args))
        return applied[-1]

    monkeypatch.setattr(tf_backend, "fused_adam_update", spy)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 50, (64, 5)), rng.normal(size=(64, 4)).astype("float32")
    weights = []
    for optimizer in (
        create_optimizer(1e-2, 24, 4, weight_decay=0.01, clipnorm=1.0),
        keras.optimizers.AdamW(
            kbert.training.WarmupLinearDecay(1e-2, 24, 4),
            weight_decay=0.01,
            epsilon=1e-6,
            global_clipnorm=1.0,
        ),
    ):
        if not isinstance(optimizer, kbert.training.optimizer.AdamW):
            optimizer.exclude_from_weight_decay(var_names=list(kbert.training.optimizer.NO_DECAY))
        keras.utils.set_random_seed(0)
        inputs = keras.Input((5,), dtype="int32")
        hidden = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(50, 8)(inputs))
        model = keras.Model(inputs, keras.layers.Dense(4)(hidden))
        model.compile(optimizer, "mse")
        model.fit(x, y, batch_size=8, epochs=3, verbose=0, shuffle=False)
        weights.append(_weights(model))
    assert applied and all(applied)  # embedding, kernel, bias: traced once
    for ours, theirs in zip(*weights):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def _batches(nan_at=None):
    items = []
    for i in range(8):
        x, y = batch(seed=i)
        if i == nan_at:
            y["mask_weights"] = np.full_like(y["mask_weights"], np.nan)
        items.append((x, y))
    return items


def _make_dataset(items):
    """A deterministic endless tf.data stream of the batches, as in pretrain.py."""
    tf = pytest.importorskip("tensorflow")
    stacked = keras.tree.map_structure(lambda *a: np.stack(a), *items)

    def make(skip):
        return tf.data.Dataset.from_tensor_slices(stacked).repeat().skip(skip)

    return make


def _model(seed):
    keras.utils.set_random_seed(seed)
    model = kbert.BertPreTrainer(kbert.BertBackbone(**TINY))
    model.compile(optimizer=create_optimizer(1e-3, 6, 2))
    return model


def _weights(model):
    return [keras.ops.convert_to_numpy(v) for v in model.weights]


def test_killed_and_resumed_run_equals_uninterrupted(tmp_path):
    items = _batches()
    full = _model(0)
    fit_resumable(
        full, _make_dataset(items), 6, str(tmp_path / "full"), steps_per_checkpoint=2, verbose=0
    )

    first = _model(0)
    fit_resumable(
        first, _make_dataset(items), 4, str(tmp_path / "cut"), steps_per_checkpoint=2, verbose=0
    )
    del first  # the process "dies" after step 4
    resumed = _model(99)  # a new process: different initial weights and RNG
    _, start = fit_resumable(
        resumed, _make_dataset(items), 6, str(tmp_path / "cut"), steps_per_checkpoint=2, verbose=0
    )
    assert start == 4
    for a, b in zip(_weights(full), _weights(resumed)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    assert int(keras.ops.convert_to_numpy(resumed.optimizer.iterations)) == 6


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    model = _model(0)
    with pytest.raises(NonFiniteLossError, match="step 3"):
        fit_resumable(
            model,
            _make_dataset(_batches(nan_at=2)),
            6,
            str(tmp_path),
            steps_per_checkpoint=2,
            verbose=0,
        )
    assert latest_checkpoint(str(tmp_path)).endswith("ckpt-000000002")


@pytest.mark.skipif(keras.backend.backend() != "jax", reason="Keras' JAX loop holds the state")
def test_resumable_fit_writes_the_state_only_for_checkpoints(tmp_path):
    """The checkpoint callback's check before each step (an RNG state to
    restore) does not write the step state into the variables (Keras'
    `Callback.model` would, at every step); its checkpoints do."""
    model = _model(0)
    writes = harness.count_state_writes(model)
    fit_resumable(model, _make_dataset(_batches()), 8, str(tmp_path), steps_per_checkpoint=4)
    assert latest_checkpoint(str(tmp_path)).endswith("ckpt-000000008")
    assert len(writes) == 2  # Keras' own, at each epoch's end (before the checkpoint there)


def test_checkpoint_from_another_model_is_refused(tmp_path):
    items = _batches()
    fit_resumable(
        _model(0), _make_dataset(items), 2, str(tmp_path), steps_per_checkpoint=2, verbose=0
    )
    other = kbert.BertPreTrainer(kbert.BertBackbone(**{**TINY, "num_layers": 1}))
    other.compile(optimizer=create_optimizer(1e-3, 6, 2))
    with pytest.raises(ValueError, match="different model"):
        fit_resumable(
            other, _make_dataset(items), 4, str(tmp_path), steps_per_checkpoint=2, verbose=0
        )


DISTRIBUTED = textwrap.dedent(
    """
    import os, sys, numpy as np, keras, kbert
    from kbert.training import create_optimizer, distribution_scope
    from tests.harness import TINY
    from tests.models.test_pretrainer import batch
    engine, out = sys.argv[1], sys.argv[2]
    devices = None
    if engine == "tf-mirrored":
        import tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2
        )
        devices = ["/cpu:0", "/cpu:1"]
    scope, replicas = distribution_scope(engine, devices=devices)
    keras.utils.set_random_seed(0)
    with scope:
        model = kbert.BertPreTrainer(kbert.BertBackbone(**TINY, dropout=0.0, attention_dropout=0.0))
        model.compile(optimizer=create_optimizer(1e-3, 10, 0, clipnorm=float(sys.argv[3])))
    xs, ys = zip(*[batch(seed=i) for i in range(3)])
    x = {k: np.concatenate([b[k] for b in xs]) for k in xs[0]}
    y = {k: np.concatenate([b[k] for b in ys]) for k in ys[0]}
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    np.savez(out, replicas=replicas, *[keras.ops.convert_to_numpy(v) for v in model.weights])
    """
)


def _train(engine, out, env_extra, clipnorm):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", **env_extra)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run(
        [sys.executable, "-c", DISTRIBUTED, engine, out, str(clipnorm)],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with np.load(out) as f:
        return int(f["replicas"]), [f[f"arr_{i}"] for i in range(len(f.files) - 1)]


@pytest.mark.parametrize("engine", ["jax-data-parallel", "tf-mirrored"])
@pytest.mark.parametrize("clipnorm", [1e9, 0.01])  # clipping off, and always active
def test_distributed_equals_single_device(engine, clipnorm, tmp_path):
    backend = "jax" if engine.startswith("jax") else "tensorflow"
    if keras.backend.backend() != backend:
        pytest.skip(f"{engine} runs in the {backend} pass of the suite")
    extra = {"KERAS_BACKEND": backend}
    if backend == "jax":
        extra["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    replicas, distributed = _train(engine, str(tmp_path / "d.npz"), extra, clipnorm)
    assert replicas == 2
    _, single = _train("none", str(tmp_path / "s.npz"), {"KERAS_BACKEND": backend}, clipnorm)
    for a, b in zip(distributed, single):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_engines_of_another_backend_are_refused():
    from kbert.training import distribution_scope

    other = "torch-ddp" if keras.backend.backend() != "torch" else "jax-data-parallel"
    with pytest.raises(ValueError, match="needs KERAS_BACKEND="):
        distribution_scope(other)


def test_torch_ddp_outside_a_launcher_says_how_to_launch(monkeypatch):
    from kbert.training import distribution_scope

    if keras.backend.backend() != "torch":
        pytest.skip("torch pass only")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="torchrun --nproc_per_node"):
        distribution_scope("torch-ddp")


MULTI_WORKER = textwrap.dedent(
    """
    import json, os, sys, numpy as np
    index, ports = int(sys.argv[1]), sys.argv[2].split(",")
    out, clipnorm = sys.argv[3], float(sys.argv[4])
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"localhost:{p}" for p in ports]},
                                          "task": {"type": "worker", "index": index}})
    import keras, kbert, tensorflow as tf
    from kbert.training import create_optimizer, distribution_scope
    from tests.harness import TINY
    from tests.models.test_pretrainer import batch
    scope, replicas = distribution_scope("tf-multi-worker")
    keras.utils.set_random_seed(0)
    with scope:
        model = kbert.BertPreTrainer(kbert.BertBackbone(**TINY, dropout=0.0, attention_dropout=0.0))
        model.compile(optimizer=create_optimizer(1e-3, 10, 0, clipnorm=clipnorm))
    xs, ys = zip(*[batch(seed=i) for i in range(3)])
    x = {k: np.concatenate([b[k] for b in xs]) for k in xs[0]}
    y = {k: np.concatenate([b[k] for b in ys]) for k in ys[0]}
    # the same global batches as single-device
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    model.fit(data.with_options(options), epochs=1, verbose=0)
    if index == 0:
        np.savez(out, replicas=replicas, *[keras.ops.convert_to_numpy(v) for v in model.weights])
    """
)


def _free_ports(n):
    import socket

    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.mark.large
@pytest.mark.parametrize("clipnorm", [1e9, 0.01])
def test_two_worker_processes_equal_single_device(clipnorm, tmp_path):
    """tf.distribute.MultiWorkerMirroredStrategy: 2 worker processes on
    localhost (TF_CONFIG), each with one CPU replica, equal single-device
    training on the same global batches."""
    if keras.backend.backend() != "tensorflow":
        pytest.skip("runs in the tensorflow pass of the suite")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", KERAS_BACKEND="tensorflow", PYTHONPATH=root)
    ports = ",".join(map(str, _free_ports(2)))
    out = str(tmp_path / "mw.npz")
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", MULTI_WORKER, str(i), ports, out, str(clipnorm)],
            env=env,
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        results = [w.communicate(timeout=600) for w in workers]
    finally:
        for w in workers:
            w.kill()
    for w, (_, err) in zip(workers, results):
        assert w.returncode == 0, err[-3000:]
    with np.load(out) as f:
        assert int(f["replicas"]) == 2
        distributed = [f[f"arr_{i}"] for i in range(len(f.files) - 1)]
    _, single = _train("none", str(tmp_path / "s.npz"), {"KERAS_BACKEND": "tensorflow"}, clipnorm)
    for a, b in zip(distributed, single):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


@pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="host-to-device copies of constants are torch's"
)
def test_torch_training_step_adds_no_host_device_syncs(monkeypatch):
    """Every Python constant that Keras' torch backend turns into a tensor is
    a host-to-device copy, which synchronises the CUDA stream. A kbert
    training step (model, losses, metrics, schedule, clipping, AdamW update,
    step counter) makes none."""
    import traceback

    import keras.src.backend.torch.core as core
    import keras.src.backend.torch.numpy as torch_numpy
    import torch

    from tests.models.test_pretrainer import batch

    model = kbert.BertPreTrainer(kbert.BertBackbone(**{**TINY, "attention_dropout": 0.1}))
    model.compile(optimizer=create_optimizer(1e-3, 100, 10))
    x, y = batch(seed=0)
    data = (
        {k: torch.as_tensor(v) for k, v in x.items()},
        {k: torch.as_tensor(v) for k, v in y.items()},
    )
    model.train_on_batch(*data)
    callers = []
    original = core.convert_to_tensor

    def recording(value, *args, **kwargs):
        if isinstance(value, (bool, int, float)):
            ours = [
                f for f in traceback.extract_stack()[:-1] if f"{os.sep}kbert{os.sep}" in f.filename
            ]
            callers.append(
                f"{os.path.basename(ours[-1].filename)}:{ours[-1].name}"
                if ours
                else "outside kbert"
            )
        return original(value, *args, **kwargs)

    monkeypatch.setattr(core, "convert_to_tensor", recording)
    monkeypatch.setattr(torch_numpy, "convert_to_tensor", recording)
    # Keras' own torch step converts constants (its loss tracker's batch
    # size): the recorder sees them, so the check below is not vacuous.
    keras.src.backend.torch.trainer.TorchTrainer.train_step(model, data)
    assert callers, "the recorder saw no conversion in Keras' step: the check would be vacuous"
    callers.clear()
    before = int(model.optimizer.iterations.numpy())
    model.train_step(data)
    assert callers == [], callers
    assert int(model.optimizer.iterations.numpy()) == before + 1


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="Keras' torch epoch iterator")
def test_torch_fit_makes_batches_on_the_host():
    """Keras' torch data adapters put every batch on the default device with
    a blocking copy; under `host_batches` (active in Task.fit when that
    device is a GPU) they stay on the host and the step copies them without
    blocking. A "meta" default device stands in for the GPU here."""
    from keras.src.backend.torch import trainer

    from kbert.backend.torch_step import host_batches
    from tests.models.test_pretrainer import batch

    original = trainer.TorchEpochIterator
    x = np.arange(12, dtype="int32").reshape(6, 2)
    with host_batches(force=True):
        iterator = trainer.TorchEpochIterator(x=x, batch_size=2, shuffle=False)
        with keras.device("meta"):
            host = [data[0] for _, _, data in iterator.enumerate_epoch()]
            default = [
                data[0]
                for _, _, data in original(x=x, batch_size=2, shuffle=False).enumerate_epoch()
            ]
    assert trainer.TorchEpochIterator is original
    assert all(b.device.type == "meta" for b in default)  # the copy Keras would make
    assert all(b.device.type == "cpu" for b in host)
    np.testing.assert_array_equal(np.concatenate([b.numpy() for b in host]), x)

    # fit (with validation, so test_step too) runs on host batches.
    model = kbert.BertPreTrainer(kbert.BertBackbone(**TINY))
    model.compile(optimizer=create_optimizer(1e-3, 100, 10))
    x, y = batch(seed=0)
    with host_batches(force=True):
        history = model.fit(x, y, validation_data=(x, y), batch_size=2, epochs=1, verbose=0).history
    assert np.isfinite(history["loss"][0]) and np.isfinite(history["val_loss"][0])


def _cuda():
    if keras.backend.backend() != "torch":
        return False
    import torch

    return torch.cuda.is_available()


def _pretrainer_pair(dropout, attention_dropout=0.0):
    """Two BertPreTrainers with the same weights, one fitting through a CUDA
    graph and one eagerly."""
    config = {**TINY, "dropout": dropout, "attention_dropout": attention_dropout}
    models = [kbert.BertPreTrainer(kbert.BertBackbone(**config)) for _ in range(2)]
    models[1].set_weights(models[0].get_weights())
    return models


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="the torch step")
def test_cuda_graph_signature_is_hashable_and_tells_shapes_apart():
    """A captured graph is looked up by its batch's signature: a (dict,
    dict) batch must give a hashable key, equal for the same shapes and
    dtypes and different when a shape, a dtype or a key differs."""
    from kbert.backend.torch_trace import batch_signature as _signature

    def make(length, dtype="int32", key="token_ids"):
        x = {key: np.zeros((2, length), dtype), "padding_mask": np.ones((2, length), "int32")}
        return x, {"labels": np.zeros((2,), "int32")}, None

    keys = {_signature(make(16)), _signature(make(16))}
    assert len(keys) == 1
    assert _signature(make(32)) not in keys
    assert _signature(make(16, "int64")) not in keys
    assert _signature(make(16, key="segment_ids")) not in keys


@pytest.mark.skipif(not _cuda(), reason="CUDA graphs: torch backend on a GPU")
def test_cuda_graph_fit_trains_as_the_eager_fit():
    """fit replaying the captured step gives the weights the eager fit gives
    (dropout 0, so both are deterministic), including a last partial batch,
    which runs eagerly, and a second fit, which captures again."""
    graphed, eager = _pretrainer_pair(dropout=0.0)
    graphed.compile(optimizer=create_optimizer(1e-3, 100, 2))
    eager.compile(optimizer=create_optimizer(1e-3, 100, 2), cuda_graph=False)
    parts = [batch(seed=s) for s in range(4)]
    x = {k: np.concatenate([p[0][k] for p in parts])[:14] for k in parts[0][0]}
    y = {k: np.concatenate([p[1][k] for p in parts])[:14] for k in parts[0][1]}
    # with validation: the torch test_step makes Keras' constants on the device too
    fit = dict(
        batch_size=2,
        epochs=1,
        shuffle=False,
        verbose=0,
        validation_data=(x, y),
        bucket_lengths=False,
    )
    for _ in range(2):
        history = graphed.fit(x, y, **fit).history
        reference = eager.fit(x, y, **fit).history
        # 7 batches: 1 eager warm-up step, the captured one, 5 replays
        assert graphed.cuda_graph_stats == {
            "replays": 6,
            "eager_steps": 1,
            "graphs": 1,
            "capture_failed": None,
        }
        np.testing.assert_allclose(history["loss"], reference["loss"], rtol=1e-5)
        np.testing.assert_allclose(history["val_loss"], reference["val_loss"], rtol=1e-5)
    assert (
        int(graphed.optimizer.iterations.numpy()) == int(eager.optimizer.iterations.numpy()) == 14
    )
    for a, b in zip(graphed.get_weights(), eager.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)
    # a partial last batch runs eagerly
    graphed.fit(
        x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, bucket_lengths=False
    )  # 3 full batches and one of 2
    assert graphed.cuda_graph_stats == {
        "replays": 2,
        "eager_steps": 2,
        "graphs": 1,
        "capture_failed": None,
    }
    graphed.fit(
        {k: v[:13] for k, v in x.items()},
        {k: v[:13] for k, v in y.items()},
        batch_size=2,
        epochs=1,
        shuffle=False,
        verbose=0,
        bucket_lengths=False,
    )
    assert graphed.cuda_graph_stats == {
        "replays": 5,
        "eager_steps": 2,
        "graphs": 1,
        "capture_failed": None,
    }


@pytest.mark.skipif(not _cuda(), reason="CUDA graphs: torch backend on a GPU")
def test_cuda_graph_replays_draw_new_dropout_masks():
    """With the learning rate at 0 and one batch repeated, the per-step loss
    changes only through the dropout masks: a graph that froze its masks at
    capture would repeat one loss."""
    model, _ = _pretrainer_pair(dropout=0.3, attention_dropout=0.3)  # SDPA's dropout too
    model.compile(optimizer=create_optimizer(0.0, 100, 0))
    x, y = batch(seed=0)
    repeat = 8
    losses = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda step, logs: losses.append(float(logs["mlm_loss"]))
    )
    model.fit(
        {k: np.concatenate([v] * repeat) for k, v in x.items()},
        {k: np.concatenate([v] * repeat) for k, v in y.items()},
        batch_size=len(y["mask_ids"]),
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[record],
    )
    assert model.cuda_graph_stats["replays"] == repeat - 1
    # mlm_loss is a running mean: step k's own loss is k * m_k - (k - 1) * m_(k-1)
    step_losses = [losses[0]] + [(k + 1) * losses[k] - k * losses[k - 1] for k in range(1, repeat)]
    replayed = step_losses[1:]
    assert len(set(np.round(replayed, 5))) == len(replayed), step_losses


@pytest.mark.skipif(not _cuda(), reason="CUDA graphs: torch backend on a GPU")
@pytest.mark.parametrize("task", ["classifier", "frozen_classifier", "token_classifier"])
def test_cuda_graph_fine_tuning_trains_as_the_eager_fit(task):
    """The fine-tuning tasks (compile metrics, sample weights, a frozen
    backbone) train the same through the replayed graph as eagerly."""
    from tests import harness

    x = harness.backbone_inputs(batch=12, length=10, seed=3)
    rng = np.random.default_rng(3)
    targets = {"y": rng.integers(0, 3, (12, 10) if task == "token_classifier" else (12,))}
    if task == "token_classifier":
        targets["sample_weight"] = x["padding_mask"].astype("float32")
    models = []
    for graph in (True, False):
        keras.utils.set_random_seed(11)
        backbone = kbert.BertBackbone(**{**TINY, "dropout": 0.0, "attention_dropout": 0.0})
        if task == "token_classifier":
            model = kbert.BertTokenClassifier(backbone, num_classes=3)
        else:
            model = kbert.BertClassifier(
                backbone, num_classes=3, freeze_backbone=task == "frozen_classifier"
            )
        model.compile(learning_rate=1e-3, cuda_graph=graph)
        history = model.fit(
            x,
            **targets,
            batch_size=2,
            epochs=2,
            shuffle=False,
            verbose=0,
            validation_data=(x, *targets.values()),
            bucket_lengths=False,
        ).history
        models.append((model, history))
    (graphed, history), (eager, reference) = models
    # 2 epochs of 6 batches: 1 eager warm-up step, the captured one, 10 replays
    assert graphed.cuda_graph_stats == {
        "replays": 11,
        "eager_steps": 1,
        "graphs": 1,
        "capture_failed": None,
    }
    for name in reference:
        np.testing.assert_allclose(history[name], reference[name], rtol=1e-5, atol=1e-6)
    for a, b in zip(graphed.get_weights(), eager.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="Keras' torch convert_to_tensor")
def test_device_constants_equal_keras_conversions():
    """Python numbers that Keras' torch backend converts in a step are made
    by fill kernels on the GPU (`constants_on_device`); values and dtypes
    are those of Keras' own conversion."""
    import torch
    from keras.src.backend.torch import core

    from kbert.backend.torch_step import device_constant

    for value in (3, 2.5, True, (4,), (2, 3), [1.0, 2.5], 1e-7):
        for dtype in (None, "float32", "int32"):
            want = core.convert_to_tensor(value, dtype=dtype)
            got = device_constant(
                core.convert_to_tensor, value, dtype, torch.device(core.get_device())
            )
            assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), (value, dtype)
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.skipif(
    keras.backend.backend() != "torch", reason="the CUDA graph choice is the torch backend's"
)
def test_cuda_graph_auto_skips_steps_with_user_code():
    """With cuda_graph="auto", a step that runs user code (a loss or metric
    function, an overridden compute_loss) stays eager: a replay would not
    rerun its Python."""
    from kbert.backend.torch_step import user_code_in_step

    def backbone():
        return kbert.BertBackbone(**TINY)

    model = kbert.BertClassifier(backbone(), num_classes=2)
    model.compile()
    assert not user_code_in_step(model)
    model.compile(metrics=["accuracy", keras.metrics.AUC()])
    assert not user_code_in_step(model)
    model.compile(loss=lambda y, p: keras.ops.mean(p))
    assert user_code_in_step(model)
    model.compile(metrics=[lambda y, p: keras.ops.mean(p)])
    assert user_code_in_step(model)

    class Custom(kbert.BertClassifier):
        def compute_loss(self, *args, **kwargs):
            return super().compute_loss(*args, **kwargs)

    custom = Custom(backbone(), num_classes=2)
    custom.compile()
    assert user_code_in_step(custom)
    pretrainer = kbert.BertPreTrainer(backbone())
    pretrainer.compile()
    assert not user_code_in_step(pretrainer)
    with pytest.raises(ValueError, match="cuda_graph"):
        pretrainer.compile(cuda_graph="yes")


def test_weight_decay_exclusions_survive_a_keras_file(tmp_path):
    """kbert's optimizers keep their exclusions in their config: a model
    reloaded from a `.keras` file goes on excluding what it excluded (Keras
    saves no exclusions), for the default and for `no_decay=()`."""
    x = {k: v for k, v in harness.backbone_inputs().items()}
    for no_decay, expected in ((None, False), ((), True)):
        classifier = kbert.BertClassifier(kbert.BertBackbone(**TINY), 2)
        kwargs = {} if no_decay is None else {"no_decay": no_decay}
        classifier.compile(optimizer=create_optimizer(1e-4, 100, 10, **kwargs))
        classifier.fit(x, np.zeros(len(x["token_ids"]), "int32"), epochs=1, verbose=0)
        classifier.save(tmp_path / "model.keras")
        restored = keras.saving.load_model(tmp_path / "model.keras")
        biases = [v for v in restored.trainable_variables if v.name == "bias"]
        assert biases and all(
            restored.optimizer._use_weight_decay(v) == expected for v in biases
        ), no_decay
        assert restored.optimizer.no_decay == (
            kbert.training.optimizer.NO_DECAY if no_decay is None else ()
        )


def test_corrected_epsilon_is_kept_in_the_config_and_adamw_only():
    optimizer = create_optimizer(1e-3, 10, 1, epsilon=1e-8, corrected_epsilon=True)
    config = keras.optimizers.serialize(optimizer)
    assert keras.optimizers.deserialize(config).corrected_epsilon is True
    assert create_optimizer(1e-3, 10, 1).corrected_epsilon is False
    with pytest.raises(ValueError, match="corrected_epsilon is an AdamW setting"):
        create_optimizer(1e-3, 10, 1, kind="lamb", corrected_epsilon=True)


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="TensorFlow's sparse gradients")
def test_global_norm_of_a_sparse_gradient_is_its_dense_norm():
    """An embedding lookup's gradient on TensorFlow repeats a row per lookup;
    clipping takes the norm of the summed (dense) gradient, as on JAX and
    torch."""
    import tensorflow as tf

    from kbert.training.optimizer import global_clip_scale

    values = tf.constant([[3.0, 0.0], [3.0, 0.0], [0.0, 4.0]])
    sparse = tf.IndexedSlices(values, tf.constant([1, 1, 2]), tf.constant([4, 2]))
    dense = tf.convert_to_tensor(sparse)  # rows 1: (6, 0), 2: (0, 4): norm sqrt(52)
    for grads in ([sparse], [dense]):
        scale = float(global_clip_scale(grads, 1.0))
        np.testing.assert_allclose(scale, 1.0 / np.sqrt(52.0), rtol=1e-6)


def test_amsgrad_with_corrected_epsilon_matches_a_numpy_reference():
    """torch.optim.AdamW(amsgrad=True)'s arithmetic: the running maximum of
    the second moment, epsilon after the bias correction."""
    rng = np.random.default_rng(1)
    lr, eps = 0.1, 0.3
    value = rng.normal(size=(4, 3)).astype("float32")
    variable = keras.Variable(value, name="kernel")
    optimizer = kbert.training.optimizer.AdamW(
        learning_rate=lr, weight_decay=0.0, epsilon=eps, amsgrad=True, corrected_epsilon=True
    )
    optimizer.build([variable])
    m, v, v_max = (np.zeros_like(value) for _ in range(3))
    for t in range(1, 4):
        scale = 3.0 if t == 1 else 0.01  # v falls after step 1
        g = rng.normal(size=value.shape).astype("float32") * scale
        optimizer.apply([keras.ops.convert_to_tensor(g)], [variable])
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        v_max = np.maximum(v_max, v)
        value = value - lr / (1 - 0.9**t) * m / (np.sqrt(v_max / (1 - 0.999**t)) + eps)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(variable), value, rtol=1e-5, atol=1e-6)
