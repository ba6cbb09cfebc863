"""The tokenizer tests do not touch a Keras backend (the Python path is
numpy and the Rust `tokenizers` engine, the in-graph path TensorFlow
whatever the backend): CI runs them once, under KERAS_BACKEND=jax."""

import keras
import pytest


def pytest_collection_modifyitems(config, items):
    if keras.backend.backend() == "jax":
        return
    skip = pytest.mark.skip(reason="backend-independent: runs under KERAS_BACKEND=jax")
    for item in items:
        if "tests/tokenizers/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
