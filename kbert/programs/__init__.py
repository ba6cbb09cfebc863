"""Whole programs above the models, each with its flags: `pretrain` (behind
`kbert pretrain` and examples/pretrain.py).

Importing this package imports no program; each module imports what it runs.
"""
