import os

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# The suite compiles hundreds of tiny XLA programs (JAX, and TensorFlow's
# jit_compile tests) and runs each for milliseconds: LLVM's optimization at
# level 1, below XLA's default, compiles about a quarter faster. The
# HLO and its fusion are the same; the machine code may round a last bit
# differently (a few 1e-8 after training a tiny classifier), far inside the
# tests' tolerances. Level 0 compiles faster still but moves some results
# by up to 6e-6 (a gradient test at 2e-6 fails): not used.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=1")

import keras
import pytest


@pytest.fixture(autouse=True)
def _seed_and_policy():
    keras.utils.set_random_seed(1234)
    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")
