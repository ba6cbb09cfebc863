"""Pre-training data as plain NumPy arrays, for machines without TensorFlow.

`export_numpy` turns a TFRecord directory into one `.npy` file per feature
(kbert names); `NumpyPretrainingData` reads them memory-mapped as a
`keras.utils.PyDataset` of `(x, y)` batches that `model.fit` takes on every
backend.
"""

import json
import os

import keras
import numpy as np

from kbert.data.check import load_arrays

X_NAMES = ("token_ids", "segment_ids", "padding_mask", "mask_positions")
Y_NAMES = ("mask_ids", "mask_weights", "next_sentence_labels")
_FROM_ORIGINAL = {
    "input_ids": "token_ids",
    "segment_ids": "segment_ids",
    "input_mask": "padding_mask",
    "masked_lm_positions": "mask_positions",
    "masked_lm_ids": "mask_ids",
    "masked_lm_weights": "mask_weights",
    "next_sentence_labels": "next_sentence_labels",
}


def export_numpy(tfrecord_dir, output_dir):
    """TFRecords made by `create_pretraining_data` -> `<name>.npy` files."""
    with open(os.path.join(tfrecord_dir, "manifest.json")) as f:
        manifest = json.load(f)
    masking = manifest["masking"]
    arrays = load_arrays(
        tfrecord_dir, masking["max_seq_length"], masking["max_predictions_per_seq"]
    )
    os.makedirs(output_dir, exist_ok=True)
    for original, name in _FROM_ORIGINAL.items():
        value = arrays[original]
        value = value.reshape(-1) if name == "next_sentence_labels" else value
        value = value.astype("float32" if name == "mask_weights" else "int32")
        np.save(os.path.join(output_dir, f"{name}.npy"), value)
    with open(os.path.join(output_dir, "manifest.json"), "w") as f:
        json.dump(
            {
                **manifest,
                "format": "kbert-pretraining-npy",
                "examples": int(len(arrays["input_ids"])),
            },
            f,
            indent=2,
        )
    return output_dir


class NumpyPretrainingData(keras.utils.PyDataset):
    """Memory-mapped `(x, y)` batches of an `export_numpy` directory.

    Args:
        directory: str. written by `export_numpy`.
        batch_size: int.
        shuffle: bool. a new order each epoch, from `seed` and the epoch.
        seed: int.
    """

    def __init__(self, directory, batch_size, shuffle=True, seed=0, **kwargs):
        super().__init__(**kwargs)
        missing = [
            n for n in X_NAMES + Y_NAMES if not os.path.isfile(os.path.join(directory, f"{n}.npy"))
        ]
        if missing:
            raise ValueError(f"{directory} lacks {missing}; write it with kbert.data.export_numpy")
        self.arrays = {
            n: np.load(os.path.join(directory, f"{n}.npy"), mmap_mode="r")
            for n in X_NAMES + Y_NAMES
        }
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.count = len(self.arrays["token_ids"])
        if self.count < batch_size:
            raise ValueError(
                f"{directory} has {self.count} examples, fewer than batch_size={batch_size}"
            )
        self._order = self._make_order()

    def _make_order(self):
        if not self.shuffle:
            return np.arange(self.count)
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.count)

    def __len__(self):
        return self.count // self.batch_size

    def __getitem__(self, index):
        rows = np.sort(self._order[index * self.batch_size : (index + 1) * self.batch_size])
        x = {n: np.asarray(self.arrays[n][rows]) for n in X_NAMES}
        y = {n: np.asarray(self.arrays[n][rows]) for n in Y_NAMES}
        return x, y

    def on_epoch_end(self):
        self.epoch += 1
        self._order = self._make_order()
