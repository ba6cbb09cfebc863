"""Reading pre-training corpora into documents of sentences.

Formats:
- "lines": the original BERT input format, one sentence per line and a blank
  line between documents;
- "prose": running text (books, articles); paragraphs are split at blank
  lines, sentences by pysbd, and consecutive paragraphs are grouped into
  documents of at least `min_document_sentences` sentences;
- "wikitext": WikiText files, where a `= Title =` line starts an article;
  sentences by pysbd;
- "auto": "wikitext" for files with `= Title =` lines, else "prose".
Any iterable of documents (each a string or a list of sentences) is accepted
too, so a Hugging Face `datasets` corpus can stream in.
"""

import dataclasses
import os
import re

FORMATS = ("lines", "prose", "wikitext", "auto")
_WIKI_TITLE = re.compile(r"^ = [^=].* = $")


@dataclasses.dataclass
class CorpusReport:
    """What was read, and what was skipped."""

    files: int = 0
    documents: int = 0
    sentences: int = 0
    skipped_documents: int = 0
    tokens: int = 0

    def __str__(self):
        return (
            f"read {self.files} file(s): {self.documents} documents, {self.sentences} sentences, "
            f"{self.tokens} tokens; skipped {self.skipped_documents} empty documents"
        )


def _read_text(path):
    if not os.path.isfile(path):
        raise ValueError(f"corpus file {path!r} does not exist")
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"corpus file {path!r} is not UTF-8 (byte {e.start}: {data[e.start : e.start + 4]!r}); "
            "convert it, e.g. iconv -f latin1 -t utf-8"
        ) from e


def _strip_gutenberg(text):
    start = re.search(r"^\*\*\* ?START OF .*$", text, re.M)
    end = re.search(r"^\*\*\* ?END OF .*$", text, re.M)
    if start and end and start.end() < end.start():
        return text[start.end() : end.start()]
    return text


class SentenceSplitter:
    """pysbd sentence boundaries (rule-based, English by default)."""

    def __init__(self, language="en"):
        import pysbd

        self._segmenter = pysbd.Segmenter(language=language, clean=False)

    def __call__(self, paragraph):
        return [s.strip() for s in self._segmenter.segment(paragraph) if s.strip()]


def _paragraphs(text):
    for block in re.split(r"\n\s*\n", text):
        paragraph = " ".join(line.strip() for line in block.splitlines() if line.strip())
        if paragraph:
            yield paragraph


def documents_from_text(
    text, format="lines", min_document_sentences=20, splitter=None, report=None
):
    """One file's text -> list of documents (lists of sentence strings)."""
    report = report if report is not None else CorpusReport()
    if format not in FORMATS:
        raise ValueError(f"unknown corpus format {format!r}; use one of {FORMATS}")
    if format == "auto":
        format = (
            "wikitext"
            if any(_WIKI_TITLE.match(line) for line in text.splitlines()[:200])
            else "prose"
        )
    documents = [[]]
    if format == "lines":
        for line in text.splitlines():
            line = line.strip()
            if not line:  # a blank line ends a document
                documents.append([])
            else:
                documents[-1].append(line)
    elif format == "wikitext":
        splitter = splitter or SentenceSplitter()
        for line in text.splitlines():
            if _WIKI_TITLE.match(line):
                documents.append([])
            elif line.strip() and not line.lstrip().startswith("= "):
                documents[-1].extend(splitter(line.strip()))
    else:
        splitter = splitter or SentenceSplitter()
        for paragraph in _paragraphs(_strip_gutenberg(text)):
            documents[-1].extend(splitter(paragraph))
            if len(documents[-1]) >= min_document_sentences:
                documents.append([])
    kept = [d for d in documents if d]
    report.documents += len(kept)
    report.sentences += sum(len(d) for d in kept)
    return kept


def _add_document(sentences, documents, report):
    if sentences:
        documents.append(sentences)
        report.documents += 1
        report.sentences += len(sentences)
    else:
        report.skipped_documents += 1


def read_documents(inputs, format="lines", min_document_sentences=20, report=None):
    """Files, or an iterable of documents -> list of documents of sentences.

    Args:
        inputs: path, list of paths, or iterable of documents (each a string,
            split into sentences with pysbd, or a list of sentence strings).
        format: str. file format, one of "lines", "prose", "wikitext".
        min_document_sentences: int. ("prose") sentences per document at least.
        report: CorpusReport or None. filled with counts.

    Example:
    >>> read_documents([["First sentence.", "Second."], "Another doc. Two sentences."])
    [['First sentence.', 'Second.'], ['Another doc.', 'Two sentences.']]
    """
    report = report if report is not None else CorpusReport()
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    documents = []
    splitter = None
    for item in inputs:
        if isinstance(item, os.PathLike) or (isinstance(item, str) and os.path.isfile(item)):
            report.files += 1
            documents += documents_from_text(
                _read_text(os.fspath(item)), format, min_document_sentences, report=report
            )
        elif isinstance(item, str):
            if os.sep in item and not any(c.isspace() for c in item):  # a path, not prose
                raise ValueError(f"corpus file {item!r} does not exist")
            splitter = splitter or SentenceSplitter()
            _add_document([s for p in _paragraphs(item) for s in splitter(p)], documents, report)
        elif isinstance(item, (list, tuple)):
            _add_document(
                [s.strip() for s in item if isinstance(s, str) and s.strip()], documents, report
            )
        else:
            raise ValueError(
                "expected a file path, a document string or a list of sentences, "
                f"got {type(item).__name__}"
            )
    if not documents:
        raise ValueError(f"the corpus is empty: no sentences in {inputs!r}"[:300])
    return documents
