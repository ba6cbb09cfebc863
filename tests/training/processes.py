"""What the multi-process training tests share: free loopback ports, waiting
for a group of processes under a timeout, and reading a worker's results."""

import socket
import subprocess

import numpy as np
import pytest


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_all(runs, timeout):
    """Waits for all `runs` (Popen); kills them all at `timeout` seconds.
    Returns (exit codes, outputs)."""
    outputs = []
    try:
        for run in runs:
            outputs.append(run.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for run in runs:
            run.kill()
        tails = [run.communicate()[0][-3000:] for run in runs]
        pytest.fail(f"a process hung (a collective or the coordinator) past {timeout} s:\n{tails}")
    return [run.returncode for run in runs], outputs


def load_run(path):
    """A worker's OUT.npz -> (weights, losses, process count)."""
    with np.load(path) as f:
        count = sum(k.startswith("arr_") for k in f.files)
        return [f[f"arr_{i}"] for i in range(count)], f["losses"], int(f["processes"])


def assert_close(a, b, atol):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, atol=atol, rtol=0)
