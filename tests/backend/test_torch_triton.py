"""The torch backend's Triton Adam kernel (`kbert.backend.torch_triton`).

On a CPU only the fallback is checked (the kernel declines and changes
nothing); the kernel's own tests need a CUDA GPU with Triton:
    CUDA_VISIBLE_DEVICES=0 KERAS_BACKEND=torch pytest tests/backend/test_torch_triton.py
"""

import keras
import numpy as np
import pytest

from tests.harness import TINY

pytestmark = pytest.mark.skipif(keras.backend.backend() != "torch", reason="torch backend")


def _gpu_with_triton():
    import torch

    from kbert.backend import torch_triton

    return torch.cuda.is_available() and torch_triton.available()


gpu = pytest.mark.skipif(
    keras.backend.backend() != "torch" or not _gpu_with_triton(), reason="a CUDA GPU with Triton"
)


def _foreach_reference(xs, gs, ms, vs, alpha, beta_1, beta_2, epsilon):
    """The foreach update of `torch_step.adam_update`, pass for pass."""
    import torch

    torch._foreach_mul_(ms, beta_1)
    torch._foreach_add_(ms, gs, alpha=1 - beta_1)
    torch._foreach_mul_(vs, beta_2)
    torch._foreach_add_(vs, torch._foreach_mul(gs, gs), alpha=1 - beta_2)
    step = torch._foreach_div(
        torch._foreach_mul(ms, alpha), torch._foreach_add(torch._foreach_sqrt(vs), epsilon)
    )
    torch._foreach_add_(xs, step, alpha=-1)


def _tensors(device, shapes, seed=0):
    import torch

    generator = torch.Generator().manual_seed(seed)

    def make(scale):
        return [(torch.randn(s, generator=generator) * scale).to(device) for s in shapes]

    return make(1.0), make(1e-3), make(1e-4), [v.abs() for v in make(1e-4)]


def test_the_kernel_declines_cpu_tensors_and_changes_nothing():
    import torch

    from kbert.backend import torch_triton

    xs, gs, ms, vs = _tensors("cpu", [(3, 5), (7,)])
    before = [t.clone() for t in xs + ms + vs]
    alpha = torch.tensor(1e-3)
    assert torch_triton.adam_update(xs, gs, ms, vs, alpha, 0.9, 0.999, 1e-6) is False
    for old, new in zip(before, xs + ms + vs):
        assert torch.equal(old, new)


def test_a_warm_up_and_a_step_make_the_first_launch_once(monkeypatch):
    """The warm-up thread's first launch and a step's `_usable` check do
    not both launch: the step waits for the warm-up and takes its answer."""
    import threading

    import torch

    from kbert.backend import torch_triton

    monkeypatch.setattr(torch_triton, "_USABLE", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    started, release, launches = threading.Event(), threading.Event(), []

    def slow_first_launch(device):
        started.set()
        assert release.wait(30)
        launches.append(device)
        return True

    monkeypatch.setattr(torch_triton, "_first_launch", slow_first_launch)
    device = torch.device("cuda", 0)
    thread = torch_triton.warm_up(device)
    assert thread is not None and started.wait(30)
    answers = []
    step = threading.Thread(target=lambda: answers.append(torch_triton._usable(device)))
    step.start()
    step.join(0.2)
    assert step.is_alive() and answers == []  # waiting for the warm-up's launch
    release.set()
    step.join(30)
    thread.join(30)
    assert answers == [True] and launches == [device]
    assert torch_triton.warm_up(device) is None  # done: nothing to start


def test_a_warm_up_launches_on_the_callers_device(monkeypatch):
    """Keras names the GPU "cuda" (no index): the warm-up thread launches on
    the caller's current device (a DDP process's), not on the thread's
    first one."""
    import threading

    import torch

    from kbert.backend import torch_triton

    monkeypatch.setattr(torch_triton, "_USABLE", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    caller = threading.get_ident()
    # CUDA's current device is per thread: 3 on the caller's, 0 on a new one
    monkeypatch.setattr(
        torch.cuda, "current_device", lambda: 3 if threading.get_ident() == caller else 0
    )
    launches = []
    monkeypatch.setattr(torch_triton, "_first_launch", lambda d: launches.append(d) or True)
    torch_triton.warm_up(torch.device("cuda")).join(30)
    assert launches == [torch.device("cuda", 3)] and torch_triton._USABLE == {3: True}


def test_fit_warms_the_kernel_up_only_where_its_step_runs_it(monkeypatch):
    """`fit` starts the warm-up before tokenizing where kbert's AdamW
    updates on a GPU; not for another optimizer, nor without a GPU."""
    import torch

    import kbert
    from kbert.backend import keras_internals, torch_step, torch_triton

    started = []
    monkeypatch.setattr(torch_triton, "warm_up", lambda device: started.append(device))
    backbone = kbert.BertBackbone(**TINY)
    model = kbert.BertClassifier(backbone, num_classes=2)
    model.compile(learning_rate=1e-3)
    x = {
        "token_ids": np.full((4, 8), 5, "int32"),
        "segment_ids": np.zeros((4, 8), "int32"),
        "padding_mask": np.ones((4, 8), "int32"),
    }
    calls = []
    warm_up = torch_step.warm_up
    monkeypatch.setattr(torch_step, "warm_up", lambda m: calls.append(m) or warm_up(m))
    model.fit(x, np.array([0, 1, 0, 1]), batch_size=2, verbose=0)
    assert calls == [model]
    assert started == [] or torch.cuda.is_available()  # no GPU: nothing started
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(keras_internals, "torch_device", lambda: "cuda:0")
    torch_step.warm_up(model)
    assert started[-1] == torch.device("cuda", 0)
    count = len(started)
    for kwargs in (
        {"optimizer": keras.optimizers.SGD(0.01)},  # no Triton update
        {"learning_rate": 1e-3, "jit_compile": True},  # torch.compile's step
    ):
        model.compile(**kwargs)
        torch_step.warm_up(model)
        assert len(started) == count


@gpu
def test_the_kernel_matches_the_foreach_update_over_several_steps():
    import torch

    from kbert.backend import torch_triton

    # sizes around the block (1024), a scalar, a matrix, an embedding-like table
    shapes = [(), (1,), (1023,), (1024,), (1025,), (3, 700), (30, 768)]
    xs, gs, ms, vs = _tensors("cuda", shapes)
    ref = [[t.clone() for t in group] for group in (xs, gs, ms, vs)]
    for step in range(1, 6):
        alpha = torch.tensor(
            2e-3 * np.sqrt(1 - 0.999**step) / (1 - 0.9**step), dtype=torch.float32, device="cuda"
        )
        assert torch_triton.adam_update(xs, gs, ms, vs, alpha, 0.9, 0.999, 1e-6)
        _foreach_reference(*ref, alpha, 0.9, 0.999, 1e-6)
        gs = [g * -1.1 for g in gs]  # new gradients for the next step
        ref[1] = [g.clone() for g in gs]
    for mine, theirs in zip(xs + ms + vs, ref[0] + ref[2] + ref[3]):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-9)


@gpu
def test_a_graphed_fit_with_the_kernel_matches_the_foreach_update():

    import kbert
    from kbert.backend import torch_triton

    def train(use_kernel):
        keras.utils.set_random_seed(0)
        backbone = kbert.BertBackbone(**dict(TINY, dropout=0.0, attention_dropout=0.0))
        model = kbert.BertClassifier(backbone, num_classes=3, dropout=0.0)
        model.compile(learning_rate=1e-3)
        rng = np.random.default_rng(0)
        x = {
            "token_ids": rng.integers(1, 97, (64, 16)).astype("int32"),
            "segment_ids": np.zeros((64, 16), "int32"),
            "padding_mask": np.ones((64, 16), "int32"),
        }
        y = rng.integers(0, 3, 64)
        original, ran = torch_triton.adam_update, []

        def counted(*args):
            ran.append(original(*args))
            return ran[-1]

        torch_triton.adam_update = counted if use_kernel else (lambda *args: False)
        try:
            model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        finally:
            torch_triton.adam_update = original
        assert model.cuda_graph_stats["replays"] > 0
        if use_kernel:  # the kernel made every update (eager, and the captured ones)
            assert ran and all(ran)
        return [keras.ops.convert_to_numpy(w) for w in model.weights]

    for mine, theirs in zip(train(True), train(False)):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)
