"""vLLM's own event classes and block hashing, loaded from the files of
the vLLM wheel (MARCONI_VLLM_DIR: the directory holding `vllm/`) without
torch or vLLM's other dependencies: every other `vllm.*` module it imports
is an inert stand-in (a module whose attributes are placeholder classes),
so only the code of the three real files runs."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

REAL = ("vllm.distributed.kv_events", "vllm.v1.core.kv_cache_utils", "vllm.utils.hashing")


class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "init_logger":
            import logging
            return logging.getLogger
        cls = type(name, (), {"__init__": lambda self, *a, **k: None,
                              "__class_getitem__": classmethod(lambda c, *_: c)})
        setattr(self, name, cls)
        return cls


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, root: str):
        self.root = root

    def find_spec(self, name, path, target=None):
        if name != "vllm" and not name.startswith("vllm."):
            return None
        file = os.path.join(self.root, *name.split(".")) + ".py"
        if name in REAL:
            return importlib.util.spec_from_file_location(name, file)
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        m = _Stub(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


def load(root: str):
    """(kv_events, kv_cache_utils, hashing) modules from `root`."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(root))
    import importlib
    return tuple(importlib.import_module(n) for n in REAL)
