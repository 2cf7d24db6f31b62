// llama-engine: a small chat engine over llama.cpp that delegates every
// prefix-caching decision to libmarconi, and checks every answer.
//
// The model is a random Nemotron-H (Mamba-2 + attention + MLP layers) built
// with no download: its GGUF metadata is written by ggml's gguf writer, the
// dimensions the cache needs are read back from that file by
// marconi_model_spec_from_gguf, and llama_model_init_from_user fills the
// tensors with seeded random values (stdev 0.3, A negative), the way
// llama.cpp's own architecture tests build models.
//
// Workload (built-in, seeded): sessions sharing a few system prompts, each a
// multi-turn chat whose next turn extends the previous answer; some requests
// branch (regenerate or edit an earlier turn). Served request by request:
//
//   marconi_cache_lookup -> restore the state of the hit's slot
//   (llama_state_seq_set_data) -> prefill the rest in chunks split at the
//   positions of marconi_cache_lease_plan, saving the state there
//   (llama_state_seq_get_data) under a fresh slot id -> decode greedily ->
//   marconi_cache_admit (planned states + the final state) ->
//   marconi_cache_release -> marconi_cache_drain_freed frees the stored
//   states of evicted slots.
//
// Every request is also served with no cache (from token 0) and the logits
// of the last prompt token and of every decode step must be bitwise equal.
// A third pass serves the same prompts with a "last state of each slot"
// policy (llama.cpp server style) for comparison. --negative zero-ssm /
// zero-conv corrupts every restored state (the SSM or the conv state of the
// last Mamba layer): the exactness check must then fail, and the program
// exits 0 only if it did.

#include "ggml.h"
#include "gguf.h"
#include "llama.h"
#include "marconi.h"

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include <signal.h>
#include <time.h>

namespace {

// ---------------------------------------------------------------- helpers

[[noreturn]] void die(const char *what) {
    std::fprintf(stderr, "llama-engine: %s\n", what);
    std::exit(2);
}

void check_marconi(marconi_status st, const char *call) {
    if (st != MARCONI_STATUS_OK) {
        char buf[512];
        marconi_last_error(buf, sizeof buf);
        std::fprintf(stderr, "llama-engine: %s failed: status %u: %s\n", call, (unsigned)st, buf);
        std::exit(2);
    }
}

double now_s() {
    using namespace std::chrono;
    return duration<double>(steady_clock::now().time_since_epoch()).count();
}

// splitmix64: a fixed algorithm, so the model and the workload are the same
// on every machine and standard library.
struct Rng {
    uint64_t s;
    uint64_t next() {
        uint64_t z = (s += 0x9e3779b97f4a7c15ULL);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
        return z ^ (z >> 31);
    }
    uint32_t below(uint32_t n) { return (uint32_t)(next() % n); }
    uint32_t range(uint32_t lo, uint32_t hi) { return lo + below(hi - lo + 1); }
    double unit() { return (double)(next() >> 11) * (1.0 / 9007199254740992.0); }
    double normal() {
        double u1 = unit(), u2 = unit();
        if (u1 < 1e-300) u1 = 1e-300;
        return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
    }
};

uint64_t fnv1a(const char *s) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (; *s; ++s) h = (h ^ (uint8_t)*s) * 0x100000001b3ULL;
    return h;
}

// ---------------------------------------------------------------- model

struct Dims {
    uint32_t n_vocab = 512;
    uint32_t n_embd = 256;
    uint32_t n_head = 4;
    uint32_t n_head_kv = 2;
    uint32_t n_ff = 512;
    uint32_t d_inner = 512;
    uint32_t d_state = 64;
    uint32_t n_group = 2;
    uint32_t ssm_heads = 8;
    uint32_t d_conv = 4;
    // M: Mamba-2, *: attention, -: MLP (Nemotron-H's hybrid_override_pattern).
    std::string pattern = "M*-M-M*-";
};

// Nemotron-H metadata, as convert_hf_to_gguf writes it: per-layer KV head
// and FFN arrays mark the layer kinds (KV 0 and FFN 0: Mamba-2; FFN 0:
// attention; else MLP).
gguf_context *build_metadata(const Dims &d) {
    gguf_context *g = gguf_init_empty();
    const uint32_t n_layer = (uint32_t)d.pattern.size();
    std::vector<uint32_t> kv(n_layer), ff(n_layer);
    for (uint32_t i = 0; i < n_layer; i++) {
        kv[i] = d.pattern[i] == '*' ? d.n_head_kv : 0;
        ff[i] = d.pattern[i] == '-' ? d.n_ff : 0;
    }
    gguf_set_val_str(g, "general.architecture", "nemotron_h");
    gguf_set_val_str(g, "general.name", "tiny-random-nemotron-h");
    gguf_set_val_u32(g, "nemotron_h.vocab_size", d.n_vocab);
    gguf_set_val_u32(g, "nemotron_h.context_length", 4096);
    gguf_set_val_u32(g, "nemotron_h.embedding_length", d.n_embd);
    gguf_set_val_u32(g, "nemotron_h.block_count", n_layer);
    gguf_set_arr_data(g, "nemotron_h.feed_forward_length", GGUF_TYPE_UINT32, ff.data(), ff.size());
    // llama.cpp derives the head size from the head count of layer 0, so the
    // query head count is one value for every layer.
    gguf_set_val_u32(g, "nemotron_h.attention.head_count", d.n_head);
    gguf_set_arr_data(g, "nemotron_h.attention.head_count_kv", GGUF_TYPE_UINT32, kv.data(), kv.size());
    gguf_set_val_f32(g, "nemotron_h.attention.layer_norm_epsilon", 1e-5f);
    gguf_set_val_f32(g, "nemotron_h.attention.layer_norm_rms_epsilon", 1e-5f);
    gguf_set_val_u32(g, "nemotron_h.ssm.conv_kernel", d.d_conv);
    gguf_set_val_u32(g, "nemotron_h.ssm.inner_size", d.d_inner);
    gguf_set_val_u32(g, "nemotron_h.ssm.state_size", d.d_state);
    gguf_set_val_u32(g, "nemotron_h.ssm.time_step_rank", d.ssm_heads);
    gguf_set_val_u32(g, "nemotron_h.ssm.group_count", d.n_group);
    // llama.cpp's test tokenizer: tokens are ids, no special tokens.
    gguf_set_val_str(g, "tokenizer.ggml.model", "test");
    std::vector<std::string> names(d.n_vocab);
    std::vector<const char *> ptrs(d.n_vocab);
    std::vector<float> scores(d.n_vocab, 0.0f);
    for (uint32_t i = 0; i < d.n_vocab; i++) {
        names[i] = "tok_" + std::to_string(i);
        ptrs[i] = names[i].c_str();
    }
    gguf_set_arr_str(g, "tokenizer.ggml.tokens", ptrs.data(), ptrs.size());
    gguf_set_arr_data(g, "tokenizer.ggml.scores", GGUF_TYPE_FLOAT32, scores.data(), scores.size());
    return g;
}

struct TensorInit {
    uint64_t seed;
    float stdev;
};

void set_tensor_data(ggml_tensor *t, void *ud) {
    const TensorInit &p = *(const TensorInit *)ud;
    Rng r{p.seed ^ fnv1a(t->name)};
    const bool ssm_a = std::strstr(t->name, "ssm_a") != nullptr;  // decay: A < 0
    const int64_t n = ggml_nelements(t);
    if (t->type != GGML_TYPE_F32) die("unexpected tensor type (only f32 is generated)");
    std::vector<float> v((size_t)n);
    for (auto &x : v) {
        float f = (float)(r.normal() * p.stdev);
        x = ssm_a ? -std::fabs(f) : f;
    }
    ggml_backend_tensor_set(t, v.data(), 0, ggml_nbytes(t));
}

void quiet_log(ggml_log_level level, const char *text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
}

// ---------------------------------------------------------------- engine

struct Engine {
    llama_context *ctx = nullptr;
    llama_batch batch{};
    uint32_t n_vocab = 0;
    uint32_t ubatch = 0;

    void clear() { llama_memory_clear(llama_get_memory(ctx), true); }

    // Prefills tokens[from, to) at positions from.., in pieces of at most
    // `ubatch` tokens, never a piece of one token (a one-token batch takes
    // another matmul path in ggml, not bitwise equal to a longer one). The
    // caller guarantees to - from >= 2. Logits only for the last token.
    void prefill(const std::vector<llama_token> &toks, uint32_t from, uint32_t to, bool logits) {
        if (to - from < 2) die("internal: a prefill chunk of fewer than 2 tokens");
        uint32_t at = from;
        while (at < to) {
            uint32_t take = std::min(ubatch, to - at);
            if (to - at - take == 1) take -= 1;
            batch.n_tokens = (int32_t)take;
            for (uint32_t i = 0; i < take; i++) {
                batch.token[i] = toks[at + i];
                batch.pos[i] = (llama_pos)(at + i);
                batch.n_seq_id[i] = 1;
                batch.seq_id[i][0] = 0;
                batch.logits[i] = (logits && at + i == to - 1) ? 1 : 0;
            }
            if (llama_decode(ctx, batch) != 0) die("llama_decode failed during prefill");
            at += take;
        }
    }

    // Greedy decode: the logits of the last prompt token, then `steps - 1`
    // single-token steps. Returns the logits of every step and the tokens.
    void decode(uint32_t pos, uint32_t steps, std::vector<float> &logits, std::vector<llama_token> &out) {
        logits.clear();
        out.clear();
        for (uint32_t s = 0; s < steps; s++) {
            const float *l = llama_get_logits_ith(ctx, -1);
            if (!l) die("no logits");
            logits.insert(logits.end(), l, l + n_vocab);
            llama_token best = (llama_token)(std::max_element(l, l + n_vocab) - l);
            out.push_back(best);
            if (s + 1 == steps) break;
            batch.n_tokens = 1;
            batch.token[0] = best;
            batch.pos[0] = (llama_pos)(pos + s);
            batch.n_seq_id[0] = 1;
            batch.seq_id[0][0] = 0;
            batch.logits[0] = 1;
            if (llama_decode(ctx, batch) != 0) die("llama_decode failed during decode");
        }
    }

    std::vector<uint8_t> save(llama_state_seq_flags flags = 0) {
        std::vector<uint8_t> b(llama_state_seq_get_size_ext(ctx, 0, flags));
        size_t n = llama_state_seq_get_data_ext(ctx, b.data(), b.size(), 0, flags);
        if (n != b.size()) die("llama_state_seq_get_data_ext wrote an unexpected size");
        return b;
    }

    void restore(const std::vector<uint8_t> &b, uint32_t expect_tokens) {
        clear();
        if (llama_state_seq_set_data(ctx, b.data(), b.size(), 0) != b.size())
            die("llama_state_seq_set_data failed");
        llama_pos mx = llama_memory_seq_pos_max(llama_get_memory(ctx), 0);
        if (mx + 1 != (llama_pos)expect_tokens) die("restored state does not end at the hit position");
    }
};

// ---------------------------------------------------------------- workload

struct Request {
    uint32_t session;
    uint32_t parent;  // index of the request whose prompt+output this extends, or UINT32_MAX
    uint32_t system;  // system prompt id (first turn only)
    std::vector<llama_token> user;  // appended user message
    uint32_t decode;  // tokens to generate
    const char *kind;
};

struct Workload {
    std::vector<std::vector<llama_token>> systems;
    std::vector<Request> reqs;
};

// Sessions pick one of a few system prompts and chat in turns; requests of
// different sessions interleave. With probability 0.2 a turn branches from
// an earlier turn of its session (a regenerated or edited message).
Workload make_workload(uint64_t seed, uint32_t n_requests, uint32_t n_sessions, uint32_t n_vocab) {
    Rng r{seed};
    Workload w;
    for (int s = 0; s < 3; s++) {
        std::vector<llama_token> t(r.range(96, 192));
        for (auto &x : t) x = (llama_token)r.below(n_vocab);
        w.systems.push_back(t);
    }
    std::vector<std::vector<uint32_t>> turns(n_sessions);  // request ids of each session
    for (uint32_t i = 0; i < n_requests; i++) {
        uint32_t s = r.below(n_sessions);
        Request q{};
        q.session = s;
        q.decode = r.range(4, 8);
        q.user.resize(r.range(6, 40));
        for (auto &x : q.user) x = (llama_token)r.below(n_vocab);
        if (turns[s].empty()) {
            q.parent = UINT32_MAX;
            q.system = r.below((uint32_t)w.systems.size());
            q.kind = "new";
        } else if (turns[s].size() >= 2 && r.unit() < 0.2) {
            q.parent = turns[s][r.below((uint32_t)turns[s].size() - 1)];
            q.kind = "branch";
        } else {
            q.parent = turns[s].back();
            q.kind = "turn";
        }
        turns[s].push_back(i);
        w.reqs.push_back(std::move(q));
    }
    return w;
}

// ---------------------------------------------------------------- main

struct Totals {
    uint64_t prompt_tokens = 0, prefilled = 0, hits = 0;
    double prefill_s = 0;
};

void usage() {
    std::fprintf(stderr,
                 "usage: llama-engine [--gguf PATH] [--requests N] [--sessions N] [--seed N]\n"
                 "                    [--capacity-states N] [--threads N] [--negative zero-ssm|zero-conv]\n"
                 "                    [--admit-decoded] [--verbose]\n"
                 "                    [--tiers [--host-states N] [--tier-write back|through]\n"
                 "                     [--store dir:PATH|redis://127.0.0.1:PORT] [--kill-store-pid PID --kill-after N]\n"
                 "                     [--expect shared|load-failures|store-down]\n"
                 "                     [--transcript-out PATH] [--resume PATH]]\n"
                 "--admit-decoded: also cache the decoded tokens (the state after decoding);\n"
                 "  those states were computed one token at a time, so the check then reports\n"
                 "  the largest logit difference instead of requiring bitwise equality\n"
                 "--tiers: serve through marconi_cache with lower tiers (device + host + store): evicted\n"
                 "  states are copied into engine host buffers and the store; lookups probe the\n"
                 "  store for states other processes wrote; every request stays bitwise equal\n"
                 "--transcript-out: each session's last sequence, for --resume in another\n"
                 "  process, which continues those sessions (a fresh device cache)\n");
    std::exit(2);
}

// ---------------------------------------------------------------- tiers

struct TierOptions {
    bool on = false;
    uint32_t host_states = 16;
    std::string write = "back";
    std::string store;  // "dir:PATH" or "redis://..." or empty
    long kill_pid = 0;
    uint32_t kill_after = 0;
    std::string expect;
    std::string transcript_out;  // write each session's last sequence here
};

// The sessions another engine process served (its --transcript-out: one
// line per session, its last prompt + answer as token ids), continued here:
// for each, a new user turn, then one more turn on top of the answer.
Workload resume_workload(const std::string &path, uint64_t seed, uint32_t n_vocab) {
    FILE *f = std::fopen(path.c_str(), "r");
    if (!f) die("cannot open the --resume transcript");
    Workload w;
    std::vector<llama_token> cur;
    long v;
    int c;
    while (true) {
        c = std::fgetc(f);
        if (c == EOF || c == '\n') {
            if (!cur.empty()) w.systems.push_back(cur);
            cur.clear();
            if (c == EOF) break;
            continue;
        }
        std::ungetc(c, f);
        if (std::fscanf(f, "%ld", &v) != 1 || v < 0 || v >= (long)n_vocab) die("bad token in the --resume transcript");
        cur.push_back((llama_token)v);
        while ((c = std::fgetc(f)) == ' ') {}
        if (c != EOF) std::ungetc(c, f);
    }
    std::fclose(f);
    if (w.systems.empty()) die("the --resume transcript is empty");
    Rng r{seed ^ 0x7265737566ULL};
    const uint32_t k = (uint32_t)w.systems.size();
    for (uint32_t round = 0; round < 2; round++) {
        for (uint32_t s = 0; s < k; s++) {
            Request q{};
            q.session = s;
            q.decode = r.range(4, 8);
            q.user.resize(r.range(6, 40));
            for (auto &x : q.user) x = (llama_token)r.below(n_vocab);
            q.parent = round == 0 ? UINT32_MAX : s;
            q.system = s;
            q.kind = round == 0 ? "resume" : "turn";
            w.reqs.push_back(std::move(q));
        }
    }
    return w;
}

std::vector<uint32_t> as_u32(const std::vector<llama_token> &t) { return std::vector<uint32_t>(t.begin(), t.end()); }

// Reads the state object of tokens[0..h] from the store; false on a miss
// (absent, corrupt, the store down or slow).
bool store_read(const marconi_store *store, const std::vector<uint32_t> &toks, uint32_t h, std::vector<uint8_t> &out) {
    size_t len = 0;
    uint32_t found = 0;
    out.resize(out.empty() ? (1u << 20) : out.capacity());
    for (int k = 0; k < 2; k++) {
        marconi_status st = marconi_store_get_state(store, toks.data(), h, h, out.data(), out.size(), &len, &found);
        if (st == MARCONI_STATUS_BUFFER_TOO_SMALL) {
            out.resize(len);
            continue;
        }
        check_marconi(st, "marconi_store_get_state");
        if (!found) return false;
        out.resize(len);
        return true;
    }
    return false;
}

// The tiered engine: a marconi_cache with lower tiers decides, the engine
// moves the bytes.
// Device states are llama.cpp sequence blobs (KV + recurrent state) by
// slot, as in the plain mode; the host tier is engine memory holding the
// same blobs, by chain (the tokens they cover); the store holds them as
// state objects (marconi_store_put_state), shared with other processes.
int run_tiered(Engine &e, const Workload &w, const marconi_model_spec &spec, uint64_t state_bytes, uint64_t kv_per_token,
               uint32_t capacity_states, uint64_t seed, const TierOptions &o) {
    const uint32_t n_requests = (uint32_t)w.reqs.size();
    marconi_cache_config dev;
    check_marconi(marconi_cache_config_init(&dev, sizeof dev), "marconi_cache_config_init");
    dev.model = spec;
    dev.model_preset = nullptr;
    dev.capacity_bytes = capacity_states * state_bytes + 1024 * kv_per_token;
    dev.tuner_adoption = MARCONI_ALPHA_ADOPTION_DETERMINISTIC;
    marconi_tier_options tc;
    check_marconi(marconi_tier_options_init(&tc, sizeof tc), "marconi_tier_options_init");
    tc.host.capacity_bytes = o.host_states * state_bytes + 2048 * kv_per_token;
    // Rates of this CPU engine: host copies are memcpy; the store is a
    // local directory or Redis on the loopback. Prefill runs at roughly
    // 1e10 FLOP/s here, so every hit is worth loading.
    tc.host.bandwidth_bytes_per_s = 5e9;
    tc.host.latency_s = 10e-6;
    tc.compute_flops = 1e10;
    tc.write_mode = o.write == "through" ? MARCONI_TIER_WRITE_THROUGH : MARCONI_TIER_WRITE_BACK;
    marconi_store *store = nullptr;
    std::string location, model_id;
    if (!o.store.empty()) {
        tc.store.capacity_bytes = 4096 * state_bytes + 65536 * kv_per_token;
        tc.store.bandwidth_bytes_per_s = 1e9;
        tc.store.latency_s = 200e-6;
        // The engine's state objects are whole sequence blobs: their KV
        // comes with them.
        tc.store_states_hold_kv = 1;
        marconi_store_config sc;
        check_marconi(marconi_store_config_init(&sc, sizeof sc), "marconi_store_config_init");
        if (o.store.rfind("dir:", 0) == 0) {
            sc.backend = MARCONI_STORE_BACKEND_DIR;
            location = o.store.substr(4);
        } else {
            sc.backend = MARCONI_STORE_BACKEND_REDIS;
            location = o.store;
        }
        // Two engines share an object exactly when this string is equal:
        // the model (its seed: the weights) and the value layout.
        model_id = "tiny-nemotron-h seed " + std::to_string(seed) + " llama.cpp seq state f32";
        sc.location = location.c_str();
        sc.model = model_id.c_str();
        sc.block_size = 16;
        sc.timeout_ms = 100;
        check_marconi(marconi_store_new(&sc, &store), "marconi_store_new");
    }
    dev.tiers = &tc;
    marconi_cache *t = nullptr;
    check_marconi(marconi_cache_new(&dev, &t), "marconi_cache_new");

    std::unordered_map<uint32_t, std::vector<uint8_t>> blobs;  // device states, by slot
    std::unordered_map<uint32_t, std::vector<uint32_t>> slot_chain;  // the tokens each slot's state covers
    std::map<std::vector<uint32_t>, std::vector<uint8_t>> host;  // host tier copies, by chain
    std::vector<uint32_t> free_slots;
    uint32_t next_slot = 0;
    auto new_slot = [&]() {
        if (!free_slots.empty()) {
            uint32_t s = free_slots.back();
            free_slots.pop_back();
            return s;
        }
        return next_slot++;
    };
    auto drop_slot = [&](uint32_t s) {
        blobs.erase(s);
        slot_chain.erase(s);
        free_slots.push_back(s);
    };
    uint64_t host_writes = 0, store_writes = 0, store_put_failures = 0, host_drops = 0, host_peak = 0;
    // Carries out the tiers' ops in order, then frees the device's slots.
    auto apply_ops = [&]() {
        size_t n_ops = 0, n_tok = 0;
        marconi_status st = marconi_cache_drain_ops(t, nullptr, 0, &n_ops, nullptr, 0, &n_tok);
        if (st != MARCONI_STATUS_OK && st != MARCONI_STATUS_BUFFER_TOO_SMALL) check_marconi(st, "drain_ops (size)");
        std::vector<marconi_tier_op> ops(n_ops + 1);
        std::vector<uint32_t> toks(n_tok + 1);
        check_marconi(marconi_cache_drain_ops(t, ops.data(), ops.size(), &n_ops, toks.data(), toks.size(), &n_tok),
                      "marconi_cache_drain_ops");
        for (size_t k = 0; k < n_ops; k++) {
            const marconi_tier_op &op = ops[k];
            std::vector<uint32_t> chain(toks.begin() + (long)op.tokens_offset,
                                        toks.begin() + (long)(op.tokens_offset + op.position));
            if (op.kind == MARCONI_TIER_OP_KIND_WRITE && op.tier == MARCONI_TIER_HOST) {
                const std::vector<uint8_t> *src = nullptr;
                for (auto &sc : slot_chain)
                    if (sc.second == chain) src = &blobs.at(sc.first);
                if (!src) die("the tiers asked for a host copy of a state no device slot holds");
                host[chain] = *src;
                host_writes++;
            } else if (op.kind == MARCONI_TIER_OP_KIND_WRITE && op.tier == MARCONI_TIER_STORE) {
                auto it = host.find(chain);
                if (it == host.end()) die("the tiers asked for a store write of a chain the host copies lack");
                marconi_status ps = marconi_store_put_state(store, chain.data(), chain.size(), chain.size(),
                                                            it->second.data(), it->second.size());
                // A store that is down does not take it: later a miss.
                if (ps == MARCONI_STATUS_OK) store_writes++;
                else if (ps == MARCONI_STATUS_BACKEND_FAILURE) store_put_failures++;
                else check_marconi(ps, "marconi_store_put_state");
            } else if (op.kind == MARCONI_TIER_OP_KIND_DROP && op.tier == MARCONI_TIER_HOST) {
                if (host.erase(chain) != 1) die("the tiers dropped a host copy never written");
                host_drops++;
            }
            // A store drop: other processes may still read the object; the
            // store's own expiry or memory policy removes it.
        }
    };
    auto drain_freed = [&]() {
        size_t np = 0, nsl = 0;
        marconi_status st = marconi_cache_drain_freed(t, nullptr, 0, &np, nullptr, 0, &nsl);
        if (st != MARCONI_STATUS_OK && st != MARCONI_STATUS_BUFFER_TOO_SMALL) check_marconi(st, "drain_freed (size)");
        std::vector<uint32_t> pages(np + 1), slots(nsl + 1);
        check_marconi(marconi_cache_drain_freed(t, pages.data(), pages.size(), &np, slots.data(), slots.size(), &nsl),
                      "marconi_cache_drain_freed");
        for (size_t k = 0; k < nsl; k++) {
            if (!blobs.count(slots[k])) die("the tiers freed a slot the engine does not hold");
            drop_slot(slots[k]);
        }
    };

    std::vector<std::vector<llama_token>> full_seq(n_requests);
    Totals cached, nocache;
    uint64_t load_fail = 0, by_tier[3] = {0, 0, 0}, shared = 0;
    uint32_t mismatches = 0;
    std::vector<uint8_t> buf;
    bool killed = false;
    for (uint32_t i = 0; i < n_requests; i++) {
        if (o.kill_pid > 0 && i == o.kill_after && !killed) {
            // The store dies mid-run: later lookups, loads and writes miss.
            if (kill((pid_t)o.kill_pid, SIGKILL) != 0) die("cannot kill the store server");
            for (int k = 0; k < 200 && kill((pid_t)o.kill_pid, 0) == 0; k++) {
                struct timespec ts{0, 10 * 1000 * 1000};
                nanosleep(&ts, nullptr);
            }
            killed = true;
            std::printf("store server (pid %ld) killed before request %u\n", o.kill_pid, i);
        }
        const Request &q = w.reqs[i];
        std::vector<llama_token> p = q.parent == UINT32_MAX ? w.systems[q.system] : full_seq[q.parent];
        p.insert(p.end(), q.user.begin(), q.user.end());
        const uint32_t n = (uint32_t)p.size();
        std::vector<uint32_t> toks = as_u32(p);

        double t0 = now_s();
        marconi_tiered_hit lk{};
        check_marconi(marconi_cache_lookup_tiered(t, 0, toks.data(), toks.size(), nullptr, 0, store, &lk),
                      "marconi_cache_lookup_tiered");
        std::vector<uint32_t> plan(lk.n_plan + 1);
        size_t n_plan = 0;
        check_marconi(marconi_cache_lease_plan(t, lk.lease, plan.data(), plan.size(), &n_plan),
                      "marconi_cache_lease_plan");
        uint32_t h = lk.hit_tokens;
        const std::vector<uint8_t> *blob = nullptr;
        if (lk.tier == MARCONI_TIER_DEVICE) {
            if (h > 0) blob = &blobs.at(lk.device_state_slot);
        } else {
            std::vector<uint32_t> chain(toks.begin(), toks.begin() + h);
            bool got = false;
            if (lk.tier == MARCONI_TIER_HOST) {
                auto it = host.find(chain);
                if (it != host.end()) {
                    buf = it->second;
                    got = true;
                }
            } else {
                got = store_read(store, toks, h, buf);
            }
            if (got) {
                blob = &buf;
                by_tier[lk.tier]++;
                shared += lk.shared;
            } else {
                // The load missed: resume from the device's own hit.
                check_marconi(marconi_cache_report_load_failure(t, lk.lease), "marconi_cache_report_load_failure");
                load_fail++;
                h = lk.device_hit_tokens;
                if (h > 0) blob = &blobs.at(lk.device_state_slot);
            }
        }
        if (h > 0 && n - h < 2) h = 0, blob = nullptr;  // never in this workload
        if (h > 0) {
            e.restore(*blob, h);
            cached.hits++;
            if (lk.tier == MARCONI_TIER_DEVICE || blob != &buf) by_tier[0]++;
        } else {
            e.clear();
        }
        std::vector<uint32_t> cuts;
        bool save_at_end = false;
        uint32_t last = h;
        for (size_t k = 0; k < n_plan; k++) {
            uint32_t c = plan[k];
            if (c == n) { save_at_end = true; continue; }
            if (c <= h || c > n) continue;
            if (c - last < 2 || n - c < 2) continue;
            cuts.push_back(c);
            last = c;
        }
        (void)save_at_end;  // the final state at n is always saved here
        std::vector<marconi_saved_state> states;
        uint32_t at = h;
        for (uint32_t c : cuts) {
            e.prefill(p, at, c, false);
            uint32_t s = new_slot();
            blobs[s] = e.save();
            slot_chain[s] = std::vector<uint32_t>(toks.begin(), toks.begin() + c);
            states.push_back({c, s});
            at = c;
        }
        e.prefill(p, at, n, true);
        {
            uint32_t s = new_slot();
            blobs[s] = e.save();
            slot_chain[s] = toks;
            states.push_back({n, s});
        }
        double t1 = now_s();
        std::vector<float> logits;
        std::vector<llama_token> out;
        e.decode(n, q.decode, logits, out);
        std::vector<uint8_t> taken(states.size());
        marconi_admit_result ar{};
        check_marconi(marconi_cache_admit(t, lk.lease, toks.data(), toks.size(), states.data(), states.size(), nullptr, 0,
                                           taken.data(), &ar),
                      "marconi_cache_admit");
        check_marconi(marconi_cache_release(t, lk.lease), "marconi_cache_release");
        // The ops first: a state the device did not take may go straight
        // to the host, copied from its slot.
        apply_ops();
        for (size_t k = 0; k < states.size(); k++)
            if (!taken[k]) drop_slot(states[k].slot);
        drain_freed();
        host_peak = std::max<uint64_t>(host_peak, host.size());
        cached.prompt_tokens += n;
        cached.prefilled += n - h;
        cached.prefill_s += t1 - t0;
        full_seq[i] = p;
        full_seq[i].insert(full_seq[i].end(), out.begin(), out.end());

        double t2 = now_s();
        e.clear();
        e.prefill(p, 0, n, true);
        double t3 = now_s();
        std::vector<float> ref;
        std::vector<llama_token> ref_out;
        e.decode(n, q.decode, ref, ref_out);
        nocache.prompt_tokens += n;
        nocache.prefilled += n;
        nocache.prefill_s += t3 - t2;
        const bool equal = ref.size() == logits.size() && std::memcmp(ref.data(), logits.data(), ref.size() * 4) == 0;
        if (!equal) {
            mismatches++;
            std::printf("req %3u: %u prompt tokens, hit %u from tier %u: logits DIFFER\n", i, n, h, lk.tier);
        }
    }

    marconi_tiered_stats st{};
    st.struct_size = sizeof st;
    check_marconi(marconi_cache_tier_stats(t, &st), "marconi_cache_tier_stats");
    check_marconi(marconi_cache_check(t), "marconi_cache_check");
    std::printf("tiers: device %u checkpoints + KV of 1024 tokens, host %u checkpoints + KV of 2048 tokens%s, write-%s\n",
                capacity_states, o.host_states, store ? ", store" : "", o.write.c_str());
    std::printf("  %-26s %6" PRIu64 " prompt tokens, %6" PRIu64 " prefilled (%5.1f%% saved), %3" PRIu64
                " hit requests, prefill %7.3f s\n",
                "no cache", nocache.prompt_tokens, nocache.prefilled, 0.0, nocache.hits, nocache.prefill_s);
    std::printf("  %-26s %6" PRIu64 " prompt tokens, %6" PRIu64 " prefilled (%5.1f%% saved), %3" PRIu64
                " hit requests, prefill %7.3f s\n",
                "libmarconi tiers", cached.prompt_tokens, cached.prefilled,
                100.0 * (1.0 - (double)cached.prefilled / (double)cached.prompt_tokens), cached.hits, cached.prefill_s);
    std::printf("hits by tier (requests resumed): device %" PRIu64 ", host %" PRIu64 ", store %" PRIu64
                " (%" PRIu64 " of them written by another process); loads that missed %" PRIu64 "\n",
                by_tier[0], by_tier[1], by_tier[2], shared, load_fail);
    const double in = (double)st.input_tokens;
    std::printf("token hit rate by tier: device %.1f%%, host %.1f%%, store %.1f%% (library counts, before load misses)\n",
                100.0 * (double)st.hit_tokens_by_tier[0] / in, 100.0 * (double)st.hit_tokens_by_tier[1] / in,
                100.0 * (double)st.hit_tokens_by_tier[2] / in);
    std::printf("tier writes: host %" PRIu64 " (drops %" PRIu64 ", peak %" PRIu64 " copies), store %" PRIu64
                " (%" PRIu64 " not taken: store down); store probes %" PRIu64 ", failed %" PRIu64
                "; load misses reported %" PRIu64 "\n",
                host_writes, host_drops, host_peak, store_writes, store_put_failures, st.store_probes,
                st.store_probe_failures, st.load_failures);
    if (store) {
        marconi_store_stats ss{};
        ss.struct_size = sizeof ss;
        check_marconi(marconi_store_get_stats(store, &ss), "marconi_store_get_stats");
        std::printf("store: %" PRIu64 " hits, misses: %" PRIu64 " absent, %" PRIu64 " corrupt, %" PRIu64
                    " unavailable, %" PRIu64 " timeout, %" PRIu64 " failed; %" PRIu64 " puts, %" PRIu64
                    " put failures\n",
                    ss.hits, ss.absent, ss.corrupt, ss.unavailable, ss.timeout, ss.failed, ss.puts, ss.put_failures);
    }
    std::printf("exactness: %u of %u requests bitwise equal to no cache (%" PRIu64 " served from a restored state)\n",
                n_requests - mismatches, n_requests, cached.hits);
    if (!o.transcript_out.empty()) {
        // Each session's last sequence, for another process to continue.
        std::map<uint32_t, uint32_t> last;
        for (uint32_t i = 0; i < n_requests; i++) last[w.reqs[i].session] = i;
        FILE *f = std::fopen(o.transcript_out.c_str(), "w");
        if (!f) die("cannot write the --transcript-out file");
        for (auto &kv : last) {
            const auto &seq = full_seq[kv.second];
            for (size_t k = 0; k < seq.size(); k++) std::fprintf(f, k ? " %d" : "%d", (int)seq[k]);
            std::fputc('\n', f);
        }
        if (std::fclose(f) != 0) die("cannot write the --transcript-out file");
    }
    int rc = mismatches == 0 && cached.hits > 0 ? 0 : 1;
    if (o.expect == "shared" && shared == 0) {
        std::printf("FAIL: expected hits on states another process stored\n");
        rc = 1;
    } else if (o.expect == "load-failures" && (load_fail == 0 || load_fail != st.load_failures)) {
        std::printf("FAIL: expected load misses (corrupt objects), counted\n");
        rc = 1;
    } else if (o.expect == "store-down" && (!killed || st.store_probe_failures == 0)) {
        std::printf("FAIL: expected the killed store to give counted misses\n");
        rc = 1;
    } else if (!o.expect.empty() && o.expect != "shared" && o.expect != "load-failures" && o.expect != "store-down") {
        die("unknown --expect");
    }
    std::printf("%s\n", rc == 0 ? "PASS" : "FAIL");
    marconi_cache_free(t);
    marconi_store_free(store);
    return rc;
}

}  // namespace

int main(int argc, char **argv) {
    std::setvbuf(stdout, nullptr, _IOLBF, 0);
    std::string gguf_path = "tiny-nemotron-h.gguf";
    uint32_t n_requests = 64, n_sessions = 10, capacity_states = 8, threads = 1;
    uint64_t seed = 12;
    std::string negative;
    bool verbose = false, admit_decoded = false;
    TierOptions tiers;
    std::string resume;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        auto val = [&]() -> const char * {
            if (i + 1 >= argc) usage();
            return argv[++i];
        };
        if (a == "--gguf") gguf_path = val();
        else if (a == "--requests") n_requests = (uint32_t)std::strtoul(val(), nullptr, 10);
        else if (a == "--sessions") n_sessions = (uint32_t)std::strtoul(val(), nullptr, 10);
        else if (a == "--seed") seed = std::strtoull(val(), nullptr, 10);
        else if (a == "--capacity-states") capacity_states = (uint32_t)std::strtoul(val(), nullptr, 10);
        else if (a == "--threads") threads = (uint32_t)std::strtoul(val(), nullptr, 10);
        else if (a == "--negative") negative = val();
        else if (a == "--verbose") verbose = true;
        else if (a == "--admit-decoded") admit_decoded = true;
        else if (a == "--tiers") tiers.on = true;
        else if (a == "--host-states") tiers.host_states = (uint32_t)std::strtoul(val(), nullptr, 10);
        else if (a == "--tier-write") tiers.write = val();
        else if (a == "--store") tiers.store = val();
        else if (a == "--kill-store-pid") tiers.kill_pid = std::strtol(val(), nullptr, 10);
        else if (a == "--kill-after") tiers.kill_after = (uint32_t)std::strtoul(val(), nullptr, 10);
        else if (a == "--expect") tiers.expect = val();
        else if (a == "--transcript-out") tiers.transcript_out = val();
        else if (a == "--resume") resume = val();
        else usage();
    }
    if (n_requests == 0 || n_sessions == 0 || capacity_states == 0 || threads == 0) usage();
    if (!negative.empty() && negative != "zero-ssm" && negative != "zero-conv") usage();
    if (tiers.on && (!negative.empty() || admit_decoded || tiers.host_states == 0 ||
                     (tiers.write != "back" && tiers.write != "through") ||
                     (tiers.kill_pid > 0 && tiers.store.empty())))
        usage();
    if (!tiers.on && (!resume.empty() || !tiers.store.empty() || !tiers.transcript_out.empty())) usage();

    // 1. The model's metadata, written as a GGUF file and read back by
    //    libmarconi: the cache is configured from the file, not by hand.
    Dims d;
    gguf_context *meta = build_metadata(d);
    if (!gguf_write_to_file(meta, gguf_path.c_str(), /*only_meta=*/true)) die("cannot write the GGUF file");
    marconi_model_spec spec{};
    check_marconi(marconi_model_spec_from_gguf(gguf_path.c_str(), &spec), "marconi_model_spec_from_gguf");
    const uint64_t state_bytes =
        (uint64_t)spec.ssm_layers * spec.state_dtype_bytes *
        (spec.ssm_state_channels * spec.d_state + spec.conv_channels * spec.conv_kernel);
    const uint64_t kv_per_token = (uint64_t)spec.attn_layers * 2 * spec.kv_heads * spec.head_dim * spec.dtype_bytes;
    std::printf("model: nemotron_h from %s: %u Mamba-2 + %u attention + %u MLP layers, d_model %" PRIu64
                "; ModelSpec: state %" PRIu64 " B per checkpoint, KV %" PRIu64 " B per token\n",
                gguf_path.c_str(), spec.ssm_layers, spec.attn_layers, spec.mlp_layers, spec.d_model, state_bytes,
                kv_per_token);

    // 2. The model itself: random weights, no download.
    llama_log_set(quiet_log, nullptr);
    llama_backend_init();
    TensorInit init{seed, 0.3f};
    llama_model_params mp = llama_model_default_params();
    llama_model *model = llama_model_init_from_user(meta, set_tensor_data, &init, mp);
    if (!model) die("llama_model_init_from_user failed");
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 4096;
    cp.n_batch = 512;
    cp.n_ubatch = 512;
    cp.n_seq_max = 1;
    cp.n_threads = (int32_t)threads;
    cp.n_threads_batch = (int32_t)threads;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.no_perf = true;
    Engine e;
    e.ctx = llama_init_from_model(model, cp);
    if (!e.ctx) die("llama_init_from_model failed");
    e.n_vocab = (uint32_t)llama_vocab_n_tokens(llama_model_get_vocab(model));
    e.ubatch = 512;
    e.batch = llama_batch_init(512, 0, 1);

    // 3. The bytes llama.cpp stores vs what the ModelSpec says. A state
    //    blob is [attention KV section][recurrent section]; PARTIAL_ONLY
    //    gives the recurrent section alone.
    {
        Rng r{seed + 7};
        std::vector<llama_token> t(300);
        for (auto &x : t) x = (llama_token)r.below(e.n_vocab);
        long long part0 = -1, full[3];
        const uint32_t ns[3] = {64, 128, 300};
        for (int k = 0; k < 3; k++) {
            e.clear();
            e.prefill(t, 0, ns[k], false);
            long long part = (long long)llama_state_seq_get_size_ext(e.ctx, 0, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);
            full[k] = (long long)llama_state_seq_get_size(e.ctx, 0);
            if (part0 < 0) part0 = part;
            if (part != part0) die("the recurrent state size depends on the position");
        }
        const long long per_token = (full[1] - full[0]) / (long long)(ns[1] - ns[0]);
        const long long kv_fixed = full[0] - part0 - per_token * ns[0];
        const bool linear = full[2] - part0 == kv_fixed + per_token * (long long)ns[2];
        std::printf("bytes: llama.cpp recurrent state (PARTIAL_ONLY) %lld B = ModelSpec %" PRIu64
                    " + %lld B of headers; full seq state(n) = %lld + %lld + n x %lld B (ModelSpec KV %" PRIu64
                    " B/token + %lld B/token of cell metadata)%s\n",
                    part0, state_bytes, part0 - (long long)state_bytes, part0, kv_fixed, per_token, kv_per_token,
                    per_token - (long long)kv_per_token, linear ? "" : " [NOT LINEAR]");
        if (!linear || part0 < (long long)state_bytes || per_token < (long long)kv_per_token) {
            std::printf("FAIL: llama.cpp's state sizes do not follow the ModelSpec\n");
            return 1;
        }
    }

    if (tiers.on) {
        Workload tw = resume.empty() ? make_workload(seed, n_requests, n_sessions, e.n_vocab)
                                     : resume_workload(resume, seed, e.n_vocab);
        int rc = run_tiered(e, tw, spec, state_bytes, kv_per_token, capacity_states, seed, tiers);
        llama_batch_free(e.batch);
        llama_free(e.ctx);
        llama_model_free(model);
        gguf_free(meta);
        llama_backend_free();
        return rc;
    }

    // 4. The cache: capacity for `capacity_states` checkpoints plus the KV
    //    of 1,024 tokens, small enough that the workload evicts.
    marconi_cache_config cfg;
    check_marconi(marconi_cache_config_init(&cfg, sizeof cfg), "marconi_cache_config_init");
    cfg.model = spec;
    cfg.model_preset = nullptr;
    cfg.capacity_bytes = capacity_states * state_bytes + 1024 * kv_per_token;
    // The default policy (Marconi admission, FLOP-aware eviction, alpha
    // tuned online), with the tuning result adopted at a fixed request so
    // that a run's decisions do not depend on thread timing.
    cfg.tuner_adoption = MARCONI_ALPHA_ADOPTION_DETERMINISTIC;
    marconi_cache *cache = nullptr;
    check_marconi(marconi_cache_new(&cfg, &cache), "marconi_cache_new");

    Workload w = make_workload(seed, n_requests, n_sessions, e.n_vocab);
    std::vector<std::vector<llama_token>> full_seq(n_requests);  // prompt + all generated tokens
    std::vector<std::vector<llama_token>> prompts(n_requests);
    std::vector<std::vector<float>> ref_logits(n_requests);

    std::unordered_map<uint32_t, std::vector<uint8_t>> blobs;  // the engine's stored states, by slot
    std::vector<uint32_t> free_slots;
    uint32_t next_slot = 0;
    size_t peak_blob_bytes = 0;
    auto blob_bytes = [&]() {
        size_t s = 0;
        for (auto &kv : blobs) s += kv.second.size();
        return s;
    };
    auto new_slot = [&]() {
        if (!free_slots.empty()) {
            uint32_t s = free_slots.back();
            free_slots.pop_back();
            return s;
        }
        return next_slot++;
    };
    uint64_t freed_total = 0;
    auto drain = [&]() {
        size_t np = 0, nsl = 0;
        marconi_status st = marconi_cache_drain_freed(cache, nullptr, 0, &np, nullptr, 0, &nsl);
        if (st != MARCONI_STATUS_OK && st != MARCONI_STATUS_BUFFER_TOO_SMALL) check_marconi(st, "drain (size)");
        std::vector<uint32_t> pages(np + 1), slots(nsl + 1);
        check_marconi(marconi_cache_drain_freed(cache, pages.data(), pages.size(), &np, slots.data(), slots.size(), &nsl),
                      "marconi_cache_drain_freed");
        for (size_t i = 0; i < nsl; i++) {
            auto it = blobs.find(slots[i]);
            if (it == blobs.end()) die("the cache freed a slot the engine does not hold");
            blobs.erase(it);
            free_slots.push_back(slots[i]);
            freed_total++;
        }
    };

    Totals cached, nocache, lastslot;
    uint32_t mismatches = 0, hit_mismatches = 0, dropped_plan = 0, corrupted = 0;
    double max_diff = 0;
    std::map<std::string, uint32_t> kinds;

    for (uint32_t i = 0; i < n_requests; i++) {
        const Request &q = w.reqs[i];
        std::vector<llama_token> &p = prompts[i];
        p = q.parent == UINT32_MAX ? w.systems[q.system] : full_seq[q.parent];
        p.insert(p.end(), q.user.begin(), q.user.end());
        const uint32_t n = (uint32_t)p.size();
        kinds[q.kind]++;
        std::vector<uint32_t> toks(p.begin(), p.end());

        // --- served with libmarconi
        double t0 = now_s();
        marconi_lookup lk{};
        check_marconi(marconi_cache_lookup(cache, 0, toks.data(), toks.size(), MARCONI_NO_SLOT, &lk), "marconi_cache_lookup");
        std::vector<uint32_t> plan(lk.n_plan);
        size_t n_plan = 0;
        check_marconi(marconi_cache_lease_plan(cache, lk.lease, plan.data(), plan.size(), &n_plan), "marconi_cache_lease_plan");
        uint32_t h = lk.hit_tokens;
        if (h > 0 && n - h < 2) h = 0;  // never in this workload: every request appends >= 6 tokens
        if (h > 0) {
            std::vector<uint8_t> b = blobs.at(lk.state_slot);
            if (!negative.empty()) {
                // The recurrent section ends with, per Mamba layer, the SSM
                // state [i32 type][u64 row size][data]; before those, the
                // conv states of the same shape. Check the headers, then
                // zero the last Mamba layer's SSM or conv state.
                const size_t s_bytes = (size_t)spec.ssm_state_channels * spec.d_state * 4;
                const size_t r_bytes = (size_t)spec.conv_channels * spec.conv_kernel * 4;
                const size_t s_sec = (size_t)spec.ssm_layers * (12 + s_bytes);
                uint64_t row = 0;
                std::memcpy(&row, b.data() + b.size() - s_bytes - 8, 8);
                if (row != s_bytes) die("negative control: unexpected state layout (SSM row size)");
                std::memcpy(&row, b.data() + b.size() - s_sec - 8 - r_bytes, 8);
                if (row != r_bytes) die("negative control: unexpected state layout (conv row size)");
                if (negative == "zero-ssm") std::memset(b.data() + b.size() - s_bytes, 0, s_bytes);
                else std::memset(b.data() + b.size() - s_sec - r_bytes, 0, r_bytes);
                corrupted++;
            }
            e.restore(b, h);
            cached.hits++;
        } else {
            e.clear();
        }
        // Chunk boundaries: the planned positions inside (h, n), each chunk
        // at least 2 tokens; the plan may also name n (saved after the
        // prompt's last chunk).
        std::vector<uint32_t> cuts;
        bool save_at_end = false;
        uint32_t last = h;
        for (size_t k = 0; k < n_plan; k++) {
            uint32_t c = plan[k];
            if (c == n) { save_at_end = true; continue; }
            if (c <= h || c > n) continue;
            if (c - last < 2 || n - c < 2) { dropped_plan++; continue; }
            cuts.push_back(c);
            last = c;
        }
        std::vector<marconi_saved_state> states;
        uint32_t at = h;
        for (uint32_t c : cuts) {
            e.prefill(p, at, c, false);
            uint32_t s = new_slot();
            blobs[s] = e.save();
            states.push_back({c, s});
            at = c;
        }
        e.prefill(p, at, n, true);
        // By default the final state admitted is the one at the end of the
        // prompt, computed by prefill: a state after decoding was computed
        // one token at a time, which ggml rounds differently from a
        // multi-token prefill of the same tokens (the next turn's no-cache
        // run prefills them), so it cannot resume bitwise equal.
        if (save_at_end || !admit_decoded) {
            uint32_t s = new_slot();
            blobs[s] = e.save();
            states.push_back({n, s});
        }
        double t1 = now_s();
        std::vector<float> logits;
        std::vector<llama_token> out;
        e.decode(n, q.decode, logits, out);
        std::vector<uint32_t> admitted(toks);
        if (admit_decoded) {
            // The final state covers prompt + all but the last generated
            // token (the last one was sampled, never fed).
            const uint32_t fin = n + q.decode - 1;
            admitted.insert(admitted.end(), out.begin(), out.end() - 1);
            uint32_t s = new_slot();
            blobs[s] = e.save();
            states.push_back({fin, s});
        }
        std::vector<uint8_t> taken(states.size());
        marconi_admit_result ar{};
        check_marconi(marconi_cache_admit(cache, lk.lease, admitted.data(), admitted.size(), states.data(), states.size(),
                                          nullptr, 0, taken.data(), &ar),
                      "marconi_cache_admit");
        for (size_t k = 0; k < states.size(); k++) {
            if (!taken[k]) {
                blobs.erase(states[k].slot);
                free_slots.push_back(states[k].slot);
            }
        }
        check_marconi(marconi_cache_release(cache, lk.lease), "marconi_cache_release");
        drain();
        peak_blob_bytes = std::max(peak_blob_bytes, blob_bytes());
        cached.prompt_tokens += n;
        cached.prefilled += n - h;
        cached.prefill_s += t1 - t0;
        full_seq[i] = p;
        full_seq[i].insert(full_seq[i].end(), out.begin(), out.end());

        // --- the same request with no cache: bitwise equal logits
        double t2 = now_s();
        e.clear();
        e.prefill(p, 0, n, true);
        double t3 = now_s();
        std::vector<float> ref;
        std::vector<llama_token> ref_out;
        e.decode(n, q.decode, ref, ref_out);
        nocache.prompt_tokens += n;
        nocache.prefilled += n;
        nocache.prefill_s += t3 - t2;
        const bool equal = ref.size() == logits.size() && std::memcmp(ref.data(), logits.data(), ref.size() * 4) == 0;
        if (!equal) {
            for (size_t k = 0; k < std::min(ref.size(), logits.size()); k++)
                max_diff = std::max(max_diff, (double)std::fabs(ref[k] - logits[k]));
            mismatches++;
            if (h > 0) hit_mismatches++;
        }
        ref_logits[i] = std::move(ref);
        if (verbose || (!equal && negative.empty()))
            std::printf("req %3u %-6s session %2u: %4u prompt tokens, hit %4u (slot %u), %zu checkpoints planned, "
                        "%zu states admitted, %u freed so far, logits %s\n",
                        i, q.kind, q.session, n, h, h ? lk.state_slot : 0, n_plan, (size_t)ar.states_taken,
                        (unsigned)freed_total, equal ? "bitwise equal" : "DIFFER");
    }

    // --- "last state of each slot": K slots, each keeping the state after
    // its last request (llama.cpp server style, without libmarconi); a
    // request reuses the slot whose tokens are the longest proper prefix of
    // its prompt, else takes the least recently used slot. K = the number
    // of checkpoints libmarconi's capacity holds (its KV is not charged).
    {
        struct Slot {
            std::vector<llama_token> toks;
            std::vector<uint8_t> blob;
            uint64_t used = 0;
        };
        std::vector<Slot> slots(capacity_states);
        uint32_t ls_mismatch = 0;
        for (uint32_t i = 0; i < n_requests; i++) {
            const std::vector<llama_token> &p = prompts[i];
            const uint32_t n = (uint32_t)p.size();
            double t0 = now_s();
            int best = -1;
            size_t best_len = 0;
            for (size_t k = 0; k < slots.size(); k++) {
                const auto &st = slots[k].toks;
                if (!st.empty() && st.size() + 2 <= n && st.size() > best_len &&
                    std::equal(st.begin(), st.end(), p.begin())) {
                    best = (int)k;
                    best_len = st.size();
                }
            }
            uint32_t h = 0;
            if (best >= 0) {
                e.restore(slots[best].blob, (uint32_t)best_len);
                h = (uint32_t)best_len;
                lastslot.hits++;
            } else {
                e.clear();
                best = 0;
                for (size_t k = 1; k < slots.size(); k++)
                    if (slots[k].used < slots[best].used) best = (int)k;
            }
            e.prefill(p, h, n, true);
            double t1 = now_s();
            Slot &s = slots[best];
            s.toks = p;
            if (!admit_decoded) s.blob = e.save();
            std::vector<float> logits;
            std::vector<llama_token> out;
            e.decode(n, w.reqs[i].decode, logits, out);
            if (logits.size() != ref_logits[i].size() ||
                std::memcmp(logits.data(), ref_logits[i].data(), logits.size() * 4) != 0)
                ls_mismatch++;
            if (admit_decoded) {
                s.toks.insert(s.toks.end(), out.begin(), out.end() - 1);
                s.blob = e.save();
            }
            s.used = i + 1;
            lastslot.prompt_tokens += n;
            lastslot.prefilled += n - h;
            lastslot.prefill_s += t1 - t0;
        }
        if (ls_mismatch && !admit_decoded) {
            std::printf("FAIL: the last-state-per-slot baseline differs from no cache on %u requests\n", ls_mismatch);
            return 1;
        }
    }

    marconi_stats st{};
    st.struct_size = sizeof st;
    check_marconi(marconi_cache_stats(cache, &st), "marconi_cache_stats");
    check_marconi(marconi_cache_check(cache), "marconi_cache_check");

    std::printf("workload: %u requests (%u new sessions, %u turns, %u branches), %u sessions, 3 system prompts, seed %" PRIu64
                "\n",
                n_requests, kinds["new"], kinds["turn"], kinds["branch"], n_sessions, seed);
    std::printf("cache: capacity %" PRIu64 " B (%u checkpoints + KV of 1024 tokens); %" PRIu64
                " states held at the end, %" PRIu64 " slots freed by evictions, peak engine state store %.1f MB\n",
                cfg.capacity_bytes, capacity_states, st.states, freed_total, peak_blob_bytes / 1e6);
    auto row = [&](const char *name, const Totals &t) {
        std::printf("  %-26s %6" PRIu64 " prompt tokens, %6" PRIu64 " prefilled (%5.1f%% saved), %3" PRIu64
                    " hit requests, prefill %7.3f s\n",
                    name, t.prompt_tokens, t.prefilled, 100.0 * (1.0 - (double)t.prefilled / (double)t.prompt_tokens),
                    t.hits, t.prefill_s);
    };
    row("no cache", nocache);
    row("last state of each slot", lastslot);
    row("libmarconi", cached);
    std::printf("prefill wall time saved: %.1f%% vs no cache, %.1f%% vs last state of each slot "
                "(includes state restores and saves)\n",
                100.0 * (1.0 - cached.prefill_s / nocache.prefill_s), 100.0 * (1.0 - cached.prefill_s / lastslot.prefill_s));
    if (dropped_plan) std::printf("note: %u planned checkpoints skipped (they would make a 1-token chunk)\n", dropped_plan);

    int rc;
    if (admit_decoded) {
        std::printf("admit-decoded: %u of %u requests bitwise equal to no cache; largest logit difference %.3g\n",
                    n_requests - mismatches, n_requests, max_diff);
        rc = 0;
    } else if (negative.empty()) {
        std::printf("exactness: %u of %u requests bitwise equal to no cache (%" PRIu64 " served from a restored state)\n",
                    n_requests - mismatches, n_requests, cached.hits);
        rc = (mismatches == 0 && cached.hits > 0 && freed_total > 0) ? 0 : 1;
        if (cached.hits == 0) std::printf("FAIL: no request hit the cache\n");
        if (freed_total == 0) std::printf("FAIL: the cache never evicted (capacity too large for the check)\n");
    } else {
        std::printf("negative control %s: %u restored states corrupted, %u of them detected (logits differ)\n",
                    negative.c_str(), corrupted, hit_mismatches);
        rc = (corrupted > 0 && hit_mismatches == corrupted && mismatches == hit_mismatches) ? 0 : 1;
    }
    std::printf("%s\n", rc == 0 ? "PASS" : "FAIL");

    marconi_cache_free(cache);
    llama_batch_free(e.batch);
    llama_free(e.ctx);
    llama_model_free(model);
    gguf_free(meta);
    llama_backend_free();
    return rc;
}
