"""One mechanism for every handle class whose native handle a call may be
using: calls in flight are counted, and close() is refused while any runs
(on another thread, or from a callback the running call makes, such as a
tokenizer), so the native handle is never freed under a running call."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional


class _Guarded:
    """Mixin of a class owning one native handle in `self._h` (None once
    closed). Call `_guard_init(what)` first in `__init__`; wrap every
    native call in `with self._using() as h:`; free with
    `_close_with(free)`."""

    _h: Optional[Any] = None
    _what = "handle"

    def _guard_init(self, what: str) -> None:
        self._h = None
        self._what = what
        self._guard = threading.Lock()
        self._calls = 0

    def _begin(self) -> Any:
        with self._guard:
            if self._h is None:
                raise ValueError(f"the {self._what} is closed")
            self._calls += 1
            return self._h

    def _end(self) -> None:
        with self._guard:
            self._calls -= 1

    @contextmanager
    def _using(self) -> Iterator[Any]:
        """The handle, counted as in use until the block ends."""
        h = self._begin()
        try:
            yield h
        finally:
            self._end()

    def _close_with(self, free: Callable[[Any], Any]) -> None:
        """Frees the handle with `free`. Idempotent; RuntimeError while a
        call runs (another thread's, or the one whose callback closes)."""
        guard = getattr(self, "_guard", None)
        if guard is None:  # __init__ failed before the guard existed
            return
        with guard:
            if self._h is None:
                return
            if self._calls:
                raise RuntimeError(
                    f"the {self._what} is in use by a running call (another thread, or the callback of this one)"
                )
            h, self._h = self._h, None
        free(h)
