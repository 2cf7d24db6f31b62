"""marconi: Python bindings of libmarconi, a prefix cache for hybrid
(attention + Mamba/SSM) LLMs, through its C ABI (ctypes, no numpy).

    import marconi
    with marconi.PrefixCache(capacity_bytes=2 << 30, model="paper-7b") as cache:
        with cache.lookup(prompt) as lease:        # released on exit
            ...  # prefill from lease.hit_tokens, saving states at lease.plan
            lease.admit(prompt + output, [(len(prompt + output), slot)])

The library is found through $MARCONI_LIBRARY, else the package directory,
else the cargo target dir (see marconi._lib.library_path). MarconiPrefixCache
is an adapter with the method names of a Python engine's radix cache.

Misuse is refused rather than passed on to C: a PrefixCache (or Lease)
cannot be copied or pickled (TypeError); close() waits for calls running on
other threads (or, with a timeout, raises TimeoutError and lets the last of
them free the cache) and later calls raise ValueError; every integer
argument is checked against its C type (TypeError for bool or float,
OutOfRangeError, an OverflowError and ValueError, when it does not fit);
a MarconiError carries the failing C function and the library's detail.
"""

from ._lib import NO_SLOT, library_path
from .adapter import MarconiNode, MarconiPrefixCache, MatchResult
from .events import CacheEvents, has_publisher
from .cache import (
    AdmitResult,
    Lease,
    MarconiError,
    OutOfRangeError,
    PrefixCache,
    last_error,
    status_message,
    version,
)
from .model import ModelSpec
from .pool import (
    HostPool,
    Pool,
    PooledAdmit,
    PooledCache,
    PooledLookup,
    Pools,
    UnitLocation,
    converged_split,
    plan,
    snapshot_copy,
    snapshot_fork,
    snapshot_promote,
)
from .gguf import model_spec_from_gguf, model_spec_from_gguf_bytes
from .store import Store
from .tiered import LoadOrder, TieredCache, TieredHit, TierOp, Tiers

__all__ = [
    "LoadOrder",
    "TieredCache",
    "TieredHit",
    "Tiers",
    "TierOp",
    "NO_SLOT",
    "AdmitResult",
    "CacheEvents",
    "Lease",
    "MarconiError",
    "MarconiNode",
    "MarconiPrefixCache",
    "MatchResult",
    "ModelSpec",
    "Store",
    "OutOfRangeError",
    "HostPool",
    "Pool",
    "PooledAdmit",
    "PooledCache",
    "PooledLookup",
    "Pools",
    "PrefixCache",
    "UnitLocation",
    "converged_split",
    "has_publisher",
    "last_error",
    "library_path",
    "plan",
    "snapshot_copy",
    "snapshot_fork",
    "snapshot_promote",
    "model_spec_from_gguf",
    "model_spec_from_gguf_bytes",
    "status_message",
    "version",
]
__version__ = "0.2.0"
