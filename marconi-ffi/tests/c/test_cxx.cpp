// The header compiles as C++ (its declarations are extern "C") and links; and
// a failing call made from a thread_local destructor, after the library's own
// thread-locals were torn down, returns its status instead of aborting.
#include "marconi.h"
#include "marconi.h"

#include <atomic>
#include <cstdio>
#include <cstring>
#include <thread>

namespace {

// The statuses the guard's destructor saw (UINT32_MAX: it did not run).
std::atomic<uint32_t> teardown_release{UINT32_MAX};
std::atomic<uint32_t> teardown_lookup{UINT32_MAX};

// An engine's RAII lease guard held in a thread_local: its destructor runs at
// thread exit, after the destructors of thread-locals first used later in the
// thread, among them libmarconi's last-error text.
struct LeaseGuard {
  const marconi_cache *cache = nullptr;
  uint64_t lease = 0;
  ~LeaseGuard() {
    if (cache == nullptr) return;
    // Both fail (a released lease, a NULL output) and so record a last error.
    teardown_release = marconi_cache_release(cache, lease);
    const uint32_t t = 1;
    teardown_lookup = marconi_cache_lookup(cache, 0, &t, 1, MARCONI_NO_SLOT, nullptr);
    char buf[64];
    marconi_last_error(buf, sizeof buf);
  }
};

thread_local LeaseGuard guard;

// Uses the guard first (registering its destructor), then makes a failing
// call (the library's thread-local is registered after it, so it is
// destroyed before the guard).
void engine_thread(const marconi_cache *cache) {
  guard.cache = cache;
  const uint32_t tokens[] = {7, 8, 9};
  marconi_lookup l{};
  if (marconi_cache_lookup(cache, 0, tokens, 3, MARCONI_NO_SLOT, &l) != MARCONI_STATUS_OK) return;
  guard.lease = l.lease;
  marconi_cache_release(cache, l.lease);
  // A failing call: the last-error thread-local now exists in this thread.
  if (marconi_cache_release(cache, l.lease) != MARCONI_STATUS_UNKNOWN_LEASE) guard.cache = nullptr;
}

int teardown_test(const marconi_cache *cache) {
  std::thread t(engine_thread, cache);
  t.join();
  if (teardown_release != MARCONI_STATUS_UNKNOWN_LEASE) {
    std::fprintf(stderr, "test_cxx: release at thread teardown returned %u\n",
                 (unsigned)teardown_release.load());
    return 1;
  }
  if (teardown_lookup != MARCONI_STATUS_NULL_ARGUMENT) {
    std::fprintf(stderr, "test_cxx: lookup at thread teardown returned %u\n",
                 (unsigned)teardown_lookup.load());
    return 1;
  }
  return 0;
}

}  // namespace

int main() {
  marconi_cache_config cfg;
  if (marconi_cache_config_init(&cfg, sizeof cfg) != MARCONI_STATUS_OK) return 1;
  cfg.model_preset = "nemotron-h-8b";
  cfg.capacity_bytes = 1ull << 32;
  marconi_cache *cache = nullptr;
  if (marconi_cache_new(&cfg, &cache) != MARCONI_STATUS_OK) return 2;
  const uint32_t tokens[] = {1, 2, 3, 4, 5};
  marconi_lookup l{};
  if (marconi_cache_lookup(cache, 0, tokens, 5, MARCONI_NO_SLOT, &l) != MARCONI_STATUS_OK) return 3;
  if (marconi_cache_release(cache, l.lease) != MARCONI_STATUS_OK) return 4;
  if (teardown_test(cache) != 0) return 6;
  // A cache with lower tiers (marconi_cache_config.tiers): a host tier below
  // the device, served through the one handle.
  marconi_tier_options tiers;
  if (marconi_tier_options_init(&tiers, sizeof tiers) != MARCONI_STATUS_OK) return 7;
  tiers.host.capacity_bytes = 1ull << 34;
  tiers.write_mode = MARCONI_TIER_WRITE_BACK;
  marconi_cache_config tcfg = cfg;
  tcfg.tiers = &tiers;
  marconi_cache *tiered = nullptr;
  if (marconi_cache_new(&tcfg, &tiered) != MARCONI_STATUS_OK) return 8;
  marconi_tiered_hit th{};
  if (marconi_cache_lookup_tiered(tiered, 0, tokens, 5, nullptr, 0, nullptr, &th) != MARCONI_STATUS_OK)
    return 9;
  if (th.tier != MARCONI_TIER_DEVICE || marconi_cache_release(tiered, th.lease) != MARCONI_STATUS_OK)
    return 10;
  marconi_cache_free(tiered);
  marconi_cache_free(cache);
  if (std::strcmp(marconi_version(), MARCONI_VERSION_STRING) != 0) return 5;
  std::printf("test_cxx: header compiles and links as C++; calls from thread_local destructors "
              "return statuses (libmarconi %s)\n",
              marconi_version());
  return 0;
}
