/*
 * C tests of the cache over pools (a marconi_cache created with
 * marconi_cache_config.pools) and of memory planning (marconi_plan):
 * multi-turn conversations through the full request cycle
 * (marconi_cache_lookup_pooled, marconi_cache_reserve, copy the cached
 * state, marconi_cache_admit_pooled, free what was not taken, release,
 * drain) over the memfd backend, with the invariants checked after every
 * step: marconi_cache_check passes,
 * every handle the cache holds resolves (is live), evicted handles come
 * back once and are no longer held, physical bytes (memfd st_blocks) never
 * exceed the budget; then misuse, each refused with its status. Also
 * where AVMP takes the split on two traces (marconi_plan_converged_split). Built by
 * ci/test.d/c.sh with -fsanitize=address,undefined.
 */
#include "marconi.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

#define PAGE 16u
#define MAX_UNITS 4096

static marconi_memory_plan plan_for(const char *preset, uint64_t budget) {
  marconi_plan_request req = plan_request(preset, PAGE, budget);
  return plan_of(&req);
}

static void test_plan(void) {
  marconi_plan_request req = plan_request("nemotron-h-8b", PAGE, 8ull << 30);
  req.state_fraction = 0.25;
  req.context_tokens = 4096;
  req.batch = 8;
  marconi_memory_plan p = plan_of(&req);
  CHECK_EQ(p.page_size, PAGE);
  CHECK_EQ(p.budget_bytes, 8ull << 30);
  CHECK_EQ(p.kv_page_bytes % 128, 0);
  CHECK_EQ(p.state_slot_bytes % 128, 0);
  CHECK(p.kv_page_bytes >= p.kv_bytes_per_token * PAGE);
  CHECK_EQ(p.max_kv_tokens, (8ull << 30) / p.kv_page_bytes * PAGE);
  CHECK_EQ(p.max_state_slots, (8ull << 30) / p.state_slot_bytes);
  /* The static split: floor(budget * 0.25) for states, the rest for KV. */
  CHECK_EQ(p.split_state_slots, (2ull << 30) / p.state_slot_bytes);
  CHECK_EQ(p.split_kv_pages, (6ull << 30) / p.kv_page_bytes);
  CHECK_EQ(p.split_kv_tokens, p.split_kv_pages * PAGE);
  /* AVMP fits at least the static split's batch, the unified table at most. */
  uint64_t pages = 4096 / PAGE;
  CHECK_EQ(p.max_batch_avmp, (8ull << 30) / (pages * p.kv_page_bytes + p.state_slot_bytes));
  CHECK(p.max_batch_avmp >= p.max_batch_static);
  CHECK(p.max_context_avmp >= p.max_context_static);
  CHECK(p.fraction_for_context > 0 && p.fraction_for_context < 1);
  /* Misuse. */
  CHECK_EQ(marconi_plan(NULL, &p), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_plan(&req, NULL), MARCONI_STATUS_NULL_ARGUMENT);
#define REFUSED(field, bad, good, status)                                      \
  CHECK_WITH(field, bad, good, marconi_plan(&req, &p), status)
  REFUSED(req.model_preset, "no-such-model", "nemotron-h-8b", MARCONI_STATUS_UNKNOWN_PRESET);
  /* No recurrent layers: no state pool. */
  REFUSED(req.model_preset, "paper-7b-attn", "nemotron-h-8b", MARCONI_STATUS_INVALID_CONFIG);
  REFUSED(req.page_size, 0, PAGE, MARCONI_STATUS_INVALID_CONFIG);
  REFUSED(req.state_fraction, 1.5, 0.5, MARCONI_STATUS_INVALID_CONFIG);
  REFUSED(req.budget_bytes, 1000, 1ull << 30, MARCONI_STATUS_INVALID_CONFIG);
#undef REFUSED
  p.struct_size = 4;
  CHECK_EQ(marconi_plan(&req, &p), MARCONI_STATUS_UNSUPPORTED_STRUCT_SIZE);
  CHECK_EQ(marconi_plan_request_init(&req, 8), MARCONI_STATUS_UNSUPPORTED_STRUCT_SIZE);
}

/* A trace in the flat form marconi_plan_converged_split takes. */
typedef struct {
  uint32_t tokens[128 * 1024];
  size_t offsets[512];
  uint32_t input_lens[512];
  size_t n_tokens, n;
} trace;

static uint32_t next_token(uint64_t *s) {
  *s = *s * 6364136223846793005ull + 1442695040888963407ull;
  return (uint32_t)(*s >> 33);
}

/* Appends a request: `prefix` (copied) then `fresh` new tokens; the last
 * `output` of them are the answer. Returns its start. */
static size_t add_request(trace *t, size_t prefix_at, size_t prefix_len, size_t fresh, size_t output,
                          uint64_t *seed) {
  size_t at = t->n_tokens;
  if (at + prefix_len + fresh > sizeof t->tokens / sizeof t->tokens[0] ||
      t->n + 2 > sizeof t->offsets / sizeof t->offsets[0]) {
    fprintf(stderr, "test_converged_split: the trace buffer is too small\n");
    exit(1);
  }
  memmove(&t->tokens[at], &t->tokens[prefix_at], prefix_len * sizeof(uint32_t));
  for (size_t i = 0; i < fresh; i++) t->tokens[at + prefix_len + i] = next_token(seed);
  t->n_tokens = at + prefix_len + fresh;
  t->offsets[t->n] = at;
  t->input_lens[t->n] = (uint32_t)(prefix_len + fresh - output);
  t->n++;
  t->offsets[t->n] = t->n_tokens;
  return at;
}

/* marconi_plan_converged_split: many short conversations (state-hungry:
 * one 27 MB state per turn against a few MB of KV) pull the split toward
 * states; a few long documents asked several questions (KV-hungry) push
 * it toward KV; the replay is deterministic; malformed traces are refused. */
static void test_converged_split(void) {
  static trace chat, docs;
  uint64_t seed = 7;
  memset(&chat, 0, sizeof chat);
  memset(&docs, 0, sizeof docs);
  size_t last[24] = {0}, len[24] = {0};
  for (int turn = 0; turn < 3; turn++)
    for (int s = 0; s < 24; s++) {
      last[s] = add_request(&chat, last[s], len[s], turn == 0 ? 48 : 32, 16, &seed);
      len[s] += turn == 0 ? 48 : 32;
    }
  for (int d = 0; d < 12; d++) {
    size_t doc = add_request(&docs, 0, 0, 2000, 16, &seed);
    for (int q = 0; q < 3; q++) add_request(&docs, doc, 1984, 24, 8, &seed);
  }
  chat.offsets[0] = docs.offsets[0] = 0;

  marconi_plan_request req = plan_request("paper-7b", PAGE, 1ull << 30);
  marconi_converged_split a, b;
  VERSIONED(a);
  b = a;

  req.state_fraction = 0.1;
  OK(marconi_plan_converged_split(&req, chat.tokens, chat.n_tokens, chat.offsets, chat.n + 1,
                                  chat.input_lens, chat.n, &a));
  CHECK_EQ(a.requests, chat.n);
  CHECK(a.start_fraction == 0.1);
  CHECK(a.migrations > 0);
  CHECK(a.bytes_migrated > 0);
  CHECK(a.settled_fraction > 0.3);
  CHECK(a.token_hit_rate > 0 && a.token_hit_rate < 1);
  /* Deterministic: the same trace, the same answer. */
  OK(marconi_plan_converged_split(&req, chat.tokens, chat.n_tokens, chat.offsets, chat.n + 1,
                                  chat.input_lens, chat.n, &b));
  CHECK(memcmp(&a, &b, sizeof a) == 0);

  req.state_fraction = 0.9;
  OK(marconi_plan_converged_split(&req, docs.tokens, docs.n_tokens, docs.offsets, docs.n + 1,
                                  docs.input_lens, docs.n, &b));
  CHECK(b.migrations > 0);
  CHECK(b.settled_fraction < 0.6);
  CHECK(b.settled_fraction < a.settled_fraction);
  printf("converged split: chat 0.10 -> %.3f (%llu migrations), docs 0.90 -> %.3f (%llu)\n",
         a.settled_fraction, (unsigned long long)a.migrations, b.settled_fraction,
         (unsigned long long)b.migrations);

  /* Misuse: each refused, *out untouched. */
  marconi_converged_split c = a;
  size_t off_bad[3] = {0, 5, 3};
  uint32_t toks[4] = {1, 2, 3, 4};
  uint32_t in_bad[2] = {5, 1};
  CHECK_EQ(marconi_plan_converged_split(NULL, toks, 4, off_bad, 3, NULL, 2, &c),
           MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_plan_converged_split(&req, NULL, 4, off_bad, 3, NULL, 2, &c),
           MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_plan_converged_split(&req, toks, 4, NULL, 3, NULL, 2, &c),
           MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_plan_converged_split(&req, toks, 4, off_bad, 3, NULL, 2, NULL),
           MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_plan_converged_split(&req, toks, 4, off_bad, 1, NULL, 0, &c),
           MARCONI_STATUS_INVALID_ARGUMENT); /* no request */
  CHECK_EQ(marconi_plan_converged_split(&req, toks, 4, off_bad, 2, NULL, 2, &c),
           MARCONI_STATUS_INVALID_ARGUMENT); /* n_offsets != n_requests + 1 */
  CHECK_EQ(marconi_plan_converged_split(&req, toks, 4, off_bad, 3, NULL, 2, &c),
           MARCONI_STATUS_INVALID_ARGUMENT); /* offsets decrease, end past n_tokens */
  size_t off_ok[3] = {0, 2, 4};
  CHECK_EQ(marconi_plan_converged_split(&req, toks, 4, off_ok, 3, in_bad, 2, &c),
           MARCONI_STATUS_INVALID_ARGUMENT); /* input longer than its request */
  size_t off_empty[3] = {0, 0, 4};
  CHECK_EQ(marconi_plan_converged_split(&req, toks, 4, off_empty, 3, NULL, 2, &c),
           MARCONI_STATUS_INVALID_ARGUMENT); /* an empty request */
#define REFUSED(field, bad, good)                                              \
  CHECK_WITH(field, bad, good, marconi_plan_converged_split(&req, toks, 4, off_ok, 3, NULL, 2, &c), \
             MARCONI_STATUS_INVALID_CONFIG)
  REFUSED(req.state_fraction, 1.0, 0.5);
  REFUSED(req.budget_bytes, 1000, 1ull << 30);
#undef REFUSED
  c.struct_size = 8;
  CHECK_EQ(marconi_plan_converged_split(&req, toks, 4, off_ok, 3, NULL, 2, &c),
           MARCONI_STATUS_UNSUPPORTED_STRUCT_SIZE);
  c.struct_size = a.struct_size;
  CHECK(memcmp(&c, &a, sizeof a) == 0);
  /* A short trace is served (tiny, no migration needed). */
  OK(marconi_plan_converged_split(&req, toks, 4, off_ok, 3, NULL, 2, &c));
  CHECK_EQ(c.requests, 2);
}

typedef struct {
  marconi_cache *pc;
  uint64_t budget;
  uint64_t freed_seen[MAX_UNITS * 4];
  size_t n_freed_seen;
} fixture;

static marconi_cache *new_pooled(const char *preset, uint64_t budget, uint32_t migration,
                                 double fraction) {
  return new_pooled_cache(preset, PAGE, MARCONI_POOL_BACKEND_MEMFD, budget, migration, fraction);
}

STATS_OF(stats_of, marconi_pooled_stats, marconi_cache, marconi_cache_pool_stats)

/* The invariants of the issue, after every step. */
static void check_invariants(fixture *f) {
  OK(marconi_cache_check(f->pc));
  static uint64_t held[MAX_UNITS * 2];
  size_t n = 0;
  OK(marconi_cache_held(f->pc, held, MAX_UNITS * 2, &n));
  static marconi_unit_location loc[MAX_UNITS * 2];
  if (n > 0) OK(marconi_cache_resolve(f->pc, held, n, loc, n)); /* all live */
  marconi_pooled_stats s = stats_of(f->pc);
  CHECK_EQ(s.held_kv_pages + s.held_state_slots, n);
  CHECK(s.physical_bytes <= f->budget);
  CHECK(s.budget_bytes <= f->budget);
  CHECK(s.kv_free <= s.kv_capacity && s.state_free <= s.state_capacity);
  /* Freed handles come back: drained once, and no longer held. */
  static uint64_t freed[MAX_UNITS * 2];
  size_t nf = 0;
  OK(marconi_cache_drain_freed_units(f->pc, freed, MAX_UNITS * 2, &nf));
  for (size_t i = 0; i < nf; i++) {
    for (size_t j = 0; j < n; j++) CHECK(freed[i] != held[j]);
    /* Between requests the caller holds nothing: a freed handle is stale. */
    marconi_unit_location l;
    CHECK(marconi_cache_resolve(f->pc, &freed[i], 1, &l, 1) != MARCONI_STATUS_OK);
    if (f->n_freed_seen < sizeof f->freed_seen / sizeof f->freed_seen[0])
      f->freed_seen[f->n_freed_seen++] = freed[i];
  }
  OK(marconi_cache_drain_freed_units(f->pc, NULL, 0, &nf));
  CHECK_EQ(nf, 0);
}

/* One request: `tokens[0..input]` looked up (with the application
 * checkpoints `hints[0..n_hints]`), `tokens[0..full]` admitted. */
static int serve_hinted(fixture *f, const uint32_t *tokens, uint32_t input, uint32_t full,
                        const uint32_t *hints, size_t n_hints) {
  marconi_pooled_lookup l;
  OK(marconi_cache_lookup_pooled_hinted(f->pc, 0, tokens, input, hints, n_hints, &l));
  CHECK(l.hit_tokens < input);
  uint64_t hit_pages[MAX_UNITS];
  size_t n_hit = 0;
  OK(marconi_cache_lease_kv_handles(f->pc, l.lease, hit_pages, MAX_UNITS, &n_hit));
  CHECK_EQ(n_hit, l.n_kv_pages);
  uint32_t plan[64];
  size_t n_plan = 0;
  OK(marconi_cache_lease_plan(f->pc, l.lease, plan, 64, &n_plan));
  CHECK_EQ(n_plan, l.n_plan);
  /* Working memory: pages past the hit, a slot per planned state + the final one. */
  uint32_t full_pages = full / PAGE;
  uint32_t want_pages = full_pages - (uint32_t)n_hit;
  uint32_t want_slots = (uint32_t)n_plan + 1;
  static uint64_t pages[MAX_UNITS];
  uint64_t slots[65];
  marconi_status st =
      marconi_cache_reserve(f->pc, want_pages, want_slots, pages + n_hit, MAX_UNITS - n_hit, slots, 65);
  if (st == MARCONI_STATUS_OUT_OF_MEMORY) {
    OK(marconi_cache_release(f->pc, l.lease));
    check_invariants(f);
    return 0;
  }
  OK(st);
  memcpy(pages, hit_pages, n_hit * sizeof pages[0]);
  /* Resume from the cached state: copy it into the request's own slot. */
  if (l.state_handle != 0) {
    marconi_state_copy o = {l.state_handle, slots[0]};
    OK(marconi_cache_copy_states(f->pc, &o, 1));
  }
  /* "Prefill and decode": write each saved state's slot. */
  marconi_pooled_state states[65];
  for (size_t i = 0; i < n_plan; i++) states[i] = (marconi_pooled_state){plan[i], 0, slots[i + 1]};
  states[n_plan] = (marconi_pooled_state){full / PAGE * PAGE, 0, slots[0]};
  marconi_unit_location sl;
  OK(marconi_cache_resolve(f->pc, &slots[0], 1, &sl, 1));
  memset((void *)(uintptr_t)sl.address, (int)(full & 0xff), 4096);
  uint8_t taken[65];
  marconi_admit_result r;
  OK(marconi_cache_admit_pooled(f->pc, l.lease, tokens, full, states, n_plan + 1, pages, full_pages,
                                taken, &r));
  /* Free what the cache did not take. */
  uint64_t mine[MAX_UNITS + 65];
  size_t n_mine = free_untaken(f->pc, pages, n_hit, full_pages, &r, states, n_plan + 1, taken, mine);
  /* A freed working unit is the caller's no more. */
  if (n_mine > 0) CHECK_EQ(marconi_cache_free_units(f->pc, mine, 1), MARCONI_STATUS_UNKNOWN_HANDLE);
  OK(marconi_cache_release(f->pc, l.lease));
  CHECK_EQ(marconi_cache_release(f->pc, l.lease), MARCONI_STATUS_UNKNOWN_LEASE);
  check_invariants(f);
  return 1;
}

static int serve(fixture *f, const uint32_t *tokens, uint32_t input, uint32_t full) {
  return serve_hinted(f, tokens, input, full, NULL, 0);
}

/* An application checkpoint at the end of a shared 320-token prompt: the
 * first request saves a state there (a slot reserved for it like any
 * planned state), the second resumes from it. */
static void test_hinted(void) {
  marconi_memory_plan p = plan_for("nemotron-h-8b", 1ull << 30);
  fixture *f = calloc(1, sizeof *f);
  f->budget = 8 * p.state_slot_bytes + 2048 / PAGE * p.kv_page_bytes + (4u << 20);
  f->pc = new_pooled("nemotron-h-8b", f->budget, MARCONI_POOL_MIGRATION_AVMP, 0.5);
  static uint32_t a[512], b[512];
  for (uint32_t i = 0; i < 512; i++) {
    a[i] = i < 320 ? i : 100000 + i;
    b[i] = i < 320 ? i : 200000 + i;
  }
  uint32_t hints[2] = {320, 330}; /* 330 rounds down to 320 (page 16) */
  marconi_pooled_lookup l;
  OK(marconi_cache_lookup_pooled_hinted(f->pc, 0, a, 400, hints, 2, &l));
  CHECK_EQ(l.n_plan, 1);
  uint32_t plan[4];
  size_t n_plan = 0;
  OK(marconi_cache_lease_plan(f->pc, l.lease, plan, 4, &n_plan));
  CHECK_EQ(plan[0], 320);
  OK(marconi_cache_release(f->pc, l.lease));
  CHECK(serve_hinted(f, a, 400, 448, hints, 2));
  OK(marconi_cache_lookup_pooled(f->pc, 0, b, 400, &l));
  CHECK_EQ(l.hit_tokens, 320);
  CHECK(l.state_handle != 0);
  OK(marconi_cache_release(f->pc, l.lease));
  /* Misuse: NULL hints with a count, a wild count; nothing leased. */
  CHECK_EQ(marconi_cache_lookup_pooled_hinted(f->pc, 0, a, 400, NULL, 3, &l),
           MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_cache_lookup_pooled_hinted(f->pc, 0, a, 400, hints, SIZE_MAX, &l),
           MARCONI_STATUS_TOO_MANY_TOKENS);
  CHECK_EQ(marconi_cache_lookup_pooled_hinted(NULL, 0, a, 400, hints, 2, &l),
           MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(stats_of(f->pc).leases, 0);
  check_invariants(f);
  marconi_cache_free(f->pc);
  free(f);
}

static void test_cycle(uint32_t migration) {
  marconi_memory_plan p = plan_for("nemotron-h-8b", 1ull << 30);
  /* Room for a few states and a few thousand tokens: evictions happen. */
  uint64_t budget = 6 * p.state_slot_bytes + 2600 / PAGE * p.kv_page_bytes;
  budget = (budget + (2u << 20) - 1) / (2u << 20) * (2u << 20);
  fixture *f = calloc(1, sizeof *f);
  f->budget = budget;
  f->pc = new_pooled("nemotron-h-8b", budget, migration, 0.3);
  check_invariants(f);
  /* Four conversations, each turn extending the previous one. */
  static uint32_t conv[4][4096];
  uint32_t len[4] = {0, 0, 0, 0};
  for (int c = 0; c < 4; c++)
    for (int i = 0; i < 4096; i++) conv[c][i] = (uint32_t)(c == 3 ? (c * 100000 + i) : (i < 160 ? i : c * 100000 + i));
  int served = 0, refused = 0;
  for (int turn = 0; turn < 10; turn++) {
    for (int c = 0; c < 4; c++) {
      uint32_t input = len[c] + 160;
      uint32_t full = input + 48;
      if (full > 4096) continue;
      if (serve(f, conv[c], input, full))
        served++;
      else
        refused++;
      len[c] = full;
    }
  }
  marconi_pooled_stats s = stats_of(f->pc);
  CHECK_EQ(s.requests, (uint64_t)(served + refused));
  CHECK_EQ(s.reservations_refused, (uint64_t)refused);
  CHECK(s.hit_tokens > 0);         /* later turns resume from cached states */
  CHECK(s.evictions > 0);          /* the budget is small: entries left memory */
  CHECK(f->n_freed_seen > 0);      /* and their handles came back */
  CHECK_EQ(s.leases, 0);
  if (migration == MARCONI_POOL_MIGRATION_AVMP) CHECK(s.migrations > 0 || s.evictions_for_memory > 0);
  else CHECK_EQ(s.migrations, 0);
  printf("pooled cycle (%s): %d served, %d refused, %llu hit tokens, %llu evictions, %llu migrations, "
         "%llu physical bytes of %llu\n",
         migration ? "avmp" : "static", served, refused, (unsigned long long)s.hit_tokens,
         (unsigned long long)s.evictions, (unsigned long long)s.migrations,
         (unsigned long long)s.physical_bytes, (unsigned long long)budget);
  marconi_cache_free(f->pc);
  free(f);
}

static void test_misuse(void) {
  marconi_memory_plan p = plan_for("nemotron-h-8b", 1ull << 30);
  uint64_t budget = 4 * p.state_slot_bytes + 64 * p.kv_page_bytes + (4u << 20);
  marconi_cache *c = new_pooled("nemotron-h-8b", budget, MARCONI_POOL_MIGRATION_AVMP, 0.5);
  uint32_t tokens[64];
  for (int i = 0; i < 64; i++) tokens[i] = 7 + (uint32_t)i;
  marconi_pooled_lookup l;
  CHECK_EQ(marconi_cache_lookup_pooled(NULL, 0, tokens, 64, &l), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_cache_lookup_pooled(c, 0, NULL, 64, &l), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_cache_lookup_pooled(c, 0, tokens, 0, &l), MARCONI_STATUS_EMPTY_TOKENS);
  OK(marconi_cache_lookup_pooled(c, 0, tokens, 48, &l));
  /* More than the whole budget: refused, nothing reserved. */
  uint64_t big[4];
  CHECK_EQ(marconi_cache_reserve(c, 0, 1000000, NULL, 0, big, 4), MARCONI_STATUS_BUFFER_TOO_SMALL);
  static uint64_t many[100000];
  CHECK_EQ(marconi_cache_reserve(c, 100000, 0, many, 100000, NULL, 0), MARCONI_STATUS_OUT_OF_MEMORY);
  uint64_t pg[4], sl[2];
  OK(marconi_cache_reserve(c, 4, 2, pg, 4, sl, 2));
  /* A slot the caller does not hold: refused, nothing changes. */
  marconi_pooled_state bad = {64, 0, 0xfffffff0u}; /* never reserved */
  uint8_t taken[1];
  marconi_admit_result r;
  CHECK_EQ(marconi_cache_admit_pooled(c, l.lease, tokens, 64, &bad, 1, pg, 4, taken, &r),
           MARCONI_STATUS_UNKNOWN_HANDLE);
  /* A page where a slot is expected. */
  marconi_pooled_state wrong = {64, 0, pg[0]};
  CHECK(marconi_cache_admit_pooled(c, l.lease, tokens, 64, &wrong, 1, pg, 4, taken, &r) != MARCONI_STATUS_OK);
  CHECK_EQ(marconi_cache_admit_pooled(c, l.lease + 1, tokens, 64, NULL, 0, pg, 4, NULL, &r),
           MARCONI_STATUS_UNKNOWN_LEASE);
  CHECK_EQ(marconi_cache_admit_pooled(c, l.lease, tokens, 64, NULL, 1, pg, 4, taken, &r),
           MARCONI_STATUS_NULL_ARGUMENT);
  /* A reserved page or slot listed twice: the documented duplicates. */
  uint64_t pg_twice[4] = {pg[0], pg[1], pg[0], pg[3]};
  marconi_pooled_state fin = {64, 0, sl[0]};
  CHECK_EQ(marconi_cache_admit_pooled(c, l.lease, tokens, 64, &fin, 1, pg_twice, 4, taken, &r),
           MARCONI_STATUS_DUPLICATE_PAGE);
  marconi_pooled_state two[2] = {{32, 0, sl[0]}, {64, 0, sl[0]}};
  uint8_t taken2[2];
  CHECK_EQ(marconi_cache_admit_pooled(c, l.lease, tokens, 64, two, 2, pg, 4, taken2, &r),
           MARCONI_STATUS_DUPLICATE_SLOT);
  /* A handle of another cache over pools: refused, its owner untouched. */
  marconi_cache *other = new_pooled("nemotron-h-8b", budget, MARCONI_POOL_MIGRATION_AVMP, 0.5);
  uint64_t opg[4], osl[1];
  OK(marconi_cache_reserve(other, 4, 1, opg, 4, osl, 1));
  marconi_pooled_state foreign = {64, 0, osl[0]};
  CHECK_EQ(marconi_cache_admit_pooled(c, l.lease, tokens, 64, &foreign, 1, opg, 4, taken, &r),
           MARCONI_STATUS_UNKNOWN_HANDLE);
  CHECK_EQ(marconi_cache_free_units(c, opg, 1), MARCONI_STATUS_UNKNOWN_HANDLE);
  marconi_unit_location ol;
  CHECK_EQ(marconi_cache_resolve(c, osl, 1, &ol, 1), MARCONI_STATUS_UNKNOWN_HANDLE);
  OK(marconi_cache_free_units(other, opg, 4));
  OK(marconi_cache_free_units(other, osl, 1));
  marconi_cache_free(other);
  OK(marconi_cache_admit_pooled(c, l.lease, tokens, 64, &fin, 1, pg, 4, taken, &r));
  CHECK_EQ(taken[0], 1);
  CHECK_EQ(r.kv_pages_taken_end - r.kv_pages_taken_start, 4);
  /* The cache's units are not the caller's to free or to overwrite. */
  CHECK_EQ(marconi_cache_free_units(c, &sl[0], 1), MARCONI_STATUS_UNKNOWN_HANDLE);
  CHECK_EQ(marconi_cache_free_units(c, pg, 1), MARCONI_STATUS_UNKNOWN_HANDLE);
  marconi_state_copy onto_cached = {sl[1], sl[0]};
  CHECK_EQ(marconi_cache_copy_states(c, &onto_cached, 1), MARCONI_STATUS_UNKNOWN_HANDLE);
  marconi_state_copy self = {sl[1], sl[1]};
  CHECK_EQ(marconi_cache_copy_states(c, &self, 1), MARCONI_STATUS_INVALID_ARGUMENT);
  OK(marconi_cache_free_units(c, &sl[1], 1));
  CHECK_EQ(marconi_cache_free_units(c, &sl[1], 1), MARCONI_STATUS_UNKNOWN_HANDLE);
  OK(marconi_cache_release(c, l.lease));
  uint64_t held[16];
  size_t n = 0;
  CHECK_EQ(marconi_cache_held(c, held, 1, &n), MARCONI_STATUS_BUFFER_TOO_SMALL);
  CHECK_EQ(n, 5); /* 4 pages + 1 state */
  OK(marconi_cache_held(c, held, 16, &n));
  marconi_pooled_stats s;
  s.struct_size = 8;
  CHECK_EQ(marconi_cache_pool_stats(c, &s), MARCONI_STATUS_UNSUPPORTED_STRUCT_SIZE);
  check_and_free(c);
  marconi_cache_free(NULL);

  /* Configurations that cannot make a cache over pools. */
  marconi_cache_config cc = cache_config("paper-7b-attn", PAGE); /* no recurrent layers */
  marconi_pool_config pc;
  OK(marconi_pool_config_init(&pc, sizeof pc));
  pc.budget_bytes = 64u << 20;
  cc.pools = &pc;
  marconi_cache *x = (marconi_cache *)0x1;
  CHECK_EQ(marconi_cache_new(&cc, &x), MARCONI_STATUS_INVALID_CONFIG);
  cc.model_preset = "nemotron-h-8b";
  pc.state_slot_bytes = 128; /* smaller than one state of the model */
  CHECK_EQ(marconi_cache_new(&cc, &x), MARCONI_STATUS_INVALID_CONFIG);
  CHECK(x == (marconi_cache *)0x1);
  CHECK_EQ(marconi_cache_new(NULL, &x), MARCONI_STATUS_NULL_ARGUMENT);
  /* Tiers below pools are written through: write-back (the default) and
   * deferred moves are refused, nothing written. */
  pc.state_slot_bytes = 0;
  marconi_tier_options to;
  OK(marconi_tier_options_init(&to, sizeof to));
  to.host.capacity_bytes = 64u << 20;
  cc.tiers = &to;
  CHECK_EQ(marconi_cache_new(&cc, &x), MARCONI_STATUS_INVALID_CONFIG);
  CHECK(x == (marconi_cache *)0x1);
  to.write_mode = MARCONI_TIER_WRITE_THROUGH;
  to.defer_moves = 1;
  CHECK_EQ(marconi_cache_new(&cc, &x), MARCONI_STATUS_INVALID_CONFIG);
  CHECK(x == (marconi_cache *)0x1);
  /* Written through: a cache over pools with tiers, whose tier calls work
   * and whose tier lookup over engine ids names the pooled one. */
  to.defer_moves = 0;
  OK(marconi_cache_new(&cc, &x));
  uint32_t toks[64];
  for (uint32_t i = 0; i < 64; i++) toks[i] = 7 + i;
  marconi_pooled_lookup pl;
  OK(marconi_cache_lookup_pooled(x, 0, toks, 64, &pl));
  CHECK_EQ(pl.hit_tokens, 0u);
  n = 99;
  OK(marconi_cache_lease_loads(x, pl.lease, NULL, 0, &n));
  CHECK_EQ(n, 0u);
  marconi_tiered_hit th;
  CHECK_EQ(marconi_cache_lookup_tiered(x, 0, toks, 64, NULL, 0, NULL, &th), MARCONI_STATUS_UNSUPPORTED);
  char err[512];
  marconi_last_error(err, sizeof err);
  CHECK(strstr(err, "marconi_cache_lookup_pooled") != NULL);
  marconi_tiered_stats ts = {.struct_size = sizeof ts};
  OK(marconi_cache_tier_stats(x, &ts));
  CHECK_EQ(ts.requests, 1u);
  CHECK(ts.capacity_bytes[MARCONI_TIER_HOST] == 64u << 20);
  OK(marconi_cache_release(x, pl.lease));
  OK(marconi_cache_settle(x));
  OK(marconi_cache_check(x));
  marconi_cache_free(x);
}

/* Calls on the wrong configuration: a pool call on a cache without pools,
 * a call over engine ids on a cache over pools; each refused, clearly. */
static void test_wrong_configuration(void) {
  marconi_cache_config cc = cache_config("nemotron-h-8b", PAGE);
  cc.capacity_bytes = 1ull << 30;
  marconi_cache *plain = NULL;
  OK(marconi_cache_new(&cc, &plain));
  uint64_t h[2];
  CHECK_EQ(marconi_cache_reserve(plain, 1, 1, h, 1, h + 1, 1), MARCONI_STATUS_UNSUPPORTED);
  char err[512];
  marconi_last_error(err, sizeof err);
  CHECK(strstr(err, "marconi_cache_config.pools") != NULL);
  marconi_pooled_stats ps;
  VERSIONED(ps);
  CHECK_EQ(marconi_cache_pool_stats(plain, &ps), MARCONI_STATUS_UNSUPPORTED);
  marconi_cache_free(plain);
  marconi_memory_plan p = plan_for("nemotron-h-8b", 1ull << 30);
  marconi_cache *c = new_pooled("nemotron-h-8b", 4 * p.state_slot_bytes + 64 * p.kv_page_bytes + (4u << 20),
                                MARCONI_POOL_MIGRATION_AVMP, 0.5);
  uint32_t tokens[32];
  for (int i = 0; i < 32; i++) tokens[i] = (uint32_t)i;
  marconi_lookup l;
  CHECK_EQ(marconi_cache_lookup(c, 0, tokens, 32, MARCONI_NO_SLOT, &l), MARCONI_STATUS_UNSUPPORTED);
  marconi_last_error(err, sizeof err);
  CHECK(strstr(err, "marconi_cache_lookup_pooled") != NULL);
  uint32_t pages[4], slots[4];
  size_t np = 0, ns = 0;
  CHECK_EQ(marconi_cache_drain_freed(c, pages, 4, &np, slots, 4, &ns), MARCONI_STATUS_UNSUPPORTED);
  marconi_stats s;
  VERSIONED(s);
  OK(marconi_cache_stats(c, &s)); /* the common stats work on both */
  CHECK_EQ(s.requests, 0);
  check_and_free(c);
}

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
/* The deprecated marconi_pooled_cache_* forwarders (one release more): the
 * same cycle, and the handle is a marconi_cache. */
static void test_deprecated_forwarders(void) {
  marconi_cache_config cc = cache_config("nemotron-h-8b", PAGE);
  marconi_pool_config pc;
  OK(marconi_pool_config_init(&pc, sizeof pc));
  pc.backend = MARCONI_POOL_BACKEND_NONE;
  pc.budget_bytes = 8ull << 30;
  marconi_pooled_cache *c = NULL;
  OK(marconi_pooled_cache_new(&cc, &pc, &c));
  CHECK_EQ(marconi_pooled_cache_new(NULL, &pc, &c), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_pooled_cache_new(&cc, NULL, &c), MARCONI_STATUS_NULL_ARGUMENT);
  uint32_t tokens[64];
  for (int i = 0; i < 64; i++) tokens[i] = 7 + (uint32_t)i;
  marconi_pooled_lookup l;
  OK(marconi_pooled_cache_lookup(c, 0, tokens, 48, &l));
  uint64_t pg[4], sl[1];
  OK(marconi_pooled_cache_reserve(c, 4, 1, pg, 4, sl, 1));
  marconi_pooled_state fin = {64, 0, sl[0]};
  uint8_t taken[1];
  marconi_admit_result r;
  OK(marconi_pooled_cache_admit(c, l.lease, tokens, 64, &fin, 1, pg, 4, taken, &r));
  CHECK_EQ(taken[0], 1);
  OK(marconi_pooled_cache_release(c, l.lease));
  OK(marconi_pooled_cache_lookup(c, 0, tokens, 64, &l));
  CHECK_EQ(l.hit_tokens, 0); /* the state covers all 64: the last token is recomputed */
  OK(marconi_pooled_cache_release(c, l.lease));
  marconi_pooled_stats s;
  VERSIONED(s);
  OK(marconi_pooled_cache_stats(c, &s));
  CHECK_EQ(s.held_kv_pages, 4);
  CHECK_EQ(s.held_state_slots, 1);
  OK(marconi_pooled_cache_check(c));
  /* It is a marconi_cache: the one handle's calls take it. */
  marconi_cache *one = (marconi_cache *)c;
  marconi_pooled_stats s1;
  VERSIONED(s1);
  OK(marconi_cache_pool_stats(one, &s1));
  CHECK_EQ(s1.requests, 2);
  OK(marconi_cache_check(one));
  marconi_cache_free(one);
}
#pragma GCC diagnostic pop

/* The one lookup, admit and drain on a cache over memfd pools with a host
 * tier below them (written through): documents cycled past what the pools
 * hold come back from the host; every host WRITE names a state of the
 * admission just made; the drain hands out ops, then freed units. */
static void test_one_cycle_with_tiers(void) {
  marconi_memory_plan p = plan_for("nemotron-h-8b", 1ull << 30);
  uint64_t budget = 4 * p.state_slot_bytes + 40 * p.kv_page_bytes;
  budget = (budget + (2u << 20) - 1) / (2u << 20) * (2u << 20);
  marconi_cache_config cc = cache_config("nemotron-h-8b", PAGE);
  cc.alpha_mode = MARCONI_ALPHA_MODE_FIXED;
  cc.alpha = 1.0;
  marconi_pool_config pc = pool_config(MARCONI_POOL_BACKEND_MEMFD, MARCONI_POOL_MIGRATION_AVMP, budget, 0, 0, 0.3);
  marconi_tier_options to;
  OK(marconi_tier_options_init(&to, sizeof to));
  to.write_mode = MARCONI_TIER_WRITE_THROUGH;
  to.host.capacity_bytes = 1ull << 40;
  to.always_load = 1;
  cc.pools = &pc;
  cc.tiers = &to;
  marconi_cache *c = NULL;
  OK(marconi_cache_new(&cc, &c));
  static uint32_t seq[160];
  static uint64_t pages[16], slots[8], hit[16], freed[256], freed_slots[64], untaken[32];
  static marconi_tier_op ops[64];
  static uint32_t op_tokens[8192];
  uint32_t plan[8];
  int host_writes = 0, lower_hits = 0;
  for (uint32_t round = 0; round < 3; round++) {
    for (uint32_t d = 0; d < 8; d++) {
      for (uint32_t i = 0; i < 160; i++) seq[i] = i < 96 ? d * 10000 + i : 1000000 + round * 10000 + d * 100 + i;
      marconi_lookup_request q;
      OK(marconi_lookup_request_init(&q, sizeof q));
      q.tokens = seq;
      q.n_tokens = 144;
      marconi_lookup_result r = {.struct_size = sizeof r};
      OK(marconi_cache_lookup_with(c, &q, &r));
      lower_hits += r.tier != MARCONI_TIER_DEVICE;
      CHECK_EQ(r.tier != MARCONI_TIER_DEVICE, r.n_loads > 0);
      size_t n_hit = 0, n_plan = 0;
      OK(marconi_cache_lease_kv_handles(c, r.lease, hit, 16, &n_hit));
      OK(marconi_cache_lease_plan(c, r.lease, plan, 8, &n_plan));
      size_t n_pages = 160 / PAGE, want = n_pages - n_hit, n_states = 0;
      marconi_admit_state st[8];
      for (size_t i = 0; i < n_plan; i++) st[n_states++] = (marconi_admit_state){plan[i], 0, 0};
      if (n_states == 0 || st[n_states - 1].position != 160) st[n_states++] = (marconi_admit_state){160, 0, 0};
      OK(marconi_cache_reserve(c, (uint32_t)want, (uint32_t)n_states, pages + n_hit, want, slots, 8));
      for (size_t i = 0; i < n_hit; i++) pages[i] = hit[i];
      for (size_t i = 0; i < n_states; i++) st[i].unit = slots[i];
      marconi_admit_request a;
      OK(marconi_admit_request_init(&a, sizeof a));
      uint8_t taken[8];
      a.lease = r.lease;
      a.tokens = seq;
      a.n_tokens = 160;
      a.states = st;
      a.n_states = n_states;
      a.page_width = MARCONI_ID_WIDTH_U64;
      a.kv_pages = pages;
      a.n_kv_pages = n_pages;
      a.taken = taken;
      marconi_admit_result res;
      OK(marconi_cache_admit_with(c, &a, &res));
      marconi_drain dr = {.struct_size = sizeof dr, .ops = ops, .ops_cap = 64, .op_tokens = op_tokens,
                          .op_tokens_cap = 8192, .kv_pages = freed, .kv_pages_cap = 256,
                          .state_slots = freed_slots, .state_slots_cap = 64};
      OK(marconi_cache_drain_with(c, &dr));
      for (size_t i = 0; i < dr.n_ops; i++) {
        if (ops[i].kind != MARCONI_TIER_OP_KIND_WRITE || ops[i].tier != MARCONI_TIER_HOST) continue;
        int found = 0;
        for (size_t k = 0; k < n_states; k++) found |= st[k].position == ops[i].position;
        CHECK(found); /* a chain of this admission: its state is st[k].unit */
        CHECK(memcmp(op_tokens + ops[i].tokens_offset, seq, ops[i].position * sizeof(uint32_t)) == 0);
        host_writes++;
      }
      size_t n_untaken = 0;
      for (size_t i = n_hit; i < n_pages; i++)
        if (i < res.kv_pages_taken_start || i >= res.kv_pages_taken_end) untaken[n_untaken++] = pages[i];
      for (size_t i = 0; i < n_states; i++)
        if (!taken[i]) untaken[n_untaken++] = st[i].unit;
      OK(marconi_cache_free_units(c, untaken, n_untaken));
      OK(marconi_cache_release(c, r.lease));
      OK(marconi_cache_check(c));
    }
  }
  marconi_tiered_stats ts = {.struct_size = sizeof ts};
  OK(marconi_cache_tier_stats(c, &ts));
  CHECK(host_writes > 0);
  CHECK(lower_hits > 0);
  CHECK_EQ(ts.hits_by_tier[MARCONI_TIER_HOST], (uint64_t)lower_hits);
  CHECK_EQ(stats_of(c).leases, 0);
  printf("one cycle over pools and a host tier: %d host writes, %d host hits\n", host_writes, lower_hits);
  marconi_cache_free(c);
}

int main(void) {
  test_plan();
  test_converged_split();
  test_cycle(MARCONI_POOL_MIGRATION_AVMP);
  test_cycle(MARCONI_POOL_MIGRATION_STATIC);
  test_misuse();
  test_hinted();
  test_wrong_configuration();
  test_deprecated_forwarders();
  test_one_cycle_with_tiers();
  return check_summary("test_pooled");
}
