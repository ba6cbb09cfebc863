"""rules="original" and rules="transformers" against their references, code point
by code point: a seeded sample of every `unicodedata` category, words mixing
them, and the cases that tell the rule sets apart."""

import json
import os
import random
import sys
import unicodedata

import numpy as np
import pytest

from kbert.models.preprocessor import BertPreprocessor
from kbert.tokenizers import BertTokenizer
from kbert.tokenizers.wordpiece import detect_rules
from tests.tokenizers.reference import minilm_vocab, reference

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
CONFIGS = [(r, lc) for r in ("original", "transformers") for lc in (True, False)]

# Characters the rule sets, casing and normalisation forms treat specially: final
# sigma, Turkish dotted and dotless I, ligatures, fullwidth forms, combining
# marks, Greek iota subscript, format and control characters, odd whitespace,
# CJK (unified, extension, compatibility), unassigned / private-use / surrogate.
HARD = (
    "ΣσςΟΔΑİıIiﬁﬀﬃßẞǅǄ"
    "ＨｅｌｏＡ１！＃"
    "\u0301\u0308\u0327\u0345\u20dd\u0307ᾼᾳΐ"
    "\u00ad\u200b\u200c\u200d\u200e\u2060\ufeff\U000e0001"
    "\x00\x01\x1c\x7f\x85\x9f\t\n\r \xa0\u1680\u2000\u2028\u2029\u3000\ufffd"
    "中文\u3400\U00020000\uf900\U0002f800\U0002cea5"
    "\u0378\U0010ffff\ue000\U000f0000\ud800\udfff"
    ".,'\"-«»…¿·"
)


def _by_category():
    groups = {}
    for cp in range(sys.maxunicode + 1):
        groups.setdefault(unicodedata.category(chr(cp)), []).append(chr(cp))
    return groups


def _tf_exceptions():
    """Code points where TensorFlow's and Python's Unicode tables differ."""
    try:
        from kbert.tokenizers import tf_ops
    except ImportError:
        return []
    return [c for c, _ in tf_ops.lowercase_fixups()] + list(tf_ops.nfd_exceptions())


@pytest.fixture(scope="module")
def pool():
    rng = random.Random(20)
    groups = _by_category()
    assert len(groups) == 30  # every general category
    chars = [
        c for cat in sorted(groups) for c in rng.sample(groups[cat], min(24, len(groups[cat])))
    ]
    return chars + list(HARD) + _tf_exceptions()


@pytest.fixture(scope="module")
def strings(pool):
    rng = random.Random(21)
    letters = "abcdeXYZ"
    out = list(pool) + [f"a{c}b {c}Z" for c in pool]
    mix = pool + list(HARD) * 3 + list(letters) * 4 + [" "] * 6
    out += ["".join(rng.choice(mix) for _ in range(rng.randint(1, 14))) for _ in range(1200)]
    out += ["ΟΔΟΣ", "ΟΔΟΣ.", "ΑΣ\u0301 Β", "Σ\u200bΑ", "ΑΣ\u00adΑ", "İSTANBUL", "ﬁne", "a\u2028Σ"]
    return out


@pytest.fixture(scope="module")
def vocabulary(pool):
    """Every character of every normal form of the pool, as a word and a
    continuation, except every seventh (those words become [UNK])."""
    chars = set("abcdexyzABCDEXYZ")
    for c in pool:
        for form in (c, c.lower()):
            for variant in (form, unicodedata.normalize("NFD", form)):
                chars.update(variant, unicodedata.normalize("NFC", variant))
    # Surrogates cannot be written to vocab.txt (or reach tf.data) as UTF-8.
    chars = sorted(c for c in chars if not 0xD800 <= ord(c) < 0xE000 and not c.isspace())
    kept = [c for i, c in enumerate(chars) if i % 7]
    return SPECIALS + kept + ["##" + c for c in kept] + ["ab", "##ab", "abc"]


@pytest.mark.parametrize("rules, lowercase", CONFIGS)
def test_python_path_equals_reference_on_every_category(vocabulary, strings, rules, lowercase):
    tok = BertTokenizer(vocabulary, lowercase=lowercase, rules=rules)
    ref = reference(tok)
    ours = tok.tokenize(strings)
    bad = [(s, a, b) for s, a, b in zip(strings, ours, map(ref, strings)) if a != b]
    assert not bad, bad[:3]
    # The sample is not vacuous: both known ids and [UNK] occur.
    flat = [i for row in ours for i in row]
    assert flat.count(tok.unk_id) > 50 and len(set(flat)) > 500


@pytest.mark.parametrize("rules, lowercase", CONFIGS)
def test_tf_path_equals_python_path_on_every_category(vocabulary, strings, rules, lowercase):
    tf = pytest.importorskip("tensorflow")
    pytest.importorskip("tensorflow_text")
    tok = BertTokenizer(vocabulary, lowercase=lowercase, rules=rules)
    exceptions = set(_tf_exceptions())
    sample = [
        s
        for i, s in enumerate(strings)
        if not any(0xD800 <= ord(c) < 0xE000 for c in s)
        and (i % 3 == 0 or exceptions.intersection(s))
    ]
    in_graph = tok.tf_tokenize(tf.constant([s.encode("utf-8") for s in sample])).to_list()
    bad = [(s, a, b) for s, a, b in zip(sample, tok.tokenize(sample), in_graph) if a != b]
    assert not bad, bad[:3]


def test_what_tells_the_rule_sets_apart():
    vocab = SPECIALS + ["x", "ο", "##δ", "##ος", "##ο", "##σ", "e", "é", "##\u0301"]
    original = BertTokenizer(vocab, lowercase=False)
    transformers = BertTokenizer(vocab, lowercase=False, rules="transformers")
    x, unk = vocab.index("x"), vocab.index("[UNK]")
    # Unassigned, private-use and surrogate code points: [UNK] words, or deleted.
    for char in ("\u0378", "\ue000", "\ud800"):
        assert original.tokenize(f"x {char}") == [x, unk]
        assert transformers.tokenize(f"x {char}") == [x]
    # Cf is deleted by both.
    assert original.tokenize("x\u200b") == transformers.tokenize("x\u200b") == [x]
    # NFC only in transformers: e + combining acute composes to é.
    assert original.tokenize("e\u0301") == [vocab.index("e"), vocab.index("##\u0301")]
    assert transformers.tokenize("e\u0301") == [vocab.index("é")]
    # Word-final sigma lowercases to ς in both (str.lower).
    for rules in ("original", "transformers"):
        tok = BertTokenizer(vocab, rules=rules)
        assert [tok.id_to_token(i) for i in tok.tokenize("ΟΔΟΣ")] == ["ο", "##δ", "##ος"]


def test_special_token_strings_in_text_are_text():
    tok = BertTokenizer(minilm_vocab(), rules="transformers")
    ids = tok.tokenize("a [SEP] b")
    assert tok.sep_id not in ids
    assert [tok.id_to_token(i) for i in ids] == ["a", "[", "sep", "]", "b"]


def test_unknown_rules_fail_clearly():
    with pytest.raises(ValueError, match="rules='original'"):
        BertTokenizer(SPECIALS, rules="google")


def _write(directory, files):
    os.makedirs(directory, exist_ok=True)
    for name, content in files.items():
        with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
            f.write(content if isinstance(content, str) else json.dumps(content))
    return str(directory)


VOCAB_TXT = "\n".join(SPECIALS + ["hello", "world"]) + "\n"


@pytest.mark.parametrize(
    "files, rules",
    [
        # Hugging Face: transformers' tokenizer_config.json, tokenizer.json, config.json.
        ({"tokenizer_config.json": {"do_lower_case": True}}, "transformers"),
        ({"tokenizer.json": {"model": {"type": "WordPiece"}}}, "transformers"),
        ({"config.json": {"model_type": "bert"}}, "transformers"),
        # An original TF checkpoint directory.
        ({"bert_config.json": {"hidden_size": 8}}, "original"),
        # A kbert preset written before rules were recorded.
        (
            {"tokenizer_config.json": {"lowercase": True, "max_input_chars_per_word": 100}},
            "original",
        ),
        ({"tokenizer_config.json": {"rules": "transformers", "lowercase": True}}, "transformers"),
    ],
)
def test_directory_rules(tmp_path, files, rules):
    directory = _write(tmp_path / "d", {"vocab.txt": VOCAB_TXT, **files})
    assert detect_rules(directory) == rules
    pre = BertPreprocessor.from_directory(directory)
    assert pre.tokenizer.rules == rules
    recorded = files.get("tokenizer_config.json", {}).get("max_input_chars_per_word")
    assert pre.tokenizer.max_input_chars_per_word == (
        recorded or {"original": 200, "transformers": 100}[rules]
    )


@pytest.mark.parametrize("source", ["tokenizer_config.json", "tokenizer.json"])
def test_hugging_face_flags_are_read(tmp_path, source):
    config = {"do_lower_case": False, "strip_accents": True, "tokenize_chinese_chars": False}
    if source == "tokenizer.json":
        normalizer = {"type": "BertNormalizer", "lowercase": False, "strip_accents": True}
        config = {"model": {}, "normalizer": {**normalizer, "handle_chinese_chars": False}}
    directory = _write(tmp_path / "hf", {"vocab.txt": VOCAB_TXT, source: config})
    tok = BertPreprocessor.from_directory(directory).tokenizer
    assert (tok.rules, tok.lowercase, tok.strip_accents, tok.tokenize_chinese_chars) == (
        "transformers",
        False,
        True,
        False,
    )
    assert tok.split_words("Héllo 中文") == ["Hello", "中文"]


def test_preprocessor_records_and_restores_rules(tmp_path):
    tok = BertTokenizer(minilm_vocab(), rules="transformers", strip_accents=False)
    pre = BertPreprocessor(tok, sequence_length=16)
    again = BertPreprocessor.from_config(pre.get_config())
    pre.save_to_directory(str(tmp_path))
    loaded = BertPreprocessor.from_directory(str(tmp_path))
    for restored in (again, loaded):
        assert restored.tokenizer.get_config() == tok.get_config()
    text = ["Ça va \u0378 ΟΔΟΣ e\u0301 中文"]
    np.testing.assert_array_equal(loaded(text)["token_ids"], pre(text)["token_ids"])


def test_preprocessor_ids_equal_in_python_and_tf_data():
    tf = pytest.importorskip("tensorflow")
    pytest.importorskip("tensorflow_text")
    letters = "abcdefghijklmnopqrstuvwxyzçéοδςσı"
    vocab = SPECIALS + list(letters) + ["##" + c for c in letters] + ["##\u0307", "中", "文"]
    pres = [
        BertPreprocessor(BertTokenizer(vocab, rules=rules), sequence_length=24)
        for rules in ("original", "transformers")
    ]
    texts = ["Naïve café \u0378 ok", "ΟΔΟΣ e\u0301 İstanbul", "x\u200b\ue000y ﬁne Ｈｅｌｌｏ 中文"]
    dataset = tf.data.Dataset.from_tensor_slices(texts).batch(3)
    (graph,) = list(dataset.map(lambda x: tuple(pre(x) for pre in pres)))
    python = [pre(texts) for pre in pres]
    for ours, theirs in zip(python, graph):
        for key in ours:
            np.testing.assert_array_equal(ours[key], theirs[key].numpy())
    # The rule sets differ on the first text: U+0378 is an [UNK] word, or deleted.
    assert python[0]["padding_mask"][0].sum() == python[1]["padding_mask"][0].sum() + 1


@pytest.mark.parametrize("rules, lowercase", CONFIGS)
def test_offsets_under_context_and_composition(vocabulary, rules, lowercase):
    """Final sigma (lowercased in context) and NFC composition (e + U+0301)
    keep the offsets aligned with the ids; a composed token spans both chars."""
    tok = BertTokenizer(vocabulary, lowercase=lowercase, rules=rules)
    text = "ΟΔΟΣ, e\u0301a \u1100\u1161\u11a8 Σ\u0301x"
    ids, starts, ends = tok.tokenize_with_offsets(text)
    assert ids == tok.tokenize(text)
    assert (starts < ends).all() and (np.diff(starts) >= 0).all() and ends[-1] == len(text)
    if rules == "transformers" and not lowercase:
        (accented,) = [i for i, s in enumerate(starts) if text[s] == "e"]
        assert ends[accented] - starts[accented] >= 2  # é from e + U+0301


def test_tokenizing_pauses_the_garbage_collector_and_restores_it():
    """The cyclic collector is off while a batch is tokenized (its
    collections walk every object of the process) and as the caller had
    it after: on, or off if the caller turned it off; also after an
    error."""
    import gc

    from kbert.utils import host

    tokenizer = BertTokenizer(minilm_vocab(), lowercase=True)
    seen = []
    split_words = tokenizer.split_words

    def recording(text):
        seen.append(gc.isenabled())
        return split_words(text)

    tokenizer.split_words = recording
    assert gc.isenabled()
    assert tokenizer.tokenize(["a b", "c"]) == [tokenizer.tokenize(t) for t in ("a b", "c")]
    assert seen and not any(seen) and gc.isenabled()
    gc.disable()
    try:
        with host.gc_paused():
            with host.gc_paused():
                pass
            assert not gc.isenabled()
        assert not gc.isenabled()  # the caller's choice, kept
    finally:
        gc.enable()
    try:
        with host.gc_paused():
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert gc.isenabled()


def test_a_full_word_cache_is_refilled_with_the_whole_batch(monkeypatch):
    """When a batch's new words overflow the word cache, the cache is
    cleared and refilled with every word of the batch, those it already
    held too: the batch tokenizes as with an unbounded cache."""
    from kbert.tokenizers import wordpiece

    texts = ["the cat sat", "the dog sat down", "a cat and a dog", "unaffable the cat"]
    want = BertTokenizer(minilm_vocab(), lowercase=True).tokenize(texts)
    monkeypatch.setattr(wordpiece, "_CACHE_SIZE", 4)
    tokenizer = BertTokenizer(minilm_vocab(), lowercase=True)
    assert [tokenizer.tokenize([t])[0] for t in texts] == want
    assert tokenizer.tokenize(texts) == want
