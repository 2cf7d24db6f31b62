"""SGLangTreeCache against SGLang 0.5.23's own source, read from the pinned
wheel (ci/test.d/sglang.sh downloads it and sets SGLANG_WHEEL; SGLang's
modules import its GPU stack, so they are parsed, not imported): every
method of BasePrefixCache and of the scheduler's path is there and takes
SGLang's arguments, the parameter fields the adapter reads exist, the
results it builds have SGLang's fields, and the registry takes our factory."""

from __future__ import annotations

import ast
import inspect
import os
import zipfile

import pytest

from marconi.adapter import (
    SGLangTreeCache,
    _EvictResult,
    _InsertResult,
    _MatchResult,
    register_with_sglang,
    sglang_factory,
)

WHEEL = os.environ.get("SGLANG_WHEEL")
pytestmark = pytest.mark.skipif(not WHEEL, reason="SGLANG_WHEEL not set (ci/test.d/sglang.sh sets it)")

SCHEDULER_PATH = [
    "checkpoint", "lock", "unlock", "prefix_device_indices", "evict_for_alloc", "claim_kv_row",
    "free_kv_row", "on_release", "maybe_hand_to_session", "touch_prefix", "supports_mamba",
    "supports_prefix_sharing", "swa_reprefill_tail_tokens", "root_node_handle", "sanity_check",
    "full_evictable_size", "mamba_evictable_size", "available_and_evictable_str", "is_root",
    "mamba_protected_size", "full_protected_size", "dfs_weight_order",
]


def _module(path: str) -> ast.Module:
    with zipfile.ZipFile(WHEEL) as z:
        return ast.parse(z.read(path).decode())


def _classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def _fields(cls: ast.ClassDef) -> list[str]:
    return [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]


@pytest.fixture(scope="module")
def base():
    return _classes(_module("sglang/srt/mem_cache/base_prefix_cache.py"))


def test_every_base_prefix_cache_method_takes_sglangs_arguments(base):
    methods = [n for n in base["BasePrefixCache"].body if isinstance(n, ast.FunctionDef)]
    assert len(methods) > 40  # the interface read is the real one
    for m in methods:
        ours = getattr(SGLangTreeCache, m.name, None)
        assert ours is not None, f"BasePrefixCache.{m.name} is missing"
        if isinstance(inspect.getattr_static(SGLangTreeCache, m.name), property):
            continue
        sig = inspect.signature(ours)
        params = sig.parameters
        has_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
        positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        theirs = m.args.args  # self included, as in ours
        assert len(positional) >= len(theirs), f"{m.name}: takes {len(positional)} positional, SGLang passes {len(theirs)}"
        for a in m.args.kwonlyargs:
            assert a.arg in params or has_kwargs, f"{m.name}: no keyword {a.arg}"


def test_prefix_cache_trait_attributes(base):
    trait = _fields(base["PrefixCacheTrait"])
    assert trait == ["req_to_token_pool", "token_to_kv_pool_allocator", "page_size", "disable"]
    for name in trait:
        assert name in SGLangTreeCache.__init__.__code__.co_names or hasattr(SGLangTreeCache, name), name


def test_scheduler_path_methods_exist():
    for name in SCHEDULER_PATH:
        assert callable(getattr(SGLangTreeCache, name, None)), name


def test_parameter_fields_the_adapter_reads_exist(base):
    assert {"key", "cow_mamba", "req"} <= set(_fields(base["MatchPrefixParams"]))
    assert {"key", "value", "mamba_value", "prev_prefix_len"} <= set(_fields(base["InsertParams"]))
    assert {"num_tokens", "mamba_num"} <= set(_fields(base["EvictParams"]))


def test_results_have_sglangs_fields(base):
    import dataclasses

    assert [f.name for f in dataclasses.fields(_MatchResult)] == _fields(base["MatchResult"])
    assert [f.name for f in dataclasses.fields(_EvictResult)] == _fields(base["EvictResult"])
    ins = _fields(base["InsertResult"])
    assert [f.name for f in dataclasses.fields(_InsertResult)] == ins[: len(dataclasses.fields(_InsertResult))]


def test_radix_key_fields():
    rk = _classes(_module("sglang/srt/mem_cache/radix_cache.py"))["RadixKey"]
    init = next(n for n in rk.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    names = [a.arg for a in init.args.args] + [a.arg for a in init.args.kwonlyargs]
    assert {"token_ids", "extra_key", "cache_salt"} <= set(names)


def test_registry_takes_the_factory():
    reg = _module("sglang/srt/mem_cache/registry.py")
    funcs = {n.name: n for n in reg.body if isinstance(n, ast.FunctionDef)}
    assert [a.arg for a in funcs["register_radix_cache_backend"].args.args] == ["name", "factory"]
    ctx = _fields(_classes(reg)["TreeCacheBuildContext"])
    assert {"params", "is_hybrid_ssm"} <= set(ctx)
    assert list(inspect.signature(sglang_factory).parameters) == ["ctx"]
    src = ast.unparse(funcs["create_tree_cache"])
    assert "cache.supports_mamba()" in src and "get_radix_cache_factory(name)" in src
    # The flag that selects a registered backend.
    memory = _classes(_module("sglang/srt/arg_groups/fields/memory.py"))
    assert any("radix_cache_backend" in _fields(c) for c in memory.values())
    assert callable(register_with_sglang)
