// marconi-hooks: see marconi-hooks.h. States are whole sequence states
// (llama_state_seq_get_data_ext, flags 0: the attention KV of the prefix and
// the recurrent state), kept in host memory under engine-owned ids that
// libmarconi hands back through marconi_cache_drain_freed when it evicts.

#include "marconi-hooks.h"

#include "marconi.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

namespace marconi_hooks {
namespace {

// One prompt in flight on a sequence: its lease, the planned cuts still
// ahead and the states saved so far (not yet the cache's).
struct Pending {
    uint64_t lease = 0;
    std::vector<uint32_t> tokens;
    std::vector<uint32_t> cuts;
    size_t next_cut = 0;
    std::vector<marconi_saved_state> saved;
};

struct Hooks {
    bool on = false;
    int mib = 64;
    marconi_cache *cache = nullptr;
    std::unordered_map<uint32_t, std::vector<uint8_t>> blobs;
    uint64_t blob_bytes = 0;
    std::vector<uint32_t> free_ids;
    uint32_t next_id = 0;
    std::unordered_map<int, Pending> seqs;
    uint64_t prompts = 0, hits = 0, hit_tokens = 0, prompt_tokens = 0, restore_failures = 0, check_failures = 0;
};

Hooks H;

void log_error(const char *call, marconi_status st) {
    char buf[512];
    marconi_last_error(buf, sizeof buf);
    std::fprintf(stderr, "marconi: %s failed: status %u: %s\n", call, (unsigned)st, buf);
}

uint32_t store(std::vector<uint8_t> &&blob) {
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
    H.free_ids.push_back(id);
}

// Frees the states libmarconi evicted.
void drain() {
    size_t n_pages = 0, n_slots = 0;
    marconi_status st = marconi_cache_drain_freed(H.cache, nullptr, 0, &n_pages, nullptr, 0, &n_slots);
    if (st != MARCONI_STATUS_OK && st != MARCONI_STATUS_BUFFER_TOO_SMALL) {
        log_error("marconi_cache_drain_freed", st);
        return;
    }
    std::vector<uint32_t> pages(n_pages + 1), slots(n_slots + 1);
    st = marconi_cache_drain_freed(H.cache, pages.data(), pages.size(), &n_pages, slots.data(), slots.size(), &n_slots);
    if (st != MARCONI_STATUS_OK) {
        log_error("marconi_cache_drain_freed", st);
        return;
    }
    for (size_t i = 0; i < n_slots; i++) drop(slots[i]);
}

// libmarconi charges the attention KV of a shared prefix once; the host
// copies here hold it once per state. Evict until the bytes really held fit
// the budget too.
void enforce_budget() {
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

void summary(const char *event, int seq) {
    marconi_stats s{};
    s.struct_size = sizeof s;
    marconi_cache_stats(H.cache, &s);
    const marconi_status ck = marconi_cache_check(H.cache);
    if (ck != MARCONI_STATUS_OK) {
        H.check_failures++;
        log_error("marconi_cache_check", ck);
    }
    std::fprintf(stderr,
                 "marconi: %s seq %d: prompts %llu hits %llu hit_tokens %llu prompt_tokens %llu states %llu "
                 "blobs %zu blob_bytes %llu leases %llu in_flight %zu evictions %llu restore_failures %llu "
                 "check_failures %llu\n",
                 event, seq, (unsigned long long)H.prompts, (unsigned long long)H.hits,
                 (unsigned long long)H.hit_tokens, (unsigned long long)H.prompt_tokens, (unsigned long long)s.states,
                 H.blobs.size(), (unsigned long long)H.blob_bytes, (unsigned long long)s.leases, H.seqs.size(),
                 (unsigned long long)s.evictions, (unsigned long long)H.restore_failures,
                 (unsigned long long)H.check_failures);
}

}  // namespace

void parse_args(int &argc, char **argv) {
    int out = 1;
    for (int i = 1; i < argc; i++) {
        if (std::strcmp(argv[i], "--marconi") == 0) {
            H.on = true;
        } else if (std::strcmp(argv[i], "--marconi-mib") == 0) {
            char *end = nullptr;
            const long v = i + 1 < argc ? std::strtol(argv[i + 1], &end, 10) : 0;
            if (i + 1 >= argc || *end != '\0' || v <= 0 || v > (1L << 20)) {
                std::fprintf(stderr, "--marconi-mib takes a positive number of MiB\n");
                std::exit(1);
            }
            H.mib = (int)v;
            i++;
        } else {
            argv[out++] = argv[i];
        }
    }
    argc = out;
    argv[argc] = nullptr;
}

bool enabled() { return H.on && H.cache != nullptr; }

int budget_mib() { return H.mib; }

bool init(const char *model_path) {
    if (!H.on) return false;
    marconi_model_spec spec{};
    marconi_status st = marconi_model_spec_from_gguf(model_path, &spec);
    if (st != MARCONI_STATUS_OK) {
        log_error("marconi_model_spec_from_gguf", st);
        H.on = false;
        return false;
    }
    marconi_cache_config cfg;
    marconi_cache_config_init(&cfg, sizeof cfg);
    cfg.model = spec;
    cfg.model_preset = nullptr;
    cfg.capacity_bytes = (uint64_t)H.mib << 20;
    st = marconi_cache_new(&cfg, &H.cache);
    if (st != MARCONI_STATUS_OK) {
        log_error("marconi_cache_new", st);
        H.on = false;
        return false;
    }
    std::fprintf(stderr, "marconi: prompt cache delegated to libmarconi, %d MiB of saved states\n", H.mib);
    return true;
}

int begin(llama_context *ctx, int seq, const llama_token *tokens, size_t n_tokens) {
    if (!enabled()) return 0;
    abandon(seq);
    llama_memory_t mem = llama_get_memory(ctx);
    H.prompts++;
    H.prompt_tokens += n_tokens;
    if (n_tokens < 3) {  // nothing to skip: at least 2 tokens are always processed
        llama_memory_seq_rm(mem, seq, -1, -1);
        return 0;
    }
    Pending p;
    p.tokens.assign(tokens, tokens + n_tokens);
    // Look up all but the last token: a hit then leaves >= 2 tokens to
    // process (a one-token batch takes another matmul path in ggml, not
    // bitwise equal to a longer one).
    marconi_lookup lk{};
    marconi_status st = marconi_cache_lookup(H.cache, 0, p.tokens.data(), n_tokens - 1, MARCONI_NO_SLOT, &lk);
    if (st != MARCONI_STATUS_OK) {
        log_error("marconi_cache_lookup", st);
        llama_memory_seq_rm(mem, seq, -1, -1);
        return 0;
    }
    p.lease = lk.lease;
    std::vector<uint32_t> plan(lk.n_plan + 1);
    size_t n_plan = 0;
    st = marconi_cache_lease_plan(H.cache, lk.lease, plan.data(), plan.size(), &n_plan);
    if (st != MARCONI_STATUS_OK) {
        log_error("marconi_cache_lease_plan", st);
        n_plan = 0;
    }
    uint32_t h = lk.hit_tokens;
    if (h > 0) {
        auto it = H.blobs.find(lk.state_slot);
        llama_memory_seq_rm(mem, seq, -1, -1);
        if (it == H.blobs.end() ||
            llama_state_seq_set_data_ext(ctx, it->second.data(), it->second.size(), seq, 0) != it->second.size() ||
            llama_memory_seq_pos_max(mem, seq) + 1 != (llama_pos)h) {
            std::fprintf(stderr, "marconi: cannot restore state %u (%u tokens) into seq %d: processing from 0\n",
                         lk.state_slot, h, seq);
            H.restore_failures++;
            h = 0;
        }
    }
    if (h == 0) llama_memory_seq_rm(mem, seq, -1, -1);
    uint32_t last = h;
    for (size_t k = 0; k < n_plan; k++) {
        const uint32_t c = plan[k];
        if (c <= last || c + 2 > n_tokens || c - last < 2) continue;
        p.cuts.push_back(c);
        last = c;
    }
    if (h > 0) {
        H.hits++;
        H.hit_tokens += h;
    }
    H.seqs[seq] = std::move(p);
    return (int)h;
}

bool is_cut(int seq, size_t n_done) {
    if (!enabled()) return false;
    auto it = H.seqs.find(seq);
    if (it == H.seqs.end()) return false;
    const Pending &p = it->second;
    return p.next_cut < p.cuts.size() && p.cuts[p.next_cut] == n_done;
}

void before_fill(llama_context *ctx, int seq, size_t n_done) {
    if (!is_cut(seq, n_done)) return;
    Pending &p = H.seqs[seq];
    p.next_cut++;
    std::vector<uint8_t> b = save(ctx, seq);
    if (b.empty()) {
        std::fprintf(stderr, "marconi: cannot save the state of seq %d at %zu\n", seq, n_done);
        return;
    }
    p.saved.push_back({(uint32_t)n_done, store(std::move(b))});
}

void prompt_done(llama_context *ctx, int seq, size_t n_tokens) {
    if (!enabled()) return;
    auto it = H.seqs.find(seq);
    if (it == H.seqs.end()) return;
    Pending &p = it->second;
    if (p.lease == 0 || n_tokens != p.tokens.size()) {
        abandon(seq);
        return;
    }
    std::vector<uint8_t> b = save(ctx, seq);
    if (!b.empty()) p.saved.push_back({(uint32_t)n_tokens, store(std::move(b))});
    std::vector<uint8_t> taken(p.saved.size(), 0);
    marconi_admit_result ar{};
    marconi_status st = marconi_cache_admit(H.cache, p.lease, p.tokens.data(), p.tokens.size(), p.saved.data(),
                                            p.saved.size(), nullptr, 0, taken.data(), &ar);
    if (st != MARCONI_STATUS_OK) {
        log_error("marconi_cache_admit", st);
        std::fill(taken.begin(), taken.end(), 0);
    }
    for (size_t k = 0; k < p.saved.size(); k++)
        if (!taken[k]) drop(p.saved[k].slot);
    p.saved.clear();
    st = marconi_cache_release(H.cache, p.lease);
    if (st != MARCONI_STATUS_OK) log_error("marconi_cache_release", st);
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
        marconi_status st = marconi_cache_release(H.cache, it->second.lease);
        if (st != MARCONI_STATUS_OK) log_error("marconi_cache_release", st);
    }
    H.seqs.erase(it);
    drain();
    summary("abandoned", seq);
}

}  // namespace marconi_hooks
