import filecmp
import json
import os
import random

import numpy as np
import pytest

from kbert.data import (
    CorpusReport,
    InstanceMaker,
    MaskingConfig,
    read_documents,
    tokenize_documents,
)
from kbert.tokenizers import BertTokenizer, train_wordpiece_vocabulary
from tests.tokenizers.reference import data_dir

tf = pytest.importorskip("tensorflow")

pytestmark = pytest.mark.skipif(data_dir() is None, reason="../shared/data is not present")


def corpus(name):
    return os.path.join(data_dir(), "corpora", name)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    train_wordpiece_vocabulary([corpus("sherlock.txt")], 2000, output=str(path))
    return BertTokenizer(str(path))


@pytest.fixture(scope="module")
def created(tokenizer, tmp_path_factory):
    from kbert.data import create_pretraining_data

    out = tmp_path_factory.mktemp("created")
    masking = MaskingConfig(max_seq_length=64, max_predictions_per_seq=10)
    create_pretraining_data(
        [corpus("sherlock.txt"), corpus("the-verdict.txt")],
        tokenizer,
        str(out),
        masking=masking,
        dupe_factor=5,
        seed=7,
        format="prose",
        workers=1,
        progress=False,
    )
    return out


def test_statistics_follow_the_paper(created):
    from kbert.data import check_directory

    stats = check_directory(str(created))
    assert stats["examples"] > 11_000
    assert abs(stats["chosen_share_of_non_special"] - 0.15) <= 0.005
    assert abs(stats["mask_share"] - 0.8) <= 0.01
    assert abs(stats["random_share"] - 0.1) <= 0.01
    assert abs(stats["kept_share"] - 0.1) <= 0.01
    assert abs(stats["nsp_random_share"] - 0.5) <= 0.01
    assert stats["special_tokens_chosen"] == 0 and stats["padding_chosen"] == 0
    assert stats["segment_errors"] == 0
    assert stats["max_length"] <= 64
    assert stats["weights_exactly_on_real_predictions"]


def test_reads_back_with_the_original_feature_spec(created):
    """Plain tf.io.parse_single_example with run_pretraining.py's spec."""
    spec = {
        "input_ids": tf.io.FixedLenFeature([64], tf.int64),
        "input_mask": tf.io.FixedLenFeature([64], tf.int64),
        "segment_ids": tf.io.FixedLenFeature([64], tf.int64),
        "masked_lm_positions": tf.io.FixedLenFeature([10], tf.int64),
        "masked_lm_ids": tf.io.FixedLenFeature([10], tf.int64),
        "masked_lm_weights": tf.io.FixedLenFeature([10], tf.float32),
        "next_sentence_labels": tf.io.FixedLenFeature([1], tf.int64),
    }
    files = sorted(str(p) for p in created.glob("*.tfrecord"))
    record = next(iter(tf.data.TFRecordDataset(files)))
    example = tf.io.parse_single_example(record, spec)
    assert example["input_ids"][0].numpy() == 2  # [CLS]
    assert set(json.loads((created / "manifest.json").read_text())["features"]) == set(spec)


def test_same_seed_is_byte_identical_and_other_seeds_differ(tokenizer, tmp_path):
    from kbert.data import create_pretraining_data

    kwargs = dict(
        masking=MaskingConfig(max_seq_length=64, max_predictions_per_seq=10),
        dupe_factor=1,
        format="prose",
        progress=False,
    )
    lines = open(corpus("sherlock.txt"), encoding="utf-8-sig").read().splitlines()
    inputs = []
    for i in range(2):
        inputs.append(str(tmp_path / f"part{i}.txt"))
        with open(inputs[-1], "w", encoding="utf-8") as f:
            f.write("\n".join(lines[500 + 1500 * i : 2000 + 1500 * i]))
    create_pretraining_data(inputs, tokenizer, str(tmp_path / "a"), seed=1, workers=2, **kwargs)
    create_pretraining_data(inputs, tokenizer, str(tmp_path / "b"), seed=1, workers=1, **kwargs)
    create_pretraining_data(inputs, tokenizer, str(tmp_path / "c"), seed=2, workers=1, **kwargs)
    names = sorted(p.name for p in (tmp_path / "a").glob("*.tfrecord"))
    assert len(names) == 2
    for name in names:
        assert filecmp.cmp(tmp_path / "a" / name, tmp_path / "b" / name, shallow=False)
    assert not filecmp.cmp(tmp_path / "a" / names[0], tmp_path / "c" / names[0], shallow=False)


def test_whole_word_masking_chooses_every_piece(tokenizer):
    documents = tokenize_documents(
        read_documents([corpus("the-verdict.txt")], format="prose"), tokenizer
    )
    maker = InstanceMaker(
        tokenizer,
        MaskingConfig(max_seq_length=64, max_predictions_per_seq=10, whole_word_mask=True),
    )
    instances = maker.from_documents(documents, random.Random(0), dupe_factor=2)
    continuation = maker.is_continuation
    special = {tokenizer.cls_id, tokenizer.sep_id}
    checked = 0
    for inst in instances:
        original = list(inst.token_ids)
        for pos, label in zip(inst.mask_positions, inst.mask_ids):
            original[pos] = label
        chosen = set(inst.mask_positions)
        for pos in chosen:
            # every piece of the word around a chosen position is chosen too
            start = pos
            while (
                start > 0 and continuation[original[start]] and original[start - 1] not in special
            ):
                start -= 1
            end = pos + 1
            while end < len(original) and continuation[original[end]]:
                end += 1
            assert set(range(start, end)) <= chosen
            checked += end - start > 1
    assert checked > 0


def test_rows_without_predictions_are_padded_with_zero_weight(tokenizer):
    from kbert.data.pretraining import Instance, instances_to_arrays

    inst = Instance([2, 7, 3, 8, 3], [0, 0, 0, 1, 1], [1], [7], False)
    arrays = instances_to_arrays([inst], 8, 3, tokenizer.pad_id)
    assert arrays["masked_lm_weights"][0].tolist() == [1.0, 0.0, 0.0]
    assert arrays["input_mask"][0].tolist() == [1] * 5 + [0] * 3


def test_pretraining_dataset_batches(created):
    from kbert.data import pretraining_dataset

    ds = pretraining_dataset(
        str(created / "*.tfrecord"),
        batch_size=16,
        max_seq_length=64,
        max_predictions_per_seq=10,
        seed=3,
    )
    x, y = next(iter(ds))
    assert set(x) == {"token_ids", "segment_ids", "padding_mask", "mask_positions"}
    assert set(y) == {"mask_ids", "mask_weights", "next_sentence_labels"}
    assert x["token_ids"].shape == (16, 64) and x["mask_positions"].shape == (16, 10)
    assert y["next_sentence_labels"].shape == (16,)
    again = next(
        iter(
            pretraining_dataset(
                str(created / "*.tfrecord"),
                batch_size=16,
                max_seq_length=64,
                max_predictions_per_seq=10,
                seed=3,
            )
        )
    )
    np.testing.assert_array_equal(x["token_ids"].numpy(), again[0]["token_ids"].numpy())
    # per-worker sharding splits the files
    shard0 = pretraining_dataset(
        str(created / "*.tfrecord"), 8, 64, 10, shuffle=False, num_shards=2, shard_index=0
    )
    shard1 = pretraining_dataset(
        str(created / "*.tfrecord"), 8, 64, 10, shuffle=False, num_shards=2, shard_index=1
    )
    first0, first1 = (
        next(iter(shard0))[0]["token_ids"].numpy(),
        next(iter(shard1))[0]["token_ids"].numpy(),
    )
    assert not np.array_equal(first0, first1)


def test_dynamic_mode_gives_fresh_masks_each_epoch(tokenizer):
    from kbert.data import dynamic_pretraining_dataset

    documents = tokenize_documents(
        read_documents([corpus("the-verdict.txt")], format="prose", min_document_sentences=5),
        tokenizer,
    )
    ds = dynamic_pretraining_dataset(
        documents, tokenizer, batch_size=4, masking=MaskingConfig(64, 10), seed=0
    )
    epoch1 = [b[0]["mask_positions"].numpy() for b in ds]
    epoch2 = [b[0]["mask_positions"].numpy() for b in ds]
    assert len(epoch1) > 3
    assert not all(np.array_equal(a, b) for a, b in zip(epoch1, epoch2))
    ds_again = dynamic_pretraining_dataset(
        documents, tokenizer, batch_size=4, masking=MaskingConfig(64, 10), seed=0
    )
    np.testing.assert_array_equal(epoch1[0], next(iter(ds_again))[0]["mask_positions"].numpy())


def test_corpus_errors_and_report(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n")
    with pytest.raises(ValueError, match="corpus is empty"):
        read_documents([str(empty)])
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1"))
    with pytest.raises(ValueError, match="not UTF-8"):
        read_documents([str(latin)])
    with pytest.raises(ValueError, match="does not exist"):
        read_documents([str(tmp_path / "missing" / "x.txt")])
    report = CorpusReport()
    docs = read_documents([corpus("sample_text.txt")], report=report)
    assert report.files == 1 and report.documents == len(docs) >= 3
    assert report.sentences == sum(len(d) for d in docs)


def test_one_document_cannot_make_nsp_pairs(tokenizer):
    maker = InstanceMaker(tokenizer, MaskingConfig(64, 10))
    with pytest.raises(ValueError, match="at least 2 documents"):
        maker.from_documents([[[5, 6, 7], [8, 9]]], random.Random(0))


def test_cli_creates_and_checks(tokenizer, tmp_path, capsys):
    from kbert.cli import main

    tokenizer.save(tmp_path / "tok")
    rc = main(
        [
            "create-pretraining-data",
            "--input",
            corpus("sample_text.txt"),
            "--vocab",
            str(tmp_path / "tok" / "vocab.txt"),
            "--output",
            str(tmp_path / "out"),
            "--max-seq-length",
            "64",
            "--max-predictions-per-seq",
            "10",
            "--dupe-factor",
            "2",
            "--seed",
            "3",
        ]
    )
    assert rc == 0
    assert main(["check-pretraining-data", str(tmp_path / "out")]) == 0
    assert '"segment_errors": 0' in capsys.readouterr().out
    assert (
        main(
            [
                "create-pretraining-data",
                "--input",
                str(tmp_path / "nope.txt"),
                "--vocab",
                str(tmp_path / "tok" / "vocab.txt"),
                "--output",
                str(tmp_path / "o2"),
            ]
        )
        == 2
    )


def test_numpy_export_trains_without_tf_data(created, tmp_path):
    import kbert
    from kbert.data import NumpyPretrainingData, export_numpy
    from kbert.data.check import load_arrays

    export_numpy(str(created), str(tmp_path / "npy"))
    data = NumpyPretrainingData(str(tmp_path / "npy"), batch_size=8, shuffle=False)
    x, y = data[0]
    original = load_arrays(str(created), 64, 10)
    np.testing.assert_array_equal(x["token_ids"], original["input_ids"][:8])
    np.testing.assert_array_equal(
        y["next_sentence_labels"], original["next_sentence_labels"][:8, 0]
    )
    model = kbert.BertPreTrainer(
        kbert.BertBackbone(
            vocabulary_size=2000,
            num_layers=1,
            num_heads=2,
            hidden_dim=16,
            intermediate_dim=32,
            max_sequence_length=64,
        )
    )
    model.compile()
    history = model.fit(data, steps_per_epoch=2, epochs=1, verbose=0).history
    assert np.isfinite(history["loss"][0])


def test_documents_from_an_iterable():
    report = CorpusReport()
    docs = read_documents(
        ["Cats and/or dogs live here. They sleep a lot.", ["One sentence.", "  ", "Two."], "", []],
        report=report,
    )
    assert docs == [["Cats and/or dogs live here.", "They sleep a lot."], ["One sentence.", "Two."]]
    assert report.documents == 2 and report.skipped_documents == 2 and report.sentences == 4


def test_same_seed_is_byte_identical_across_processes(tokenizer, tmp_path):
    """Each process orders protobuf's feature map its own way unless the
    examples are serialized deterministically: two fresh processes, one seed,
    the same bytes."""
    import subprocess
    import sys

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(tokenizer.vocabulary) + "\n", encoding="utf-8")
    source = tmp_path / "part.txt"
    lines = open(corpus("sherlock.txt"), encoding="utf-8-sig").read().splitlines()
    source.write_text("\n".join(lines[500:1500]), encoding="utf-8")
    code = (
        "import sys\n"
        "from kbert.data import MaskingConfig, create_pretraining_data\n"
        "from kbert.tokenizers import BertTokenizer\n"
        "create_pretraining_data([sys.argv[1]], BertTokenizer(sys.argv[2]), sys.argv[3], seed=3,"
        " workers=1, dupe_factor=1, format='prose', progress=False,"
        " masking=MaskingConfig(max_seq_length=64, max_predictions_per_seq=10))\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root, "TF_CPP_MIN_LOG_LEVEL": "3"}
    for out in ("a", "b"):
        result = subprocess.run(
            [sys.executable, "-c", code, str(source), str(vocab), str(tmp_path / out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-2000:]
    names = sorted(p.name for p in (tmp_path / "a").glob("*.tfrecord"))
    assert names
    for name in names:
        assert filecmp.cmp(tmp_path / "a" / name, tmp_path / "b" / name, shallow=False)
