"""A persistent XLA compilation cache for kbert's JAX steps on a GPU or TPU.

XLA compiles a BERT-base training step for many seconds on a GPU, and a
short fine-tuning run spends much of its time waiting for it (or running
slower loop programs meanwhile: `kbert.backend.jax_compile`). The
executables depend only on the program, the compiler options, the device
and the JAX version, so a run that compiled them once can keep them on
disk, and the next run of the same model, batch shapes and options loads
them in about a second (JAX's persistent compilation cache, the
counterpart of torch.compile's on-disk caches; what a second run gains:
benchmarks/RESULTS.md).

kbert turns JAX's cache on the first time a task makes a step function on
an accelerator (`use_compilation_cache`), in a directory of its own; the
setting is JAX's, for the process: every later compilation in it, kbert's
or not, uses that cache (a program that compiles in under a second is
not stored, JAX's default):

- `KBERT_COMPILATION_CACHE`: a directory to use instead, or `0` (or
  `off`, `false`, `no`) for no cache (`1`, `on`, `true`: the default);
- the default: `$XDG_CACHE_HOME/kbert/xla`, else `~/.cache/kbert/xla`,
  at most `MAX_BYTES` (least recently used entries removed).

A cache the user configured for JAX (`jax_compilation_cache_dir`,
`JAX_COMPILATION_CACHE_DIR`) is left as it is. The cache holds machine
code that JAX loads without checks: the directory is resolved (links
followed; JAX gets the result), and one that another user owns or can
write, or that sits in a parent another user could rename it in, is
refused (with a warning); kbert creates its own with permissions 0700.
CPU runs are left alone: programs there compile in seconds at most, and
JAX's own default (no cache) applies.
"""

import os
import stat
import threading
import warnings

from kbert.backend import jax_on_accelerator

ENV = "KBERT_COMPILATION_CACHE"
MAX_BYTES = 4 * 2**30  # BERT-base step programs are ~2-5 MB each
_OFF = {"0", "off", "false", "no"}
_ON = {"", "1", "on", "true", "yes"}  # the default directory
_LOCK = threading.Lock()
_DONE = False


def cache_directory():
    """The directory kbert would use (see module doc), or None for none."""
    value = os.environ.get(ENV, "").strip()
    if value.lower() in _OFF:
        return None
    if value.lower() not in _ON:
        return value
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kbert", "xla")


def _safe_directory(path):
    """Creates `path` (resolved, 0700) if missing; whether it is a
    directory the user owns that no one else can write, in parents no one
    else can rename it in (each the user's or root's, and not writable by
    others unless sticky)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or not hasattr(os, "getuid"):
        return stat.S_ISDIR(info.st_mode)
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return False
    parent = os.path.dirname(path)
    while parent and parent != os.path.dirname(parent):
        info = os.stat(parent)
        shared = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if info.st_uid not in (0, os.getuid()) or (shared and not info.st_mode & stat.S_ISVTX):
            return False
        parent = os.path.dirname(parent)
    return True


def use_compilation_cache(force=False):
    """Turns JAX's persistent compilation cache on in `cache_directory()`,
    once per process, where JAX runs on an accelerator (or with `force`),
    unless the user configured JAX's cache or turned kbert's off. Returns
    the directory in use, or None."""
    global _DONE
    import jax

    with _LOCK:
        if _DONE:
            return jax.config.jax_compilation_cache_dir
        if not force and not jax_on_accelerator():
            return None
        _DONE = True
        if jax.config.jax_compilation_cache_dir:  # the user's own
            return jax.config.jax_compilation_cache_dir
        path = cache_directory()
        if path is None:
            return None
        path = os.path.realpath(os.path.expanduser(path))
        try:
            safe = _safe_directory(path)
        except OSError as error:
            warnings.warn(f"kbert: no compilation cache ({error}); set {ENV}=0 to silence this")
            return None
        if not safe:
            warnings.warn(
                f"kbert: not using {path} as a compilation cache: it is not a directory of "
                f"yours that only you can write to (set {ENV} to one, or to 0)"
            )
            return None
        from jax.experimental.compilation_cache import compilation_cache

        jax.config.update("jax_compilation_cache_dir", path)
        if getattr(jax.config, "jax_compilation_cache_max_size", None) == -1:  # unbounded
            jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
        # JAX before 0.5 settles its cache at the process's first
        # compilation (Keras' initializers compile before any step): its
        # reset makes the next compilation read the directory
        compilation_cache.reset_cache()
        return path
