"""`Dropout`: keras.layers.Dropout drawing its mask with the fastest random
bit generator of the backend (see `kbert.layers.fused.fused_dropout`)."""

import keras

from kbert.backend.ops import fused_dropout


@keras.saving.register_keras_serializable(package="kbert")
class Dropout(keras.layers.Dropout):
    """Inverted dropout; same arguments and seeding as `keras.layers.Dropout`.

    Example:
    >>> layer = Dropout(0.5, seed=1)
    >>> tuple(layer(keras.ops.ones((2, 3)), training=True).shape)
    (2, 3)
    """

    def call(self, inputs, training=False):
        if training and self.rate > 0 and self.noise_shape is None:
            return fused_dropout(inputs, self.rate, self.seed_generator)
        return super().call(inputs, training=training)
