"""Faults during training, with real signals in real processes: SIGKILL at
several steps, SIGKILL while a checkpoint is being written, SIGTERM. Each
interrupted-and-restarted run must end with the weights of an uninterrupted
run."""

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("tensorflow")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(checkpoints, out, *flags, seed=0):
    env = {
        **os.environ,
        "PYTHONPATH": ROOT,
        "CUDA_VISIBLE_DEVICES": "",
        "TF_CPP_MIN_LOG_LEVEL": "3",
    }
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.training.fault_worker",
            str(checkpoints),
            str(out),
            *flags,
            "--seed",
            str(seed),
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return result


def _weights(path):
    with np.load(path) as f:
        return [
            f[k]
            for k in sorted(
                (k for k in f.files if k.startswith("arr_")), key=lambda k: int(k.split("_")[1])
            )
        ]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    directory = tmp_path_factory.mktemp("full")
    result = _run(directory / "ckpt", directory / "final.npz")
    assert result.returncode == 0, result.stderr[-2000:]
    return _weights(directory / "final.npz")


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, atol=1e-6, rtol=0)


@pytest.mark.large
def test_sigkill_at_several_steps_then_resume(uninterrupted, tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "final.npz"
    # the first run starts like the uninterrupted one (same seed); restarts get
    # other seeds, so everything must come from the checkpoint
    for seed, step in enumerate([3, 6]):  # killed mid-interval and just after a checkpoint
        result = _run(ckpt, out, "--kill-at", str(step), seed=seed)
        assert result.returncode == -signal.SIGKILL
        assert not out.exists()
    result = _run(ckpt, out, seed=9)
    assert result.returncode == 0, result.stderr[-2000:]
    _assert_same(_weights(out), uninterrupted)


@pytest.mark.large
def test_sigkill_while_writing_a_checkpoint_keeps_the_previous_one(uninterrupted, tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "final.npz"
    result = _run(ckpt, out, "--kill-in-save", "2", seed=0)  # dies writing the step-4 checkpoint
    assert result.returncode == -signal.SIGKILL
    names = sorted(os.listdir(ckpt))
    assert names == [
        "ckpt-000000002",
        "ckpt-000000004.tmp",
    ]  # the half-written one never got its name
    result = _run(ckpt, out, seed=2)
    assert result.returncode == 0, result.stderr[-2000:]
    _assert_same(_weights(out), uninterrupted)


@pytest.mark.large
def test_sigterm_saves_a_checkpoint_and_exits(uninterrupted, tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "final.npz"
    # SIGTERM arrives during step 4's callbacks; the run finishes the step in
    # flight (5), checkpoints it between the regular checkpoints (every 2) and exits
    result = _run(ckpt, out, "--term-at", "4", seed=0)
    assert result.returncode == 128 + signal.SIGTERM, result.stderr[-2000:]
    assert "saved a checkpoint at step 5" in result.stdout
    assert "ckpt-000000005" in os.listdir(ckpt)
    result = _run(ckpt, out, seed=2)
    assert result.returncode == 0, result.stderr[-2000:]
    _assert_same(_weights(out), uninterrupted)


@pytest.mark.large
def test_same_seed_gives_identical_loss_curve_and_weights(uninterrupted, tmp_path):
    first = _run(tmp_path / "a", tmp_path / "a.npz")
    second = _run(tmp_path / "b", tmp_path / "b.npz")
    assert first.returncode == 0 and second.returncode == 0
    with np.load(tmp_path / "a.npz") as a, np.load(tmp_path / "b.npz") as b:
        assert len(a["losses"]) == 8
        np.testing.assert_array_equal(a["losses"], b["losses"])  # bit-identical loss curve
    for x, y in zip(_weights(tmp_path / "a.npz"), _weights(tmp_path / "b.npz")):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(_weights(tmp_path / "a.npz"), uninterrupted):
        np.testing.assert_array_equal(x, y)
