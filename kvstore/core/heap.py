"""Keeping long-lived containers out of the garbage collector's walks (the directory's index and policies).

    by_hash = heap.frozen_dict()   # an empty dict that no collection walks, however large it grows
    heap.freeze()                  # collect, then freeze everything alive (a tier's new policy)
    heap.give_back()               # after work that freed much: the C allocator returns what it can

A full collection walks every tracked container it finds, whatever its size: at a million blocks
the index's dicts and the policies' sets make each one a pause of a fraction of a second with the
GIL held, and saves trigger one every time the tracked heap grows by a quarter. Objects frozen
(`gc.freeze`) are never walked again; what they hold stays alive through their references as
before, and reference counting still frees it. The entries themselves are plain tuples of plain
values, which the collector stops tracking after a few collections.

Freezing pins whatever cyclic garbage exists at that moment, so it is done once per container
(per namespace, per tier, at start), after a collection: never per request.
"""

from __future__ import annotations

import ctypes
import gc


def freeze() -> None:
    """Collect first: a tuple frozen while still tracked (a home shared by many entries) would keep
    every entry that holds it tracked for good."""
    gc.collect()
    gc.freeze()


def frozen_dict() -> dict:
    """An empty dict in the collector's permanent generation. A dict is tracked only from its first
    tracked value on, so it holds one while it is frozen."""
    new: dict = {None: []}
    freeze()
    del new[None]
    return new


def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc; other C libraries have no such call
    except (AttributeError, OSError):
        return None


_TRIM = _malloc_trim()


def give_back() -> None:
    """Hand the memory freed since to the operating system where the C library kept it. glibc keeps
    freed blocks for the process unless it is asked: a tier's policy built over a million blocks
    left about 80 MiB resident that nothing used again."""
    if _TRIM is not None:
        _TRIM(0)
