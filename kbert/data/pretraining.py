"""MLM + NSP pre-training examples, as in the original `create_pretraining_data.py`.

Documents (lists of sentences of token ids) -> instances: segment A made of
whole sentences, segment B the true continuation (label 0) or, with
probability 0.5, sentences from a random other document (label 1), packed
towards `max_seq_length` (a shorter target with probability `short_seq_prob`),
truncated from a random end, then masked: 15% of the non-special tokens are
chosen (never [CLS]/[SEP]/[PAD]); of those 80% become [MASK], 10% a random
token, 10% stay. With whole-word masking all pieces of a word are chosen
together.

Three deliberate, documented differences from the original code: the number
of predictions is 15% of the *non-special* tokens (the original counts [CLS]
and [SEP] too, which inflates short sequences); random replacements are
drawn from non-special tokens only (the original could insert [CLS] or [PAD]);
and the NSP label is drawn before segment A is cut, so labels are 50/50 (the
original forces "random" for one-sentence chunks: 58% random on Sherlock).

With `MaskingConfig(sentence_task="sop")` the pair is made for ALBERT's
sentence-order prediction (Lan et al., 2020) instead: A and B are two
consecutive runs of sentences of one document (B starts where A ends), and
with probability 0.5 they are swapped. The label, stored as
`next_sentence_labels`, is 0 for document order (A then B) and 1 for swapped,
as in ALBERT's code (and transformers' `sentence_order_label`). A
one-sentence chunk takes the next sentence (or the one before, at a
document's end) as its partner, as the NSP continuation does; ALBERT's code
falls back to a random-document B there, which would mix NSP into SOP.

Shapes: B batch, T tokens (max_seq_length), P predictions (max_predictions_per_seq).
"""

import dataclasses

import numpy as np

from kbert.tokenizers import BertTokenizer

SENTENCE_TASKS = ("nsp", "sop")


@dataclasses.dataclass
class Instance:
    token_ids: list  # [CLS] A [SEP] B [SEP] after masking
    segment_ids: list
    mask_positions: list
    mask_ids: list  # the original ids at mask_positions
    sentence_label: bool  # NSP: B is random; SOP: A and B are swapped


@dataclasses.dataclass
class MaskingConfig:
    max_seq_length: int = 128
    max_predictions_per_seq: int = 20
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1
    whole_word_mask: bool = False
    # "nsp": B follows A or is random (BERT); "sop": A and B consecutive,
    # swapped half of the time (ALBERT). Label 1 = random / swapped.
    sentence_task: str = "nsp"

    def __post_init__(self):
        if self.sentence_task not in SENTENCE_TASKS:
            raise ValueError(
                f"sentence_task must be 'nsp' (next sentence prediction) or 'sop' (sentence "
                f"order prediction), got {self.sentence_task!r}"
            )
        if self.max_seq_length < 5:
            raise ValueError(
                f"max_seq_length={self.max_seq_length} is too short for [CLS] A [SEP] B [SEP]"
            )
        if not 0.0 < self.masked_lm_prob < 1.0:
            raise ValueError(f"masked_lm_prob must be in (0, 1), got {self.masked_lm_prob}")
        if self.max_predictions_per_seq < 1:
            raise ValueError("max_predictions_per_seq must be at least 1")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise ValueError(f"short_seq_prob must be in [0, 1], got {self.short_seq_prob}")


class InstanceMaker:
    """Creates instances from tokenized documents with a seeded `random.Random`.

    Args:
        tokenizer: `kbert.BertTokenizer`. gives special ids and `##` pieces.
        config: MaskingConfig.
    """

    def __init__(self, tokenizer, config):
        if not isinstance(tokenizer, BertTokenizer):
            raise TypeError(
                f"pre-training data is made with a WordPiece BertTokenizer, got "
                f"{type(tokenizer).__name__}: whole-word masking reads its ## pieces and "
                "the sentence task its two token types"
            )
        self.config = config
        self.cls_id, self.sep_id, self.mask_id = (
            tokenizer.cls_id,
            tokenizer.sep_id,
            tokenizer.mask_id,
        )
        special = {
            tokenizer.pad_id,
            tokenizer.unk_id,
            tokenizer.cls_id,
            tokenizer.sep_id,
            tokenizer.mask_id,
        }
        self.replacement_ids = [i for i in range(tokenizer.vocabulary_size) if i not in special]
        if not self.replacement_ids:
            raise ValueError("the vocabulary has only special tokens")
        self.is_continuation = np.array([t.startswith("##") for t in tokenizer.vocabulary], bool)

    def from_documents(self, documents, rng, dupe_factor=1):
        """All instances of `dupe_factor` passes over `documents`, shuffled."""
        documents = [d for d in documents if d]
        if not documents:
            raise ValueError("no non-empty documents to make pre-training instances from")
        if len(documents) < 2 and self.config.sentence_task == "nsp":
            raise ValueError(
                f"next-sentence prediction needs at least 2 documents, got {len(documents)}; "
                "separate documents by blank lines (format 'lines') or add text"
            )
        instances = []
        for _ in range(dupe_factor):
            for index in range(len(documents)):
                instances.extend(self.from_document(documents, index, rng))
        rng.shuffle(instances)
        return instances

    def from_document(self, documents, document_index, rng):
        cfg = self.config
        document = documents[document_index]
        max_num_tokens = cfg.max_seq_length - 3
        target_length = max_num_tokens
        if rng.random() < cfg.short_seq_prob:
            target_length = rng.randint(2, max_num_tokens)
        sop = cfg.sentence_task == "sop"
        instances, chunk, chunk_length, i = [], [], 0, 0
        while i < len(document):
            segment = document[i]
            chunk.append(segment)
            chunk_length += len(segment)
            if i == len(document) - 1 or chunk_length >= target_length:
                # The label is drawn first, so that NSP is balanced 50/50. (The
                # original forces a random B for one-sentence chunks, which skews
                # labels towards "random" on corpora of long sentences.) A true
                # continuation for a one-sentence chunk takes the next sentence.
                # SOP draws the swap the same way; its B is always the continuation.
                label = rng.random() < 0.5
                is_random_next, swap = label and not sop, label and sop
                if not is_random_next and len(chunk) == 1:
                    if i + 1 < len(document):
                        i += 1
                        chunk.append(document[i])
                    elif i >= 1:  # the last sentence: pair it with the one before
                        chunk = [document[i - 1], document[i]]
                    else:
                        chunk = []  # a one-sentence document has no true pair
                if chunk:
                    a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
                    tokens_a = [t for s in chunk[:a_end] for t in s]
                    tokens_b = []
                    if is_random_next and len(documents) > 1:
                        target_b_length = target_length - len(tokens_a)
                        for _ in range(10):
                            random_index = rng.randint(0, len(documents) - 1)
                            if random_index != document_index:
                                break
                        random_document = documents[random_index]
                        start = rng.randint(0, len(random_document) - 1)
                        for j in range(start, len(random_document)):
                            tokens_b.extend(random_document[j])
                            if len(tokens_b) >= target_b_length:
                                break
                        i -= len(chunk) - a_end  # put the unused segments back
                    elif is_random_next:
                        tokens_b = []  # one document cannot give a random pair: skip
                    else:
                        tokens_b = [t for s in chunk[a_end:] for t in s]
                    self._truncate(tokens_a, tokens_b, max_num_tokens, rng)
                    if swap:
                        tokens_a, tokens_b = tokens_b, tokens_a
                    if tokens_a and tokens_b:
                        instances.append(self._instance(tokens_a, tokens_b, label, rng))
                chunk, chunk_length = [], 0
            i += 1
        return instances

    @staticmethod
    def _truncate(tokens_a, tokens_b, max_num_tokens, rng):
        while len(tokens_a) + len(tokens_b) > max_num_tokens:
            longer = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
            if rng.random() < 0.5:
                del longer[0]
            else:
                longer.pop()

    def _instance(self, tokens_a, tokens_b, sentence_label, rng):
        tokens = [self.cls_id] + tokens_a + [self.sep_id] + tokens_b + [self.sep_id]
        segment_ids = [0] * (len(tokens_a) + 2) + [1] * (len(tokens_b) + 1)
        masked, positions, labels = self.mask(tokens, rng)
        return Instance(masked, segment_ids, positions, labels, sentence_label)

    def mask(self, tokens, rng):
        """(masked tokens, sorted positions, original ids) for one sequence."""
        cfg = self.config
        candidates = []
        for index, token in enumerate(tokens):
            if token in (self.cls_id, self.sep_id):
                continue
            # A `##` piece joins the word just before it (not across [SEP]).
            if (
                cfg.whole_word_mask
                and candidates
                and self.is_continuation[token]
                and candidates[-1][-1] == index - 1
            ):
                candidates[-1].append(index)
            else:
                candidates.append([index])
        num_tokens = sum(len(c) for c in candidates)
        num_to_predict = min(
            cfg.max_predictions_per_seq, max(1, int(round(num_tokens * cfg.masked_lm_prob)))
        )
        rng.shuffle(candidates)
        output = list(tokens)
        chosen = []
        for index_set in candidates:
            if len(chosen) >= num_to_predict:
                break
            if len(chosen) + len(index_set) > num_to_predict:
                continue
            for index in index_set:
                if rng.random() < 0.8:
                    replacement = self.mask_id
                elif rng.random() < 0.5:
                    replacement = tokens[index]
                else:
                    replacement = self.replacement_ids[
                        rng.randint(0, len(self.replacement_ids) - 1)
                    ]
                output[index] = replacement
                chosen.append(index)
        chosen.sort()
        return output, chosen, [tokens[i] for i in chosen]


def tokenize_documents(documents, tokenizer, report=None):
    """Documents of sentence strings -> documents of sentence id lists."""
    out = []
    for document in documents:
        ids = [s for s in tokenizer.tokenize(document) if s]
        if ids:
            out.append(ids)
            if report is not None:
                report.tokens += sum(len(s) for s in ids)
    return out


def instances_to_arrays(instances, max_seq_length, max_predictions_per_seq, pad_id=0):
    """Instances -> dict of arrays in the original feature names (padded)."""
    n, t, p = len(instances), max_seq_length, max_predictions_per_seq
    arrays = {
        "input_ids": np.full((n, t), pad_id, "int64"),
        "input_mask": np.zeros((n, t), "int64"),
        "segment_ids": np.zeros((n, t), "int64"),
        "masked_lm_positions": np.zeros((n, p), "int64"),
        "masked_lm_ids": np.zeros((n, p), "int64"),
        "masked_lm_weights": np.zeros((n, p), "float32"),
        "next_sentence_labels": np.zeros((n, 1), "int64"),
    }
    for row, inst in enumerate(instances):
        length, count = len(inst.token_ids), len(inst.mask_positions)
        arrays["input_ids"][row, :length] = inst.token_ids
        arrays["input_mask"][row, :length] = 1
        arrays["segment_ids"][row, :length] = inst.segment_ids
        arrays["masked_lm_positions"][row, :count] = inst.mask_positions
        arrays["masked_lm_ids"][row, :count] = inst.mask_ids
        arrays["masked_lm_weights"][row, :count] = 1.0
        arrays["next_sentence_labels"][row, 0] = int(inst.sentence_label)
    return arrays
