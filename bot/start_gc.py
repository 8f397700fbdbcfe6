"""`kazma run`'s start with a large young generation for the cyclic garbage collector, until Kazma serves.

Importing the libraries and building the app make about 190,000 objects the
collector tracks, most of them for the life of the process (modules, classes,
functions, schemas). With the default thresholds (a young collection every 700
allocations) a start ran about 290 young, 26 middle and 2 full collections,
passing over the same long-lived objects again and again: about 90 ms, an
eighth of the CPU a start takes to be ready (bench/idle_rss.py; gc.callbacks
timing in the child). With a young generation of 300,000 objects the start runs
none of its own (what is left, about 12 ms, is collected before `run`'s module
is imported); once Kazma serves, the first young collection passes over what
the start made once, about 40 ms, and frees its garbage (about 55,000 objects).

Garbage is still collected while a start lasts (a platform retried for
minutes, say): at most that many objects wait, not everything since the start.
The default thresholds come back once Kazma serves, or when the command ends.

Once Kazma serves (:func:`served`), what the start made and still holds is
collected once and then frozen (``gc.freeze``): a full collection no longer
passes over it. Without that, every full collection of a serving Kazma went over
the ~135,000 objects of its imports and its app, 50-75 ms with the event loop
held (a press, the cards' edits and every long-poll wait behind it); a process
deciding all the time runs one every few thousand decisions (bench/audit_chain.py:
one or two per 1,800 decisions at 60 in flight). Frozen, the same collection
passes over what came since. What is frozen is still freed when nothing refers
to it; only a reference cycle among those objects would stay, and the start's
garbage was collected just before.
"""

from __future__ import annotations

import gc

START_YOUNG = 300_000  # allocations between two young collections while `kazma run` starts (the default is 700)

_saved: list[tuple[int, int, int]] = []  # the thresholds to restore: empty when not starting


def begin() -> None:
    """From here the young generation is ``START_YOUNG`` objects (again in the same start: nothing changes)."""
    if not _saved:
        _saved.append(gc.get_threshold())
        young, middle, old = _saved[0]
        gc.set_threshold(max(young, START_YOUNG), middle, old)


def end() -> None:
    """The thresholds as they were before :func:`begin` (nothing when not starting)."""
    if _saved:
        gc.set_threshold(*_saved.pop())


def served() -> None:
    """Kazma serves: the thresholds as they were, the start's garbage collected, and what it holds frozen."""
    end()
    gc.collect()
    gc.freeze()


def thawed() -> None:
    """The command ended (or ran in-process, as in tests): nothing stays frozen after it."""
    gc.unfreeze()


def starting() -> bool:
    return bool(_saved)
