"""kbert's torch Adam update: torch's fused CPU kernel computes Keras' Adam."""

import contextlib

import keras
import numpy as np
import pytest


def _gpu():
    import torch

    return torch.cuda.is_available()


pytestmark = [
    pytest.mark.skipif(keras.backend.backend() != "torch", reason="torch backend"),
    pytest.mark.skipif(
        keras.backend.backend() == "torch" and _gpu(),
        reason="the CPU path; Keras uses the GPU here",
    ),
]


def _train(monkeypatch, fused, steps=12, optimizer_class=None, weight_decay=0.01, own=False):
    import torch

    from kbert.backend import keras_internals, torch_step
    from kbert.training.optimizer import AdamW

    class Calls(list):
        pass

    calls = Calls()
    original = torch_step.cpu_fused_adam

    def counted(*args, **kwargs):
        ran = original(*args, **kwargs) if fused else False
        calls.append(ran)
        decays.append(kwargs.get("weight_decay"))
        scales.append(kwargs.get("clip_scale"))
        return ran

    decays, separate, scales = [], [], []
    apply_now = keras_internals.OptimizerShims.apply_weight_decay_now
    monkeypatch.setattr(
        AdamW,
        "apply_weight_decay_now",
        lambda self, v: (separate.append(len(v)), apply_now(self, v)),
    )

    monkeypatch.setattr(torch_step, "cpu_fused_adam", counted)
    rng = np.random.default_rng(0)
    shapes = [(5, 7), (7,), (3,)]
    variables = [keras.Variable(rng.normal(size=s).astype("float32")) for s in shapes]
    optimizer = (optimizer_class or AdamW)(
        learning_rate=1e-2, weight_decay=weight_decay, global_clipnorm=1.0, epsilon=1e-6
    )
    optimizer.exclude_from_weight_decay(var_list=[variables[1]])
    for step in range(steps):
        scale = 1e-3 if step % 2 else 1.0  # steps where epsilon matters
        grads = [torch.tensor(rng.normal(size=s).astype("float32") * scale) for s in shapes]
        with torch_step.own_gradients() if own else contextlib.nullcontext():
            optimizer.apply(grads, variables)
    calls.decays, calls.separate, calls.scales = decays, separate, scales
    return [v.numpy() for v in variables], calls


def test_cpu_fused_adam_computes_the_foreach_update(monkeypatch):
    fused, ran = _train(monkeypatch, fused=True)
    foreach, declined = _train(monkeypatch, fused=False)
    assert ran and all(ran) and not any(declined)
    for a, b in zip(fused, foreach):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_weight_decay_runs_in_the_fused_pass_with_keras_arithmetic(monkeypatch):
    """kbert's AdamW applies Keras' decoupled weight decay inside torch's
    fused kernel (one pass), or as Keras' own pass where the kernel does
    not run: both give Keras' AdamW, decay excluded where asked."""
    fused, ran = _train(monkeypatch, fused=True)
    foreach, declined = _train(monkeypatch, fused=False)
    keras_adamw, _ = _train(monkeypatch, fused=False, optimizer_class=keras.optimizers.AdamW)
    undecayed, _ = _train(monkeypatch, fused=True, weight_decay=0.0)
    assert all(ran) and not any(declined)
    # fused: the decay went to the kernel, no separate pass; else Keras' pass
    assert ran.decays == [(0.01, [True, False, True])] * 12 and sum(ran.separate) == 0
    assert declined.separate == [2] * 12
    for a, b, c in zip(fused, foreach, keras_adamw):
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(b, c, rtol=1e-5, atol=1e-6)
    # 12 steps of decay at lr 1e-2, rate 0.01: about 1e-3 of each value
    np.testing.assert_allclose(fused[1], undecayed[1], rtol=1e-5)  # excluded
    assert np.abs(fused[0] / undecayed[0] - 1).max() > 5e-4  # decayed


def test_clipping_in_the_training_step_runs_in_the_fused_pass(monkeypatch):
    """In kbert's training step (its own gradients), the global-norm
    clipping scale multiplies the gradients inside the fused kernel (no
    separate pass); without the kernel, as its own pass. Both give Keras'
    AdamW with Keras' clipping. Outside the step, gradients given to
    `apply` are not scaled in place."""
    fused, ran = _train(monkeypatch, fused=True, own=True)
    foreach, declined = _train(monkeypatch, fused=False, own=True)
    keras_adamw, _ = _train(monkeypatch, fused=False, optimizer_class=keras.optimizers.AdamW)
    outside, outside_calls = _train(monkeypatch, fused=True)
    assert all(ran) and not any(declined)
    assert all(scale is not None for scale in ran.scales)
    assert all(scale is None for scale in outside_calls.scales)
    clipped = [float(scale) < 1 for scale in ran.scales]
    assert any(clipped) and not all(clipped)  # steps of large and of small gradients
    for a, b, c, d in zip(fused, foreach, keras_adamw, outside):
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(b, c, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(d, c, rtol=1e-5, atol=1e-6)


def test_cpu_fused_adam_declines_what_it_cannot_take():
    import torch

    from kbert.backend import torch_step

    x, g = torch.ones(3), torch.ones(3)
    m, v = torch.zeros(3), torch.zeros(3)
    lr, step = torch.tensor(0.1), torch.tensor(1.0)
    half = [[t.to(torch.bfloat16)] for t in (x, g, m, v)]
    assert not torch_step.cpu_fused_adam(*half, lr, step, 0.9, 0.999, 1e-7)
    beta_1 = torch.tensor(0.9)  # a tensor hyperparameter
    square = [torch.ones(2, 3).t()]  # a variable made from a transposed array
    zeros = [torch.zeros(3, 2)]
    assert not torch_step.cpu_fused_adam(square, zeros, zeros, zeros, lr, step, 0.9, 0.999, 1e-7)
    assert not torch_step.cpu_fused_adam([x], [g], [m], [v], lr, step, beta_1, 0.999, 1e-7)
    assert x.tolist() == [1.0, 1.0, 1.0] and m.tolist() == [0.0, 0.0, 0.0]
    version = x._version
    assert torch_step.cpu_fused_adam([x], [g], [m], [v], lr, step, 0.9, 0.999, 1e-7)
    assert x.tolist() != [1.0, 1.0, 1.0]
    # changed in place, and seen as changed by caches of derived weights
    assert x._version > version


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_predictions_after_fit_use_the_updated_weights(weight_decay):
    """The fused kernel updates the weights in place; inference on a CPU
    multiplies by a cached oneDNN copy of each kernel, which must see the
    update (with or without weight decay): a model's predictions after
    `fit` equal those of a fresh model given its weights."""
    import kbert
    from kbert.training.optimizer import create_optimizer
    from tests.harness import TINY

    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(1, TINY["vocabulary_size"], (16, 8)).astype("int32"),
        "segment_ids": np.zeros((16, 8), "int32"),
        "padding_mask": np.ones((16, 8), "int32"),
    }
    y = rng.integers(0, 2, 16)

    def classifier():
        keras.utils.set_random_seed(0)
        return kbert.BertClassifier(kbert.BertBackbone(**TINY), num_classes=2)

    model = classifier()
    model.predict(x, verbose=0)  # caches the packed kernels
    optimizer = create_optimizer(1e-2, 100, 0, weight_decay=weight_decay)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    fresh = classifier()
    fresh.set_weights(model.get_weights())
    np.testing.assert_allclose(
        model.predict(x, verbose=0), fresh.predict(x, verbose=0), rtol=1e-5, atol=1e-6
    )


def test_an_interrupted_update_leaves_nothing_to_later_steps(monkeypatch):
    """A step that fails between Keras' clipping hook and the update (its
    deferred scale and decay never applied) does not change the updates
    that follow, outside kbert's step or in it; gradients given to `apply`
    outside the step come back unchanged."""
    import torch

    from kbert.backend import torch_step
    from kbert.training.optimizer import AdamW

    def run(interrupt):
        rng = np.random.default_rng(0)
        variables = [keras.Variable(rng.normal(size=(4, 3)).astype("float32"))]
        optimizer = AdamW(learning_rate=1e-2, weight_decay=0.01, global_clipnorm=1.0)
        optimizer.build(variables)
        if interrupt:  # fails once the hooks have run, before the update

            def fail(*args):
                raise KeyboardInterrupt

            monkeypatch.setattr(optimizer, "take_deferred_decay", fail)
            with pytest.raises(KeyboardInterrupt), torch_step.own_gradients():
                optimizer.apply([torch.full((4, 3), 5.0)], variables)
            monkeypatch.undo()
        for step in range(4):
            grads = [torch.tensor(rng.normal(size=(4, 3)).astype("float32") * 3)]
            given = grads[0].clone()
            with torch_step.own_gradients() if step % 2 else contextlib.nullcontext():
                optimizer.apply(grads, variables)
            if not step % 2:
                torch.testing.assert_close(grads[0], given, rtol=0, atol=0)
        return variables[0].numpy()

    np.testing.assert_allclose(run(True), run(False), rtol=1e-6)


def test_gradient_accumulation_matches_keras():
    """With `gradient_accumulation_steps`, the update (fused on a CPU) is
    Keras' AdamW's: one step per accumulated group."""
    import torch

    from kbert.training.optimizer import AdamW

    def run(cls):
        rng = np.random.default_rng(0)
        variables = [keras.Variable(rng.normal(size=(4, 3)).astype("float32"))]
        optimizer = cls(
            learning_rate=1e-2,
            weight_decay=0.01,
            global_clipnorm=1.0,
            gradient_accumulation_steps=2,
        )
        for _ in range(6):
            optimizer.apply([torch.tensor(rng.normal(size=(4, 3)).astype("float32"))], variables)
        return variables[0].numpy(), int(optimizer.iterations)

    (ours, steps), (keras_adamw, keras_steps) = run(AdamW), run(keras.optimizers.AdamW)
    assert steps == keras_steps == 3
    np.testing.assert_allclose(ours, keras_adamw, rtol=1e-5, atol=1e-6)
