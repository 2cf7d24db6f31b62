// marconi-hooks: see marconi-hooks.h. States are whole sequence states
// (llama_state_seq_get_data_ext, flags 0: the attention KV of the prefix and
// the recurrent state), kept in host memory under engine-owned ids that
// libmarconi hands back when it evicts them.
//
// The hooks drive one marconi_cache. With --marconi-store it has lower
// tiers (marconi_cache_config.tiers: the server's states are the device
// tier, a host tier holds copies of states evicted from it, the store tier
// is a directory or Redis shared by servers) and the hooks carry out the
// tiers' ops (marconi_cache_drain_ops): a
// host WRITE copies a state's bytes, a store WRITE puts them into the store
// (marconi_store_put_state), a host DROP frees the copy.
//
// The key of a prompt is its tokens but the last 2: the state saved there
// serves a regenerate of the same prompt (2 tokens processed, the fewest
// whose logits are bitwise those of a one-pass prefill: a one-token batch
// takes another matmul path in ggml) and every continuation of it.

#include "marconi-hooks.h"

#include "gguf.h"
#include "marconi.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace marconi_hooks {
namespace {

// One prompt in flight on a sequence: its lease, the planned cuts still
// ahead and the states saved so far (not yet the cache's).
struct Pending {
    uint64_t lease = 0;
    uint64_t ns = 0;
    std::vector<uint32_t> tokens;  // the whole prompt
    size_t key_len = 0;            // all but the last 2 tokens: a state is saved there
    size_t input_len = 0;          // tokens looked up and admitted
    std::vector<std::pair<uint32_t, bool>> stops;  // where filling stops; true: a state is saved there
    size_t next_stop = 0;
    std::vector<marconi_saved_state> saved;
};

// One adapter set: its namespace and its store handle.
struct Space {
    uint64_t ns = 0;
    std::string identity;
    marconi_store *store = nullptr;
};

using Chain = std::pair<uint64_t, std::vector<uint32_t>>;  // (namespace, tokens)

struct Hooks {
    bool on = false;
    int mib = 64;
    int host_mib = -1;
    double flops = 1e11;
    std::string store_location, model_id, negative;
    marconi_model_spec spec{};
    marconi_cache *cache = nullptr;
    bool tiered = false;  // the cache has a host and a store tier (--marconi-store)
    std::unordered_map<uint32_t, std::vector<uint8_t>> blobs;  // device states, by slot
    std::unordered_map<uint32_t, Chain> slot_chain;             // tiered: what each slot covers
    std::map<Chain, std::vector<uint8_t>> host;                 // tiered: host tier copies
    uint64_t blob_bytes = 0, host_bytes = 0, owned = 0;
    std::vector<uint32_t> free_ids;
    uint32_t next_id = 0;
    std::unordered_map<int, Pending> seqs;
    std::unordered_map<std::string, Space> spaces;  // by adapter string
    std::unordered_map<uint64_t, marconi_store *> stores;  // by namespace
    uint64_t prompts = 0, hits = 0, hit_tokens = 0, prompt_tokens = 0, restore_failures = 0, check_failures = 0;
    uint64_t hits_by_tier[3] = {0, 0, 0}, load_failures = 0, store_puts = 0, store_put_failures = 0;
    uint64_t corrupted = 0;
};

Hooks H;

void log_error(const char *call, marconi_status st) {
    char buf[512];
    marconi_last_error(buf, sizeof buf);
    std::fprintf(stderr, "marconi: %s failed: status %u: %s\n", call, (unsigned)st, buf);
}

// 64-bit FNV-1a over bytes, folded 8 bytes at a time for speed.
uint64_t mix(uint64_t h, const uint8_t *p, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        std::memcpy(&w, p + i, 8);
        h = (h ^ w) * 0x100000001b3ULL;
        h ^= h >> 29;
    }
    for (; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ULL;
    return h;
}

// A digest of a file's bytes (the model, an adapter): two servers share
// states only when their files are byte-identical. Empty on a read error.
std::string file_digest(const std::string &path) {
    FILE *f = std::fopen(path.c_str(), "rb");
    if (!f) return "";
    std::vector<uint8_t> buf(1 << 20);
    uint64_t a = 0xcbf29ce484222325ULL, b = 0x84222325cbf29ce4ULL, len = 0;
    size_t n;
    while ((n = std::fread(buf.data(), 1, buf.size(), f)) > 0) {
        a = mix(a, buf.data(), n);
        b = mix(b ^ len, buf.data(), n);
        len += n;
    }
    const bool err = std::ferror(f) != 0;
    std::fclose(f);
    if (err) return "";
    char out[64];
    std::snprintf(out, sizeof out, "%016llx%016llx-%llu", (unsigned long long)a, (unsigned long long)b,
                  (unsigned long long)len);
    return out;
}

uint32_t store_blob(std::vector<uint8_t> &&blob) {
    uint32_t id;
    if (!H.free_ids.empty()) {
        id = H.free_ids.back();
        H.free_ids.pop_back();
    } else {
        id = H.next_id++;
    }
    H.blob_bytes += blob.size();
    H.blobs[id] = std::move(blob);
    return id;
}

void drop(uint32_t id) {
    auto it = H.blobs.find(id);
    if (it == H.blobs.end()) {
        std::fprintf(stderr, "marconi: asked to free state %u, which is not held\n", id);
        return;
    }
    H.blob_bytes -= it->second.size();
    H.blobs.erase(it);
    H.slot_chain.erase(id);
    H.free_ids.push_back(id);
}

// Carries out the tiers' ops in order (before the freed slots are dropped:
// a host WRITE copies a device slot's bytes).
void apply_ops() {
    if (!H.tiered) return;
    size_t n_ops = 0, n_tok = 0;
    marconi_status st = marconi_cache_drain_ops(H.cache, nullptr, 0, &n_ops, nullptr, 0, &n_tok);
    if (st != MARCONI_STATUS_OK && st != MARCONI_STATUS_BUFFER_TOO_SMALL) {
        log_error("marconi_cache_drain_ops", st);
        return;
    }
    std::vector<marconi_tier_op> ops(n_ops + 1);
    std::vector<uint32_t> toks(n_tok + 1);
    st = marconi_cache_drain_ops(H.cache, ops.data(), ops.size(), &n_ops, toks.data(), toks.size(), &n_tok);
    if (st != MARCONI_STATUS_OK) {
        log_error("marconi_cache_drain_ops", st);
        return;
    }
    for (size_t k = 0; k < n_ops; k++) {
        const marconi_tier_op &op = ops[k];
        Chain chain{op.ns, std::vector<uint32_t>(toks.begin() + (long)op.tokens_offset,
                                                 toks.begin() + (long)(op.tokens_offset + op.position))};
        if (op.kind == MARCONI_TIER_OP_KIND_WRITE && op.tier == MARCONI_TIER_HOST) {
            const std::vector<uint8_t> *src = nullptr;
            for (const auto &sc : H.slot_chain)
                if (sc.second == chain) src = &H.blobs.at(sc.first);
            if (!src) {
                std::fprintf(stderr, "marconi: a host write of a state no slot holds (%u tokens): skipped\n",
                             op.position);
                continue;
            }
            auto &dst = H.host[chain];
            H.host_bytes += src->size() - dst.size();
            dst = *src;
        } else if (op.kind == MARCONI_TIER_OP_KIND_WRITE && op.tier == MARCONI_TIER_STORE) {
            auto it = H.host.find(chain);
            auto sit = H.stores.find(op.ns);
            if (it == H.host.end() || sit == H.stores.end()) {
                std::fprintf(stderr, "marconi: a store write of a state the host tier lacks (%u tokens): skipped\n",
                             op.position);
                continue;
            }
            const std::vector<uint32_t> &c = chain.second;
            const marconi_status ps =
                marconi_store_put_state(sit->second, c.data(), c.size(), c.size(), it->second.data(), it->second.size());
            if (ps == MARCONI_STATUS_OK) {
                H.store_puts++;
            } else {
                // The store is down or refused it: later simply a miss.
                H.store_put_failures++;
                if (ps != MARCONI_STATUS_BACKEND_FAILURE) log_error("marconi_store_put_state", ps);
            }
        } else if (op.kind == MARCONI_TIER_OP_KIND_DROP && op.tier == MARCONI_TIER_HOST) {
            auto it = H.host.find(chain);
            if (it != H.host.end()) {
                H.host_bytes -= it->second.size();
                H.host.erase(it);
            }
        }
        // A store DROP: other servers may still read the object; the
        // store's own expiry or memory policy removes it.
    }
}

// Frees the states libmarconi evicted.
void drain() {
    apply_ops();
    size_t n_pages = 0, n_slots = 0;
    marconi_status st = marconi_cache_drain_freed(H.cache, nullptr, 0, &n_pages, nullptr, 0, &n_slots);
    if (st != MARCONI_STATUS_OK && st != MARCONI_STATUS_BUFFER_TOO_SMALL) {
        log_error("drain_freed", st);
        return;
    }
    std::vector<uint32_t> pages(n_pages + 1), slots(n_slots + 1);
    st = marconi_cache_drain_freed(H.cache, pages.data(), pages.size(), &n_pages, slots.data(), slots.size(),
                                   &n_slots);
    if (st != MARCONI_STATUS_OK) {
        log_error("drain_freed", st);
        return;
    }
    for (size_t i = 0; i < n_slots; i++) {
        drop(slots[i]);
        H.owned--;
    }
}

// libmarconi charges the attention KV of a shared prefix once; the host
// copies here hold it once per state. Evict until the bytes really held fit
// the budget too.
void enforce_budget() {
    if (!H.cache) return;
    const uint64_t budget = (uint64_t)H.mib << 20;
    for (int round = 0; round < 64 && H.blob_bytes > budget; round++) {
        marconi_stats s{};
        s.struct_size = sizeof s;
        if (marconi_cache_stats(H.cache, &s) != MARCONI_STATUS_OK) return;
        const uint64_t before = H.blob_bytes;
        uint64_t free_now = 0;
        const uint64_t want = (s.capacity_bytes > s.used_bytes ? s.capacity_bytes - s.used_bytes : 0) +
                              (H.blob_bytes - budget);
        marconi_status st = marconi_cache_evict(H.cache, want, &free_now);
        if (st != MARCONI_STATUS_OK) {
            log_error("marconi_cache_evict", st);
            return;
        }
        drain();
        if (H.blob_bytes == before) return;  // nothing evictable left (states leased by running prompts)
    }
}

std::vector<uint8_t> save(llama_context *ctx, int seq) {
    std::vector<uint8_t> b(llama_state_seq_get_size_ext(ctx, seq, 0));
    const size_t n = llama_state_seq_get_data_ext(ctx, b.data(), b.size(), seq, 0);
    if (n != b.size()) b.clear();
    return b;
}

// The negative control: zero the last Mamba layer's SSM or conv state of a
// state blob. The recurrent section ends with, per Mamba layer, the SSM
// state [i32 type][u64 row size][data]; before those, the conv states of
// the same shape (the layout ../../llama-engine checks the same way).
bool corrupt(std::vector<uint8_t> &b) {
    const marconi_model_spec &s = H.spec;
    const size_t s_bytes = (size_t)s.ssm_state_channels * s.d_state * 4;
    const size_t r_bytes = (size_t)s.conv_channels * s.conv_kernel * 4;
    const size_t s_sec = (size_t)s.ssm_layers * (12 + s_bytes);
    if (s_bytes == 0 || r_bytes == 0 || b.size() < s_sec + 8 + r_bytes) return false;
    uint64_t row = 0;
    std::memcpy(&row, b.data() + b.size() - s_bytes - 8, 8);
    if (row != s_bytes) return false;
    std::memcpy(&row, b.data() + b.size() - s_sec - 8 - r_bytes, 8);
    if (row != r_bytes) return false;
    if (H.negative == "zero-ssm") std::memset(b.data() + b.size() - s_bytes, 0, s_bytes);
    else std::memset(b.data() + b.size() - s_sec - r_bytes, 0, r_bytes);
    return true;
}

// Reads the state of tokens[0..h] from the store; false on a miss (absent,
// truncated, corrupt, foreign, the store down or slow).
bool store_read(marconi_store *store, const std::vector<uint32_t> &toks, uint32_t h, std::vector<uint8_t> &out) {
    out.resize(1 << 20);
    for (int k = 0; k < 2; k++) {
        size_t len = 0;
        uint32_t found = 0;
        const marconi_status st =
            marconi_store_get_state(store, toks.data(), h, h, out.data(), out.size(), &len, &found);
        if (st == MARCONI_STATUS_BUFFER_TOO_SMALL) {
            out.resize(len);
            continue;
        }
        if (st != MARCONI_STATUS_OK) {
            log_error("marconi_store_get_state", st);
            return false;
        }
        if (!found) return false;
        out.resize(len);
        return true;
    }
    return false;
}

// The namespace of an adapter set ("" for none: namespace 0), with its
// store handle when there is a store.
Space *space_for(const char *adapters) {
    const std::string key = adapters ? adapters : "";
    auto it = H.spaces.find(key);
    if (it != H.spaces.end()) return &it->second;
    Space sp;
    // The identity: the model's digest, then each adapter's digest and
    // scale (the patch passes "path@scale;" per active adapter).
    std::string ids;
    size_t at = 0;
    while (at < key.size()) {
        size_t end = key.find(';', at);
        if (end == std::string::npos) end = key.size();
        const std::string item = key.substr(at, end - at);
        const size_t sep = item.rfind('@');
        const std::string path = item.substr(0, sep);
        std::string d = file_digest(path);
        if (d.empty()) d = "path:" + path;
        ids += " adapter " + d + (sep == std::string::npos ? "" : "@" + item.substr(sep + 1));
        at = end + 1;
    }
    if (!ids.empty()) {
        const uint64_t h = mix(0xcbf29ce484222325ULL, (const uint8_t *)ids.data(), ids.size());
        sp.ns = h == 0 ? 1 : h;
    }
    sp.identity = "llama-server llama_state_seq_ext flags 0, model " + H.model_id + ids;
    if (H.tiered && !H.store_location.empty()) {
        marconi_store_config sc;
        marconi_store_config_init(&sc, sizeof sc);
        const bool redis = H.store_location.rfind("redis://", 0) == 0;
        sc.backend = redis ? MARCONI_STORE_BACKEND_REDIS : MARCONI_STORE_BACKEND_DIR;
        sc.location = H.store_location.c_str();
        sc.model = sp.identity.c_str();
        sc.block_size = 16;  // unused: the store holds states only
        sc.timeout_ms = 200;
        sc.connect_timeout_ms = 100;
        sc.max_value_bytes = 1ULL << 30;
        marconi_status st = marconi_store_new(&sc, &sp.store);
        if (st != MARCONI_STATUS_OK) {
            log_error("marconi_store_new", st);
            sp.store = nullptr;
        } else {
            H.stores[sp.ns] = sp.store;
        }
    }
    return &H.spaces.emplace(key, std::move(sp)).first->second;
}

void summary(const char *event, int seq) {
    uint64_t states = 0, leases = 0, evictions = 0;
    marconi_status ck;
    if (H.tiered) {
        marconi_tiered_stats s{};
        s.struct_size = sizeof s;
        marconi_cache_tier_stats(H.cache, &s);
        states = H.owned;
        for (const auto &p : H.seqs) leases += p.second.lease != 0;
        ck = marconi_cache_check(H.cache);
    } else {
        marconi_stats s{};
        s.struct_size = sizeof s;
        marconi_cache_stats(H.cache, &s);
        states = s.states;
        leases = s.leases;
        evictions = s.evictions;
        ck = marconi_cache_check(H.cache);
    }
    if (ck != MARCONI_STATUS_OK) {
        H.check_failures++;
        log_error("check", ck);
    }
    uint64_t store_misses = 0;
    for (const auto &kv : H.stores) {
        marconi_store_stats ss{};
        ss.struct_size = sizeof ss;
        if (marconi_store_get_stats(kv.second, &ss) != MARCONI_STATUS_OK) continue;
        store_misses += ss.absent + ss.truncated + ss.corrupt + ss.version + ss.foreign_model + ss.wrong_key +
                        ss.oversized + ss.not_regular + ss.timeout + ss.unavailable + ss.failed;
    }
    std::fprintf(stderr,
                 "marconi: %s seq %d: prompts %llu hits %llu hit_tokens %llu prompt_tokens %llu states %llu "
                 "blobs %zu blob_bytes %llu leases %llu in_flight %zu evictions %llu restore_failures %llu "
                 "check_failures %llu host_hits %llu store_hits %llu load_failures %llu host_copies %zu "
                 "store_puts %llu store_put_failures %llu store_misses %llu corrupted %llu\n",
                 event, seq, (unsigned long long)H.prompts, (unsigned long long)H.hits,
                 (unsigned long long)H.hit_tokens, (unsigned long long)H.prompt_tokens, (unsigned long long)states,
                 H.blobs.size(), (unsigned long long)H.blob_bytes, (unsigned long long)leases, H.seqs.size(),
                 (unsigned long long)evictions, (unsigned long long)H.restore_failures,
                 (unsigned long long)H.check_failures, (unsigned long long)H.hits_by_tier[MARCONI_TIER_HOST],
                 (unsigned long long)H.hits_by_tier[MARCONI_TIER_STORE], (unsigned long long)H.load_failures,
                 H.host.size(), (unsigned long long)H.store_puts, (unsigned long long)H.store_put_failures,
                 (unsigned long long)store_misses, (unsigned long long)H.corrupted);
}

// libmarconi's GGUF reader does not map gated-delta-net hybrids (Qwen3.5:
// `qwen35`) yet. Their shape from the GGUF keys llama.cpp reads
// (llama_model_qwen35::load_arch_hparams): every full_attention_interval-th
// layer gated attention, the others gated delta net, each with a gated MLP.
// A delta-net layer's state is n_v_heads x head_v x head_k numbers
// (ssm.inner_size x ssm.state_size), its conv state (2 x key dim + value
// dim) x (conv_kernel - 1); its FLOPs are counted as a Mamba-2 mixer's of
// the same state.
bool spec_from_gguf_keys(const char *path, marconi_model_spec &s) {
    gguf_init_params gp{/*no_alloc=*/true, /*ctx=*/nullptr};
    gguf_context *g = gguf_init_from_file(path, gp);
    if (!g) return false;
    auto str = [&](const std::string &k) -> std::string {
        const int64_t id = gguf_find_key(g, k.c_str());
        return id >= 0 && gguf_get_kv_type(g, id) == GGUF_TYPE_STRING ? gguf_get_val_str(g, id) : "";
    };
    const std::string arch = str("general.architecture");
    auto u32 = [&](const char *k, uint32_t dflt) -> uint32_t {
        const int64_t id = gguf_find_key(g, (arch + "." + k).c_str());
        if (id < 0) return dflt;
        const gguf_type t = gguf_get_kv_type(g, id);
        if (t == GGUF_TYPE_UINT32) return gguf_get_val_u32(g, id);
        if (t == GGUF_TYPE_INT32) return (uint32_t)gguf_get_val_i32(g, id);
        if (t == GGUF_TYPE_ARRAY) {  // per-layer values (as llama_model_save_to_file writes them): the largest
            const gguf_type at = gguf_get_arr_type(g, id);
            if (at != GGUF_TYPE_UINT32 && at != GGUF_TYPE_INT32) return 0;
            const uint32_t *v = (const uint32_t *)gguf_get_arr_data(g, id);
            uint32_t m = 0;
            for (size_t i = 0; i < gguf_get_arr_n(g, id); i++) m = std::max(m, v[i]);
            return m;
        }
        return 0;
    };
    bool ok = false;
    if (arch == "qwen35") {
        const uint32_t n_layer = u32("block_count", 0), interval = u32("full_attention_interval", 4);
        const uint32_t d = u32("embedding_length", 0), heads = u32("attention.head_count", 0);
        const uint32_t kv = u32("attention.head_count_kv", 0), ff = u32("feed_forward_length", 0);
        const uint32_t inner = u32("ssm.inner_size", 0), d_state = u32("ssm.state_size", 0);
        const uint32_t groups = u32("ssm.group_count", 0), conv = u32("ssm.conv_kernel", 0);
        // Which layers are recurrent: the per-layer flags llama.cpp saves,
        // else every full_attention_interval-th layer is attention.
        uint32_t n_attn = n_layer / std::max<uint32_t>(interval, 1);
        const int64_t rid = gguf_find_key(g, "qwen35.attention.recurrent_layers");
        if (rid >= 0 && gguf_get_kv_type(g, rid) == GGUF_TYPE_ARRAY) {
            const gguf_type at = gguf_get_arr_type(g, rid);
            const size_t n = std::min<size_t>(gguf_get_arr_n(g, rid), n_layer);
            const uint8_t *b = (const uint8_t *)gguf_get_arr_data(g, rid);
            const size_t w = (at == GGUF_TYPE_BOOL || at == GGUF_TYPE_UINT8 || at == GGUF_TYPE_INT8) ? 1
                             : (at == GGUF_TYPE_UINT32 || at == GGUF_TYPE_INT32) ? 4 : 0;
            if (w) {
                n_attn = n_layer - (uint32_t)n;
                for (size_t i = 0; i < n; i++) {
                    uint32_t v = 0;
                    std::memcpy(&v, b + i * w, w);
                    n_attn += v == 0;
                }
            }
        }
        if (n_layer && n_attn && n_attn < n_layer && d && heads && kv && ff && inner && d_state && groups &&
            conv > 1 && u32("expert_count", 0) == 0) {
            s = marconi_model_spec{};
            s.attn_layers = n_attn;
            s.ssm_layers = n_layer - s.attn_layers;
            s.mlp_layers = n_layer;
            s.d_model = d;
            s.n_heads = heads;
            s.kv_heads = kv;
            s.head_dim = u32("attention.key_length", d / heads);
            s.ffn_dim = ff;
            s.ffn_matrices = 3;
            s.ssm_inner = inner;
            s.d_state = d_state;
            s.ssm_state_channels = inner;
            s.conv_channels = 2ULL * groups * d_state + inner;
            s.conv_kernel = conv - 1;
            s.dtype_bytes = 2;
            s.state_dtype_bytes = 4;
            ok = true;
        }
    }
    gguf_free(g);
    return ok;
}

[[noreturn]] void bad_arg(const char *what) {
    std::fprintf(stderr, "%s\n", what);
    std::exit(1);
}

long parse_mib(int i, int argc, char **argv, const char *name) {
    char *end = nullptr;
    const long v = i + 1 < argc ? std::strtol(argv[i + 1], &end, 10) : 0;
    if (i + 1 >= argc || *end != '\0' || v <= 0 || v > (1L << 20)) {
        std::fprintf(stderr, "%s takes a positive number of MiB\n", name);
        std::exit(1);
    }
    return v;
}

}  // namespace

void parse_args(int &argc, char **argv) {
    int out = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const bool has_val = i + 1 < argc;
        if (std::strcmp(a, "--marconi") == 0) {
            H.on = true;
        } else if (std::strcmp(a, "--marconi-mib") == 0) {
            H.mib = (int)parse_mib(i, argc, argv, a);
            i++;
        } else if (std::strcmp(a, "--marconi-host-mib") == 0) {
            H.host_mib = (int)parse_mib(i, argc, argv, a);
            i++;
        } else if (std::strcmp(a, "--marconi-store") == 0) {
            if (!has_val || argv[i + 1][0] == '\0') bad_arg("--marconi-store takes a directory or redis://HOST:PORT");
            H.store_location = argv[++i];
        } else if (std::strcmp(a, "--marconi-model-id") == 0) {
            if (!has_val || argv[i + 1][0] == '\0') bad_arg("--marconi-model-id takes a non-empty string");
            H.model_id = argv[++i];
        } else if (std::strcmp(a, "--marconi-flops") == 0) {
            char *end = nullptr;
            const double v = has_val ? std::strtod(argv[i + 1], &end) : 0.0;
            if (!has_val || *end != '\0' || !(v > 0.0) || v > 1e20) bad_arg("--marconi-flops takes a positive FLOP/s");
            H.flops = v;
            i++;
        } else if (std::strcmp(a, "--marconi-negative") == 0) {
            if (!has_val || (std::strcmp(argv[i + 1], "zero-ssm") != 0 && std::strcmp(argv[i + 1], "zero-conv") != 0))
                bad_arg("--marconi-negative takes zero-ssm or zero-conv");
            H.negative = argv[++i];
        } else {
            argv[out++] = argv[i];
        }
    }
    argc = out;
    argv[argc] = nullptr;
    if (!H.on && (!H.store_location.empty() || H.host_mib > 0 || !H.negative.empty()))
        bad_arg("--marconi-store, --marconi-host-mib and --marconi-negative need --marconi");
}

bool enabled() { return H.on && H.cache != nullptr; }

int budget_mib() { return H.mib; }

bool init(const char *model_path) {
    if (!H.on) return false;
    marconi_status st = marconi_model_spec_from_gguf(model_path, &H.spec);
    if (st != MARCONI_STATUS_OK) {
        if (!spec_from_gguf_keys(model_path, H.spec)) {
            log_error("marconi_model_spec_from_gguf", st);
            H.on = false;
            return false;
        }
        std::fprintf(stderr, "marconi: model shape from the GGUF keys (gated delta net hybrid)\n");
    }
    marconi_cache_config cfg;
    marconi_cache_config_init(&cfg, sizeof cfg);
    cfg.model = H.spec;
    cfg.model_preset = nullptr;
    cfg.capacity_bytes = (uint64_t)H.mib << 20;
    if (H.store_location.empty()) {
        st = marconi_cache_new(&cfg, &H.cache);
        if (st != MARCONI_STATUS_OK) {
            log_error("marconi_cache_new", st);
            H.on = false;
            return false;
        }
        std::fprintf(stderr, "marconi: prompt cache delegated to libmarconi, %d MiB of saved states\n", H.mib);
        return true;
    }
    if (H.model_id.empty()) {
        H.model_id = file_digest(model_path);
        if (H.model_id.empty()) {
            std::fprintf(stderr, "marconi: cannot read %s to name the model in the store; give --marconi-model-id\n",
                         model_path);
            H.on = false;
            return false;
        }
    }
    if (H.host_mib < 0) H.host_mib = H.mib;
    marconi_tier_options tc;
    marconi_tier_options_init(&tc, sizeof tc);
    // Every state goes through to the store at once: another server, or
    // this one restarted, finds it there.
    tc.write_mode = MARCONI_TIER_WRITE_THROUGH;
    tc.host.capacity_bytes = (uint64_t)H.host_mib << 20;
    tc.host.bandwidth_bytes_per_s = 5e9;  // memcpy
    tc.host.latency_s = 10e-6;
    tc.store.capacity_bytes = 1ULL << 40;  // what the store may hold: its own policy bounds it
    tc.store.bandwidth_bytes_per_s = 1e9;  // a local directory or Redis on the network
    tc.store.latency_s = 1e-3;
    tc.compute_flops = H.flops;
    tc.store_states_hold_kv = 1;  // whole sequence states: their KV comes with them
    // The probe asks the store about the positions just below the input's
    // end, longest first: as many as a slot's context holds.
    tc.max_store_probe = 8192;
    cfg.tiers = &tc;
    st = marconi_cache_new(&cfg, &H.cache);
    if (st != MARCONI_STATUS_OK) {
        log_error("marconi_cache_new", st);
        H.on = false;
        return false;
    }
    H.tiered = true;
    if (!space_for("")->store) {
        std::fprintf(stderr, "marconi: the store %s cannot be used\n", H.store_location.c_str());
        marconi_cache_free(H.cache);
        H.cache = nullptr;
        H.tiered = false;
        H.on = false;
        return false;
    }
    std::fprintf(stderr,
                 "marconi: prompt cache delegated to libmarconi, %d MiB of saved states, host tier %d MiB, "
                 "store %s (model %s)\n",
                 H.mib, H.host_mib, H.store_location.c_str(), H.model_id.c_str());
    return true;
}

int begin(llama_context *ctx, int seq, const llama_token *tokens, size_t n_tokens, const char *adapters) {
    if (!enabled()) return 0;
    abandon(seq);
    llama_memory_t mem = llama_get_memory(ctx);
    H.prompts++;
    H.prompt_tokens += n_tokens;
    if (n_tokens < 4) {  // nothing to skip: at least 2 tokens are always processed
        llama_memory_seq_rm(mem, seq, -1, -1);
        return 0;
    }
    Space *sp = space_for(adapters);
    Pending p;
    p.ns = sp->ns;
    p.tokens.assign(tokens, tokens + n_tokens);
    p.key_len = n_tokens - 2;
    uint32_t h = 0, slot = MARCONI_NO_SLOT, tier = MARCONI_TIER_DEVICE, dev_h = 0, dev_slot = MARCONI_NO_SLOT;
    size_t n_plan_max = 0;
    // The input looked up is the prompt but its last token (a lookup never
    // hits its whole input), with the key's end as a checkpoint hint so
    // that the state there is planned; a hit past the key (an earlier
    // prompt's state 1 token before this one's end) would leave a one-token
    // batch: then the key alone is looked up again.
    const uint32_t hint = (uint32_t)p.key_len;
    for (int attempt = 0; attempt < 2; attempt++) {
        p.input_len = attempt == 0 ? n_tokens - 1 : p.key_len;
        const uint32_t *hints = attempt == 0 ? &hint : nullptr;
        const size_t n_hints = attempt == 0 ? 1 : 0;
        marconi_status st;
        if (H.tiered) {
            marconi_tiered_hit lk{};
            st = marconi_cache_lookup_tiered(H.cache, p.ns, p.tokens.data(), p.input_len, hints, n_hints, sp->store, &lk);
            p.lease = lk.lease;
            h = lk.hit_tokens;
            tier = lk.tier;
            slot = lk.device_state_slot;
            dev_h = lk.device_hit_tokens;
            dev_slot = lk.device_state_slot;
            n_plan_max = lk.n_plan;
        } else {
            marconi_lookup lk{};
            st = marconi_cache_lookup_hinted(H.cache, p.ns, p.tokens.data(), p.input_len, hints, n_hints,
                                             MARCONI_NO_SLOT, &lk);
            p.lease = lk.lease;
            h = lk.hit_tokens;
            slot = lk.state_slot;
            n_plan_max = lk.n_plan;
        }
        if (st != MARCONI_STATUS_OK) {
            log_error("lookup", st);
            llama_memory_seq_rm(mem, seq, -1, -1);
            return 0;
        }
        if (h <= p.key_len) break;
        const marconi_status rs = marconi_cache_release(H.cache, p.lease);
        if (rs != MARCONI_STATUS_OK) log_error("release", rs);
        p.lease = 0;
    }
    std::vector<uint32_t> plan(n_plan_max + 1);
    size_t n_plan = 0;
    const marconi_status pst = marconi_cache_lease_plan(H.cache, p.lease, plan.data(), plan.size(), &n_plan);
    if (pst != MARCONI_STATUS_OK) {
        log_error("lease_plan", pst);
        n_plan = 0;
    }

    // The bytes to restore: the device's own state, or a lower tier's.
    std::vector<uint8_t> blob;
    bool have = false;
    if (h > 0 && tier == MARCONI_TIER_DEVICE) {
        auto it = H.blobs.find(slot);
        if (it != H.blobs.end()) blob = it->second, have = true;
    } else if (h > 0 && tier == MARCONI_TIER_HOST) {
        auto it = H.host.find(Chain{p.ns, std::vector<uint32_t>(p.tokens.begin(), p.tokens.begin() + h)});
        if (it != H.host.end()) blob = it->second, have = true;
    } else if (h > 0 && tier == MARCONI_TIER_STORE && sp->store) {
        have = store_read(sp->store, p.tokens, h, blob);
    }
    if (h > 0 && !have && tier != MARCONI_TIER_DEVICE) {
        // The load missed (the store lost the object, returned a corrupt
        // or foreign one, or is down): resume from the device's own hit.
        marconi_cache_report_load_failure(H.cache, p.lease);
        H.load_failures++;
        h = dev_h;
        tier = MARCONI_TIER_DEVICE;
        auto it = H.blobs.find(dev_slot);
        if (h > 0 && it != H.blobs.end()) blob = it->second, have = true;
    }
    llama_memory_seq_rm(mem, seq, -1, -1);
    if (h > 0) {
        if (!H.negative.empty() && have) {
            if (corrupt(blob)) H.corrupted++;
            else std::fprintf(stderr, "marconi: negative control: unexpected state layout, state not corrupted\n");
        }
        if (!have || llama_state_seq_set_data_ext(ctx, blob.data(), blob.size(), seq, 0) != blob.size() ||
            llama_memory_seq_pos_max(mem, seq) + 1 != (llama_pos)h) {
            std::fprintf(stderr, "marconi: cannot restore the state of %u tokens (tier %u) into seq %d: "
                         "processing from 0\n", h, tier, seq);
            H.restore_failures++;
            llama_memory_seq_rm(mem, seq, -1, -1);
            h = 0;
        }
    }
    // Cuts: the planned positions, then the key's end (the state a
    // regenerate and every continuation resume from); every chunk >= 2
    // tokens. llama.cpp splits a chunk into micro-batches of n_ubatch
    // tokens: a chunk of k * n_ubatch + 1 tokens would end in a one-token
    // micro-batch (another matmul path in ggml, not bitwise that of a
    // prefill in one pass), so such a chunk is stopped 2 tokens early
    // once more (a stop where nothing is saved).
    const uint32_t ub = std::max<uint32_t>(llama_n_ubatch(ctx), 2);
    uint32_t last = h;
    auto add = [&](uint32_t c, bool keep) {
        if ((c - last) % ub == 1) p.stops.push_back({c - 2, false});
        p.stops.push_back({c, keep});
        last = c;
    };
    for (size_t k = 0; k < n_plan; k++) {
        const uint32_t c = plan[k];
        if (c < last + 2 || c + 2 > p.key_len) continue;
        add(c, true);
    }
    if (p.key_len >= (size_t)last + 2) add((uint32_t)p.key_len, true);
    if ((p.tokens.size() - last) % ub == 1) p.stops.push_back({(uint32_t)p.tokens.size() - 2, false});
    if (h > 0) {
        H.hits++;
        H.hit_tokens += h;
        H.hits_by_tier[tier]++;
    }
    H.seqs[seq] = std::move(p);
    return (int)h;
}

bool is_cut(int seq, size_t n_done) {
    if (!enabled()) return false;
    auto it = H.seqs.find(seq);
    if (it == H.seqs.end()) return false;
    const Pending &p = it->second;
    return p.next_stop < p.stops.size() && p.stops[p.next_stop].first == n_done;
}

void before_fill(llama_context *ctx, int seq, size_t n_done) {
    if (!is_cut(seq, n_done)) return;
    Pending &p = H.seqs[seq];
    const bool keep = p.stops[p.next_stop++].second;
    if (!keep) return;
    std::vector<uint8_t> b = save(ctx, seq);
    if (b.empty()) {
        std::fprintf(stderr, "marconi: cannot save the state of seq %d at %zu\n", seq, n_done);
        return;
    }
    const uint32_t id = store_blob(std::move(b));
    if (H.tiered)
        H.slot_chain[id] = Chain{p.ns, std::vector<uint32_t>(p.tokens.begin(), p.tokens.begin() + n_done)};
    p.saved.push_back({(uint32_t)n_done, id});
}

void prompt_done(llama_context *ctx, int seq, size_t n_tokens) {
    (void)ctx;
    if (!enabled()) return;
    auto it = H.seqs.find(seq);
    if (it == H.seqs.end()) return;
    Pending &p = it->second;
    if (p.lease == 0 || n_tokens != p.tokens.size()) {
        abandon(seq);
        return;
    }
    std::vector<uint8_t> taken(p.saved.size(), 0);
    marconi_admit_result ar{};
    const marconi_status st = marconi_cache_admit(H.cache, p.lease, p.tokens.data(), p.input_len, p.saved.data(),
                                                  p.saved.size(), nullptr, 0, taken.data(), &ar);
    if (st != MARCONI_STATUS_OK) {
        log_error("admit", st);
        std::fill(taken.begin(), taken.end(), 0);
    }
    for (uint8_t t : taken) H.owned += t;
    const marconi_status rs = marconi_cache_release(H.cache, p.lease);
    if (rs != MARCONI_STATUS_OK) log_error("release", rs);
    // The ops first: a state the device did not take may go straight to
    // the host tier, copied from its slot.
    apply_ops();
    for (size_t k = 0; k < p.saved.size(); k++)
        if (!taken[k]) drop(p.saved[k].slot);
    H.seqs.erase(it);
    drain();
    enforce_budget();
    summary("admitted", seq);
}

void abandon(int seq) {
    if (!enabled()) return;
    auto it = H.seqs.find(seq);
    if (it == H.seqs.end()) return;
    for (const auto &s : it->second.saved) drop(s.slot);
    if (it->second.lease != 0) {
        const marconi_status st = marconi_cache_release(H.cache, it->second.lease);
        if (st != MARCONI_STATUS_OK) log_error("release", st);
    }
    H.seqs.erase(it);
    drain();
    summary("abandoned", seq);
}

}  // namespace marconi_hooks
