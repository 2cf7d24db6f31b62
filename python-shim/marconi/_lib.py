"""Loads libmarconi and declares every C function and struct of marconi.h.

The declarations here are checked against include/marconi.h by
tests/test_signatures.py (argument counts and types, struct fields), so the
two cannot drift.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
import sys
from ctypes import (
    POINTER,
    Structure,
    c_char_p,
    c_double,
    c_int32,
    c_int64,
    c_size_t,
    c_uint8,
    c_uint32,
    c_uint64,
    c_void_p,
)
from pathlib import Path

from . import _pml_abi
from ._pml_abi import _u64_fields

LIB_ENV = "MARCONI_LIBRARY"
"""Environment variable naming the shared library to load (a file path)."""

_LIB_NAME = {"darwin": "libmarconi.dylib", "win32": "marconi.dll"}.get(sys.platform, "libmarconi.so")

NO_SLOT = 0xFFFF_FFFF
"""MARCONI_NO_SLOT: "no slot" in lookups, saved states and dst_slot."""
LOOKUP_WHOLE_INPUT = 1
"""MARCONI_LOOKUP_WHOLE_INPUT: the hit may cover the whole input."""
LOOKUP_NO_KV_PAGES = 2
"""MARCONI_LOOKUP_NO_KV_PAGES: the hit's page ids only when asked."""

status_t = c_uint32


class marconi_model_spec(Structure):
    """struct marconi_model_spec."""

    _fields_ = [
        ("attn_layers", c_uint32),
        ("ssm_layers", c_uint32),
        ("mlp_layers", c_uint32),
        ("moe_layers", c_uint32),
        ("moe_top_k", c_uint32),
        ("reserved", c_uint32),
        ("d_model", c_uint64),
        ("n_heads", c_uint64),
        ("kv_heads", c_uint64),
        ("head_dim", c_uint64),
        ("ffn_dim", c_uint64),
        ("ffn_matrices", c_uint64),
        ("ssm_inner", c_uint64),
        ("d_state", c_uint64),
        ("ssm_state_channels", c_uint64),
        ("conv_channels", c_uint64),
        ("conv_kernel", c_uint64),
        ("dtype_bytes", c_uint64),
        ("state_dtype_bytes", c_uint64),
    ]


class marconi_tier_spec(Structure):
    """struct marconi_tier_spec: one lower tier (absent when capacity_bytes is 0)."""

    _fields_ = [
        ("capacity_bytes", c_uint64),
        ("bandwidth_bytes_per_s", c_double),
        ("latency_s", c_double),
    ]


class marconi_tier_options(Structure):
    """struct marconi_tier_options: the lower tiers of a cache (marconi_cache_config.tiers)."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("write_mode", c_uint32),
        ("host", marconi_tier_spec),
        ("store", marconi_tier_spec),
        ("compute_flops", c_double),
        ("promote", c_uint32),
        ("always_load", c_uint32),
        ("lower_plans", c_uint32),
        ("defer_moves", c_uint32),
        ("max_store_probe", c_uint32),
        ("store_states_hold_kv", c_uint32),
        ("exclusive", c_uint32),
        ("reserved", c_uint32),
    ]


class marconi_pool_config(Structure):
    """struct marconi_pool_config (versioned by struct_size)."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("backend", c_uint32),
        ("budget_bytes", c_uint64),
        ("kv_page_bytes", c_uint64),
        ("state_slot_bytes", c_uint64),
        ("state_fraction", c_double),
        ("migration", c_uint32),
        ("migration_batch_units", c_uint32),
        ("chunk_bytes", c_uint64),
        ("cuda_device", c_uint32),
        ("reserved", c_uint32),
    ]


class marconi_cache_config(Structure):
    """struct marconi_cache_config (versioned by struct_size)."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("page_size", c_uint32),
        ("model_preset", c_char_p),
        ("model", marconi_model_spec),
        ("capacity_bytes", c_uint64),
        ("checkpoint_grid", c_uint32),
        ("admission", c_uint32),
        ("block_size", c_uint32),
        ("eviction", c_uint32),
        ("alpha_mode", c_uint32),
        ("decision_log", c_uint32),
        ("protect_branch_states", c_uint32),
        ("reserved", c_uint32),
        ("alpha", c_double),
        ("tuner_grid", POINTER(c_double)),
        ("tuner_grid_len", c_size_t),
        ("tuner_bootstrap_factor", c_uint32),
        ("tuner_min_window", c_uint32),
        ("tuner_retune", c_uint32),
        ("tuner_objective", c_uint32),
        ("tuner_threads", c_uint32),
        ("tuner_retune_neighbours", c_uint32),
        ("tuner_min_gain", c_double),
        ("tuner_adoption", c_uint32),
        ("reserved2", c_uint32),
        ("tuner_max_window", c_uint32),
        ("tuner_retune_every", c_uint32),
        ("tuner_apply_after", c_uint32),
        ("tuner_tune_rules", c_uint32),
        ("shadows", c_uint32),
        ("shadow_tuned", c_uint32),
        ("shadow_lru", c_uint32),
        ("shadow_half_life", c_uint32),
        ("shadow_alphas", POINTER(c_double)),
        ("shadow_alphas_len", c_size_t),
        ("shadow_hysteresis", c_double),
        ("shadow_exact_bytes", c_uint64),
        ("shadow_sample_tokens", c_uint32),
        ("min_branch_depth", c_uint32),
        ("superseded_age", c_double),
        ("tiers", POINTER(marconi_tier_options)),
        ("pools", POINTER(marconi_pool_config)),
    ]


class marconi_copy_order(Structure):
    """struct marconi_copy_order."""

    _fields_ = [("src_slot", c_uint32), ("dst_slot", c_uint32)]


class marconi_lookup(Structure):
    """struct marconi_lookup."""

    _fields_ = [
        ("lease", c_uint64),
        ("hit_tokens", c_uint32),
        ("kv_matched_tokens", c_uint32),
        ("state_slot", c_uint32),
        ("n_kv_pages", c_uint32),
        ("n_plan", c_uint32),
        ("n_copy_orders", c_uint32),
        ("copy_order", marconi_copy_order),
    ]


class marconi_saved_state(Structure):
    """struct marconi_saved_state."""

    _fields_ = [("position", c_uint32), ("slot", c_uint32)]


class marconi_admit_result(Structure):
    """struct marconi_admit_result."""

    _fields_ = [
        ("states_taken", c_uint32),
        ("slots_returned", c_uint32),
        ("kv_pages_taken_start", c_uint32),
        ("kv_pages_taken_end", c_uint32),
        ("new_kv_tokens", c_uint32),
        ("truncated_to", c_uint32),
        ("rejected", ctypes.c_bool),
    ]


class marconi_stats(Structure):
    """struct marconi_stats (versioned by struct_size)."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("tuning_rounds", c_uint32),
        ("requests", c_uint64),
        ("hit_requests", c_uint64),
        ("input_tokens", c_uint64),
        ("hit_tokens", c_uint64),
        ("kv_matched_unusable_tokens", c_uint64),
        ("flops_saved", c_double),
        ("flops_total", c_double),
        ("kv_bytes", c_uint64),
        ("state_bytes", c_uint64),
        ("capacity_bytes", c_uint64),
        ("states", c_uint64),
        ("nodes", c_uint64),
        ("evictions", c_uint64),
        ("states_admitted", c_uint64),
        ("admissions_rejected", c_uint64),
        ("admissions_truncated", c_uint64),
        ("leases", c_uint64),
        ("alpha", c_double),
        ("used_bytes", c_uint64),
        ("evictable_bytes", c_uint64),
        ("kv_bytes_per_token", c_uint64),
        ("state_bytes_per_entry", c_uint64),
        ("evictable_kv_tokens", c_uint64),
        ("evictable_states", c_uint64),
    ]


class marconi_unit_location(Structure):
    """struct marconi_unit_location."""

    _fields_ = [
        ("address", c_uint64),
        ("byte_offset", c_uint64),
        ("unit_bytes", c_uint64),
        ("kind", c_uint32),
        ("index", c_uint32),
    ]


class marconi_migration(Structure):
    """struct marconi_migration."""

    _fields_ = [
        ("donor", c_uint32),
        ("donor_units", c_uint32),
        ("recipient_units", c_uint32),
        ("reserved", c_uint32),
        ("donor_bytes", c_uint64),
    ]


class marconi_pool_stats(Structure):
    """struct marconi_pool_stats (versioned by struct_size)."""

    _fields_ = [("struct_size", c_uint32), ("backend", c_uint32)] + _u64_fields(
        """
        budget_bytes kv_unit_bytes state_unit_bytes kv_capacity kv_free state_capacity state_free
        migrations bytes_migrated chunks_moved mapped_chunks budget_chunks physical_bytes ops kv_retired
        state_retired
        """
    )


class marconi_state_copy(Structure):
    """struct marconi_state_copy (two 64-bit state handles)."""

    _fields_ = [("src_state", c_uint64), ("dst_state", c_uint64)]


class marconi_host_pool_config(Structure):
    """struct marconi_host_pool_config (versioned by struct_size)."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("reserved", c_uint32),
        ("capacity_bytes", c_uint64),
        ("page_bytes", c_uint64),
        ("state_bytes", c_uint64),
        ("state_fraction", c_double),
        ("chunk_bytes", c_uint64),
    ]


class marconi_host_pool_stats(Structure):
    """struct marconi_host_pool_stats (versioned by struct_size)."""

    _fields_ = [("struct_size", c_uint32), ("pinned", c_uint32)] + _u64_fields(
        """
        capacity_bytes page_capacity pages_live state_capacity states_live bytes_demoted bytes_promoted
        units_moved resident_bytes
        """
    )


class marconi_unit_move(Structure):
    """struct marconi_unit_move (two 64-bit unit handles)."""

    _fields_ = [("src", c_uint64), ("dst", c_uint64)]


class marconi_pooled_state(Structure):
    """struct marconi_pooled_state."""

    _fields_ = [("position", c_uint32), ("reserved", c_uint32), ("state_handle", c_uint64)]


class marconi_state_buffer(Structure):
    """struct marconi_state_buffer."""

    _fields_ = [
        ("base", POINTER(c_uint8)),
        ("slot_bytes", c_size_t),
        ("slots", c_uint32),
        ("layers", c_uint32),
    ]


class marconi_plan_request(Structure):
    """struct marconi_plan_request (versioned by struct_size)."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("page_size", c_uint32),
        ("model_preset", c_char_p),
        ("model", marconi_model_spec),
        ("budget_bytes", c_uint64),
        ("state_fraction", c_double),
        ("context_tokens", c_uint64),
        ("batch", c_uint64),
    ]


class marconi_memory_plan(Structure):
    """struct marconi_memory_plan (versioned by struct_size)."""

    _fields_ = [("struct_size", c_uint32), ("page_size", c_uint32)] + [
        (name, c_double if name in ("state_fraction", "fraction_for_context") else c_uint64)
        for name in (
            "budget_bytes",
            "kv_bytes_per_token",
            "kv_page_bytes",
            "state_slot_bytes",
            "max_kv_tokens",
            "max_state_slots",
            "unified_unit_bytes",
            "unified_units",
            "state_fraction",
            "split_kv_pages",
            "split_kv_tokens",
            "split_state_slots",
            "fraction_for_context",
            "max_batch_static",
            "max_batch_avmp",
            "max_batch_unified",
            "max_context_static",
            "max_context_avmp",
            "max_context_unified",
        )
    ]


class marconi_converged_split(Structure):
    """struct marconi_converged_split (versioned by struct_size)."""

    _fields_ = [("struct_size", c_uint32), ("reserved", c_uint32), ("requests", c_uint64)] + [
        (name, c_double) for name in ("start_fraction", "final_fraction", "settled_fraction", "token_hit_rate")
    ] + [(name, c_uint64) for name in ("refused", "migrations", "bytes_migrated", "evictions_for_memory")]


class marconi_pooled_lookup(Structure):
    """struct marconi_pooled_lookup."""

    _fields_ = [
        ("lease", c_uint64),
        ("hit_tokens", c_uint32),
        ("kv_matched_tokens", c_uint32),
        ("state_handle", c_uint64),
        ("n_kv_pages", c_uint32),
        ("n_plan", c_uint32),
    ]


class marconi_pooled_stats(Structure):
    """struct marconi_pooled_stats (versioned by struct_size)."""

    _fields_ = [("struct_size", c_uint32), ("backend", c_uint32)] + _u64_fields(
        """
        requests input_tokens hit_tokens evictions admissions_rejected reservations reservations_refused
        migrations bytes_migrated evictions_for_memory evictions_other_kind held_kv_pages
        held_state_slots kv_capacity kv_free state_capacity state_free budget_bytes physical_bytes
        leases
        """
    )


class marconi_events_config(Structure):
    """struct marconi_events_config (docs/events.md)."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("states", c_uint32),
        ("hash_format", c_uint32),
        ("layout", c_uint32),
        ("seed", c_char_p),
        ("medium", c_char_p),
        ("data_parallel_rank", c_int64),
        ("endpoint", c_char_p),
        ("replay_endpoint", c_char_p),
        ("topic", c_char_p),
        ("buffer_steps", c_uint64),
        ("hwm", c_int32),
        ("max_queue", c_int32),
        ("replay_topic", c_uint32),
        ("namespaces", c_uint32),
    ]


# The store tier (marconi-ffi/src/store.rs, docs/store.md).
marconi_store_get_fn = ctypes.CFUNCTYPE(
    c_int32, c_void_p, c_char_p, POINTER(c_uint8), c_size_t, POINTER(c_size_t)
)
"""int32_t (*)(void *user, const char *name, uint8_t *buf, size_t cap, size_t *len)"""
marconi_store_put_fn = ctypes.CFUNCTYPE(c_int32, c_void_p, c_char_p, POINTER(c_uint8), c_size_t)
"""int32_t (*)(void *user, const char *name, const uint8_t *data, size_t len)"""
marconi_store_exists_fn = ctypes.CFUNCTYPE(c_int32, c_void_p, c_char_p)
"""int32_t (*)(void *user, const char *name)"""
marconi_store_delete_fn = ctypes.CFUNCTYPE(c_int32, c_void_p, c_char_p)
"""int32_t (*)(void *user, const char *name)"""

CALLBACK_TYPES = {
    "marconi_store_get_fn": marconi_store_get_fn,
    "marconi_store_put_fn": marconi_store_put_fn,
    "marconi_store_exists_fn": marconi_store_exists_fn,
    "marconi_store_delete_fn": marconi_store_delete_fn,
}
"""Every function-pointer typedef of the header, by its C name."""

STORE_CB_OK = 0
STORE_CB_ABSENT = 1
STORE_CB_TOO_SMALL = 2


class marconi_store_config(Structure):
    """struct marconi_store_config (docs/store.md)."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("backend", c_uint32),
        ("location", c_char_p),
        ("model", c_char_p),
        ("prefix", c_char_p),
        ("namespace_", c_char_p),
        ("seed", c_char_p),
        ("ns", c_uint64),
        ("block_size", c_uint32),
        ("layout_version", c_uint32),
        ("timeout_ms", c_uint32),
        ("connect_timeout_ms", c_uint32),
        ("max_value_bytes", c_uint64),
        ("ttl_s", c_uint64),
        ("get", marconi_store_get_fn),
        ("put", marconi_store_put_fn),
        ("exists", marconi_store_exists_fn),
        ("del", marconi_store_delete_fn),
        ("user", c_void_p),
    ]


STORE_STATS_FIELDS = [
    "hits",
    "absent",
    "truncated",
    "corrupt",
    "version",
    "foreign_model",
    "wrong_key",
    "oversized",
    "not_regular",
    "timeout",
    "unavailable",
    "failed",
    "puts",
    "put_failures",
    "bytes_read",
    "bytes_written",
]


class marconi_store_stats(Structure):
    """struct marconi_store_stats."""

    _fields_ = [("struct_size", c_uint32), ("reserved", c_uint32)] + [(f, c_uint64) for f in STORE_STATS_FIELDS]


# The tiered cache (marconi-ffi/src/tiered.rs, docs/tiers.md): marconi_tier_spec and
# marconi_tier_options are above marconi_cache_config, which points to them.

class marconi_tiered_config(Structure):
    """struct marconi_tiered_config."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("write_mode", c_uint32),
        ("device", POINTER(marconi_cache_config)),
        ("host", marconi_tier_spec),
        ("store", marconi_tier_spec),
        ("compute_flops", c_double),
        ("promote", c_uint32),
        ("always_load", c_uint32),
        ("lower_plans", c_uint32),
        ("defer_moves", c_uint32),
        ("max_store_probe", c_uint32),
        ("store_states_hold_kv", c_uint32),
        ("exclusive", c_uint32),
    ]


class marconi_tiered_hit(Structure):
    """struct marconi_tiered_hit: what marconi_tiered_lookup found."""

    _fields_ = [
        ("lease", c_uint64),
        ("hit_tokens", c_uint32),
        ("tier", c_uint32),
        ("device_hit_tokens", c_uint32),
        ("device_kv_tokens", c_uint32),
        ("device_state_slot", c_uint32),
        ("n_loads", c_uint32),
        ("n_plan", c_uint32),
        ("n_kv_pages", c_uint32),
        ("shared", c_uint32),
        ("declined_tier", c_uint32),
        ("declined_tokens", c_uint32),
        ("reserved", c_uint32),
        ("load_s", c_double),
        ("recompute_s", c_double),
    ]


class marconi_load_order(Structure):
    """struct marconi_load_order."""

    _fields_ = [
        ("tier", c_uint32),
        ("kind", c_uint32),
        ("start", c_uint32),
        ("end", c_uint32),
        ("position", c_uint32),
        ("slot", c_uint32),
        ("bytes", c_uint64),
    ]


class marconi_tier_op(Structure):
    """struct marconi_tier_op."""

    _fields_ = [
        ("kind", c_uint32),
        ("tier", c_uint32),
        ("ns", c_uint64),
        ("position", c_uint32),
        ("reserved", c_uint32),
        ("tokens_offset", c_uint64),
        ("bytes", c_uint64),
    ]


TIERED_STATS_SCALARS_1 = ["requests", "input_tokens", "hit_tokens"]
TIERED_STATS_ARRAYS_1 = ["hit_tokens_by_tier", "hits_by_tier", "bytes_loaded", "bytes_written", "writes"]
TIERED_STATS_SCALARS_2 = [
    "demotions_skipped",
    "loads_declined",
    "shared_hits",
    "shared_hit_tokens",
    "store_probes",
    "store_probe_failures",
    "load_failures",
]
TIERED_STATS_ARRAYS_2 = ["used_bytes", "capacity_bytes"]


class marconi_tiered_stats(Structure):
    """struct marconi_tiered_stats (arrays indexed by tier: device, host, store)."""

    _fields_ = (
        [("struct_size", c_uint32), ("reserved", c_uint32)]
        + [(f, c_uint64) for f in TIERED_STATS_SCALARS_1]
        + [(f, c_uint64 * 3) for f in TIERED_STATS_ARRAYS_1]
        + [(f, c_uint64) for f in TIERED_STATS_SCALARS_2]
        + [(f, c_uint64 * 3) for f in TIERED_STATS_ARRAYS_2]
        + [("load_s", c_double)]
    )


class marconi_lookup_request(Structure):
    """struct marconi_lookup_request (versioned by struct_size)."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("token_width", c_uint32),
        ("ns", c_uint64),
        ("tokens", c_void_p),
        ("n_tokens", c_size_t),
        ("checkpoints", POINTER(c_uint32)),
        ("n_checkpoints", c_size_t),
        ("flags", c_uint32),
        ("dst_slot", c_uint32),
        ("store", c_void_p),
    ]


class marconi_lookup_result(Structure):
    """struct marconi_lookup_result (versioned by struct_size)."""

    _fields_ = (
        [("struct_size", c_uint32), ("tier", c_uint32), ("lease", c_uint64)]
        + [
            (f, c_uint32)
            for f in (
                "hit_tokens", "device_hit_tokens", "kv_matched_tokens", "n_kv_pages", "n_plan", "n_loads",
                "has_device_state", "has_copy_order",
            )
        ]
        + [("device_state", c_uint64), ("copy_order", marconi_copy_order)]
        + [(f, c_uint32) for f in ("shared", "declined_tier", "declined_tokens", "reserved")]
        + [("load_s", c_double), ("recompute_s", c_double)]
    )


class marconi_admit_state(Structure):
    """struct marconi_admit_state."""

    _fields_ = [("position", c_uint32), ("reserved", c_uint32), ("unit", c_uint64)]


class marconi_admit_request(Structure):
    """struct marconi_admit_request (versioned by struct_size)."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("token_width", c_uint32),
        ("lease", c_uint64),
        ("tokens", c_void_p),
        ("n_tokens", c_size_t),
        ("states", POINTER(marconi_admit_state)),
        ("n_states", c_size_t),
        ("page_width", c_uint32),
        ("reserved", c_uint32),
        ("kv_pages", c_void_p),
        ("n_kv_pages", c_size_t),
        ("taken", POINTER(c_uint8)),
    ]


class marconi_drain(Structure):
    """struct marconi_drain (versioned by struct_size)."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("reserved", c_uint32),
        ("ops", POINTER(marconi_tier_op)),
        ("ops_cap", c_size_t),
        ("n_ops", c_size_t),
        ("op_tokens", POINTER(c_uint32)),
        ("op_tokens_cap", c_size_t),
        ("n_op_tokens", c_size_t),
        ("kv_pages", POINTER(c_uint64)),
        ("kv_pages_cap", c_size_t),
        ("n_kv_pages", c_size_t),
        ("state_slots", POINTER(c_uint64)),
        ("state_slots_cap", c_size_t),
        ("n_state_slots", c_size_t),
    ]


STRUCTS = {
    cls.__name__: cls
    for cls in (
        marconi_model_spec,
        marconi_cache_config,
        marconi_copy_order,
        marconi_lookup,
        marconi_saved_state,
        marconi_admit_result,
        marconi_stats,
        marconi_pool_config,
        marconi_unit_location,
        marconi_migration,
        marconi_pool_stats,
        marconi_state_copy,
        marconi_host_pool_config,
        marconi_host_pool_stats,
        marconi_unit_move,
        marconi_pooled_state,
        marconi_state_buffer,
        marconi_plan_request,
        marconi_memory_plan,
        marconi_converged_split,
        marconi_pooled_lookup,
        marconi_pooled_stats,
        marconi_events_config,
        marconi_store_config,
        marconi_store_stats,
        marconi_tier_spec,
        marconi_tier_options,
        marconi_tiered_config,
        marconi_tiered_hit,
        marconi_load_order,
        marconi_tier_op,
        marconi_tiered_stats,
        marconi_lookup_request,
        marconi_lookup_result,
        marconi_admit_state,
        marconi_admit_request,
        marconi_drain,
    )
}
STRUCTS.update(_pml_abi.PML_STRUCTS)
"""Every struct of the header, by its C name."""

_cache_p = c_void_p
_pool_p = c_void_p
_host_pool_p = c_void_p
_events_p = c_void_p
_pooled_p = c_void_p
_store_p = c_void_p
_tiered_p = c_void_p
_u8_p = POINTER(c_uint8)
_u32_p = POINTER(c_uint32)
_i64_p = POINTER(c_int64)
_u64_p = POINTER(c_uint64)
_size_p = POINTER(c_size_t)

SIGNATURES = {
    "marconi_version": (c_char_p, []),
    "marconi_status_message": (c_size_t, [c_uint32, c_char_p, c_size_t]),
    "marconi_last_error": (c_size_t, [c_char_p, c_size_t]),
    "marconi_cache_config_init": (status_t, [POINTER(marconi_cache_config), c_size_t]),
    "marconi_cache_config_preset": (status_t, [POINTER(marconi_cache_config), c_size_t, c_char_p]),
    "marconi_model_spec_preset": (status_t, [c_char_p, POINTER(marconi_model_spec)]),
    "marconi_model_spec_from_hf_config": (status_t, [c_char_p, c_size_t, POINTER(marconi_model_spec)]),
    "marconi_model_spec_from_gguf": (status_t, [c_char_p, POINTER(marconi_model_spec)]),
    "marconi_model_spec_from_gguf_bytes": (status_t, [POINTER(c_uint8), c_size_t, POINTER(marconi_model_spec)]),
    "marconi_cache_new": (status_t, [POINTER(marconi_cache_config), POINTER(_cache_p)]),
    "marconi_cache_free": (None, [_cache_p]),
    "marconi_cache_lookup": (status_t, [_cache_p, c_uint64, _u32_p, c_size_t, c_uint32, POINTER(marconi_lookup)]),
    "marconi_cache_lookup_hinted": (
        status_t, [_cache_p, c_uint64, _u32_p, c_size_t, _u32_p, c_size_t, c_uint32, POINTER(marconi_lookup)],
    ),
    "marconi_cache_lookup_i64": (status_t, [_cache_p, c_uint64, _i64_p, c_size_t, c_uint32, POINTER(marconi_lookup)]),
    "marconi_cache_lookup_i64_flags": (
        status_t, [_cache_p, c_uint64, _i64_p, c_size_t, c_uint32, c_uint32, POINTER(marconi_lookup)],
    ),
    "marconi_cache_lease_kv_pages": (status_t, [_cache_p, c_uint64, _u32_p, c_size_t, _size_p]),
    "marconi_cache_lease_plan": (status_t, [_cache_p, c_uint64, _u32_p, c_size_t, _size_p]),
    "marconi_cache_admit": (
        status_t,
        [
            _cache_p, c_uint64, _u32_p, c_size_t, POINTER(marconi_saved_state), c_size_t, _u32_p, c_size_t,
            POINTER(c_uint8), POINTER(marconi_admit_result),
        ],
    ),
    "marconi_cache_admit_i64": (
        status_t,
        [
            _cache_p, c_uint64, _i64_p, c_size_t, POINTER(marconi_saved_state), c_size_t, _i64_p, c_size_t,
            POINTER(c_uint8), POINTER(marconi_admit_result),
        ],
    ),
    "marconi_cache_release": (status_t, [_cache_p, c_uint64]),
    "marconi_cache_drain_freed": (status_t, [_cache_p, _u32_p, c_size_t, _size_p, _u32_p, c_size_t, _size_p]),
    "marconi_cache_evict": (status_t, [_cache_p, c_uint64, POINTER(c_uint64)]),
    "marconi_cache_stats": (status_t, [_cache_p, POINTER(marconi_stats)]),
    "marconi_cache_drain_log": (status_t, [_cache_p, c_char_p, c_size_t, _size_p]),
    "marconi_cache_check": (status_t, [_cache_p]),
    # Pools and snapshots (marconi-ffi/src/pool.rs).
    "marconi_pool_config_init": (status_t, [POINTER(marconi_pool_config), c_size_t]),
    "marconi_pool_new": (status_t, [POINTER(marconi_pool_config), POINTER(_pool_p)]),
    "marconi_pool_free": (None, [_pool_p]),
    "marconi_pool_allocate": (status_t, [_pool_p, c_uint32, c_size_t, _u64_p, c_size_t]),
    "marconi_pool_free_units": (status_t, [_pool_p, _u64_p, c_size_t]),
    "marconi_pool_resolve": (status_t, [_pool_p, _u64_p, c_size_t, POINTER(marconi_unit_location), c_size_t]),
    "marconi_pool_migrate": (status_t, [_pool_p, c_uint32, c_uint32, POINTER(marconi_migration)]),
    "marconi_pool_get_stats": (status_t, [_pool_p, POINTER(marconi_pool_stats)]),
    "marconi_pool_copy_states": (status_t, [_pool_p, POINTER(marconi_state_copy), c_size_t]),
    "marconi_pool_fork_state": (status_t, [_pool_p, c_uint64, _u64_p, c_size_t]),
    "marconi_pool_promote_state": (status_t, [_pool_p, c_uint64, _u64_p, c_size_t, c_size_t, c_uint32, _u64_p]),
    # Host tier memory (marconi-ffi/src/host_pool.rs).
    "marconi_host_pool_config_init": (status_t, [POINTER(marconi_host_pool_config), c_size_t]),
    "marconi_host_pool_new": (status_t, [POINTER(marconi_host_pool_config), POINTER(_host_pool_p)]),
    "marconi_host_pool_free": (None, [_host_pool_p]),
    "marconi_host_pool_allocate": (status_t, [_host_pool_p, c_uint32, c_size_t, _u64_p, c_size_t]),
    "marconi_host_pool_free_units": (status_t, [_host_pool_p, _u64_p, c_size_t]),
    "marconi_host_pool_resolve": (status_t, [_host_pool_p, _u64_p, c_size_t, POINTER(marconi_unit_location), c_size_t]),
    "marconi_host_pool_get_stats": (status_t, [_host_pool_p, POINTER(marconi_host_pool_stats)]),
    "marconi_host_pool_demote": (
        status_t, [_host_pool_p, _pool_p, POINTER(marconi_unit_move), c_size_t, POINTER(c_uint64)],
    ),
    "marconi_host_pool_promote": (
        status_t, [_host_pool_p, _pool_p, POINTER(marconi_unit_move), c_size_t, POINTER(c_uint64)],
    ),
    "marconi_snapshot_copy": (status_t, [POINTER(marconi_state_buffer), POINTER(marconi_copy_order), c_size_t]),
    "marconi_snapshot_fork": (status_t, [POINTER(marconi_state_buffer), c_uint32, _u32_p, c_size_t]),
    # Memory planning (marconi-ffi/src/plan.rs).
    "marconi_plan_request_init": (status_t, [POINTER(marconi_plan_request), c_size_t]),
    "marconi_plan": (status_t, [POINTER(marconi_plan_request), POINTER(marconi_memory_plan)]),
    "marconi_plan_converged_split": (
        status_t,
        [
            POINTER(marconi_plan_request), POINTER(c_uint32), c_size_t, POINTER(c_size_t), c_size_t, POINTER(c_uint32),
            c_size_t, POINTER(marconi_converged_split),
        ],
    ),
    # The cache over pools (marconi-ffi/src/pooled.rs): the one handle's
    # pool calls (the deprecated marconi_pooled_cache_* forwarders: below).
    "marconi_cache_lookup_pooled": (status_t, [_cache_p, c_uint64, _u32_p, c_size_t, POINTER(marconi_pooled_lookup)]),
    "marconi_cache_lookup_pooled_hinted": (
        status_t, [_cache_p, c_uint64, _u32_p, c_size_t, _u32_p, c_size_t, POINTER(marconi_pooled_lookup)],
    ),
    "marconi_cache_lease_kv_handles": (status_t, [_cache_p, c_uint64, _u64_p, c_size_t, _size_p]),
    "marconi_cache_reserve": (status_t, [_cache_p, c_uint32, c_uint32, _u64_p, c_size_t, _u64_p, c_size_t]),
    "marconi_cache_admit_pooled": (
        status_t,
        [
            _cache_p, c_uint64, _u32_p, c_size_t, POINTER(marconi_pooled_state), c_size_t, _u64_p, c_size_t,
            POINTER(c_uint8), POINTER(marconi_admit_result),
        ],
    ),
    "marconi_cache_free_units": (status_t, [_cache_p, _u64_p, c_size_t]),
    "marconi_cache_drain_freed_units": (status_t, [_cache_p, _u64_p, c_size_t, _size_p]),
    "marconi_cache_held": (status_t, [_cache_p, _u64_p, c_size_t, _size_p]),
    "marconi_cache_resolve": (status_t, [_cache_p, _u64_p, c_size_t, POINTER(marconi_unit_location), c_size_t]),
    "marconi_cache_copy_states": (status_t, [_cache_p, POINTER(marconi_state_copy), c_size_t]),
    "marconi_cache_pool_stats": (status_t, [_cache_p, POINTER(marconi_pooled_stats)]),
    "marconi_snapshot_promote": (
        status_t, [POINTER(marconi_state_buffer), c_uint32, _u32_p, c_size_t, c_size_t, c_uint32, _u32_p],
    ),
    # Cache events (marconi-ffi/src/events.rs, docs/events.md).
    "marconi_events_config_init": (status_t, [POINTER(marconi_events_config), c_size_t]),
    "marconi_events_new": (status_t, [_cache_p, POINTER(marconi_events_config), POINTER(_events_p)]),
    "marconi_events_free": (None, [_events_p, _cache_p]),
    "marconi_events_has_publisher": (c_uint32, []),
    "marconi_events_drain": (status_t, [_events_p, _cache_p, c_double, POINTER(c_uint8), c_size_t, _size_p]),
    "marconi_events_snapshot": (status_t, [_events_p, _cache_p, c_double, POINTER(c_uint8), c_size_t, _size_p]),
    "marconi_events_publish": (status_t, [_events_p, _cache_p, c_double, POINTER(c_uint64)]),
    "marconi_events_endpoint": (status_t, [_events_p, c_uint32, c_char_p, c_size_t, _size_p]),
    # The store tier (marconi-ffi/src/store.rs, docs/store.md).
    "marconi_store_config_init": (status_t, [POINTER(marconi_store_config), c_size_t]),
    "marconi_store_new": (status_t, [POINTER(marconi_store_config), POINTER(_store_p)]),
    "marconi_store_free": (None, [_store_p]),
    "marconi_store_put_state": (status_t, [_store_p, _u32_p, c_size_t, c_size_t, _u8_p, c_size_t]),
    "marconi_store_get_state": (status_t, [_store_p, _u32_p, c_size_t, c_size_t, _u8_p, c_size_t, _size_p, _u32_p]),
    "marconi_store_delete_state": (status_t, [_store_p, _u32_p, c_size_t, c_size_t]),
    "marconi_store_put_kv": (status_t, [_store_p, _u32_p, c_size_t, c_size_t, c_size_t, _u8_p, c_size_t]),
    "marconi_store_get_kv": (status_t, [_store_p, _u32_p, c_size_t, c_size_t, c_size_t, _u8_p, c_size_t, _size_p]),
    "marconi_store_kv_prefix": (status_t, [_store_p, _u32_p, c_size_t, _size_p]),
    "marconi_store_get_stats": (status_t, [_store_p, POINTER(marconi_store_stats)]),
    # The tiers of a cache (marconi-ffi/src/tiered.rs, docs/tiers.md).
    "marconi_tier_options_init": (status_t, [POINTER(marconi_tier_options), c_size_t]),
    "marconi_lookup_request_init": (status_t, [POINTER(marconi_lookup_request), c_size_t]),
    "marconi_admit_request_init": (status_t, [POINTER(marconi_admit_request), c_size_t]),
    "marconi_cache_admit_with": (
        status_t,
        [_cache_p, POINTER(marconi_admit_request), POINTER(marconi_admit_result)],
    ),
    "marconi_cache_drain_with": (status_t, [_cache_p, POINTER(marconi_drain)]),
    "marconi_cache_lookup_with": (
        status_t,
        [_cache_p, POINTER(marconi_lookup_request), POINTER(marconi_lookup_result)],
    ),
    "marconi_cache_lookup_tiered": (
        status_t, [_cache_p, c_uint64, _u32_p, c_size_t, _u32_p, c_size_t, _store_p, POINTER(marconi_tiered_hit)],
    ),
    "marconi_cache_lookup_tiered_i64_flags": (
        status_t, [_cache_p, c_uint64, _i64_p, c_size_t, c_uint32, _store_p, POINTER(marconi_tiered_hit)],
    ),
    "marconi_cache_lease_loads": (status_t, [_cache_p, c_uint64, POINTER(marconi_load_order), c_size_t, _size_p]),
    "marconi_cache_report_load_failure": (status_t, [_cache_p, c_uint64]),
    "marconi_cache_settle": (status_t, [_cache_p]),
    "marconi_cache_drain_ops": (
        status_t, [_cache_p, POINTER(marconi_tier_op), c_size_t, _size_p, _u32_p, c_size_t, _size_p],
    ),
    "marconi_cache_tier_stats": (status_t, [_cache_p, POINTER(marconi_tiered_stats)]),
    # The deprecated handles' constructors (their other calls: below).
    "marconi_pooled_cache_new": (
        status_t, [POINTER(marconi_cache_config), POINTER(marconi_pool_config), POINTER(_pooled_p)],
    ),
    "marconi_tiered_config_init": (status_t, [POINTER(marconi_tiered_config), c_size_t]),
    "marconi_tiered_new": (status_t, [POINTER(marconi_tiered_config), POINTER(_tiered_p)]),
}

FORWARDERS = {
    "marconi_pooled_cache_free": "marconi_cache_free",
    "marconi_pooled_cache_lookup": "marconi_cache_lookup_pooled",
    "marconi_pooled_cache_lookup_hinted": "marconi_cache_lookup_pooled_hinted",
    "marconi_pooled_cache_lease_kv_pages": "marconi_cache_lease_kv_handles",
    "marconi_pooled_cache_lease_plan": "marconi_cache_lease_plan",
    "marconi_pooled_cache_reserve": "marconi_cache_reserve",
    "marconi_pooled_cache_admit": "marconi_cache_admit_pooled",
    "marconi_pooled_cache_free_units": "marconi_cache_free_units",
    "marconi_pooled_cache_release": "marconi_cache_release",
    "marconi_pooled_cache_drain_freed": "marconi_cache_drain_freed_units",
    "marconi_pooled_cache_held": "marconi_cache_held",
    "marconi_pooled_cache_resolve": "marconi_cache_resolve",
    "marconi_pooled_cache_copy_states": "marconi_cache_copy_states",
    "marconi_pooled_cache_stats": "marconi_cache_pool_stats",
    "marconi_pooled_cache_check": "marconi_cache_check",
    "marconi_tiered_free": "marconi_cache_free",
    "marconi_tiered_lookup": "marconi_cache_lookup_tiered",
    "marconi_tiered_lease_loads": "marconi_cache_lease_loads",
    "marconi_tiered_lease_plan": "marconi_cache_lease_plan",
    "marconi_tiered_lease_kv_pages": "marconi_cache_lease_kv_pages",
    "marconi_tiered_admit": "marconi_cache_admit",
    "marconi_tiered_release": "marconi_cache_release",
    "marconi_tiered_report_load_failure": "marconi_cache_report_load_failure",
    "marconi_tiered_settle": "marconi_cache_settle",
    "marconi_tiered_drain_ops": "marconi_cache_drain_ops",
    "marconi_tiered_drain_freed": "marconi_cache_drain_freed",
    "marconi_tiered_get_stats": "marconi_cache_tier_stats",
    "marconi_tiered_check": "marconi_cache_check",
}
"""The deprecated handles' calls, each a forwarder onto the one handle's
call named here: it takes the same arguments (a marconi_pooled_cache or
marconi_tiered handle for the marconi_cache one; all three are void* here)."""
SIGNATURES.update({name: SIGNATURES[target] for name, target in FORWARDERS.items()})
# marconi_store_*_ns: the plain store call with a namespace after the handle.
for _name in ("put_state", "get_state", "delete_state", "put_kv", "get_kv", "kv_prefix"):
    _restype, (_store, *_rest) = SIGNATURES[f"marconi_store_{_name}"]
    SIGNATURES[f"marconi_store_{_name}_ns"] = (_restype, [_store, c_uint64, *_rest])
SIGNATURES.update(_pml_abi.PML_SIGNATURES)
"""Every function of the header: name -> (restype, argtypes)."""


def _bundled() -> list[Path]:
    """Where a library bundled into the package lies: `pip install` builds
    marconi-ffi and copies it there as libmarconi.abi3.so (an extension
    module's name, so that the wheel is tagged for the platform), or one
    copied by hand as libmarconi.so."""
    here = Path(__file__).resolve().parent
    names = ["libmarconi" + s for s in importlib.machinery.EXTENSION_SUFFIXES] + [_LIB_NAME]
    return [here / n for n in dict.fromkeys(names)]


def _candidates() -> list[Path]:
    out = []
    env = os.environ.get(LIB_ENV)
    if env:
        out.append(Path(env))
    out += _bundled()
    target = os.environ.get("CARGO_TARGET_DIR")
    if target:
        out.append(Path(target) / "release" / _LIB_NAME)
    # A source checkout: the cargo target dir above this file or the cwd.
    for start in (Path(__file__).resolve().parent, Path.cwd()):
        for d in (start, *start.parents):
            out.append(d / "target" / "release" / _LIB_NAME)
    return out


def library_path() -> Path:
    """The library that load() opens: $MARCONI_LIBRARY, else the one
    bundled in the package directory (by pip install), else
    $CARGO_TARGET_DIR/release, else target/release in a directory above the
    package or the current directory."""
    tried = _candidates()
    if os.environ.get(LIB_ENV):
        # An explicit path must exist: never silently fall back.
        p = tried[0]
        if not p.is_file():
            raise OSError(f"{LIB_ENV}={p} does not exist")
        return p
    for p in tried:
        if p.is_file():
            return p
    raise OSError(
        f"{_LIB_NAME} not found: `pip install ./python-shim` builds and bundles it; from a "
        f"source checkout, build it with `cargo build --release -p marconi-ffi` or set "
        f"{LIB_ENV}. Tried: " + ", ".join(str(p) for p in tried[:6]) + ", ..."
    )


_lib = None


def load() -> ctypes.CDLL:
    """The loaded library, with every signature declared (loaded once)."""
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(str(library_path()))
        for name, (restype, argtypes) in SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = argtypes
        _lib = lib
    return _lib
