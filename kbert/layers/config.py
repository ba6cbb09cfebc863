"""`ArgumentsConfig`: a layer whose config is its constructor arguments."""

import functools
import inspect

_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


@functools.cache
def constructor_arguments(cls):
    """The names of the constructor arguments of `cls` and of the classes
    it derives from that define one, base classes' first, each in its
    signature's order (not `self`, not `*args` / `**kwargs`): a subclass
    that adds arguments and passes the rest on keeps its base's config."""
    names = []
    for klass in reversed(cls.__mro__):
        if "__init__" not in vars(klass) or not issubclass(klass, ArgumentsConfig):
            continue
        parameters = list(inspect.signature(klass.__init__).parameters.values())[1:]
        names += [p.name for p in parameters if p.kind in _NAMED and p.name not in names]
    return tuple(names)


class ArgumentsConfig:
    """Mixin (before `keras.layers.Layer` in the bases) for a layer that keeps
    each constructor argument as an attribute of the same name and whose
    `get_config` returns them, in signature order, after Keras' own keys.

    `__init__` calls `self.store_arguments(locals())` once the values are
    final (an argument it normalizes is reassigned first). Class attributes
    adjust the config: `config_excluded`, arguments kept but not serialized
    (a sublayer shared with the model that rebuilds this layer);
    `config_omitted`, an argument mapped to the value at which its key is
    left out (configs saved without the key load to that value).

    Example:
    >>> class Scale(ArgumentsConfig, keras.layers.Layer):
    ...     def __init__(self, factor=2.0, **kwargs):
    ...         super().__init__(**kwargs)
    ...         self.store_arguments(locals())
    >>> Scale(3.0).get_config()["factor"]
    3.0
    """

    config_excluded = ()
    config_omitted = {}

    def store_arguments(self, values):
        """Sets `self.<name>` for each constructor argument in `values` (the
        calling constructor's `locals()`)."""
        for name in constructor_arguments(type(self)):
            if name in values:
                setattr(self, name, values[name])

    def get_config(self):
        config = super().get_config()
        for name in constructor_arguments(type(self)):
            if not hasattr(self, name):  # a subclass's argument it keeps itself
                continue
            value = getattr(self, name)
            omitted = name in self.config_omitted and value == self.config_omitted[name]
            if name not in self.config_excluded and not omitted:
                config[name] = value
        return config
