"""Pre-training TFRecords in the original BERT feature format, and tf.data
pipelines that turn them (or documents, on the fly) into `(x, y)` batches.

Feature names on disk are the original ones, so files made by Google's
`create_pretraining_data.py` train here and the other way round. Batches use
kbert's names: x = token_ids, segment_ids, padding_mask, mask_positions;
y = mask_ids, mask_weights, next_sentence_labels.
"""

import os
import random

import tensorflow as tf

from kbert.data.pretraining import InstanceMaker, MaskingConfig, instances_to_arrays

FEATURE_NAMES = (
    "input_ids",
    "input_mask",
    "segment_ids",
    "masked_lm_positions",
    "masked_lm_ids",
    "masked_lm_weights",
    "next_sentence_labels",
)


def feature_spec(max_seq_length, max_predictions_per_seq):
    """The original `run_pretraining.py` parsing spec."""
    t, p = max_seq_length, max_predictions_per_seq
    return {
        "input_ids": tf.io.FixedLenFeature([t], tf.int64),
        "input_mask": tf.io.FixedLenFeature([t], tf.int64),
        "segment_ids": tf.io.FixedLenFeature([t], tf.int64),
        "masked_lm_positions": tf.io.FixedLenFeature([p], tf.int64),
        "masked_lm_ids": tf.io.FixedLenFeature([p], tf.int64),
        "masked_lm_weights": tf.io.FixedLenFeature([p], tf.float32),
        "next_sentence_labels": tf.io.FixedLenFeature([1], tf.int64),
    }


def _example(arrays, row):
    def ints(values):
        return tf.train.Feature(int64_list=tf.train.Int64List(value=values.tolist()))

    feature = {
        name: ints(arrays[name][row]) for name in FEATURE_NAMES if name != "masked_lm_weights"
    }
    feature["masked_lm_weights"] = tf.train.Feature(
        float_list=tf.train.FloatList(value=arrays["masked_lm_weights"][row].tolist())
    )
    return tf.train.Example(features=tf.train.Features(feature=feature))


def write_instances(instances, path, max_seq_length, max_predictions_per_seq, pad_id=0):
    """Writes instances to one TFRecord file; returns the count."""
    arrays = instances_to_arrays(instances, max_seq_length, max_predictions_per_seq, pad_id)
    with tf.io.TFRecordWriter(path) as writer:
        for row in range(len(instances)):
            writer.write(_example(arrays, row).SerializeToString(deterministic=True))
    return len(instances)


def to_model_batch(features):
    """Original feature names -> kbert (x, y) names, int32 ids."""
    x = {
        "token_ids": tf.cast(features["input_ids"], tf.int32),
        "segment_ids": tf.cast(features["segment_ids"], tf.int32),
        "padding_mask": tf.cast(features["input_mask"], tf.int32),
        "mask_positions": tf.cast(features["masked_lm_positions"], tf.int32),
    }
    y = {
        "mask_ids": tf.cast(features["masked_lm_ids"], tf.int32),
        "mask_weights": tf.cast(features["masked_lm_weights"], tf.float32),
        "next_sentence_labels": tf.cast(
            tf.reshape(features["next_sentence_labels"], [-1]), tf.int32
        ),
    }
    return x, y


def pretraining_dataset(
    file_pattern,
    batch_size,
    max_seq_length=128,
    max_predictions_per_seq=20,
    shuffle=True,
    seed=None,
    repeat=False,
    num_shards=1,
    shard_index=0,
    shuffle_buffer=10_000,
    cycle_length=8,
    drop_remainder=True,
    skip_batches=0,
):
    """A tf.data pipeline of `(x, y)` batches from pre-training TFRecords.

    Args:
        file_pattern: str or list of str. TFRecord files or glob patterns.
        batch_size: int. global batch size (per worker when sharded).
        max_seq_length, max_predictions_per_seq: int. as the files were made.
        shuffle: bool. shuffle files and examples.
        seed: int or None. makes file order, interleave and shuffle deterministic.
        repeat: bool. repeat forever (for step-based training).
        num_shards, shard_index: int. per-worker sharding by file (multi-host).
        shuffle_buffer: int. example shuffle buffer.
        cycle_length: int. files read in parallel.
        drop_remainder: bool. fixed batch shapes (no recompilation).
        skip_batches: int. start this many batches in (resuming a run: the
            stream is deterministic under a seed, so this restores the data
            position; skipped batches are read but not parsed).

    Example:
    >>> ds = pretraining_dataset("data/*.tfrecord", batch_size=32, seed=0)  # doctest: +SKIP
    """
    patterns = (
        [file_pattern] if isinstance(file_pattern, (str, os.PathLike)) else list(file_pattern)
    )
    files = sorted({f for p in patterns for f in tf.io.gfile.glob(os.fspath(p))})
    if not files:
        raise ValueError(f"no pre-training files match {patterns}")
    if len(files) < num_shards:
        raise ValueError(
            f"{len(files)} file(s) cannot be sharded over {num_shards} workers; write more shards"
        )
    ds = tf.data.Dataset.from_tensor_slices(files)
    ds = ds.shard(num_shards, shard_index)
    if shuffle:
        ds = ds.shuffle(len(files), seed=seed, reshuffle_each_iteration=True)
    if repeat:
        ds = ds.repeat()
    ds = ds.interleave(
        tf.data.TFRecordDataset,
        cycle_length=min(cycle_length, len(files)),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )
    if shuffle:
        ds = ds.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
    ds = ds.batch(batch_size, drop_remainder=drop_remainder)
    if skip_batches:
        ds = ds.skip(skip_batches)
    spec = feature_spec(max_seq_length, max_predictions_per_seq)
    ds = ds.map(
        lambda records: to_model_batch(tf.io.parse_example(records, spec)),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )
    return ds.prefetch(tf.data.AUTOTUNE)


def dynamic_pretraining_dataset(
    documents,
    tokenizer,
    batch_size,
    masking=None,
    seed=0,
    repeat=False,
    drop_remainder=True,
    skip_batches=0,
):
    """Batches made on the fly from tokenized documents: fresh sentence
    pairs (NSP, or SOP with `MaskingConfig(sentence_task="sop")`) and masks
    every epoch (epoch e uses seed + e), nothing written to disk.

    Args:
        documents: list of documents, each a list of sentence id lists
            (`kbert.data.tokenize_documents`).
        tokenizer: `kbert.BertTokenizer`.
        batch_size: int.
        masking: `kbert.data.MaskingConfig`.
        seed: int. epoch e is made with `random.Random(seed + e)`.
        repeat: bool. cycle epochs forever.
    """
    masking = masking or MaskingConfig()
    maker = InstanceMaker(tokenizer, masking)
    t, p = masking.max_seq_length, masking.max_predictions_per_seq
    epoch = {"n": 0}

    def generate():
        rng = random.Random(seed + epoch["n"])
        epoch["n"] += 1
        instances = maker.from_documents(documents, rng)
        arrays = instances_to_arrays(instances, t, p, tokenizer.pad_id)
        for row in range(len(instances)):
            yield {name: arrays[name][row] for name in FEATURE_NAMES}

    signature = {
        name: tf.TensorSpec(shape=spec.shape, dtype=spec.dtype)
        for name, spec in feature_spec(t, p).items()
    }
    ds = tf.data.Dataset.from_generator(generate, output_signature=signature)
    if repeat:
        ds = ds.repeat()
    ds = ds.batch(batch_size, drop_remainder=drop_remainder)
    if skip_batches:
        ds = ds.skip(skip_batches)
    ds = ds.map(to_model_batch, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.prefetch(tf.data.AUTOTUNE)
