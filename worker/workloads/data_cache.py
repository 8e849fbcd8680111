"""The tabular workloads' splits, made once per host and kept on disk (joblib.Memory).

Making a split imports scikit-learn and runs its generator or loader and a stratified split: ~1 s of CPU in every
worker process (clf: 0.8 s of imports, 0.24 s of make_classification), and a local job starts 4 of them at once on
this box's 2 cores. A kept split is read back in milliseconds, without scikit-learn.

What a kept split is keyed by (so it is never stale): the loader (module and name), its arguments (the seed, the
validation hold-out), the bytes of the source files that make it (the loader's module and mlp.py's splits: any
edit, a constant included, makes a new entry), and the versions of scikit-learn and numpy that generated it.

Where: $DELTAPS_DATA_CACHE, else $XDG_CACHE_HOME/deltaps/data (~/.cache/deltaps/data); `off` makes every split
afresh. A directory that cannot be written falls back to making the split; concurrent writers are safe (joblib
writes to a temporary name and renames it).
"""
from __future__ import annotations

import hashlib
import os
import sys
import warnings
from collections.abc import Callable
from importlib.metadata import version

CACHE_ENV = "DELTAPS_DATA_CACHE"


def data_cache_dir() -> str | None:
    """Where splits are kept; None when $DELTAPS_DATA_CACHE is `off`."""
    where = os.environ.get(CACHE_ENV, "")
    if where == "off":
        return None
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return where or os.path.join(home, "deltaps", "data")


def sources_digest(*functions: Callable) -> str:
    """BLAKE2b over the source files defining `functions` and the generating libraries' versions."""
    h = hashlib.blake2b(digest_size=16)
    for path in sorted({sys.modules[f.__module__].__file__ for f in functions}):
        with open(path, "rb") as f:
            h.update(f.read())
    h.update(f"scikit-learn {version('scikit-learn')} numpy {version('numpy')}".encode())
    return h.hexdigest()


def _made(make: Callable, sources: str, *args):
    """make(*args); `sources` only keys the entry."""
    return make(*args)


def kept(make: Callable, *args):
    """make(*args), read back from the cache when this host made it before; keyed by the args and the source files
    of make and of the functions among the args (a loader make calls)."""
    where = data_cache_dir()
    if where is None:
        return make(*args)
    from joblib import Memory
    try:
        os.makedirs(where, exist_ok=True)
    except OSError:
        return make(*args)
    with warnings.catch_warnings():     # an unwritable entry: joblib warns and returns the result it made
        warnings.simplefilter("ignore")
        return Memory(where, verbose=0).cache(_made)(make, sources_digest(make, *filter(callable, args)), *args)
