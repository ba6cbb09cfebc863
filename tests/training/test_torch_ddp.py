"""torch-ddp (torch.distributed DistributedDataParallel, one process per
device), run as two CPU processes with the gloo backend on localhost: it
must equal one process on the same global batches, with clipping inactive
and always active, and a run whose processes are killed (SIGKILL) or one of
them asked to stop (SIGTERM), then restarted, must end where an
uninterrupted one does.

Each process runs `tests/training/multiprocess_worker.py --engine
torch-ddp` (pre-training) or `ddp_fit_worker.py` (a classifier's `fit` on
raw text): once under `torchrun` itself, otherwise started here with the
variables torchrun sets (so that each process's exit code and flags are
its own). Every process feeds the same global `tf.data` batches and takes
its half of each; the masked-LM loss is normalised over the global batch.
Dropout is off: each process draws its own masks for its rows, which one
process on the global batch would draw differently. Process 0 writes the
checkpoints. A hung collective fails the test at a timeout.
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
if keras.backend.backend() != "torch":
    pytest.skip("torch-ddp runs in the torch pass of the suite", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT = 300  # seconds for one run of the processes on a busy CI machine
WORKER = ["-m", "tests.training.multiprocess_worker"]
FIT_WORKER = ["-m", "tests.training.ddp_fit_worker"]


def _env(**more):
    env = {k: v for k, v in os.environ.items() if "_proxy" not in k.lower()}  # loopback
    env.update(
        PYTHONPATH=ROOT,
        KERAS_BACKEND="torch",
        CUDA_VISIBLE_DEVICES="",
        TF_CPP_MIN_LOG_LEVEL="3",
        OMP_NUM_THREADS="1",
        KBERT_DDP_TIMEOUT="120",
        **more,
    )
    return env


def _popen(command, env):
    return subprocess.Popen(
        command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _single(checkpoints, out, *flags):
    return _popen([sys.executable, *WORKER, str(checkpoints), str(out), *flags], _env())


def _pair(checkpoints, out, *flags, second=(), worker=WORKER):
    """Two processes of one run, started as torchrun would; `second`: flags
    for process 1 alone."""
    port = str(free_port())
    runs = []
    for rank in range(2):
        env = _env(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        paths = [str(checkpoints)] if checkpoints else []
        command = [sys.executable, *worker, *paths, str(out), "--engine", "torch-ddp"]
        runs.append(_popen([*command, *flags, *(second if rank else ())], env))
    return runs


def _torchrun(checkpoints, out, *flags):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    command += [*WORKER, str(checkpoints), str(out), "--engine", "torch-ddp", *flags]
    return _popen(command, _env())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two-process runs (under torchrun without clipping, gradients summed
    by DDP's hooks; started here with clipping at 1e-4, active at every
    step, gradients summed after the backward pass as a CUDA-graph replay
    does) and one-process runs of each."""
    root = tmp_path_factory.mktemp("ddp")
    flags = {
        "free": ("--no-dropout", "--clipnorm", "0", "--evaluate"),
        "clip": ("--no-dropout", "--clipnorm", "1e-4"),
    }
    started = [
        _torchrun(root / "pair-free", root / "pair-free.npz", *flags["free"]),
        _single(root / "single-free", root / "single-free.npz", *flags["free"]),
    ]
    codes, outputs = _run(started)
    for code, output in zip(codes, outputs):
        assert code == 0, output[-3000:]
    started = [
        *_pair(root / "pair-clip", root / "pair-clip.npz", *flags["clip"], "--sync-after-backward"),
        _single(root / "single-clip", root / "single-clip.npz", *flags["clip"]),
        *_pair(None, root / "fit-pair.npz", worker=FIT_WORKER),
        _popen([sys.executable, *FIT_WORKER, str(root / "fit-single.npz")], _env()),
    ]
    codes, outputs = _run(started)
    for code, output in zip(codes, outputs):
        assert code == 0, output[-3000:]
    results = {name: load_run(root / f"{name}.npz") for name in ("pair-free", "single-free")}
    results.update({f"{name}-path": root / f"{name}.npz" for name in ("pair-free", "single-free")})
    results.update({name: load_run(root / f"{name}.npz") for name in ("pair-clip", "single-clip")})
    for name in ("fit-pair", "fit-single"):
        with np.load(root / f"{name}.npz") as f:
            count = sum(k.startswith("arr_") for k in f.files)
            results[name] = {k: f[k] for k in f.files} | {"count": count}
    return flags, results


@pytest.mark.large
def test_task_fit_on_raw_text_equals_one_process(runs):
    # Global batches of 3 split 2 + 1: each process's loss weighs by its rows.
    _, results = runs
    pair, single = results["fit-pair"], results["fit-single"]
    assert (int(pair["processes"]), int(single["processes"])) == (2, 1)
    for i in range(single["count"]):
        np.testing.assert_allclose(pair[f"arr_{i}"], single[f"arr_{i}"], atol=1e-5, rtol=0)
    # The logged loss and accuracy are over the global batch, not process 0's rows.
    np.testing.assert_allclose(pair["loss"], single["loss"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(pair["accuracy"], single["accuracy"], atol=1e-6, rtol=0)


@pytest.mark.large
@pytest.mark.parametrize("mode", ["free", "clip"])
def test_two_processes_equal_one_process(runs, mode):
    _, results = runs
    weights, losses, processes = results[f"pair-{mode}"]
    single_weights, single_losses, single_processes = results[f"single-{mode}"]
    assert (processes, single_processes) == (2, 1)
    assert len(losses) == 6
    np.testing.assert_allclose(losses, single_losses, atol=1e-5, rtol=0)
    assert_close(weights, single_weights, atol=1e-5)


@pytest.mark.large
def test_evaluate_logs_the_loss_of_one_process(runs):
    # The pre-trainer's loss is normalised by global totals, so each
    # process computes a share of it: the logged total must be the whole
    # (it was the share, half of it, while the parts were whole).
    _, results = runs
    pair = np.load(results["pair-free-path"])["evaluated"]
    single = np.load(results["single-free-path"])["evaluated"]
    np.testing.assert_allclose(pair, single, atol=1e-5, rtol=0)
    np.testing.assert_allclose(pair[0], pair[1] + pair[2], atol=1e-5, rtol=0)


@pytest.mark.large
def test_clipping_is_of_the_global_gradient(runs):
    # Clipped at 1e-4 every step, the run must differ from the unclipped
    # one: the comparison above was not between two unclipped runs.
    _, results = runs
    free, clipped = results["pair-free"][0], results["pair-clip"][0]
    assert max(float(np.abs(a - b).max()) for a, b in zip(free, clipped)) > 1e-4


@pytest.mark.large
def test_killed_and_stopped_runs_end_as_uninterrupted(runs, tmp_path):
    flags, results = runs
    weights, losses, _ = results["pair-free"]
    checkpoints, out = tmp_path / "ckpt", tmp_path / "final.npz"
    free = flags["free"]
    codes, outputs = _run(_pair(checkpoints, out, *free, "--kill-at", "3"))
    # Both die after step 3 (SIGKILL; or the survivor when its peer vanishes).
    assert all(code != 0 for code in codes), outputs
    assert -signal.SIGKILL in codes, outputs
    assert not out.exists()
    assert sorted(os.listdir(checkpoints)) == ["ckpt-000000002"]  # written by process 0 only
    # Restarted with other seeds, so weights, optimizer and data position
    # must come from the checkpoint. SIGTERM reaches process 1 alone, after
    # step 3: both stop together at the next checkpoint (4) and exit 143.
    codes, outputs = _run(_pair(checkpoints, out, *free, "--seed", "7", second=("--term-at", "3")))
    assert codes == [128 + signal.SIGTERM] * 2, [o[-3000:] for o in outputs]
    assert "saved a checkpoint at step 4" in outputs[0]
    assert "ckpt-000000004" in os.listdir(checkpoints)
    assert not out.exists()
    codes, outputs = _run(_pair(checkpoints, out, *free, "--seed", "8"))
    assert codes == [0, 0], [o[-3000:] for o in outputs]
    resumed_weights, resumed_losses, _ = load_run(out)
    np.testing.assert_allclose(resumed_losses, losses[4:], atol=1e-6, rtol=0)
    assert_close(resumed_weights, weights, atol=1e-6)


def _run(runs):
    return run_all(runs, TIMEOUT)
