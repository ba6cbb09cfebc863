"""Decoding loops over a key/value cache: greedy search, beam search and
top-k / top-p sampling (`kbert.generation.search`)."""

from kbert.generation.search import greedy_search, sample_search

__all__ = ["greedy_search", "sample_search"]
