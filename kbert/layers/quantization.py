"""The quantized layers of a model, as a config entry, and the same
quantization applied again to a freshly built model.

kbert models are rebuilt from their constructor arguments (`from_config`,
presets), which make float layers. A model that `model.quantize(mode)`
converted records `{layer path: dtype policy name}` for each quantized layer
in its config; loading builds the float model, quantizes those layers (Keras'
own `layer.dtype_policy = policy`, which runs `layer.quantize`) and then
assigns the saved weights, which now match in name, shape and dtype.
"""

import keras

from kbert.backend import keras_internals


def quantized_layers(layer, exclude=()):
    """{path: dtype policy name} of every quantized sublayer of `layer`.

    Args:
        layer: `keras.Layer`. the model or layer to look through.
        exclude: iterable of `keras.Layer`. sublayers of these are left out
            (a task leaves out its backbone, which records its own).

    Example:
    >>> from kbert.layers import Dense
    >>> model = keras.Sequential([keras.Input((4,)), Dense(2, name="d")])
    >>> model.quantize("int8")
    >>> quantized_layers(model)
    {'d': 'int8_from_float32'}
    """
    skip = {id(sub) for owner in exclude for sub in keras_internals.flatten_layers(owner)}
    return {
        sub.path: sub.dtype_policy.name
        for sub in keras_internals.flatten_layers(layer)
        if sub.quantization_mode is not None and id(sub) not in skip
    }


def apply_quantization(model, policies, source="the config"):
    """Quantizes each sublayer of `model` that `policies` names, as
    `quantized_layers` recorded them. Returns `model`.

    Args:
        model: `keras.Model`. built, with float weights (about to be
            overwritten by saved quantized ones).
        policies: dict or None. {layer path: dtype policy name}.
        source: str. where `policies` came from, for error messages.
    """
    if not policies:
        return model
    if not isinstance(policies, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in policies.items()
    ):
        raise ValueError(
            f"{source}: quantized_layers must map layer paths to dtype policy names "
            f"such as 'int8_from_float32', got {policies!r:.120}"
        )
    layers = {sub.path: sub for sub in keras_internals.flatten_layers(model)}
    unknown = sorted(set(policies) - set(layers))
    if unknown:
        raise ValueError(
            f"{source} lists quantized layers that {model.name!r} does not have: {unknown[:8]}; "
            "the config does not describe this model (re-save the quantized model)"
        )
    for path, name in policies.items():
        layer = layers[path]
        try:
            policy = keras.dtype_policies.get(name)
        except ValueError as e:
            raise ValueError(
                f"{source}: layer {path!r} has an unknown dtype policy {name!r}"
            ) from e
        if policy.quantization_mode is None:
            raise ValueError(f"{source}: layer {path!r} is listed with the float policy {name!r}")
        if layer.quantization_mode is None:
            layer.dtype_policy = policy  # Keras quantizes a built layer given a quantized policy
    keras_internals.retrack_variables(model)
    return model


def quantized_layers_config(layer, exclude=()):
    """`{"quantized_layers": quantized_layers(layer, exclude)}`, or {} for a
    float model (whose config then has no such entry)."""
    policies = quantized_layers(layer, exclude)
    return {"quantized_layers": policies} if policies else {}
