"""Static pre-training data creation (the `kbert create-pretraining-data` command).

One TFRecord shard per input file, made in parallel worker processes; each
shard is seeded from (seed, shard index), so the same seed gives
byte-identical files whatever the number of workers.
"""

import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import random

from kbert.data.corpus import CorpusReport, read_documents
from kbert.data.pretraining import (
    InstanceMaker,
    MaskingConfig,
    instances_to_arrays,
    tokenize_documents,
)
from kbert.tokenizers import BertTokenizer


def _shard_instances(args):
    path, tokenizer_state, masking, dupe_factor, seed, index, format = args
    tokenizer = BertTokenizer(**tokenizer_state)
    report = CorpusReport()
    documents = tokenize_documents(
        read_documents([path], format=format, report=report), tokenizer, report
    )
    rng = random.Random(f"{seed}:{index}")
    instances = InstanceMaker(tokenizer, masking).from_documents(documents, rng, dupe_factor)
    arrays = instances_to_arrays(
        instances, masking.max_seq_length, masking.max_predictions_per_seq, tokenizer.pad_id
    )
    return index, arrays, len(instances), dataclasses.asdict(report)


def create_pretraining_data(
    inputs,
    tokenizer,
    output_dir,
    masking=None,
    dupe_factor=10,
    seed=12345,
    format="lines",
    workers=None,
    progress=True,
):
    """Writes pre-training TFRecords (original feature names) for each input file.

    Args:
        inputs: list of corpus file paths (one output shard each).
        tokenizer: `kbert.BertTokenizer`.
        output_dir: str. gets `<name>-<index>.tfrecord` files and `manifest.json`.
        masking: `MaskingConfig` (sequence length, predictions, probabilities,
            whole-word masking, sentence task: NSP or ALBERT's SOP).
        dupe_factor: int. passes over each corpus, each with fresh masks.
        seed: int. same seed -> byte-identical output.
        format: str. corpus format ("lines", "prose", "wikitext").
        workers: int or None. worker processes (default: cores, at most #inputs).
        progress: bool. show a progress bar.

    Returns:
        dict: the manifest (files, instance counts, corpus report, settings).
    """
    if not isinstance(tokenizer, BertTokenizer):
        raise TypeError(
            f"pre-training data is made with a WordPiece BertTokenizer, got "
            f"{type(tokenizer).__name__}"
        )
    import tensorflow as tf

    from kbert.data.tfrecords import FEATURE_NAMES, _example  # imports TensorFlow

    masking = masking or MaskingConfig()
    inputs = [
        os.fspath(p) for p in ([inputs] if isinstance(inputs, (str, os.PathLike)) else inputs)
    ]
    if not inputs:
        raise ValueError("no input files given")
    for path in inputs:
        if not os.path.isfile(path):
            raise ValueError(f"input file {path!r} does not exist")
    if dupe_factor < 1:
        raise ValueError(f"dupe_factor must be at least 1, got {dupe_factor}")
    os.makedirs(output_dir, exist_ok=True)
    state = {"vocabulary": tokenizer.vocabulary, "lowercase": tokenizer.lowercase}
    state.update({f"{k}_token": v for k, v in tokenizer.special_tokens.items()})
    state.update(
        rules=tokenizer.rules,
        max_input_chars_per_word=tokenizer.max_input_chars_per_word,
        strip_accents=tokenizer.strip_accents,
        tokenize_chinese_chars=tokenizer.tokenize_chinese_chars,
    )
    jobs = [(path, state, masking, dupe_factor, seed, i, format) for i, path in enumerate(inputs)]
    workers = workers or min(len(jobs), os.cpu_count() or 1)

    if workers > 1:
        context = multiprocessing.get_context("spawn")
        pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=context)
        results = pool.map(_shard_instances, jobs)
    else:
        pool, results = None, map(_shard_instances, jobs)
    if progress:
        from tqdm.auto import tqdm

        results = tqdm(results, total=len(jobs), desc="creating pre-training data", unit="shard")
    files, total, report = [], 0, CorpusReport()
    try:
        for index, arrays, count, shard_report in results:
            name = f"{os.path.splitext(os.path.basename(inputs[index]))[0]}-{index:05d}.tfrecord"
            with tf.io.TFRecordWriter(os.path.join(output_dir, name)) as writer:
                for row in range(count):
                    writer.write(_example(arrays, row).SerializeToString(deterministic=True))
            files.append(
                {"file": name, "source": os.path.basename(inputs[index]), "instances": count}
            )
            total += count
            for key, value in shard_report.items():
                setattr(report, key, getattr(report, key) + value)
    finally:
        if pool is not None:
            pool.shutdown()
    manifest = {
        "format": "bert-pretraining-tfrecord",
        "features": list(FEATURE_NAMES),
        "instances": total,
        "files": files,
        "corpus": dataclasses.asdict(report),
        "masking": dataclasses.asdict(masking),
        "dupe_factor": dupe_factor,
        "seed": seed,
        "lowercase": tokenizer.lowercase,
        "vocabulary_size": tokenizer.vocabulary_size,
        "special_ids": {
            "cls": tokenizer.cls_id,
            "sep": tokenizer.sep_id,
            "mask": tokenizer.mask_id,
            "pad": tokenizer.pad_id,
        },
    }
    with open(os.path.join(output_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
    if progress:
        print(f"{report}; wrote {total} instances to {output_dir}")
    return manifest
