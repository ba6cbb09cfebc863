"""Running an export in a TensorFlow-backend Python process.

A SavedModel is a TensorFlow graph, and the in-graph tokenizer is
TensorFlow ops; from JAX or torch, kbert saves the model as a `.keras` file
and a child process with `KERAS_BACKEND=tensorflow` (same interpreter, same
kbert) rebuilds it and writes the artifact. The weights are the same, so
outputs agree with the parent's to float32 rounding.
"""

import json
import os
import subprocess
import sys
import tempfile

from kbert import backend as kbert_backend

_CHILD = """
import json, sys
import keras
import kbert.export as export
model = keras.saving.load_model(sys.argv[1])
options = json.loads(sys.argv[4])
getattr(export, sys.argv[3])(model, sys.argv[2], **options)
"""

_FUNCTIONS = {"model": "export_model", "text": "export_text_model"}


def in_tensorflow(model, filepath, what, **options):
    """Exports `model` from a TensorFlow-backend process.

    Args:
        model: a kbert model on any backend.
        filepath: str. the artifact to write.
        what: str. "model" (`export_model`) or "text" (`export_text_model`).
        **options: JSON-safe keyword arguments of that function.
    """
    try:
        import tensorflow  # noqa: F401
    except ImportError as error:
        raise ImportError(
            f"exporting a SavedModel or from the {kbert_backend.name()} backend needs "
            "TensorFlow: pip install 'kbert[export]'"
        ) from error
    # The directory holding the kbert package, for the child's imports.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "model.keras")
        model.save(source)
        result = subprocess.run(
            [
                sys.executable,
                "-c",
                _CHILD,
                source,
                os.path.abspath(os.fspath(filepath)),
                _FUNCTIONS[what],
                json.dumps(options),
            ],
            env=env,
            capture_output=True,
            text=True,
        )
    if result.returncode:
        raise RuntimeError(
            f"exporting {model.name} in a TensorFlow-backend process failed:\n"
            + result.stderr[-3000:]
        )
