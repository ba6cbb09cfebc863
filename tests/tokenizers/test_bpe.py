"""Byte-level BPE from a tokenizer.json (RoBERTa, Longformer): the ids,
packing, offsets and text transformers' fast tokenizer gives for the same
file, through kbert's preprocessor, saved artifacts and tf.data."""

import json

import numpy as np
import pytest

import kbert
from kbert.tokenizers import ByteLevelBPETokenizer

tokenizers = pytest.importorskip("tokenizers")

SPECIAL = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]  # RoBERTa's ids 0-4
TEXTS = [
    "Hello world, Mr. Holmes!",
    "",
    "  leading spaces and a very long sentence that will not fit in the window " * 3,
    "naïve café — 東京 🙂 ünïcödé",
    "tabs\tand\nnewlines",
]
PAIRS = ["a pair", "b", "short", "", "another one 🙂"]


def bpe_json(vocab_size=400):
    """A RoBERTa-shaped tokenizer.json trained on a few lines of text:
    byte-level pre-tokenizer and decoder, RoBERTa's post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    lines = [
        "It is a capital mistake to theorize before one has data.",
        "The world is full of obvious things which nobody by any chance ever observes.",
        "You see, but you do not observe. The distinction is clear.",
    ] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        lines,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=SPECIAL,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    return tok.to_str()


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bpe")
    (directory / "tokenizer.json").write_text(bpe_json(), encoding="utf-8")
    return directory


@pytest.fixture(scope="module")
def reference(bpe_dir):
    transformers = pytest.importorskip("transformers")
    names = dict(bos_token="<s>", eos_token="</s>", sep_token="</s>", cls_token="<s>")
    names.update(pad_token="<pad>", unk_token="<unk>", mask_token="<mask>")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(bpe_dir / "tokenizer.json"), **names
    )


def _theirs(reference, texts, pairs, length):
    out = reference(
        texts,
        pairs,
        truncation="longest_first",
        max_length=length,
        padding="max_length",
    )
    return np.array(out["input_ids"]), np.array(out["attention_mask"])


@pytest.mark.parametrize("length", [7, 16, 64])
def test_packing_matches_transformers(bpe_dir, reference, length):
    """`<s> A </s>` and `<s> A </s></s> B </s>`, longest-first truncation,
    padding, one token type: transformers' ids and attention mask."""
    ours = ByteLevelBPETokenizer.load(bpe_dir)
    for pairs in (None, PAIRS):
        packed = ours(TEXTS, pairs, sequence_length=length)
        ids, mask = _theirs(reference, TEXTS, pairs, length)
        np.testing.assert_array_equal(packed["token_ids"], ids)
        np.testing.assert_array_equal(packed["padding_mask"], mask)
        assert not packed["segment_ids"].any()
    assert ours.tokenize("") == []


def test_text_offsets_and_special_ids_match_transformers(bpe_dir, reference):
    ours = ByteLevelBPETokenizer.load(bpe_dir)
    assert (ours.cls_id, ours.pad_id, ours.sep_id, ours.unk_id, ours.mask_id) == (0, 1, 2, 3, 4)
    assert ours.vocabulary_size == len(reference)
    for text in TEXTS:
        theirs = reference(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, starts, ends = ours.tokenize_with_offsets(text)
        assert ids == theirs["input_ids"] == ours.tokenize(text)
        spans = [tuple(s) for s in theirs["offset_mapping"]]
        assert list(zip(starts.tolist(), ends.tolist())) == spans
        assert ours.detokenize(ids) == reference.decode(ids, skip_special_tokens=True)
    packed = ours(TEXTS[:1], sequence_length=12)["token_ids"]
    assert ours.detokenize(packed) == [reference.decode(packed[0], skip_special_tokens=True)]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ours.detokenize([ours.vocabulary_size])


def test_preprocessor_round_trips_through_config_and_directory(bpe_dir, tmp_path):
    """A saved artifact embeds the file's text (never its path); a preset
    directory holds tokenizer.json and reloads as the same tokenizer."""
    pre = kbert.BertPreprocessor(ByteLevelBPETokenizer.load(bpe_dir), 20)
    expected = pre(TEXTS, PAIRS)
    config = json.loads(json.dumps(pre.get_config()))
    assert config["tokenizer"]["kind"] == "byte_level_bpe"
    assert "path" not in json.dumps(config["tokenizer"]).lower()
    again = kbert.BertPreprocessor.from_config(config)
    for name, value in again(TEXTS, PAIRS).items():
        np.testing.assert_array_equal(value, expected[name])
    pre.save_to_directory(tmp_path)
    loaded = kbert.BertPreprocessor.from_directory(str(tmp_path))
    assert isinstance(loaded.tokenizer, ByteLevelBPETokenizer) and loaded.sequence_length == 20
    for name, value in loaded(TEXTS, PAIRS).items():
        np.testing.assert_array_equal(value, expected[name])


def test_tf_data_path_gives_the_python_ids(bpe_dir):
    tf = pytest.importorskip("tensorflow")
    pre = kbert.BertPreprocessor(ByteLevelBPETokenizer.load(bpe_dir), 16)
    expected = pre(TEXTS, PAIRS)
    data = tf.data.Dataset.from_tensor_slices((TEXTS, PAIRS)).batch(2)
    batches = list(data.map(lambda a, b: pre(a, b)).as_numpy_iterator())
    for name in expected:
        got = np.concatenate([b[name] for b in batches])
        np.testing.assert_array_equal(got, expected[name])


def test_bad_tokenizer_files_are_refused(tmp_path):
    wordpiece = {"model": {"type": "WordPiece", "vocab": {"[UNK]": 0}}}
    with pytest.raises(ValueError, match="WordPiece model, not BPE"):
        ByteLevelBPETokenizer(json.dumps(wordpiece))
    with pytest.raises(ValueError, match="not valid JSON"):
        ByteLevelBPETokenizer("{not json")
    with pytest.raises(ValueError, match="text of a tokenizer.json"):
        ByteLevelBPETokenizer(str(tmp_path / "tokenizer.json").encode())
    with pytest.raises(ValueError, match=r"special tokens \['\[CLS\]'\] are not in"):
        ByteLevelBPETokenizer(bpe_json(), cls_token="[CLS]")
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        ByteLevelBPETokenizer.load(tmp_path)
    short = ByteLevelBPETokenizer(bpe_json())
    with pytest.raises(ValueError, match="cannot hold the 4 special tokens"):
        short(["a"], ["b"], sequence_length=3)


def test_export_tokenizer_json_gives_the_preprocessors_ids(bpe_dir, tmp_path):
    """`export_tokenizer_json` of a BPE preprocessor: the file's model with
    kbert's packing, truncation and padding, for serving without kbert."""
    from tokenizers import Tokenizer

    from kbert.export import export_tokenizer_json

    pre = kbert.BertPreprocessor(ByteLevelBPETokenizer.load(bpe_dir), 16)
    served = Tokenizer.from_file(export_tokenizer_json(pre, str(tmp_path)))
    expected = pre(TEXTS, PAIRS)
    encodings = served.encode_batch(list(zip(TEXTS, PAIRS)))
    np.testing.assert_array_equal([e.ids for e in encodings], expected["token_ids"])
    np.testing.assert_array_equal([e.attention_mask for e in encodings], expected["padding_mask"])
    np.testing.assert_array_equal([e.type_ids for e in encodings], expected["segment_ids"])
    single = served.encode_batch(TEXTS)
    np.testing.assert_array_equal([e.ids for e in single], pre(TEXTS)["token_ids"])


def test_raw_string_savedmodel_refuses_a_bpe_tokenizer(bpe_dir):
    from kbert.export.text import export_text_model

    backbone = kbert.BertBackbone(
        vocabulary_size=400, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=8
    )
    pre = kbert.BertPreprocessor(ByteLevelBPETokenizer.load(bpe_dir), 16)
    model = kbert.BertClassifier(backbone, 2, preprocessor=pre)
    with pytest.raises(ValueError, match="holds WordPiece only"):
        export_text_model(model, "unused")


def test_hugging_face_export_keeps_the_bpe_tokenizer(bpe_dir, tmp_path):
    """A BERT with a BPE preprocessor exported to a Hugging Face directory:
    transformers' AutoTokenizer packs as kbert did, and kbert reloads the
    same tokenizer from it."""
    transformers = pytest.importorskip("transformers")
    from kbert.convert.huggingface import export_to_huggingface

    backbone = kbert.BertBackbone(
        vocabulary_size=400, num_layers=1, num_heads=2, hidden_dim=8, intermediate_dim=8
    )
    pre = kbert.BertPreprocessor(ByteLevelBPETokenizer.load(bpe_dir), 16)
    export_to_huggingface(kbert.BertClassifier(backbone, 2, preprocessor=pre), str(tmp_path))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    out = theirs(TEXTS, PAIRS, truncation="longest_first", max_length=16, padding="max_length")
    np.testing.assert_array_equal(out["input_ids"], pre(TEXTS, PAIRS)["token_ids"])
    again = kbert.BertPreprocessor.from_directory(str(tmp_path), 16)
    np.testing.assert_array_equal(again(TEXTS, PAIRS)["token_ids"], pre(TEXTS, PAIRS)["token_ids"])


def test_word_tagging_reads_words_as_roberta_does(bpe_dir):
    """Pre-split words for tagging: each word as it reads after a space, the
    ids RoBERTa's tokenizer gives with `add_prefix_space=True` on
    pre-split words (the tokenizers library with that setting)."""
    from tokenizers import Tokenizer

    ours = ByteLevelBPETokenizer.load(bpe_dir)
    words = ["The", "world", "is", "full", "naïve", "🙂"]
    content = json.loads(ours.tokenizer_json)
    content["pre_tokenizer"]["add_prefix_space"] = True
    theirs = Tokenizer.from_str(json.dumps(content))
    expected = theirs.encode(words, is_pretokenized=True, add_special_tokens=False).ids
    pieces = ours.tokenize_split_words(words)
    assert [i for word in pieces for i in word] == expected
    assert pieces[1] == ours.tokenize(" world") != ours.tokenize("world")


def test_exported_file_keeps_robertas_offsets(bpe_dir, reference):
    """`serving_json` keeps RoBERTa's post-processor where the file has it
    (the same packing, and offsets trimmed of their leading space)."""
    from tokenizers import Tokenizer

    ours = ByteLevelBPETokenizer.load(bpe_dir)
    served = Tokenizer.from_str(json.dumps(ours.serving_json()))
    assert served.to_str() and ours.serving_json()["post_processor"]["type"] == "RobertaProcessing"
    again = ByteLevelBPETokenizer(json.dumps(ours.serving_json()))
    for text in TEXTS:
        a, b = again.tokenize_with_offsets(text), ours.tokenize_with_offsets(text)
        assert a[0] == b[0] and a[1].tolist() == b[1].tolist() and a[2].tolist() == b[2].tolist()


def test_lone_surrogates_and_non_strings(bpe_dir):
    ours = ByteLevelBPETokenizer.load(bpe_dir)
    assert ours.tokenize("a\ud800b") == ours.tokenize("a\ufffdb")
    ids, starts, ends = ours.tokenize_with_offsets("a\ud800b")
    assert ends.max() == 3
    with pytest.raises(ValueError, match="texts must be strings"):
        ours.tokenize([b"bytes"])


def test_pretraining_data_refuses_a_bpe_tokenizer(bpe_dir, tmp_path):
    from kbert.data.create import create_pretraining_data
    from kbert.data.pretraining import InstanceMaker, MaskingConfig

    ours = ByteLevelBPETokenizer.load(bpe_dir)
    with pytest.raises(TypeError, match="WordPiece BertTokenizer"):
        InstanceMaker(ours, MaskingConfig())
    with pytest.raises(TypeError, match="WordPiece BertTokenizer"):
        create_pretraining_data([], ours, str(tmp_path))
