/*
 * C tests of libmarconi through include/marconi.h: a multi-turn workload
 * through the full request cycle (exact hit lengths and stats), several
 * threads sharing one cache, and bad inputs (each refused with its status and
 * leaving the cache unchanged). Built by ci/test.d/c.sh with
 * -fsanitize=address,undefined.
 */
#include "marconi.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Defined in test_include_twice.c (a second translation unit). */
int second_tu_version_ok(void);

#include "check.h"

static const char *last_error(void) {
  static char buf[512];
  marconi_last_error(buf, sizeof buf);
  return buf;
}

static marconi_cache *new_cache(uint64_t capacity, uint32_t page_size, int log) {
  marconi_cache_config cfg = cache_config("paper-7b", page_size);
  cfg.capacity_bytes = capacity;
  cfg.decision_log = (uint32_t)log;
  marconi_cache *cache = NULL;
  OK(marconi_cache_new(&cfg, &cache));
  CHECK(cache != NULL);
  return cache;
}

STATS_OF(stats_of, marconi_stats, marconi_cache, marconi_cache_stats)

/* Fills tokens[0..n) with first, first + 1, ... */
static void iota(uint32_t *tokens, size_t n, uint32_t first) {
  for (size_t i = 0; i < n; i++) tokens[i] = first + (uint32_t)i;
}

/* One request the way an engine runs it: lookup, save states at the planned
 * positions and at the end, admit, release. Returns the usable hit. */
static uint32_t run_request(const marconi_cache *cache, const uint32_t *input,
                            size_t n_input, const uint32_t *output,
                            size_t n_output, uint32_t *next_slot,
                            marconi_lookup *out_lookup) {
  marconi_lookup l;
  uint32_t dst = (*next_slot)++;
  OK(marconi_cache_lookup(cache, 0, input, n_input, dst, &l));
  if (l.state_slot != MARCONI_NO_SLOT) {
    CHECK_EQ(l.n_copy_orders, 1);
    CHECK_EQ(l.copy_order.src_slot, l.state_slot);
    CHECK_EQ(l.copy_order.dst_slot, dst);
  } else {
    CHECK_EQ(l.n_copy_orders, 0);
  }
  uint32_t plan[16];
  size_t n_plan = 0;
  OK(marconi_cache_lease_plan(cache, l.lease, plan, 16, &n_plan));
  CHECK_EQ(n_plan, l.n_plan);

  size_t n_full = n_input + n_output;
  uint32_t *full = malloc(n_full * sizeof *full);
  memcpy(full, input, n_input * sizeof *full);
  if (n_output) memcpy(full + n_input, output, n_output * sizeof *full);
  marconi_saved_state states[17];
  size_t n_states = 0;
  int final_planned = 0;
  for (size_t i = 0; i < n_plan; i++) {
    states[n_states].position = plan[i];
    states[n_states].slot = (*next_slot)++;
    n_states++;
    if (plan[i] == (uint32_t)n_full) final_planned = 1;
  }
  if (!final_planned) {
    states[n_states].position = (uint32_t)n_full; /* page size 1 */
    states[n_states].slot = (*next_slot)++;
    n_states++;
  }
  uint8_t taken[17];
  marconi_admit_result r;
  OK(marconi_cache_admit(cache, l.lease, full, n_full, states, n_states, NULL,
                         0, taken, &r));
  CHECK(!r.rejected);
  uint32_t n_taken = 0;
  for (size_t i = 0; i < n_states; i++) n_taken += taken[i];
  CHECK_EQ(n_taken, r.states_taken);
  OK(marconi_cache_release(cache, l.lease));
  free(full);
  if (out_lookup) *out_lookup = l;
  return l.hit_tokens;
}

/* A small multi-turn workload with exact expectations. */
static void test_multi_turn(void) {
  marconi_cache *cache = new_cache(UINT64_C(100000000000), 1, 1);
  uint32_t next_slot = 1;
  uint32_t a[100], out1[20], turn2[150], out2[20], conv2[80], conv3[80];
  iota(a, 100, 0);
  iota(out1, 20, 1000);
  marconi_lookup l;

  /* Turn 1: nothing cached. */
  CHECK_EQ(run_request(cache, a, 100, out1, 20, &next_slot, &l), 0);
  CHECK_EQ(l.kv_matched_tokens, 0);
  CHECK_EQ(l.state_slot, MARCONI_NO_SLOT);

  /* Turn 2 resumes from the state after turn 1's last decoded token. */
  memcpy(turn2, a, sizeof a);
  memcpy(turn2 + 100, out1, sizeof out1);
  iota(turn2 + 120, 10, 2000);
  iota(out2, 20, 3000);
  CHECK_EQ(run_request(cache, turn2, 130, out2, 20, &next_slot, &l), 120);
  CHECK_EQ(l.kv_matched_tokens, 120);
  CHECK(l.state_slot != MARCONI_NO_SLOT);

  /* A second conversation shares the first 50 tokens: the KV matches but no
   * state exists at 50 (the silent miss), so Marconi plans a checkpoint
   * there. */
  memcpy(conv2, a, 50 * sizeof *a);
  iota(conv2 + 50, 30, 5000);
  CHECK_EQ(run_request(cache, conv2, 80, NULL, 0, &next_slot, &l), 0);
  CHECK_EQ(l.kv_matched_tokens, 50);
  CHECK_EQ(l.n_plan, 1);

  /* A third conversation resumes from the checkpoint at 50. */
  memcpy(conv3, a, 50 * sizeof *a);
  iota(conv3 + 50, 30, 7000);
  CHECK_EQ(run_request(cache, conv3, 80, NULL, 0, &next_slot, &l), 50);
  CHECK(l.state_slot != MARCONI_NO_SLOT);

  marconi_stats s = stats_of(cache);
  CHECK_EQ(s.requests, 4);
  CHECK_EQ(s.hit_requests, 2);
  CHECK_EQ(s.input_tokens, 100 + 130 + 80 + 80);
  CHECK_EQ(s.hit_tokens, 120 + 50);
  CHECK_EQ(s.kv_matched_unusable_tokens, 50);
  CHECK_EQ(s.leases, 0);
  CHECK_EQ(s.evictions, 0);
  CHECK(s.flops_saved > 0 && s.flops_saved < s.flops_total);
  CHECK_EQ(s.used_bytes, s.kv_bytes + s.state_bytes);
  CHECK_EQ(s.kv_bytes, s.kv_bytes_per_token * 150 + s.kv_bytes_per_token * 30 * 2);
  CHECK_EQ(s.state_bytes, s.states * s.state_bytes_per_entry);

  /* The decision log drains as JSON lines. */
  size_t needed = 0;
  CHECK_EQ(marconi_cache_drain_log(cache, NULL, 0, &needed),
           MARCONI_STATUS_BUFFER_TOO_SMALL);
  CHECK(needed > 0);
  char *log = malloc(needed);
  size_t got = 0;
  OK(marconi_cache_drain_log(cache, log, needed, &got));
  CHECK_EQ(got, needed);
  size_t lines = 0;
  for (size_t i = 0; i < got; i++) lines += log[i] == '\n';
  CHECK(lines >= 12); /* 4 x (lookup, admit, release) + plan */
  CHECK(got > 0 && log[0] == '{' && log[got - 1] == '\n');
  CHECK(strstr(log, "\"kind\":\"lookup\"") != NULL);
  free(log);
  OK(marconi_cache_drain_log(cache, NULL, 0, &got));
  CHECK_EQ(got, 0);

  check_and_free(cache);
}

/* Evictions report freed ids; the needed-size query drains nothing. */
static void test_eviction_reports(void) {
  /* About 3 states of paper-7b plus their KV. */
  marconi_cache *cache = new_cache(UINT64_C(120000000), 1, 0);
  uint32_t next_slot = 1;
  uint32_t tokens[64];
  for (uint32_t conv = 0; conv < 10; conv++) {
    iota(tokens, 64, conv * 1000);
    run_request(cache, tokens, 64, NULL, 0, &next_slot, NULL);
  }
  marconi_stats s = stats_of(cache);
  CHECK(s.evictions > 0);
  size_t np = 99, ns = 99;
  CHECK_EQ(marconi_cache_drain_freed(cache, NULL, 0, &np, NULL, 0, &ns),
           MARCONI_STATUS_BUFFER_TOO_SMALL);
  CHECK_EQ(np, 0); /* no page ids were passed */
  CHECK(ns > 0);
  size_t again_p = 0, again_s = 0;
  CHECK_EQ(marconi_cache_drain_freed(cache, NULL, 0, &again_p, NULL, 0, &again_s),
           MARCONI_STATUS_BUFFER_TOO_SMALL);
  CHECK_EQ(again_s, ns);
  uint32_t *slots = malloc(ns * sizeof *slots);
  OK(marconi_cache_drain_freed(cache, NULL, 0, &np, slots, ns, &ns));
  for (size_t i = 0; i < ns; i++) CHECK(slots[i] >= 1 && slots[i] < next_slot);
  free(slots);
  OK(marconi_cache_drain_freed(cache, NULL, 0, &np, NULL, 0, &ns));
  CHECK_EQ(ns, 0);
  /* evict everything unleased */
  uint64_t free_bytes = 0;
  OK(marconi_cache_evict(cache, s.capacity_bytes, &free_bytes));
  CHECK_EQ(free_bytes, s.capacity_bytes);
  CHECK_EQ(stats_of(cache).used_bytes, 0);
  check_and_free(cache);
}

/* Several threads share one cache. */
struct worker {
  const marconi_cache *cache;
  uint32_t id;
};

static void *worker_main(void *arg) {
  struct worker *w = arg;
  uint32_t next_slot = (w->id + 1) * 1000000u;
  uint32_t hist[200];
  for (uint32_t conv = 0; conv < 8; conv++) {
    size_t n = 0;
    iota(hist, 32, 0); /* shared system prompt */
    n = 32;
    for (uint32_t turn = 0; turn < 4; turn++) {
      iota(hist + n, 10, 100000u * (w->id + 1) + 1000u * conv + 100u * turn);
      n += 10;
      uint32_t out[5];
      iota(out, 5, 900000000u + 100000u * w->id + 1000u * conv + 10u * turn);
      run_request(w->cache, hist, n, out, 5, &next_slot, NULL);
      memcpy(hist + n, out, sizeof out);
      n += 5;
    }
  }
  return NULL;
}

static void test_threads(void) {
  marconi_cache *cache = new_cache(UINT64_C(1500000000), 1, 0);
  pthread_t th[4];
  struct worker w[4];
  for (uint32_t i = 0; i < 4; i++) {
    w[i].cache = cache;
    w[i].id = i;
    CHECK_EQ(pthread_create(&th[i], NULL, worker_main, &w[i]), 0);
  }
  for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
  marconi_stats s = stats_of(cache);
  CHECK_EQ(s.requests, 4 * 8 * 4);
  CHECK_EQ(s.leases, 0);
  CHECK(s.hit_requests > 0);
  CHECK(s.evictions > 0);
  CHECK(s.used_bytes <= s.capacity_bytes);
  check_and_free(cache);
}

/* Every bad input returns its status and leaves the cache unchanged. */
static void test_bad_inputs(void) {
  marconi_cache *cache = new_cache(UINT64_C(100000000000), 1, 0);
  uint32_t next_slot = 1;
  uint32_t t[40];
  iota(t, 40, 0);
  run_request(cache, t, 30, t + 30, 10, &next_slot, NULL);
  marconi_stats before = stats_of(cache);
#define UNCHANGED()                                                            \
  do {                                                                         \
    marconi_stats now_ = stats_of(cache);                                      \
    CHECK(memcmp(&now_, &before, sizeof now_) == 0);                           \
  } while (0)

  /* Config. */
  marconi_cache_config cfg;
  marconi_cache *c2 = (marconi_cache *)0x1;
  CHECK_CONFIG_INIT(marconi_cache_config_init, cfg);
  CHECK_EQ(marconi_cache_new(NULL, &c2), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_cache_new(&cfg, NULL), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_cache_new(&cfg, &c2), MARCONI_STATUS_INVALID_CONFIG); /* capacity 0 */
  CHECK(strstr(last_error(), "capacity_bytes is 0") != NULL);
  CHECK(c2 == (marconi_cache *)0x1); /* outputs untouched on failure */
  cfg.capacity_bytes = 1000000;
  cfg.model_preset = "no-such-model";
  CHECK_EQ(marconi_cache_new(&cfg, &c2), MARCONI_STATUS_UNKNOWN_PRESET);
  cfg.model_preset = NULL;
  cfg.admission = 42;
  CHECK_EQ(marconi_cache_new(&cfg, &c2), MARCONI_STATUS_INVALID_CONFIG);
  cfg.admission = MARCONI_ADMISSION_ALL_BLOCKS;
  cfg.page_size = 16;
  cfg.block_size = 24;
  CHECK_EQ(marconi_cache_new(&cfg, &c2), MARCONI_STATUS_INVALID_CONFIG);
  CHECK(strstr(last_error(), "block_size 24") != NULL);
  cfg.block_size = 32;
  cfg.struct_size = 4;
  CHECK_EQ(marconi_cache_new(&cfg, &c2), MARCONI_STATUS_UNSUPPORTED_STRUCT_SIZE);
  cfg.struct_size = sizeof cfg;
  cfg.alpha_mode = MARCONI_ALPHA_MODE_FIXED;
  cfg.alpha = -1.0;
  CHECK_EQ(marconi_cache_new(&cfg, &c2), MARCONI_STATUS_INVALID_CONFIG);
  CHECK(c2 == (marconi_cache *)0x1);
  marconi_model_spec m;
  CHECK_EQ(marconi_model_spec_preset("nope", &m), MARCONI_STATUS_UNKNOWN_PRESET);
  OK(marconi_model_spec_preset("jamba-1.5-mini", &m));
  CHECK_EQ(m.attn_layers, 4);
  CHECK_EQ(m.ssm_layers, 28);
  /* A Hugging Face config.json (not NUL-terminated: the length counts). */
  static const char hf[] = "{\"model_type\": \"bamba\", \"hidden_size\": 64, "
                           "\"num_hidden_layers\": 4, \"attn_layer_indices\": [1], "
                           "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, "
                           "\"intermediate_size\": 96, \"mamba_n_heads\": 8, \"mamba_d_head\": 16, "
                           "\"mamba_d_state\": 16, \"mamba_n_groups\": 1, \"mamba_d_conv\": 4, "
                           "\"mamba_expand\": 2, \"torch_dtype\": \"bfloat16\"}garbage";
  OK(marconi_model_spec_from_hf_config(hf, sizeof hf - 1 - strlen("garbage"), &m));
  CHECK_EQ(m.attn_layers, 1);
  CHECK_EQ(m.ssm_layers, 3);
  CHECK_EQ(m.conv_channels, 128 + 2 * 16);
  CHECK_EQ(m.dtype_bytes, 2);
  CHECK_EQ(marconi_model_spec_from_hf_config(hf, sizeof hf - 1, &m), MARCONI_STATUS_INVALID_ARGUMENT);
  CHECK_EQ(marconi_model_spec_from_hf_config(NULL, 3, &m), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_model_spec_from_hf_config(hf, 3, NULL), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_model_spec_from_hf_config("{\"model_type\": \"bamba\"}", 23, &m), MARCONI_STATUS_INVALID_CONFIG);
  CHECK(strstr(last_error(), "num_hidden_layers\" is missing") != NULL);
  CHECK_EQ(m.attn_layers, 1); /* untouched by the refused calls */

  /* Lookup. */
  marconi_lookup l;
  CHECK_EQ(marconi_cache_lookup(NULL, 0, t, 10, MARCONI_NO_SLOT, &l), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_cache_lookup(cache, 0, NULL, 12, MARCONI_NO_SLOT, &l), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK(strstr(last_error(), "tokens is NULL but length is 12") != NULL);
  CHECK_EQ(marconi_cache_lookup(cache, 0, NULL, 0, MARCONI_NO_SLOT, &l), MARCONI_STATUS_EMPTY_TOKENS);
  CHECK_EQ(marconi_cache_lookup(cache, 0, t, SIZE_MAX, MARCONI_NO_SLOT, &l), MARCONI_STATUS_TOO_MANY_TOKENS);
  CHECK_EQ(marconi_cache_lookup(cache, 0, t, (size_t)UINT32_MAX, MARCONI_NO_SLOT, &l), MARCONI_STATUS_TOO_MANY_TOKENS);
  CHECK_EQ(marconi_cache_lookup(cache, 0, t, 10, MARCONI_NO_SLOT, NULL), MARCONI_STATUS_NULL_ARGUMENT);
  /* Slot 2 holds the cached final state of the first request. */
  CHECK_EQ(marconi_cache_lookup(cache, 0, t, 40, 2, &l), MARCONI_STATUS_INVALID_ARGUMENT);
  CHECK(strstr(last_error(), "dst_slot 2") != NULL);
  UNCHANGED();

  /* Leases. */
  CHECK_EQ(marconi_cache_release(cache, 0), MARCONI_STATUS_UNKNOWN_LEASE);
  CHECK_EQ(marconi_cache_release(cache, 12345), MARCONI_STATUS_UNKNOWN_LEASE);
  size_t n = 0;
  uint32_t buf[8];
  CHECK_EQ(marconi_cache_lease_plan(cache, 12345, buf, 8, &n), MARCONI_STATUS_UNKNOWN_LEASE);
  CHECK_EQ(marconi_cache_lease_kv_pages(cache, 12345, buf, 8, &n), MARCONI_STATUS_UNKNOWN_LEASE);
  UNCHANGED();

  /* A live lease for the admission cases: u branches from the cached
   * 40-token sequence at 30, so Marconi plans a checkpoint at 30. */
  uint32_t u[60];
  iota(u, 30, 0);
  iota(u + 30, 30, 500); /* branches at 30 from the cached sequence */
  OK(marconi_cache_lookup(cache, 0, u, 45, MARCONI_NO_SLOT, &l));
  CHECK_EQ(l.n_plan, 1);
  uint32_t plan[4];
  OK(marconi_cache_lease_plan(cache, l.lease, plan, 4, &n));
  CHECK_EQ(plan[0], 30);
  CHECK_EQ(marconi_cache_lease_plan(cache, l.lease, NULL, 0, &n), MARCONI_STATUS_BUFFER_TOO_SMALL);
  CHECK_EQ(n, 1);
  before = stats_of(cache);
  marconi_admit_result r;
  marconi_saved_state st[3];
  st[0].position = 17; /* never planned */
  st[0].slot = 100;
  CHECK_EQ(marconi_cache_admit(cache, l.lease, u, 60, st, 1, NULL, 0, NULL, &r), MARCONI_STATUS_NOT_PLANNED);
  CHECK(strstr(last_error(), "position 17") != NULL);
  st[0].position = 30;
  st[0].slot = 100;
  st[1].position = 60;
  st[1].slot = 100; /* the same slot twice */
  CHECK_EQ(marconi_cache_admit(cache, l.lease, u, 60, st, 2, NULL, 0, NULL, &r), MARCONI_STATUS_DUPLICATE_SLOT);
  st[1].slot = 2; /* already owned by the cache */
  CHECK_EQ(marconi_cache_admit(cache, l.lease, u, 60, st, 2, NULL, 0, NULL, &r), MARCONI_STATUS_DUPLICATE_SLOT);
  st[1].slot = 101;
  st[2] = st[1];
  st[2].slot = 102; /* the same position twice */
  CHECK_EQ(marconi_cache_admit(cache, l.lease, u, 60, st, 3, NULL, 0, NULL, &r), MARCONI_STATUS_DUPLICATE_POSITION);
  CHECK_EQ(marconi_cache_admit(cache, l.lease, u, 60, NULL, 2, NULL, 0, NULL, &r), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_cache_admit(cache, l.lease, u, 60, st, 2, NULL, 0, NULL, NULL), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_cache_admit(cache, l.lease, u, 60, st, 2, buf, 3, NULL, &r), MARCONI_STATUS_BAD_PAGE_LIST);
  CHECK_EQ(marconi_cache_admit(cache, l.lease, u, 50, st, 2, NULL, 0, NULL, &r), MARCONI_STATUS_POSITION_OUT_OF_RANGE);
  st[1].position = 50; /* neither planned nor the final position */
  CHECK_EQ(marconi_cache_admit(cache, l.lease, u, 60, st, 2, NULL, 0, NULL, &r), MARCONI_STATUS_NOT_PLANNED);
  st[1].position = 60;
  st[0].position = 61;
  CHECK_EQ(marconi_cache_admit(cache, l.lease, u, 60, st, 1, NULL, 0, NULL, &r), MARCONI_STATUS_POSITION_OUT_OF_RANGE);
  st[0].position = 30;
  CHECK_EQ(marconi_cache_admit(cache, l.lease, t, 40, st, 1, NULL, 0, NULL, &r), MARCONI_STATUS_PREFIX_MISMATCH);
  CHECK_EQ(marconi_cache_admit(cache, 777, u, 60, st, 2, NULL, 0, NULL, &r), MARCONI_STATUS_UNKNOWN_LEASE);
  CHECK_EQ(marconi_cache_admit(cache, l.lease, u, 0, st, 2, NULL, 0, NULL, &r), MARCONI_STATUS_EMPTY_TOKENS);
  UNCHANGED();
  /* The good admission, then the lease is gone. */
  uint8_t taken[2] = {9, 9};
  OK(marconi_cache_admit(cache, l.lease, u, 60, st, 2, NULL, 0, taken, &r));
  CHECK_EQ(r.states_taken, 2);
  CHECK_EQ(taken[0], 1);
  CHECK_EQ(taken[1], 1);
  OK(marconi_cache_release(cache, l.lease));
  before = stats_of(cache);
  CHECK_EQ(marconi_cache_release(cache, l.lease), MARCONI_STATUS_UNKNOWN_LEASE);
  st[0].slot = 200;
  st[1].slot = 201;
  CHECK_EQ(marconi_cache_admit(cache, l.lease, u, 60, st, 2, NULL, 0, NULL, &r), MARCONI_STATUS_UNKNOWN_LEASE);
  UNCHANGED();

  /* Other calls. */
  uint64_t bytes;
  CHECK_EQ(marconi_cache_evict(cache, 1, NULL), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_cache_evict(NULL, 1, &bytes), MARCONI_STATUS_NULL_ARGUMENT);
  size_t np, ns;
  CHECK_EQ(marconi_cache_drain_freed(cache, NULL, 5, &np, NULL, 0, &ns), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_cache_drain_freed(cache, NULL, 0, NULL, NULL, 0, &ns), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_cache_drain_log(cache, NULL, 0, NULL), MARCONI_STATUS_NULL_ARGUMENT);
  marconi_stats small;
  memset(&small, 0, sizeof small);
  CHECK_EQ(marconi_cache_stats(cache, &small), MARCONI_STATUS_UNSUPPORTED_STRUCT_SIZE);
  CHECK_EQ(marconi_cache_stats(cache, NULL), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_cache_check(NULL), MARCONI_STATUS_NULL_ARGUMENT);
  /* An older caller's stats struct (only the first 32 bytes) is respected. */
  unsigned char old[48];
  memset(old, 0xAB, sizeof old);
  marconi_stats *olds = (marconi_stats *)(void *)old;
  uint32_t size32 = 32;
  memcpy(old, &size32, sizeof size32);
  OK(marconi_cache_stats(cache, olds));
  CHECK_EQ(old[32], 0xAB);
  CHECK_EQ(olds->requests, before.requests);
  UNCHANGED();
  check_and_free(cache);
  marconi_cache_free(NULL); /* a no-op */
#undef UNCHANGED
}

static void test_messages(void) {
  char buf[64];
  size_t n = marconi_status_message(MARCONI_STATUS_UNKNOWN_LEASE, buf, sizeof buf);
  CHECK_EQ(n, strlen(buf));
  CHECK(strcmp(buf, "lease is unknown or already released") == 0);
  char unknown[64], invalid[64];
  marconi_status_message(9999, unknown, sizeof unknown);
  marconi_status_message(MARCONI_STATUS_INVALID_ARGUMENT, invalid, sizeof invalid);
  CHECK(strcmp(unknown, invalid) == 0);
  /* snprintf semantics: truncated with a NUL, full length returned */
  char tiny[5];
  CHECK_EQ(marconi_status_message(MARCONI_STATUS_OK, NULL, 0), 2);
  n = marconi_status_message(MARCONI_STATUS_UNKNOWN_LEASE, tiny, sizeof tiny);
  CHECK_EQ(n, strlen("lease is unknown or already released"));
  CHECK(strcmp(tiny, "leas") == 0);
  /* Version macros match the library. */
  CHECK(strcmp(marconi_version(), MARCONI_VERSION_STRING) == 0);
  char expect[32];
  snprintf(expect, sizeof expect, "%d.%d.%d", MARCONI_VERSION_MAJOR,
           MARCONI_VERSION_MINOR, MARCONI_VERSION_PATCH);
  CHECK(strcmp(expect, marconi_version()) == 0);
  CHECK(second_tu_version_ok());
}

/* marconi_status_ALL is an initialiser of every status, in value order. */
static void test_status_all(void) {
  static const marconi_status all[] = marconi_status_ALL;
  size_t n = sizeof all / sizeof all[0];
  CHECK(n >= 20);
  for (size_t i = 0; i < n; i++) CHECK_EQ(all[i], i);
  CHECK_EQ(all[MARCONI_STATUS_UNSUPPORTED_STRUCT_SIZE], MARCONI_STATUS_UNSUPPORTED_STRUCT_SIZE);
}

/* NULL is refused before anything else is looked at: a NULL buffer with an
 * oversized length is MARCONI_STATUS_NULL_ARGUMENT, not TOO_MANY_TOKENS. */
static void test_null_first(void) {
  marconi_cache *cache = new_cache(UINT64_C(100000000000), 1, 0);
  marconi_lookup l;
  marconi_admit_result r;
  uint32_t t[4] = {1, 2, 3, 4};
  size_t n = 0;
  CHECK_EQ(marconi_cache_lookup(cache, 0, NULL, (size_t)UINT32_MAX, MARCONI_NO_SLOT, &l),
           MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_cache_lookup(cache, 0, NULL, SIZE_MAX, MARCONI_NO_SLOT, &l),
           MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_cache_lookup(NULL, 0, t, SIZE_MAX, MARCONI_NO_SLOT, &l),
           MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_cache_lookup(cache, 0, t, SIZE_MAX, MARCONI_NO_SLOT, NULL),
           MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_cache_admit(cache, 12345, NULL, (size_t)UINT32_MAX, NULL, 0, NULL, 0, NULL, &r),
           MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_cache_admit(cache, 12345, t, SIZE_MAX, NULL, 0, NULL, 0, NULL, NULL),
           MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_cache_admit(cache, 12345, t, 4, NULL, 3, NULL, 0, NULL, &r),
           MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_cache_lease_plan(cache, 12345, NULL, 4, &n), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_cache_lease_kv_pages(cache, 12345, t, 4, NULL), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_cache_drain_freed(cache, NULL, SIZE_MAX, &n, NULL, 0, &n),
           MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_cache_drain_log(cache, NULL, SIZE_MAX, &n), MARCONI_STATUS_NULL_ARGUMENT);
  marconi_cache_config cfg;
  OK(marconi_cache_config_init(&cfg, sizeof cfg));
  cfg.alpha_mode = MARCONI_ALPHA_MODE_AUTO;
  cfg.tuner_grid = NULL;
  cfg.tuner_grid_len = SIZE_MAX;
  marconi_cache *c2 = NULL;
  CHECK_EQ(marconi_cache_new(&cfg, &c2), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK(c2 == NULL);
  marconi_cache_free(cache);
}

/* Model dimensions whose byte or FLOP products overflow 64 bits are refused
 * when the cache is built, not wrapped. */
static void test_overflowing_models(void) {
  struct {
    const char *what;
    uint64_t *field;
    uint64_t value;
  } cases[8];
  marconi_cache_config cfg;
  size_t n = 0;
#define CASE(f, v) cases[n].what = #f " = " #v, cases[n].field = &cfg.model.f, cases[n].value = (v), n++
  CASE(kv_heads, UINT64_C(1) << 63);
  CASE(head_dim, UINT64_C(1) << 62);
  CASE(n_heads, UINT64_C(1) << 63); /* n_heads * head_dim in the FLOP formula */
  CASE(state_dtype_bytes, UINT64_C(1) << 62);
  CASE(kv_heads, UINT64_MAX);
  CASE(d_state, UINT64_C(1) << 60);
  CASE(conv_kernel, UINT64_C(1) << 61);
  CASE(dtype_bytes, UINT64_C(1) << 62);
#undef CASE
  for (size_t i = 0; i < n; i++) {
    OK(marconi_cache_config_init(&cfg, sizeof cfg));
    cfg.capacity_bytes = UINT64_C(100000000000);
    *cases[i].field = cases[i].value;
    marconi_cache *c = NULL;
    marconi_status st = marconi_cache_new(&cfg, &c);
    if (st != MARCONI_STATUS_INVALID_CONFIG) {
      fprintf(stderr, "overflowing model %s: status %u\n", cases[i].what, (unsigned)st);
      failures++;
    }
    marconi_cache_free(c);
  }
}

/* Application checkpoint hints: the first request of a new system prompt
 * saves a state at the hinted end of the prompt, so the second request
 * resumes from it; bad arguments are refused. */
static void test_app_checkpoints(void) {
  marconi_cache *cache = new_cache(UINT64_C(100000000000), 1, 1);
  uint32_t first[300], second[300], hints[3] = {250, 5000, 250};
  iota(first, 300, 0);
  iota(second, 250, 0);
  iota(second + 250, 50, 100000);
  marconi_lookup l;
  CHECK_EQ(marconi_cache_lookup_hinted(cache, 0, first, 300, NULL, 2, MARCONI_NO_SLOT, &l),
           MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_cache_lookup_hinted(NULL, 0, first, 300, hints, 3, MARCONI_NO_SLOT, &l),
           MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_cache_lookup_hinted(cache, 0, first, 0, hints, 3, MARCONI_NO_SLOT, &l),
           MARCONI_STATUS_EMPTY_TOKENS);
  CHECK_EQ(marconi_cache_lookup_hinted(cache, 0, first, 300, hints, 3, MARCONI_NO_SLOT, NULL),
           MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(stats_of(cache).requests, 0); /* refused calls change nothing */
  /* 5000 is past the input and the duplicate 250 is one checkpoint. */
  OK(marconi_cache_lookup_hinted(cache, 0, first, 300, hints, 3, MARCONI_NO_SLOT, &l));
  CHECK_EQ(l.hit_tokens, 0);
  CHECK_EQ(l.n_plan, 1);
  uint32_t plan[4] = {0};
  size_t n_plan = 0;
  OK(marconi_cache_lease_plan(cache, l.lease, plan, 4, &n_plan));
  CHECK_EQ(n_plan, 1);
  CHECK_EQ(plan[0], 250);
  marconi_saved_state states[2] = {{250, 1}, {300, 2}};
  uint8_t taken[2];
  marconi_admit_result r;
  OK(marconi_cache_admit(cache, l.lease, first, 300, states, 2, NULL, 0, taken, &r));
  CHECK_EQ(r.states_taken, 2);
  OK(marconi_cache_release(cache, l.lease));
  /* NULL hints with 0: a plain lookup. */
  OK(marconi_cache_lookup_hinted(cache, 0, second, 300, NULL, 0, MARCONI_NO_SLOT, &l));
  CHECK_EQ(l.hit_tokens, 250);
  CHECK_EQ(l.state_slot, 1);
  OK(marconi_cache_release(cache, l.lease));
  char log[8192] = {0};
  size_t n_log = 0;
  OK(marconi_cache_drain_log(cache, log, sizeof log - 1, &n_log)); /* NUL-terminated */
  CHECK(strstr(log, "\"reason\":\"AppCheckpoint\"") != NULL);
  check_and_free(cache);
}

/* Policy presets and the tuning fields of version 3 of the config. */
static void test_tuning_config(void) {
  marconi_cache_config cfg;
  OK(marconi_cache_config_preset(&cfg, sizeof cfg, "marconi-tuned"));
  CHECK_EQ(cfg.struct_size, sizeof cfg);
  CHECK_EQ(cfg.tuner_tune_rules, 1);
  CHECK_EQ(cfg.tuner_max_window, 100);
  CHECK_EQ(cfg.shadows, 0);
  CHECK_EQ(cfg.min_branch_depth, 16);
  CHECK(cfg.superseded_age == 1.0);
  OK(marconi_cache_config_preset(&cfg, sizeof cfg, "marconi-paper"));
  CHECK_EQ(cfg.protect_branch_states, 0);
  CHECK_EQ(cfg.min_branch_depth, 0);
  CHECK(cfg.superseded_age == 0.0);
  CHECK_EQ(cfg.tuner_retune, 0);
  CHECK_EQ(cfg.tuner_objective, MARCONI_TUNING_OBJECTIVE_TOKEN_HITS);
  OK(marconi_cache_config_preset(&cfg, sizeof cfg, "marconi-shadow"));
  CHECK_EQ(cfg.shadows, 1);
  CHECK_EQ(cfg.shadow_tuned, 1);
  CHECK_EQ(cfg.shadow_half_life, 200);
  CHECK_EQ(marconi_cache_config_preset(&cfg, sizeof cfg, "marconi-best"),
           MARCONI_STATUS_UNKNOWN_PRESET);
  CHECK_EQ(marconi_cache_config_preset(&cfg, sizeof cfg, NULL), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_cache_config_preset(NULL, sizeof cfg, "marconi"), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_cache_config_preset(&cfg, 8, "marconi"), MARCONI_STATUS_UNSUPPORTED_STRUCT_SIZE);

  /* Shadows with fixed alphas, built and used. */
  OK(marconi_cache_config_preset(&cfg, sizeof cfg, "marconi-shadow"));
  double alphas[2] = {0.5, 2.0};
  cfg.model_preset = "paper-7b";
  cfg.capacity_bytes = UINT64_C(2000000000);
  cfg.shadow_alphas = alphas;
  cfg.shadow_alphas_len = 2;
  cfg.shadow_lru = 1;
  marconi_cache *cache = NULL;
  OK(marconi_cache_new(&cfg, &cache));
  uint32_t next_slot = 1, t[400];
  for (uint32_t k = 0; k < 30; k++) {
    iota(t, 200, 0);
    iota(t + 200, 200, 1000 * (k + 1));
    run_request(cache, t, 400, NULL, 0, &next_slot, NULL);
  }
  check_and_free(cache);

  /* Bad values: INVALID_CONFIG (or NULL_ARGUMENT), never a cache. */
  marconi_cache_config bad;
  cache = NULL;
  OK(marconi_cache_config_preset(&bad, sizeof bad, "marconi-shadow"));
  bad.capacity_bytes = UINT64_C(1000000000);
#define REFUSED(field, bad_value, good, status)                                \
  CHECK_WITH(field, bad_value, good, marconi_cache_new(&bad, &cache), status)
  REFUSED(bad.shadow_alphas_len, 3, 0, MARCONI_STATUS_NULL_ARGUMENT); /* NULL with a length */
  REFUSED(bad.shadow_hysteresis, -1.0, 0.0, MARCONI_STATUS_INVALID_CONFIG);
  REFUSED(bad.shadow_sample_tokens, 0, 64, MARCONI_STATUS_INVALID_CONFIG);
  bad.alpha_mode = MARCONI_ALPHA_MODE_FIXED;
  CHECK_EQ(marconi_cache_new(&bad, &cache), MARCONI_STATUS_INVALID_CONFIG);
  CHECK(strstr(last_error(), "shadows") != NULL);
  bad.alpha_mode = MARCONI_ALPHA_MODE_AUTO;
  REFUSED(bad.tuner_retune_every, 0, 4, MARCONI_STATUS_INVALID_CONFIG);
  REFUSED(bad.reserved2, 1, 0, MARCONI_STATUS_INVALID_CONFIG);
  bad.superseded_age = -0.5;
  CHECK_EQ(marconi_cache_new(&bad, &cache), MARCONI_STATUS_INVALID_CONFIG);
  CHECK(strstr(last_error(), "superseded_age") != NULL);
#undef REFUSED
  CHECK(cache == NULL);
}

int main(void) {
  test_status_all();
  test_null_first();
  test_overflowing_models();
  test_messages();
  test_multi_turn();
  test_eviction_reports();
  test_threads();
  test_bad_inputs();
  test_app_checkpoints();
  test_tuning_config();
  return check_summary("test_cache");
}
