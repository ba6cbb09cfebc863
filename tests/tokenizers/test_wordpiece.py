import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kbert.tokenizers import BertTokenizer, train_wordpiece_vocabulary, truncate_pair
from tests.tokenizers.reference import data_dir, minilm_vocab, reference, shared_texts

tf = pytest.importorskip("tensorflow")
pytest.importorskip("tensorflow_text")

needs_data = pytest.mark.skipif(data_dir() is None, reason="../shared/data is not present")


@pytest.fixture(scope="module")
def uncased():
    return BertTokenizer(minilm_vocab(), lowercase=True)


@pytest.fixture(scope="module")
def cased(tmp_path_factory):
    root = data_dir()
    if root is None:
        pytest.skip("../shared/data is not present")
    files = [
        os.path.join(root, "corpora", f) for f in ("sherlock.txt", "wikitext-2-valid.tokens.txt")
    ]
    files.append(os.path.join(root, "conll2003", "eng.testa"))
    path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    train_wordpiece_vocabulary(files, 4000, output=str(path), lowercase=False)
    return BertTokenizer(str(path), lowercase=False)


@pytest.fixture(scope="module")
def texts():
    return shared_texts()


def _mismatches(tokenizer, texts, reference_ids):
    ours = tokenizer.tokenize(texts)
    return [(t, a, b) for t, a, b in zip(texts, ours, reference_ids) if a != b]


@needs_data
@pytest.mark.large
@pytest.mark.parametrize("rules", ["original", "transformers"])
@pytest.mark.parametrize("which", ["uncased", "cased"])
def test_zero_mismatches_on_shared_data(which, rules, request, texts):
    """Every text against the original rules. The rule sets treat ASCII text
    alike, so the transformers rules take every non-ASCII text and every
    twentieth ASCII one."""
    base = request.getfixturevalue(which)
    tokenizer = BertTokenizer(base.vocabulary, lowercase=base.lowercase, rules=rules)
    ref = reference(tokenizer)
    assert len(texts) > 140_000
    if rules == "transformers":
        texts = [t for i, t in enumerate(texts) if not t.isascii() or i % 20 == 0]
        assert sum(not t.isascii() for t in texts) > 1000
    bad = _mismatches(tokenizer, texts, [ref(t) for t in texts])
    assert not bad, bad[:5]
    in_graph = tokenizer.tf_tokenize(tf.constant(texts)).to_list()
    bad_tf = [t for t, a, b in zip(texts, tokenizer.tokenize(texts), in_graph) if a != b]
    assert not bad_tf, bad_tf[:5]


@needs_data
@pytest.mark.large
def test_agrees_with_transformers_bert_tokenizer(texts):
    """transformers.BertTokenizer (Rust) lowercases character by character, so a
    word-final capital sigma becomes σ instead of the Python rules' ς; every
    other text must agree exactly with rules="transformers"."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.BertTokenizer.from_pretrained(os.path.dirname(minilm_vocab()))
    ours = BertTokenizer.load(os.path.dirname(minilm_vocab()))
    assert ours.rules == "transformers"
    extra = ["ΟΔΟΣ", "Σ", "naïve café", "\u0085x\u0085", "a\u2028b", "e\u0301"]
    sample = texts + extra
    theirs = hf(sample, add_special_tokens=False)["input_ids"]
    bad = [t for t, a, b in zip(sample, ours.tokenize(sample), theirs) if a != b]
    assert "ΟΔΟΣ" in bad  # the known deviation is real...
    assert all("Σ" in t for t in bad), [t for t in bad if "Σ" not in t][:5]  # ...and the only one


# Characters that break tokenizers: controls, odd whitespace, zero-width and
# format characters, U+FFFD, combining accents, CJK, emoji with ZWJ and skin
# tones, case-changing letters (Σ, İ, ß), RTL scripts, punctuation.
HARD = (
    "\x00\x01\x07\x08\x0b\x0c\x1c\x1f\x7f\x85\x9f"
    "\t\n\r \xa0\u1680\u2000\u2005\u200a\u2028\u2029\u202f\u205f\u3000"
    "\u200b\u200c\u200d\u200e\u200f\u2060\ufeff\u00ad\ufffd"
    "\u0300\u0301\u0308\u0327\u0345\u20dd"
    "éÉñçÅøßẞİıΣσςΟΔ"
    "中文字符日本語한국어\u3400\U00020000\uf900"
    "😀👍🏽👨\u200d👩\u200d👧🇫🇷©™"
    "عربيעברית\u0915\u094d\u0937"
    ".,;:!?'\"()[]{}<>/\\|@#$%^&*_-+=~`«»“”‘’—–…¿¡·•§¶"
    "aeiouxyzABCXYZ0123456789"
)
hard_text = st.text(alphabet=st.sampled_from(HARD), max_size=40)
any_text = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=40)
url = st.builds(
    lambda a, b, c: f"https://{a}.example.com/{b}?q={c}#x",
    st.text("abcxyz-", min_size=1, max_size=8),
    st.text("abcXYZ_/.%", max_size=12),
    st.text("äöü 12", max_size=6),
)
long_word = st.builds(lambda c, n: c * n, st.sampled_from("aé中😀x"), st.integers(90, 110))
fuzz_text = st.one_of(hard_text, hard_text, any_text, url, long_word)


@pytest.mark.large
@settings(
    max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True
)
@given(batch=st.lists(fuzz_text, min_size=100, max_size=100))
def test_fuzz_against_reference_and_tf(uncased, batch):
    """100 examples x 100 strings = 10,000 fuzzed strings."""
    ref = reference(uncased)
    ours = uncased.tokenize(batch)
    for text, ids in zip(batch, ours):
        assert ids == ref(text), repr(text)
    in_graph = uncased.tf_tokenize(tf.constant([t.encode("utf-8") for t in batch])).to_list()
    for text, a, b in zip(batch, ours, in_graph):
        assert a == b, repr(text)


def test_empty_whitespace_and_huge_strings(uncased):
    assert uncased.tokenize("") == []
    assert uncased.tokenize(" \t\n\u3000\u200b") == []
    packed = uncased("")
    assert packed["token_ids"][0, :3].tolist() == [uncased.cls_id, uncased.sep_id, uncased.pad_id]
    assert packed["padding_mask"][0].sum() == 2
    huge = "The quick brown fox jumps over the lazy dog. " * 2300  # ~100 KB
    ids = uncased.tokenize(huge)
    assert len(ids) == 10 * 2300
    assert uncased.tf_tokenize(huge).numpy().tolist() == ids
    assert uncased(huge, sequence_length=16)["padding_mask"].sum() == 16


@pytest.mark.parametrize("rules, limit", [("original", 200), ("transformers", 100)])
def test_long_word_is_unknown_by_characters(uncased, rules, limit):
    tok = BertTokenizer(uncased.vocabulary, rules=rules)
    assert tok.max_input_chars_per_word == limit
    assert tok.tokenize("a" * (limit + 1)) == [tok.unk_id]
    assert tok.tokenize("a" * limit) != [tok.unk_id]
    words = ["a" * (limit + 1), "é" * 40, "é" * limit]
    assert tok.tf_tokenize(words).to_list() == tok.tokenize(words)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    rows=st.lists(st.lists(st.integers(5, 999), max_size=12), max_size=6),
    length=st.integers(2, 10),
    as_arrays=st.booleans(),
)
def test_single_segment_packing_is_cls_ids_sep_then_padding(uncased, rows, length, as_arrays):
    """Each row: [CLS], its first T - 2 ids, [SEP], then [PAD]; segment 0; the
    mask on the real tokens (empty rows, rows cut, rows given as arrays)."""
    first = [np.asarray(r, "int32") for r in rows] if as_arrays else rows
    out = uncased.pack(first, sequence_length=length)
    assert all(out[k].shape == (len(rows), length) and out[k].dtype == np.int32 for k in out)
    for row, ids in enumerate(rows):
        want = [uncased.cls_id] + list(ids[: length - 2]) + [uncased.sep_id]
        pad = [uncased.pad_id] * (length - len(want))
        assert out["token_ids"][row].tolist() == want + pad
        assert out["padding_mask"][row].tolist() == [1] * len(want) + [0] * len(pad)
        assert not out["segment_ids"][row].any()


def test_pair_packing(uncased):
    out = uncased(["hello world"], ["how are you"], sequence_length=12)
    tokens = [uncased.id_to_token(i) for i in out["token_ids"][0]]
    assert tokens == [
        "[CLS]",
        "hello",
        "world",
        "[SEP]",
        "how",
        "are",
        "you",
        "[SEP]",
        "[PAD]",
        "[PAD]",
        "[PAD]",
        "[PAD]",
    ]
    assert out["segment_ids"][0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0]
    assert out["padding_mask"][0].tolist() == [1] * 8 + [0] * 4
    in_graph = uncased.tf_call(tf.constant(["hello world"]), tf.constant(["how are you"]), 12)
    for key in out:
        np.testing.assert_array_equal(out[key], in_graph[key].numpy())


def test_truncation_is_longest_first_in_both_paths():
    from kbert.tokenizers.tf_ops import truncate_pair_lengths

    cases = [(a, b, m) for a in range(9) for b in range(9) for m in range(1, 12)]
    la, lb, m = (np.array(c) for c in zip(*cases))
    got_a, got_b = [], []
    for limit in sorted(set(m.tolist())):
        sel = m == limit
        ra, rb = truncate_pair_lengths(tf.constant(la[sel]), tf.constant(lb[sel]), int(limit))
        got_a += ra.numpy().tolist()
        got_b += rb.numpy().tolist()
    expected = []
    for limit in sorted(set(m.tolist())):
        for a, b, mm in cases:
            if mm == limit:
                ta, tb = truncate_pair(range(a), range(b), mm)
                expected.append((len(ta), len(tb)))
    assert list(zip(got_a, got_b)) == expected


def test_offsets_point_into_the_original_text(uncased):
    text = "Héllo, WORLD!  Naïve\u200bcafé 中文 unaffable"
    ids, starts, ends = uncased.tokenize_with_offsets(text)
    assert ids == uncased.tokenize(text)
    for token_id, s, e in zip(ids, starts, ends):
        piece = uncased.id_to_token(token_id).removeprefix("##")
        assert uncased.normalize(text[s:e]).replace(" ", "") == piece


def test_offsets_of_a_list_of_texts_are_each_texts_own(uncased):
    """A list of texts (their words WordPiece'd in one call) gives each
    text's own ids and spans, empty texts and repeated words included."""
    texts = ["Héllo, WORLD!", "", "world héllo world", "Naïve\u200bcafé 中文", "unaffable"] * 3
    vocabulary = uncased.vocabulary
    together = BertTokenizer(vocabulary, lowercase=True).tokenize_with_offsets(texts)
    assert len(together) == len(texts)
    for text, (ids, starts, ends) in zip(texts, together):
        fresh = BertTokenizer(vocabulary, lowercase=True)  # its caches empty
        alone = fresh.tokenize_with_offsets(text)
        assert ids == alone[0] == fresh.tokenize(text)
        np.testing.assert_array_equal(starts, alone[1])
        np.testing.assert_array_equal(ends, alone[2])
        for token_id, s, e in zip(ids, starts, ends):  # spans cover each piece's characters
            piece = fresh.id_to_token(token_id).removeprefix("##")
            assert fresh.normalize(text[s:e]).replace(" ", "") == piece
    assert together[1][0] == [] and together[1][1].shape == (0,)


def test_offsets_of_many_texts_are_made_in_chunks(uncased, monkeypatch):
    """A long list is tokenized a chunk of texts at a time (each holds its
    character maps until its spans are made); a text whose spans cannot be
    aligned is named by its index in the list."""
    from kbert.tokenizers import wordpiece

    monkeypatch.setattr(wordpiece, "_OFFSETS_CHUNK", 2)
    texts = ["héllo world", "a", "", "world", "unaffable café"]
    chunks = []
    original = uncased._tokenize_with_offsets

    def recording(part, first=0):
        chunks.append((first, list(part)))
        return original(part, first)

    monkeypatch.setattr(uncased, "_tokenize_with_offsets", recording)
    out = uncased.tokenize_with_offsets(texts)
    assert chunks == [(0, texts[:2]), (2, texts[2:4]), (4, texts[4:])]
    assert [ids for ids, _, _ in out] == uncased.tokenize(texts)
    monkeypatch.setattr(uncased, "_normalize_with_origin", lambda t: (t + " x", [0] * 9, [1] * 9))
    with pytest.raises(AssertionError, match=r"text 4\)"):
        original(["abcdéfg"], 4)  # not ASCII: its spans are checked against its ids


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(st.characters(min_codepoint=0, max_codepoint=127), max_size=60),
    lowercase=st.booleans(),
)
def test_ascii_offsets_shortcut_is_the_unit_by_unit_normalisation(text, lowercase):
    """Printable ASCII text takes a shortcut to its normalisation and
    character origins: the same as normalising character by character."""
    tokenizer = BertTokenizer(minilm_vocab(), lowercase=lowercase)
    assert tokenizer._normalize_with_origin(text) == tokenizer._normalize_units(text)


@settings(max_examples=200, deadline=None)
@given(
    texts=st.lists(
        st.text(st.characters(min_codepoint=0, max_codepoint=255), max_size=40), max_size=4
    ),
    lowercase=st.booleans(),
)
def test_offsets_are_the_ids_of_tokenize_and_cover_their_pieces(texts, lowercase):
    """Printable ASCII text takes its ids and spans from one pass over its
    words; other text from `tokenize` and the unit-by-unit normalisation:
    either way the ids are `tokenize`'s and each span is its piece."""
    tokenizer = BertTokenizer(minilm_vocab(), lowercase=lowercase)
    for text, (ids, starts, ends) in zip(texts, tokenizer.tokenize_with_offsets(texts)):
        assert ids == tokenizer.tokenize(text)
        for token_id, s, e in zip(ids, starts, ends):
            piece = tokenizer.id_to_token(token_id).removeprefix("##")
            if piece != "[UNK]":
                assert tokenizer.normalize(text[s:e]).replace(" ", "") == piece


# Characters NFC composes (Hangul jamo, letters and combining marks) and
# characters the cleaning deletes between them (U+200B, U+FFFD, controls,
# private-use, unassigned), whitespace, a CJK ideograph and Greek sigma.
COMPOSING = (
    "\u1100\u1101\u1102\u1161\u1162\u1163\u11a8\u11a9\uac00\ud55c"
    "\u0301\u0308\u0327aeEo\u03a3\u03c3"
    "\u200b\u200d\ufffd\x00\x07\ue000\u0378 \t\u4e2d"
)


@settings(max_examples=300, deadline=None)
@given(
    texts=st.lists(st.text(st.sampled_from(COMPOSING), max_size=12), min_size=1, max_size=4),
    lowercase=st.booleans(),
    strip_accents=st.sampled_from([None, False, True]),
)
def test_offsets_where_deleted_characters_part_what_nfc_composes(texts, lowercase, strip_accents):
    """Under transformers' rules the cleaning deletes C* characters before
    NFC, so a lead consonant and a vowel (or a letter and its accent) apart
    around a U+200B compose into one character: the offsets' ids are
    `tokenize`'s and each span normalises to text that holds its piece."""
    with open(minilm_vocab(), encoding="utf-8") as f:
        vocabulary = f.read().splitlines()
    vocabulary += sorted({"\u1100", "##\u1161", "\uac00", "\ud55c", "##\uac00"} - set(vocabulary))
    tokenizer = BertTokenizer(
        vocabulary, lowercase=lowercase, strip_accents=strip_accents, rules="transformers"
    )
    for text, (ids, starts, ends) in zip(texts, tokenizer.tokenize_with_offsets(texts)):
        assert ids == tokenizer.tokenize(text), repr(text)
        for token_id, s, e in zip(ids, starts, ends):
            piece = tokenizer.id_to_token(token_id).removeprefix("##")
            if piece != "[UNK]":  # a character NFD splits in two spans both its pieces
                alone = tokenizer.normalize(text[s:e]).replace(" ", "")
                # a word-final sigma lowercases to ς in its word, σ alone
                assert piece.replace("ς", "σ") in alone.replace("ς", "σ"), repr(text)


def test_offsets_of_jamo_around_a_deleted_character():
    tokenizer = BertTokenizer(
        ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "\u1100", "##\u1161", "\uac00"],
        lowercase=True,
        strip_accents=False,
        rules="transformers",
    )
    ids, starts, ends = tokenizer.tokenize_with_offsets("\u1100\u200b\u1161 \u1100\u1161")
    assert ids == tokenizer.tokenize("\u1100\u200b\u1161 \u1100\u1161") == [7, 7]
    assert starts.tolist() == [0, 4] and ends.tolist() == [3, 6]


def test_detokenize_and_lookup(uncased):
    ids = uncased.tokenize("unaffable tokenization")
    assert uncased.detokenize(ids) == "unaffable tokenization"
    assert uncased.token_to_id(uncased.id_to_token(ids[0])) == ids[0]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        uncased.id_to_token(10**9)


@pytest.mark.parametrize("missing", ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
def test_vocabulary_without_special_token(missing):
    vocab = [t for t in ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a"] if t != missing]
    with pytest.raises(ValueError, match=rf"no \{missing}"):
        BertTokenizer(vocab)


def test_save_and_load(uncased, tmp_path):
    uncased.save(tmp_path)
    again = BertTokenizer.load(tmp_path)
    assert again.vocabulary == uncased.vocabulary and again.lowercase
    assert again.rules == "original"
    # A Hugging Face directory (do_lower_case in tokenizer_config.json) loads too.
    hf = BertTokenizer.load(os.path.dirname(minilm_vocab()))
    assert hf.lowercase and hf.vocabulary_size == 30522 and hf.rules == "transformers"


def test_trained_vocabulary(cased):
    assert cased.vocabulary[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert 3000 < cased.vocabulary_size <= 4000
    ids = cased.tokenize("Sherlock Holmes said to Watson")
    assert cased.unk_id not in ids
    assert cased.tokenize("Holmes") != cased.tokenize("holmes")


def test_training_on_empty_input_fails_clearly():
    with pytest.raises(ValueError, match="no text"):
        train_wordpiece_vocabulary(["", "  "], 100)


@pytest.mark.parametrize(
    "text", ["\ufffd", "a\ufffdb", "é\ufffd", "\x00", "x\u200by", "\u2028", "Σ\ufffdΣ"]
)
def test_deleted_characters_in_printable_text(uncased, text):
    """Regression: U+FFFD is printable, yet the references delete it."""
    ref = reference(uncased)
    assert uncased.tokenize(text) == ref(text)
    assert uncased.tf_tokenize([text]).to_list()[0] == ref(text)
