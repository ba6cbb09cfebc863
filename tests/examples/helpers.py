"""Paths, the tiny vocabulary and the example loader shared by the example tests."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLES = os.path.join(ROOT, "examples", "data")
SHARED = os.environ.get("KBERT_SHARED_DATA") or os.path.normpath(
    os.path.join(ROOT, "..", "shared", "data")
)

# Lowercase characters and their continuations: every word tokenizes, in a
# vocabulary small enough for the tiny test model.
CHARACTERS = "abcdefghijklmnopqrstuvwxyz0123456789.,'-"
VOCAB = (
    ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    + list(CHARACTERS)
    + ["##" + c for c in "abcdefghijklmnopqrstuvwxyz"]
)


def load_example(name):
    """examples/<name>.py as a module (the examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(
        f"{name}_example", os.path.join(ROOT, "examples", f"{name}.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
