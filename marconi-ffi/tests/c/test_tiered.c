/*
 * C tests of a cache with lower tiers (marconi_cache_config.tiers) in
 * include/marconi.h: a device cache with a host and a store tier, served
 * the way an engine serves it (marconi_cache_lookup_tiered, the loads,
 * prefill with the planned states, admit, release, the ops carried out in
 * order: host copies, store writes through marconi_store_put_state, drops),
 * then a second handle on the same directory store resuming from what the
 * first wrote (as a second engine process does), and misuse (NULL, foreign
 * handles, foreign leases, buffers too small, tier calls on a cache without
 * tiers), each refused with its status; last, one cycle through the
 * deprecated marconi_tiered_* forwarders, which act on the same handle.
 * Built by ci/test.d/c.sh with -fsanitize=address,undefined.
 */
#define _POSIX_C_SOURCE 200809L

#include "marconi.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

#define SESSIONS 6
#define TURNS 4
#define MAXLEN 512

static uint32_t rng_state = 12345;
static uint32_t rnd(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 17;
  rng_state ^= rng_state << 5;
  return rng_state;
}

/* A chain's bytes: a digest of its tokens, 64 bytes. */
static void blob_of(const uint32_t *tokens, size_t n, uint8_t out[64]) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; i++) h = (h ^ tokens[i]) * 0x100000001b3ull;
  for (int i = 0; i < 8; i++) {
    uint64_t v = h ^ (uint64_t)i;
    memcpy(out + 8 * i, &v, 8);
  }
}

STATS_OF(stats_of, marconi_tiered_stats, marconi_cache, marconi_cache_tier_stats)

static marconi_cache_config device_config(void) {
  marconi_cache_config d;
  OK(marconi_cache_config_init(&d, sizeof d));
  d.model_preset = "paper-7b";
  d.capacity_bytes = 0; /* set by the caller */
  d.tuner_adoption = MARCONI_ALPHA_ADOPTION_DETERMINISTIC;
  return d;
}

/* Carries out the pending ops: host writes counted, store writes put. */
static void apply_ops(const marconi_cache *t, const marconi_store *store, uint64_t *writes,
                      uint64_t *drops) {
  size_t n_ops = 0, n_tok = 0;
  marconi_status st = marconi_cache_drain_ops(t, NULL, 0, &n_ops, NULL, 0, &n_tok);
  if (n_ops == 0) {
    OK(st);
    return;
  }
  CHECK_EQ(st, MARCONI_STATUS_BUFFER_TOO_SMALL);
  marconi_tier_op *ops = calloc(n_ops, sizeof *ops);
  uint32_t *toks = calloc(n_tok + 1, sizeof *toks);
  OK(marconi_cache_drain_ops(t, ops, n_ops, &n_ops, toks, n_tok, &n_tok));
  for (size_t i = 0; i < n_ops; i++) {
    const uint32_t *chain = toks + ops[i].tokens_offset;
    CHECK(ops[i].tokens_offset + ops[i].position <= n_tok);
    if (ops[i].kind == MARCONI_TIER_OP_KIND_WRITE) {
      (*writes)++;
      if (ops[i].tier == MARCONI_TIER_STORE && store) {
        uint8_t b[64];
        blob_of(chain, ops[i].position, b);
        OK(marconi_store_put_state(store, chain, ops[i].position, ops[i].position, b, sizeof b));
      }
    } else {
      CHECK_EQ(ops[i].kind, MARCONI_TIER_OP_KIND_DROP);
      (*drops)++;
    }
  }
  free(ops);
  free(toks);
  size_t np = 0, ns = 0;
  uint32_t slots[256];
  OK(marconi_cache_drain_freed(t, NULL, 0, &np, slots, 256, &ns));
}

/* Serves the workload; returns the requests whose hit came from the shared store. */
static uint64_t serve(const marconi_cache *t, const marconi_store *store, uint32_t seed, int last_only) {
  static uint32_t hist[SESSIONS][MAXLEN];
  size_t len[SESSIONS];
  uint64_t writes = 0, drops = 0, shared = 0;
  uint32_t next_slot = 0;
  rng_state = seed;
  for (int s = 0; s < SESSIONS; s++) {
    for (int i = 0; i < 64; i++) hist[s][i] = 1000000 + i;
    len[s] = 64;
  }
  for (int turn = 0; turn < TURNS; turn++) {
    for (int s = 0; s < SESSIONS; s++) {
      size_t nu = 10 + rnd() % 60, nr = 5 + rnd() % 30;
      for (size_t i = 0; i < nu; i++) hist[s][len[s] + i] = rnd() % 50000;
      size_t n = len[s] + nu;
      for (size_t i = 0; i < nr; i++) hist[s][n + i] = rnd() % 50000;
      size_t full = n + nr;
      len[s] = full;
      if (last_only && turn != TURNS - 1) continue;
      marconi_tiered_hit l;
      OK(marconi_cache_lookup_tiered(t, 0, hist[s], n, NULL, 0, store, &l));
      uint32_t hit = l.hit_tokens;
      if (l.tier != MARCONI_TIER_DEVICE) {
        marconi_load_order orders[8];
        size_t no = 0;
        OK(marconi_cache_lease_loads(t, l.lease, orders, 8, &no));
        CHECK(no >= 1 && no == l.n_loads);
        CHECK_EQ(orders[no - 1].kind, MARCONI_LOAD_KIND_STATE);
        CHECK_EQ(orders[no - 1].position, hit);
        if (orders[no - 1].tier == MARCONI_TIER_STORE && store) {
          uint8_t got[64], want[64];
          size_t glen = 0;
          uint32_t found = 0;
          OK(marconi_store_get_state(store, hist[s], hit, hit, got, sizeof got, &glen, &found));
          blob_of(hist[s], hit, want);
          if (found && glen == 64 && memcmp(got, want, 64) == 0) {
            shared += l.shared;
          } else {
            OK(marconi_cache_report_load_failure(t, l.lease));
            hit = l.device_hit_tokens;
          }
        }
      }
      uint32_t plan[64];
      size_t np = 0;
      OK(marconi_cache_lease_plan(t, l.lease, plan, 64, &np));
      marconi_saved_state states[65];
      size_t k = 0;
      for (size_t i = 0; i < np; i++)
        if (plan[i] > hit) states[k++] = (marconi_saved_state){plan[i], next_slot++};
      states[k++] = (marconi_saved_state){(uint32_t)full, next_slot++};
      marconi_admit_result r;
      OK(marconi_cache_admit(t, l.lease, hist[s], full, states, k, NULL, 0, NULL, &r));
      OK(marconi_cache_release(t, l.lease));
      apply_ops(t, store, &writes, &drops);
    }
  }
  OK(marconi_cache_check(t));
  if (!last_only) CHECK(writes > 0);
  return shared;
}

/* The lower tiers of a device configured as `dev`: a host twice the
 * device, a store 400 times it. */
static marconi_tier_options tier_options(const marconi_cache_config *dev, uint32_t hold_kv) {
  marconi_tier_options opts;
  OK(marconi_tier_options_init(&opts, sizeof opts));
  CHECK_EQ(opts.write_mode, MARCONI_TIER_WRITE_BACK);
  opts.host.capacity_bytes = dev->capacity_bytes * 2;
  opts.store.capacity_bytes = dev->capacity_bytes * 400;
  opts.store.bandwidth_bytes_per_s = 20e9;
  opts.store.latency_s = 10e-6;
  opts.store_states_hold_kv = hold_kv;
  return opts;
}

static marconi_cache *new_tiered(const marconi_cache_config *dev, uint32_t hold_kv) {
  marconi_tier_options opts = tier_options(dev, hold_kv);
  marconi_cache_config cfg = *dev;
  cfg.tiers = &opts;
  marconi_cache *t = NULL;
  OK(marconi_cache_new(&cfg, &t));
  CHECK(t != NULL);
  return t;
}

static void test_shared_store(void) {
  char dir[] = "/tmp/marconi-tiered-c-XXXXXX";
  CHECK(mkdtemp(dir) != NULL);
  marconi_store_config sc;
  OK(marconi_store_config_init(&sc, sizeof sc));
  sc.backend = MARCONI_STORE_BACKEND_DIR;
  sc.location = dir;
  sc.model = "paper-7b c test";
  sc.block_size = 16;
  marconi_store *store = NULL;
  OK(marconi_store_new(&sc, &store));

  marconi_cache_config dev = device_config();
  /* The device holds about 300 tokens and a state. */
  marconi_cache_config d300 = dev;
  {
    marconi_cache_config tmp = dev;
    tmp.capacity_bytes = 1ull << 40;
    marconi_cache *c = NULL;
    OK(marconi_cache_new(&tmp, &c));
    marconi_stats cs;
    VERSIONED(cs);
    OK(marconi_cache_stats(c, &cs));
    d300.capacity_bytes = 300 * cs.kv_bytes_per_token + cs.state_bytes_per_entry;
    marconi_cache_free(c);
  }
  marconi_cache *a = new_tiered(&d300, 1);
  serve(a, store, 7, 0);
  CHECK(stats_of(a).writes[MARCONI_TIER_STORE] > 0);

  marconi_cache *b = new_tiered(&d300, 1);
  uint64_t shared = serve(b, store, 7, 1);
  CHECK(shared > 0);
  marconi_tiered_stats sb = stats_of(b);
  CHECK_EQ(sb.shared_hits, shared);
  CHECK_EQ(sb.load_failures, 0);
  CHECK_EQ(sb.store_probe_failures, 0);
  printf("test_tiered: a second handle resumed %llu of %d requests from the shared store\n",
         (unsigned long long)shared, SESSIONS);

  marconi_cache_free(a);
  marconi_cache_free(b);
  marconi_store_free(store);
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  CHECK_EQ(system(cmd), 0);
}

static void test_misuse(void) {
  marconi_tier_options opts;
  CHECK_CONFIG_INIT(marconi_tier_options_init, opts);
  marconi_cache *t = (marconi_cache *)0x1;
  /* No configuration: NULL, and *out untouched. */
  CHECK_EQ(marconi_cache_new(NULL, &t), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK(t == (marconi_cache *)0x1);
  marconi_cache_config cfg = device_config();
  cfg.capacity_bytes = 1ull << 34;
  cfg.tiers = &opts;
  opts.store.capacity_bytes = 1ull << 36; /* a store without a host */
  CHECK_EQ(marconi_cache_new(&cfg, &t), MARCONI_STATUS_INVALID_CONFIG);
  CHECK(t == (marconi_cache *)0x1);
  opts.store.capacity_bytes = 0;
  t = NULL;
  OK(marconi_cache_new(&cfg, &t));

  const uint32_t toks[] = {1, 2, 3, 4, 5, 6, 7, 8};
  marconi_tiered_hit l;
  CHECK_EQ(marconi_cache_lookup_tiered(NULL, 0, toks, 8, NULL, 0, NULL, &l),
           MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_cache_lookup_tiered(t, 0, NULL, 8, NULL, 0, NULL, &l),
           MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_cache_lookup_tiered(t, 0, toks, 0, NULL, 0, NULL, &l),
           MARCONI_STATUS_EMPTY_TOKENS);
  uint64_t foreign[8] = {0};
  CHECK_EQ(marconi_cache_lookup_tiered((const marconi_cache *)foreign, 0, toks, 8, NULL, 0, NULL, &l),
           MARCONI_STATUS_INVALID_ARGUMENT);
  CHECK_EQ(marconi_cache_lookup_tiered(t, 0, toks, 8, NULL, 0, (const marconi_store *)foreign, &l),
           MARCONI_STATUS_INVALID_ARGUMENT);
  marconi_cache_free((marconi_cache *)foreign); /* refused, left alone */
  marconi_cache_free(NULL);

  OK(marconi_cache_lookup_tiered(t, 0, toks, 8, NULL, 0, NULL, &l));
  CHECK_EQ(marconi_cache_release(t, l.lease + 1), MARCONI_STATUS_UNKNOWN_LEASE);
  size_t n = 99;
  CHECK_EQ(marconi_cache_lease_plan(t, l.lease, NULL, 3, &n), MARCONI_STATUS_NULL_ARGUMENT);
  marconi_load_order lo;
  OK(marconi_cache_lease_loads(t, l.lease, &lo, 1, &n));
  CHECK_EQ(n, 0);
  OK(marconi_cache_release(t, l.lease));
  CHECK_EQ(marconi_cache_release(t, l.lease), MARCONI_STATUS_UNKNOWN_LEASE);
  /* The int64 lookup: an id outside u32 or an unknown flag refused. */
  const int64_t ids[] = {1, 2, 3, 4, 5, 6, 7, 8};
  const int64_t bad_ids[] = {1, 2, -1};
  CHECK_EQ(marconi_cache_lookup_tiered_i64_flags(t, 0, bad_ids, 3, 0, NULL, &l),
           MARCONI_STATUS_INVALID_ARGUMENT);
  CHECK_EQ(marconi_cache_lookup_tiered_i64_flags(t, 0, ids, 8, 1u << 30, NULL, &l),
           MARCONI_STATUS_INVALID_ARGUMENT);
  OK(marconi_cache_lookup_tiered_i64_flags(t, 0, ids, 8, MARCONI_LOOKUP_NO_KV_PAGES, NULL, &l));
  CHECK_EQ(l.n_kv_pages, 0);
  OK(marconi_cache_release(t, l.lease));
  marconi_tiered_stats s;
  memset(&s, 0, sizeof s);
  s.struct_size = 4;
  CHECK_EQ(marconi_cache_tier_stats(t, &s), MARCONI_STATUS_UNSUPPORTED_STRUCT_SIZE);
  OK(marconi_cache_settle(t));
  marconi_cache_free(t);

  /* The tier calls on a cache without tiers: refused, nothing written. */
  cfg.tiers = NULL;
  marconi_cache *plain = NULL;
  OK(marconi_cache_new(&cfg, &plain));
  memset(&l, 0xab, sizeof l);
  CHECK_EQ(marconi_cache_lookup_tiered(plain, 0, toks, 8, NULL, 0, NULL, &l),
           MARCONI_STATUS_UNSUPPORTED);
  CHECK_EQ(l.lease, 0xababababababababull);
  CHECK_EQ(marconi_cache_lookup_tiered_i64_flags(plain, 0, ids, 8, 0, NULL, &l),
           MARCONI_STATUS_UNSUPPORTED);
  VERSIONED(s);
  CHECK_EQ(marconi_cache_tier_stats(plain, &s), MARCONI_STATUS_UNSUPPORTED);
  size_t n_ops = 0, n_tok = 0;
  CHECK_EQ(marconi_cache_drain_ops(plain, NULL, 0, &n_ops, NULL, 0, &n_tok),
           MARCONI_STATUS_UNSUPPORTED);
  CHECK_EQ(marconi_cache_settle(plain), MARCONI_STATUS_UNSUPPORTED);
  check_and_free(plain);
}

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
/* The deprecated marconi_tiered_* forwarders (one release more): a short
 * cycle, and the handle is a marconi_cache with tiers: what the forwarders
 * admit, the one handle's calls find, and the other way round. */
static void test_deprecated_forwarders(void) {
  marconi_cache_config dev = device_config();
  dev.capacity_bytes = 1ull << 34;
  marconi_tiered_config cfg;
  OK(marconi_tiered_config_init(&cfg, sizeof cfg));
  CHECK_EQ(cfg.write_mode, MARCONI_TIER_WRITE_BACK);
  CHECK_EQ(cfg.exclusive, 1);
  cfg.host.capacity_bytes = dev.capacity_bytes * 2;
  marconi_tiered *t = (marconi_tiered *)0x1;
  /* marconi_tiered_config carries the device's configuration: none, NULL. */
  CHECK_EQ(marconi_tiered_new(&cfg, &t), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK(t == (marconi_tiered *)0x1);
  cfg.device = &dev;
  t = NULL;
  OK(marconi_tiered_new(&cfg, &t));
  CHECK(t != NULL);
  marconi_cache *one = (marconi_cache *)t;

  uint32_t tokens[80];
  for (int i = 0; i < 80; i++) tokens[i] = 500 + (uint32_t)i;
  marconi_tiered_hit l;
  OK(marconi_tiered_lookup(t, 0, tokens, 64, NULL, 0, NULL, &l));
  CHECK_EQ(l.hit_tokens, 0);
  size_t n = 99;
  marconi_load_order lo;
  OK(marconi_tiered_lease_loads(t, l.lease, &lo, 1, &n));
  CHECK_EQ(n, 0);
  uint32_t plan[8];
  OK(marconi_tiered_lease_plan(t, l.lease, plan, 8, &n));
  CHECK_EQ(n, l.n_plan);
  uint32_t pages[8];
  OK(marconi_tiered_lease_kv_pages(t, l.lease, pages, 8, &n));
  CHECK_EQ(n, 0);
  marconi_saved_state fin = {64, 3};
  uint8_t taken[1];
  marconi_admit_result r;
  OK(marconi_tiered_admit(t, l.lease, tokens, 64, &fin, 1, NULL, 0, taken, &r));
  CHECK_EQ(taken[0], 1);
  OK(marconi_tiered_report_load_failure(t, l.lease)); /* counted; the lease stays valid */
  OK(marconi_tiered_release(t, l.lease));
  CHECK_EQ(marconi_tiered_release(t, l.lease), MARCONI_STATUS_UNKNOWN_LEASE);
  OK(marconi_tiered_settle(t));
  size_t n_ops = 99, n_tok = 99;
  OK(marconi_tiered_drain_ops(t, NULL, 0, &n_ops, NULL, 0, &n_tok));
  CHECK_EQ(n_ops, 0);
  CHECK_EQ(n_tok, 0);
  uint32_t fp[4], fs[4];
  size_t nfp = 99, nfs = 99;
  OK(marconi_tiered_drain_freed(t, fp, 4, &nfp, fs, 4, &nfs));
  CHECK_EQ(nfp, 0);
  CHECK_EQ(nfs, 0);

  /* The one handle's calls take it: the device hit the forwarders admitted. */
  marconi_tiered_hit h;
  OK(marconi_cache_lookup_tiered(one, 0, tokens, 80, NULL, 0, NULL, &h));
  CHECK_EQ(h.hit_tokens, 64);
  CHECK_EQ(h.tier, MARCONI_TIER_DEVICE);
  CHECK_EQ(h.device_state_slot, 3);
  OK(marconi_cache_release(one, h.lease));
  /* And a one-handle lease is released by the forwarder. */
  OK(marconi_cache_lookup_tiered(one, 0, tokens, 80, NULL, 0, NULL, &h));
  OK(marconi_tiered_release(t, h.lease));
  CHECK_EQ(marconi_cache_release(one, h.lease), MARCONI_STATUS_UNKNOWN_LEASE);

  marconi_tiered_stats a, b;
  VERSIONED(a);
  VERSIONED(b);
  OK(marconi_tiered_get_stats(t, &a));
  OK(marconi_cache_tier_stats(one, &b));
  CHECK_EQ(a.requests, 3);
  CHECK_EQ(a.load_failures, 1);
  CHECK_EQ(memcmp(&a, &b, sizeof a), 0);
  marconi_stats cs;
  VERSIONED(cs);
  OK(marconi_cache_stats(one, &cs));
  CHECK_EQ(cs.requests, 3);
  OK(marconi_tiered_check(t));
  OK(marconi_cache_check(one));
  marconi_tiered_free(t);
}
#pragma GCC diagnostic pop

int main(void) {
  test_misuse();
  test_shared_store();
  test_deprecated_forwarders();
  return check_summary("test_tiered");
}
