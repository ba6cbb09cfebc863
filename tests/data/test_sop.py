"""Sentence-order prediction pairs (ALBERT) on real text: two consecutive
runs of one document, swapped half of the time (label 1 = swapped).

Instance creation touches no Keras backend: CI runs these once, under
KERAS_BACKEND=jax."""

import os
import random

import keras
import numpy as np
import pytest

from kbert.data import InstanceMaker, MaskingConfig, read_documents, tokenize_documents
from kbert.tokenizers import BertTokenizer, train_wordpiece_vocabulary

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="backend-independent: runs under KERAS_BACKEND=jax"
)

CORPUS = os.path.join(
    os.path.dirname(__file__), "..", "..", "examples", "data", "wikitext-2-valid.tokens.txt"
)
MAX_SEQ_LENGTH = 64


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The first 12 WikiText-2 articles, a tokenizer trained on them, and
    their token-id documents."""
    with open(CORPUS, encoding="utf-8") as f:
        lines = f.readlines()
    titles = [i for i, line in enumerate(lines) if line.startswith(" = ") and line.count("=") == 2]
    directory = tmp_path_factory.mktemp("sop")
    path = directory / "articles.txt"
    path.write_text("".join(lines[: titles[12]]), encoding="utf-8")
    vocabulary = directory / "vocab.txt"
    train_wordpiece_vocabulary([str(path)], 1000, output=str(vocabulary))
    tokenizer = BertTokenizer(str(vocabulary))
    documents = tokenize_documents(read_documents([str(path)], format="wikitext"), tokenizer)
    return path, tokenizer, documents


def _instances(tokenizer, documents, task, seed=0):
    masking = MaskingConfig(MAX_SEQ_LENGTH, 10, sentence_task=task)
    return InstanceMaker(tokenizer, masking).from_documents(
        documents, random.Random(seed), dupe_factor=3
    )


def _segments(instance):
    """(A, B) as original ids (masking undone), without [CLS] and [SEP]."""
    ids = list(instance.token_ids)
    for position, original in zip(instance.mask_positions, instance.mask_ids):
        ids[position] = original
    segments = np.asarray(instance.segment_ids)
    a = ids[1 : int((segments == 0).sum()) - 1]
    b = ids[int((segments == 0).sum()) : -1]
    return a, b


def _text(ids):
    return "," + ",".join(map(str, ids)) + ","


def _placement(first, second, streams):
    """The smallest gap (in tokens) at which `second` follows `first` in
    one document, or None when no document holds them in that order."""
    a, b = _text(first), _text(second)
    best = None
    for stream in streams:
        start = stream.find(a)
        while start != -1:
            end = start + len(a) - 1  # the comma closing `first`
            later = stream.find(b, end)
            if later != -1:
                gap = stream.count(",", end, later)
                best = gap if best is None else min(best, gap)
            start = stream.find(a, start + 1)
    return best


def test_sop_pairs_are_consecutive_runs_of_one_document_swapped_half_the_time(corpus):
    _, tokenizer, documents = corpus
    instances = _instances(tokenizer, documents, "sop")
    n = len(instances)
    assert n > 1000
    swapped = np.mean([inst.sentence_label for inst in instances])
    assert abs(swapped - 0.5) <= 3 * np.sqrt(0.25 / n)  # 3 standard deviations

    streams = [_text([t for sentence in document for t in sentence]) for document in documents]
    untruncated = 0
    for inst in instances:
        a, b = _segments(inst)
        first, second = (b, a) if inst.sentence_label else (a, b)
        gap = _placement(first, second, streams)
        assert gap is not None, "segments not in document order in any one document"
        if len(a) + len(b) < MAX_SEQ_LENGTH - 3:  # nothing was cut: B starts where A ends
            assert gap == 0
            untruncated += 1
    assert untruncated >= 30  # (chunks overshoot their target: most pairs are cut)


def test_nsp_pairs_still_take_random_segments(corpus):
    """The contrast: NSP's label-1 pairs mostly do not continue their A."""
    _, tokenizer, documents = corpus
    instances = _instances(tokenizer, documents, "nsp")[:300]
    streams = [_text([t for sentence in document for t in sentence]) for document in documents]
    random_pairs = [inst for inst in instances if inst.sentence_label]
    in_order = sum(_placement(*_segments(inst), streams) == 0 for inst in random_pairs)
    assert in_order < len(random_pairs) // 10


def test_created_files_carry_the_sop_label(corpus, tmp_path):
    pytest.importorskip("tensorflow")
    from kbert.data import check_directory, create_pretraining_data

    path, tokenizer, _ = corpus
    manifest = create_pretraining_data(
        [str(path)],
        tokenizer,
        str(tmp_path),
        masking=MaskingConfig(MAX_SEQ_LENGTH, 10, sentence_task="sop"),
        dupe_factor=2,
        seed=3,
        format="wikitext",
        workers=1,
        progress=False,
    )
    assert manifest["masking"]["sentence_task"] == "sop"
    stats = check_directory(str(tmp_path))
    assert "nsp_random_share" not in stats
    n = stats["examples"]
    assert abs(stats["sop_swapped_share"] - 0.5) <= 3 * np.sqrt(0.25 / n)
    assert stats["segment_errors"] == 0


def test_bad_sentence_task_raises():
    with pytest.raises(ValueError, match="sentence_task must be 'nsp'"):
        MaskingConfig(sentence_task="order")
