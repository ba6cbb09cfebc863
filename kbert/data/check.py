"""Statistics of a pre-training data directory (`kbert check-pretraining-data DIR`)."""

import glob
import json
import os

import numpy as np


def load_arrays(directory_or_files, max_seq_length, max_predictions_per_seq):
    """All examples as numpy arrays, parsed with the original feature spec."""
    import tensorflow as tf

    from kbert.data.tfrecords import feature_spec  # imports TensorFlow

    if isinstance(directory_or_files, str) and os.path.isdir(directory_or_files):
        files = sorted(glob.glob(os.path.join(directory_or_files, "*.tfrecord")))
    else:
        files = list(directory_or_files)
    spec = feature_spec(max_seq_length, max_predictions_per_seq)
    # parsed in batches inside tf.data: one op per 1,024 records, not per record
    batches = tf.data.TFRecordDataset(files).batch(1024).map(lambda r: tf.io.parse_example(r, spec))
    parts = [{k: v.numpy() for k, v in batch.items()} for batch in batches]
    if not parts:
        raise ValueError(f"no examples in {directory_or_files}")
    return {k: np.concatenate([part[k] for part in parts]) for k in spec}


def statistics(arrays, cls_id, sep_id, mask_id, pad_id=0, sentence_task="nsp"):
    """The numbers the paper's recipe fixes, measured on generated examples
    (the share of label 1 is `nsp_random_share`, or `sop_swapped_share` for
    sentence-order data)."""
    ids, mask, seg = arrays["input_ids"], arrays["input_mask"], arrays["segment_ids"]
    pos, labels, weights = (
        arrays["masked_lm_positions"],
        arrays["masked_lm_ids"],
        arrays["masked_lm_weights"],
    )
    real = weights > 0
    n = len(ids)
    chosen_tokens = np.take_along_axis(ids, pos, axis=1)
    lengths = mask.sum(1)
    non_special = ((ids != cls_id) & (ids != sep_id) & (mask == 1)).sum(1)
    # Original ids at chosen positions, to tell [MASK] / kept / random apart.
    originals = ids.copy()
    np.put_along_axis(
        originals, pos, np.where(real, labels, np.take_along_axis(ids, pos, 1)), axis=1
    )
    special_chosen = int(((labels == cls_id) | (labels == sep_id) | (labels == pad_id))[real].sum())
    replaced_mask = (chosen_tokens == mask_id) & real
    kept = (chosen_tokens == labels) & real & ~replaced_mask
    total = real.sum()
    segment_errors = 0
    for row in range(n):
        length = lengths[row]
        seps = np.flatnonzero(originals[row, :length] == sep_id)
        expected = np.zeros(length, int)
        if len(seps) >= 2:
            expected[seps[0] + 1 : length] = 1
        segment_errors += int(
            ids[row, 0] != cls_id
            or originals[row, length - 1] != sep_id
            or (seg[row, :length] != expected).any()
            or (seg[row, length:] != 0).any()
        )
    weights_ok = bool(
        ((weights == 1.0) | (weights == 0.0)).all()
        and (real == (np.arange(pos.shape[1]) < real.sum(1, keepdims=True))).all()
    )
    return {
        "examples": int(n),
        "mean_length": float(lengths.mean()),
        "max_length": int(lengths.max()),
        "chosen_share_of_non_special": float(total / non_special.sum()),
        "at_prediction_cap_share": float((real.sum(1) == pos.shape[1]).mean()),
        "mask_share": float(replaced_mask.sum() / total),
        "random_share": float((real & ~replaced_mask & ~kept).sum() / total),
        "kept_share": float(kept.sum() / total),
        ("sop_swapped_share" if sentence_task == "sop" else "nsp_random_share"): float(
            arrays["next_sentence_labels"].mean()
        ),
        "special_tokens_chosen": special_chosen,
        "padding_chosen": int((np.take_along_axis(mask, pos, 1) == 0)[real].sum()),
        "segment_errors": segment_errors,
        "weights_exactly_on_real_predictions": weights_ok,
    }


def check_directory(directory):
    """Statistics of a directory written by `create_pretraining_data`."""
    with open(os.path.join(directory, "manifest.json")) as f:
        manifest = json.load(f)
    masking = manifest["masking"]
    arrays = load_arrays(directory, masking["max_seq_length"], masking["max_predictions_per_seq"])
    special = manifest["special_ids"]
    return statistics(
        arrays,
        special["cls"],
        special["sep"],
        special["mask"],
        special["pad"],
        sentence_task=masking.get("sentence_task", "nsp"),
    )
