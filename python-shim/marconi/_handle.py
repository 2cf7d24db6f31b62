"""The one guard of every class that owns a native handle (PrefixCache,
Pool, HostPool, Store, CacheEvents, pml's Schema and ModuleCache, and the
deprecated PooledCache and TieredCache).

A native handle is never freed under a running call, and no call ever gets
a freed handle: every call is counted while it runs (`_begin()` / `_end()`,
or `with self._using() as h:`); close() refuses new calls at once
(ValueError "the <what> is closed"), waits for the calls running on other
threads (for at most `timeout` seconds: then TimeoutError, and the last of
them frees the handle as it returns), and only then frees it. A close()
from inside a call of the same thread (a tokenizer or store callback the
call makes) cannot wait for that call: it is refused with RuntimeError and
the handle stays open. Closing twice is a no-op; so is closing an object
whose __init__ failed.

The count is a list of the calling threads' idents: list.append and
list.remove are atomic, so a call counts itself without taking a lock (the
request path of PrefixCache inlines the same steps). close() sets
`_closing` under `_state` and waits on it until the list is empty; a call
that appended before the flag was set is waited for, one that appends
after sees the flag and never touches the handle, and one that ends after
close() began takes `_state` to wake it. The library's own locks are only
taken inside native calls, never while `_state` is held.
"""

from __future__ import annotations

import threading
from _thread import get_ident
from contextlib import contextmanager
from typing import Any, Iterator, Optional

from ._convert import _real
from ._errors import _check


class _Owner:
    """A native object's last owner: frees it when dropped. The handle's
    Python object holds one reference and each view of its memory another,
    so the native free runs at close() when no view is alive, else when the
    last view goes."""

    __slots__ = ("_free", "_handle")

    def __init__(self, free: Any, handle: Any):
        self._free = free
        self._handle = handle

    def __del__(self) -> None:
        h, self._handle = self._handle, None
        if h is not None:
            self._free(h)


class _Unique:
    """Refuses copy.copy, copy.deepcopy and pickling with a TypeError that
    says why (`_NOT_COPIED`, `_NOT_PICKLED`)."""

    _NOT_COPIED = "it owns a native handle (share the object instead)"
    _NOT_PICKLED = "it owns a native handle of this process"

    def __copy__(self):
        raise TypeError(f"a {type(self).__name__} cannot be copied: {self._NOT_COPIED}")

    def __deepcopy__(self, memo):
        self.__copy__()

    def __reduce_ex__(self, protocol):
        raise TypeError(f"a {type(self).__name__} cannot be pickled: {self._NOT_PICKLED}")


class _Handle(_Unique):
    """Base of a class owning one native handle in `self._handle` (see the
    module documentation). `_WHAT` names it in errors ("the cache is
    closed"); `_FREE` is the library function that frees it (one argument),
    looked up on `self._lib` when it is freed. Call `_guard_init()` first
    in `__init__`, then `_adopt()` with the new handle. A `with` block
    closes it, and so does garbage collection."""

    _WHAT = "handle"
    _FREE = ""
    _handle: Any = None
    _state: Optional[threading.Condition] = None
    _closing = False

    def _guard_init(self) -> None:
        self._handle = None
        self._state = threading.Condition(threading.Lock())
        """Guards close() and the end of the calls it waits for."""
        self._calls: list = []
        """The ident of each calling thread, once per call between _begin()
        and _end() (inside the library, or about to be)."""
        self._closing = False
        self._orphaned = False
        """close() gave up waiting: the last call to end frees the handle."""
        self._owner: Optional[_Owner] = None
        """The native object's last owner, shared with views of its memory
        (None: close() frees it with `_FREE`)."""

    def _adopt(self, lib: Any, handle: Any, views: bool = False) -> None:
        """Takes ownership of a native handle just created. `views`: views of
        its memory may outlive close() (the last of them frees it)."""
        self._lib = lib
        self._handle = handle
        if views:
            self._owner = _Owner(getattr(lib, self._FREE), handle)

    # -- calls ---------------------------------------------------------------

    def _begin(self) -> Any:
        """The handle, for one method's native calls; pair with _end() on
        the same thread."""
        self._calls.append(get_ident())
        if self._closing:
            self._end()
            raise ValueError(f"the {self._WHAT} is closed")
        return self._handle

    def _end(self) -> None:
        self._calls.remove(get_ident())
        if self._closing:
            self._ended()

    def _ended(self) -> None:
        """A call ended after close() began: wake close(), or free the
        handle if close() gave up waiting and this was the last call."""
        with self._state:
            if self._calls:
                return
            self._state.notify_all()
            if not self._orphaned:
                return  # close() is waiting and frees
            h, self._handle = self._handle, None
        self._free(h)

    @contextmanager
    def _using(self) -> Iterator[Any]:
        """The handle, counted as in use until the block ends."""
        h = self._begin()
        try:
            yield h
        finally:
            self._end()

    def _call(self, fn: str, *args: Any) -> None:
        """Calls library function `fn` with the handle and `args`; raises
        MarconiError on a failure status."""
        h = self._begin()
        try:
            _check(getattr(self._lib, fn)(h, *args), fn)
        finally:
            self._end()

    # -- lifetime ------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True once close() has begun: every later call raises ValueError."""
        return self._closing

    def _on_close(self) -> None:
        """Runs once, under `_state`, when close() begins (new calls are
        refused from then on)."""

    def _free(self, h: Any) -> None:
        if h is None:
            return
        owner, self._owner = self._owner, None
        if owner is None:
            self._free_native(h)
        # Else dropping it frees the handle now, or with the last view.
        del owner

    def _free_native(self, h: Any) -> None:
        getattr(self._lib, self._FREE)(h)

    def close(self, timeout: Optional[float] = None) -> None:
        """Frees the native handle. Idempotent and thread-safe. New calls
        are refused at once (ValueError); calls already running on other
        threads are waited for, for at most `timeout` seconds (None: as long
        as they take). If some are still running then, raises TimeoutError
        and leaves the object closed to new calls: the last of those calls
        frees it as it returns. RuntimeError (and the handle stays open)
        from inside a call of this thread, e.g. from a callback the call
        makes: that call cannot be waited for."""
        if timeout is not None:
            timeout = _real(timeout, "timeout")
            if not timeout >= 0:
                raise ValueError(f"timeout: {timeout} is not a number of seconds >= 0")
        state = self._state
        if state is None:  # __init__ failed before the guard existed
            return
        with state:
            if self._handle is None and not self._calls:
                self._closing = True
                return  # freed already (or never made)
            if get_ident() in self._calls:
                raise RuntimeError(
                    f"the {self._WHAT} is in use by a running call of this thread (close() from its "
                    "callback): close it after the call returns"
                )
            if not self._closing:
                self._closing = True
                self._on_close()
            if not state.wait_for(lambda: not self._calls, timeout):
                self._orphaned = True
                n = len(self._calls)
                raise TimeoutError(
                    f"{n} call{' is' if n == 1 else 's are'} still running on the {self._WHAT}; it is "
                    "closed to new calls and is freed when the last one returns"
                )
            h, self._handle = self._handle, None
        self._free(h)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter teardown: nothing to report to
            pass
