import os

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# The suite compiles hundreds of tiny XLA programs (JAX, and TensorFlow's
# jit_compile tests) and runs each for milliseconds: LLVM's optimization
# passes cost more compile time than they save (about a third of the JAX
# suite's time). XLA still fuses and lays out the same HLO; only LLVM's
# optimization of the emitted code is skipped.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")

import keras
import pytest


@pytest.fixture(autouse=True)
def _seed_and_policy():
    keras.utils.set_random_seed(1234)
    keras.config.set_dtype_policy("float32")
    yield
    keras.config.set_dtype_policy("float32")
