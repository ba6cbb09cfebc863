"""Checkpoint interchange: Hugging Face BERT directories (both ways)."""
