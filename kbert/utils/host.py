"""Host-side helpers for input preparation."""

import contextlib
import functools
import gc


@contextlib.contextmanager
def gc_paused():
    """Within: Python's cyclic garbage collector off (if it was on), back on
    after. Tokenizing a data set makes millions of small lists and ints,
    which trigger collections that each walk every object the process
    holds: with torch and Keras loaded (hundreds of thousands of objects)
    they take about half of tokenizing SST-2's training set. For kbert's
    own preparation code only (the caller's iterators are read before),
    whose objects hold no cycles: the pause frees nothing later than it
    would have been. A pause that finds the collector off leaves it alone,
    so nested or concurrent pauses never leave it off for good."""
    was_enabled = gc.isenabled()
    if was_enabled:
        gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def with_gc_paused(function):
    """`function`, run inside `gc_paused()`."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with gc_paused():
            return function(*args, **kwargs)

    return wrapper
