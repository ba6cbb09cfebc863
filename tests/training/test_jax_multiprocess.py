"""Multi-process JAX training (`jax.distributed`, the path for several hosts),
run as two CPU processes on localhost: it must equal one process on one
device on the same global batches, and a run whose processes are all killed
(SIGKILL) or one of them asked to stop (SIGTERM), then restarted, must end
where an uninterrupted one does.

Each process runs `tests/training/multiprocess_worker.py` with one CPU
device and feeds the same global `tf.data` batches; `DataParallel` gives
process i the i-th half of each (`distribute_dataset`), and the loss is
normalised over the global batch. Process 0 writes the checkpoints into a
directory both read. A hung collective fails the test at a timeout.
"""

import os
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest

from tests.training.processes import assert_close, free_port, load_run, run_all

pytest.importorskip("tensorflow")
if keras.backend.backend() != "jax":
    pytest.skip(
        "jax.distributed runs in the jax pass of the suite (multi-process training is JAX's)",
        allow_module_level=True,
    )

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT = 420  # seconds for one run of the processes (compilation on a busy CI machine)


def _env(cache):
    env = {k: v for k, v in os.environ.items() if "_proxy" not in k.lower()}  # gRPC on loopback
    env.update(
        PYTHONPATH=ROOT,
        KERAS_BACKEND="jax",
        JAX_PLATFORMS="cpu",
        CUDA_VISIBLE_DEVICES="",
        TF_CPP_MIN_LOG_LEVEL="3",
        # one device per process; quick XLA compilation, cached for the restarts
        XLA_FLAGS="--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0",
        JAX_COMPILATION_CACHE_DIR=str(cache),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    return env


def _start(checkpoints, out, cache, *flags):
    command = [sys.executable, "-m", "tests.training.multiprocess_worker", str(checkpoints)]
    return subprocess.Popen(
        [*command, str(out), *flags],
        env=_env(cache),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _pair(checkpoints, out, cache, *flags, seed=0, second=()):
    """Two processes of one run on a fresh loopback coordinator; `second`:
    flags for process 1 alone."""
    address = f"127.0.0.1:{free_port()}"
    return [
        _start(
            checkpoints,
            out,
            cache,
            "--coordinator-address",
            address,
            "--num-processes",
            "2",
            "--process-id",
            str(i),
            "--seed",
            str(seed),
            *flags,
            *(second if i else ()),
        )
        for i in range(2)
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted two-process run and a one-process run, side by side."""
    root = tmp_path_factory.mktemp("multiprocess")
    cache = root / "xla-cache"
    pair = _pair(root / "pair", root / "pair.npz", cache)
    single = _start(root / "single", root / "single.npz", cache)
    codes, outputs = _run([*pair, single])
    for code, output in zip(codes, outputs):
        assert code == 0, output[-3000:]
    return root, cache, load_run(root / "pair.npz"), load_run(root / "single.npz")


@pytest.mark.large
def test_two_processes_equal_one_process(runs):
    _, _, (weights, losses, processes), (single_weights, single_losses, single_processes) = runs
    assert (processes, single_processes) == (2, 1)
    assert len(losses) == 6
    np.testing.assert_allclose(losses, single_losses, atol=1e-5, rtol=0)
    assert_close(weights, single_weights, atol=1e-5)


@pytest.mark.large
def test_killed_and_stopped_runs_end_as_uninterrupted(runs, tmp_path):
    root, cache, (weights, losses, _), _ = runs
    checkpoints, out = tmp_path / "ckpt", tmp_path / "final.npz"
    codes, outputs = _run(_pair(checkpoints, out, cache, "--kill-at", "3"))
    # Both die after step 3 (SIGKILL; or the survivor when its peer vanishes).
    assert all(code != 0 for code in codes), outputs
    assert -signal.SIGKILL in codes, outputs
    assert not out.exists()
    assert sorted(os.listdir(checkpoints)) == ["ckpt-000000002"]  # written by process 0 only
    # Restarted with another seed (the same on both: Keras checks that replicated
    # values agree), so weights, optimizer and data position must come from the
    # checkpoint. SIGTERM reaches process 1 alone, after step 3: both processes
    # stop together at the next checkpoint (4) and exit 143.
    codes, outputs = _run(_pair(checkpoints, out, cache, seed=7, second=("--term-at", "3")))
    assert codes == [128 + signal.SIGTERM] * 2, [o[-3000:] for o in outputs]
    assert "saved a checkpoint at step 4" in outputs[0]
    assert "ckpt-000000004" in os.listdir(checkpoints)
    assert not out.exists()
    codes, outputs = _run(_pair(checkpoints, out, cache, seed=8))
    assert codes == [0, 0], [o[-3000:] for o in outputs]
    resumed_weights, resumed_losses, _ = load_run(out)
    np.testing.assert_allclose(resumed_losses, losses[4:], atol=1e-6, rtol=0)
    assert_close(resumed_weights, weights, atol=1e-6)


def _run(runs):
    return run_all(runs, TIMEOUT)
