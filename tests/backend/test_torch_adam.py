"""kbert's torch Adam update: torch's fused CPU kernel computes Keras' Adam."""

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


def _train(monkeypatch, fused, steps=12):
    import torch

    from kbert.backend import torch_step
    from kbert.training.optimizer import AdamW

    calls = []
    original = torch_step.cpu_fused_adam

    def counted(*args):
        ran = original(*args) if fused else False
        calls.append(ran)
        return ran

    monkeypatch.setattr(torch_step, "cpu_fused_adam", counted)
    rng = np.random.default_rng(0)
    shapes = [(5, 7), (7,), (3,)]
    variables = [keras.Variable(rng.normal(size=s).astype("float32")) for s in shapes]
    optimizer = AdamW(learning_rate=1e-2, weight_decay=0.01, global_clipnorm=1.0, epsilon=1e-6)
    for step in range(steps):
        scale = 1e-3 if step % 2 else 1.0  # steps where epsilon matters
        grads = [torch.tensor(rng.normal(size=s).astype("float32") * scale) for s in shapes]
        optimizer.apply(grads, variables)
    return [v.numpy() for v in variables], calls


def test_cpu_fused_adam_computes_the_foreach_update(monkeypatch):
    fused, ran = _train(monkeypatch, fused=True)
    foreach, declined = _train(monkeypatch, fused=False)
    assert ran and all(ran) and not any(declined)
    for a, b in zip(fused, foreach):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


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
    assert torch_step.cpu_fused_adam([x], [g], [m], [v], lr, step, 0.9, 0.999, 1e-7)
    assert x.tolist() != [1.0, 1.0, 1.0]
