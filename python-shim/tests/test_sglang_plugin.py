"""libmarconi selected in SGLang 0.5.23 by one setting: the installed
package declares an SGLang general plugin (entry point group
`sglang.srt.plugins`), SGLang's own plugin loader (`sglang/srt/plugins`,
run from the pinned wheel) discovers and runs it, and SGLang's own registry
(`sglang/srt/mem_cache/registry.py`, also run from the wheel) then holds
the tree cache under the name `--radix-cache-backend marconi` asks for.

SGLang's package `__init__` and four modules the registry imports pull in
torch and the GPU stack; they are replaced by empty stand-ins, the loader
and the registry are SGLang's code. ci/test.d/sglang.sh installs the
package (so its entry point exists) and sets SGLANG_WHEEL."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
import types
import zipfile

import pytest

WHEEL = os.environ.get("SGLANG_WHEEL")
pytestmark = pytest.mark.skipif(not WHEEL, reason="SGLANG_WHEEL not set (ci/test.d/sglang.sh sets it)")

ENTRY = ("marconi", "marconi.adapter:register_with_sglang")
RUN_FROM_WHEEL = ("sglang/srt/environ.py", "sglang/srt/plugins/", "sglang/srt/mem_cache/registry.py")
STAND_INS = {
    "sglang.srt.hardware_backend.mlx.runtime": {"use_mlx": lambda: False},
    "sglang.srt.mem_cache.base_prefix_cache": {"BasePrefixCache": object},
    "sglang.srt.mem_cache.cache_init_params": {"CacheInitParams": object},
    "sglang.srt.runtime_context": {n: (lambda: None) for n in ("get_disagg", "get_memory", "get_serving")},
}


def _installed() -> bool:
    try:
        importlib.metadata.distribution("marconi")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.fixture
def sglang(tmp_path, monkeypatch):
    """SGLang's plugin loader and registry, imported from the wheel."""
    with zipfile.ZipFile(WHEEL) as z:
        for name in z.namelist():
            if name.endswith(".py") and name.startswith(RUN_FROM_WHEEL):
                z.extract(name, tmp_path)
    for mod in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, mod)
    for pkg in ("sglang", "sglang.srt", "sglang.srt.mem_cache", "sglang.srt.hardware_backend",
                "sglang.srt.hardware_backend.mlx"):
        m = types.ModuleType(pkg)
        m.__path__ = [str(tmp_path.joinpath(*pkg.split(".")))]
        monkeypatch.setitem(sys.modules, pkg, m)
    for name, attrs in STAND_INS.items():
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    monkeypatch.delenv("SGLANG_PLATFORM", raising=False)
    plugins = importlib.import_module("sglang.srt.plugins")
    registry = importlib.import_module("sglang.srt.mem_cache.registry")
    assert plugins.__file__.startswith(str(tmp_path)) and registry.__file__.startswith(str(tmp_path))
    return plugins, registry


def test_the_installed_package_declares_the_plugin():
    if not _installed():
        pytest.fail("the marconi distribution is not installed (ci/test.d/sglang.sh installs it)")
    eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
    assert ENTRY in {(e.name, e.value) for e in eps}


def test_sglangs_loader_registers_the_cache_under_its_flag(sglang):
    if not _installed():
        pytest.fail("the marconi distribution is not installed (ci/test.d/sglang.sh installs it)")
    plugins, registry = sglang
    from marconi.adapter import register_with_sglang, sglang_factory

    assert "marconi" not in registry.registered_radix_cache_backends()
    plugins.load_plugins()
    assert registry.get_radix_cache_factory("marconi") is sglang_factory
    # Another load in the same process, or a call by hand as well: a no-op,
    # not SGLang's "already registered" error.
    register_with_sglang()
    assert registry.registered_radix_cache_backends().count("marconi") == 1


def test_a_name_taken_by_another_backend_is_sglangs_error(sglang):
    _, registry = sglang
    from marconi.adapter import register_with_sglang

    registry.register_radix_cache_backend("marconi", lambda ctx: None)
    with pytest.raises(ValueError, match="already registered"):
        register_with_sglang()
