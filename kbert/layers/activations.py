"""Activations by name, as BERT checkpoints spell them.

Checkpoints differ: the original BERT and most Hugging Face BERTs use the exact
(erf) GELU, some use the tanh approximation. Using the wrong one costs ~3e-3 of
agreement with the reference, so the name is part of the model config.
"""

import keras

from kbert.backend.ops import fused_gelu
from kbert.utils.naming import closest


def _gelu_exact(x):
    return fused_gelu(x, approximate=False)


def _gelu_tanh(x):
    return fused_gelu(x, approximate=True)


_ACTIVATIONS = {
    "gelu": _gelu_exact,
    "gelu_tanh": _gelu_tanh,
    "relu": keras.activations.relu,
    "tanh": keras.activations.tanh,
    "silu": keras.activations.silu,
}

# Names other libraries use for the same functions.
ALIASES = {
    "gelu_exact": "gelu",
    "gelu_erf": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_approximate": "gelu_tanh",
    "swish": "silu",
}


def canonical_activation(name):
    """Returns kbert's name for an activation name, or raises a clear error."""
    if not isinstance(name, str):
        raise ValueError(f"activation must be a name (one of {sorted(_ACTIVATIONS)}), got {name!r}")
    key = ALIASES.get(name.lower(), name.lower())
    if key not in _ACTIVATIONS:
        raise ValueError(
            f"unknown activation {name!r}; use one of {sorted(_ACTIVATIONS)}"
            + closest(name, list(_ACTIVATIONS) + list(ALIASES))
        )
    return key


def get_activation(name):
    """Returns the activation function for a (possibly aliased) name."""
    return _ACTIVATIONS[canonical_activation(name)]
