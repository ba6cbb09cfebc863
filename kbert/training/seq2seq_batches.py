"""Length buckets for sequence-to-sequence batches: each batch of
(encoder, decoder) rows cut on both sides, each side to its own longest
real row rounded up to a multiple (one compiled step per bucket pair)."""

import keras
import numpy as np

ENCODER = ("encoder_token_ids", "encoder_padding_mask")
DECODER = ("decoder_token_ids", "decoder_padding_mask")


def _bucket(mask, multiple):
    longest = int(np.max(np.sum(np.asarray(mask) != 0, axis=1), initial=1))
    return -(-longest // multiple) * multiple


class Seq2SeqBatches(keras.utils.PyDataset):
    """(x, y) batches of seq2seq model inputs and (B, T) labels, in a new
    random order each epoch (`shuffle`), encoder and decoder sides each cut
    to their longest row rounded up to `multiple` (at most their width).

    Args:
        x: dict of int arrays: the four seq2seq inputs (N, S) and (N, T).
        y: int array (N, T). the labels, cut with the decoder side.
        batch_size: int. rows per batch.
        shuffle: bool. reorder the rows each epoch.
        multiple: int. bucket lengths are multiples of it.
        seed: int. the order's random seed.

    Example:
    >>> x = {k: np.ones((4, 32), "int32") for k in ENCODER + DECODER}
    >>> x["decoder_padding_mask"][:, 5:] = 0
    >>> batches = Seq2SeqBatches(x, np.zeros((4, 32), "int32"), batch_size=2)
    >>> batches[0][0]["decoder_token_ids"].shape
    (2, 16)
    """

    def __init__(self, x, y, batch_size=32, shuffle=True, multiple=16, seed=0):
        super().__init__()
        self.x = {k: np.asarray(v) for k, v in x.items()}
        self.y = np.asarray(y)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.multiple = multiple
        self.rng = np.random.default_rng(seed)
        self.rows = len(self.y)
        self.order = self.rng.permutation(self.rows) if shuffle else np.arange(self.rows)

    def __len__(self):
        return -(-self.rows // self.batch_size)

    def __getitem__(self, index):
        rows = self.order[index * self.batch_size : (index + 1) * self.batch_size]
        source = _bucket(self.x["encoder_padding_mask"][rows], self.multiple)
        target = _bucket(self.x["decoder_padding_mask"][rows], self.multiple)
        x = {}
        for name, value in self.x.items():
            length = source if name in ENCODER else target
            x[name] = value[rows][:, :length]
        return x, self.y[rows][:, :target]

    def on_epoch_end(self):
        if self.shuffle:
            self.order = self.rng.permutation(self.rows)
