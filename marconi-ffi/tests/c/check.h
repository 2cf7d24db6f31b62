/*
 * The checks every C test of include/marconi.h uses: a failed check prints
 * where it failed, the values and libmarconi's last error, and counts; the
 * test's main ends with check_summary, which returns non-zero when
 * `failures` is not 0. Also what the tests share: versioned output structs
 * (VERSIONED, STATS_OF), configurations (CHECK_CONFIG_INIT, CHECK_WITH for
 * refusals, cache_config, pool_config, plan_request, new_pooled_cache),
 * the end of a pooled admit (free_untaken), and the checks every pool
 * backend passes (check_pool_snapshots, check_pool_threads: test_pool.c
 * on memfd, test_cuda.c on CUDA). Included once per test program (each
 * test is its own executable).
 */
#ifndef MARCONI_TEST_CHECK_H
#define MARCONI_TEST_CHECK_H

#include "marconi.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

static int failures = 0;

/* Counts a failed check at file:line and says what failed, with
 * libmarconi's last error. */
static inline void check_failed_at(const char *file, int line, const char *what) {
  char err[512];
  marconi_last_error(err, sizeof err);
  fprintf(stderr, "%s:%d: %s (last error: %s)\n", file, line, what, err);
  failures++;
}

/* Checks a == b, both as unsigned 64-bit values. */
static inline void check_eq_at(const char *file, int line, const char *a_text,
                               unsigned long long a, const char *b_text, unsigned long long b) {
  if (a == b) return;
  char what[1024];
  snprintf(what, sizeof what, "%s == %llu, expected %s == %llu", a_text, a, b_text, b);
  check_failed_at(file, line, what);
}

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) check_failed_at(__FILE__, __LINE__, "CHECK failed: " #cond);  \
  } while (0)

#define CHECK_EQ(a, b)                                                         \
  check_eq_at(__FILE__, __LINE__, #a, (unsigned long long)(a), #b,             \
              (unsigned long long)(b))

#define OK(call) CHECK_EQ((call), MARCONI_STATUS_OK)

/* A configuration refused: `field` set to `bad` makes `call` return
 * `status`; then `field` is set to `good` for the next check. */
#define CHECK_WITH(field, bad, good, call, status)                             \
  do {                                                                         \
    (field) = (bad);                                                           \
    check_eq_at(__FILE__, __LINE__, #call " with " #field " = " #bad,          \
                (unsigned long long)(call), #status,                           \
                (unsigned long long)(status));                                 \
    (field) = (good);                                                          \
  } while (0)

/* Zeroes a versioned output struct (stats, plans) and sets its
 * struct_size, as the call that fills it wants. */
#define VERSIONED(s) (memset(&(s), 0, sizeof(s)), (s).struct_size = (uint32_t)sizeof(s))

/* Defines `static TYPE NAME(const HANDLE *h)`: a versioned TYPE filled by
 * GETTER(h, &out), the call checked. */
#define STATS_OF(NAME, TYPE, HANDLE, GETTER)                                   \
  static TYPE NAME(const HANDLE *h_) {                                         \
    TYPE s_;                                                                   \
    VERSIONED(s_);                                                             \
    OK(GETTER(h_, &s_));                                                       \
    return s_;                                                                 \
  }

/* The _init contract of a versioned configuration: NULL and a struct_size
 * below the first version's refused, then `cfg` initialised with its
 * struct_size set. */
#define CHECK_CONFIG_INIT(INIT, cfg)                                           \
  do {                                                                         \
    CHECK_EQ(INIT(NULL, sizeof(cfg)), MARCONI_STATUS_NULL_ARGUMENT);           \
    CHECK_EQ(INIT(&(cfg), 8), MARCONI_STATUS_UNSUPPORTED_STRUCT_SIZE);         \
    OK(INIT(&(cfg), sizeof(cfg)));                                             \
    CHECK_EQ((cfg).struct_size, sizeof(cfg));                                  \
  } while (0)

/* A pool configuration: the defaults, then backend, migration, budget,
 * unit sizes and split. */
static inline marconi_pool_config pool_config(uint32_t backend, uint32_t migration,
                                              uint64_t budget_bytes, uint64_t kv_page_bytes,
                                              uint64_t state_slot_bytes, double state_fraction) {
  marconi_pool_config cfg;
  OK(marconi_pool_config_init(&cfg, sizeof cfg));
  cfg.backend = backend;
  cfg.migration = migration;
  cfg.budget_bytes = budget_bytes;
  cfg.kv_page_bytes = kv_page_bytes;
  cfg.state_slot_bytes = state_slot_bytes;
  cfg.state_fraction = state_fraction;
  return cfg;
}

/* marconi_pool_new, checked: the pool (NULL after a failed check). */
static inline marconi_pool *pool_from(const marconi_pool_config *cfg) {
  marconi_pool *pool = NULL;
  OK(marconi_pool_new(cfg, &pool));
  CHECK(pool != NULL);
  return pool;
}

/* A plan request for `preset` at `page_size` tokens a page and a budget;
 * the other fields at their defaults. */
static inline marconi_plan_request plan_request(const char *preset, uint32_t page_size,
                                                uint64_t budget_bytes) {
  marconi_plan_request req;
  OK(marconi_plan_request_init(&req, sizeof req));
  req.model_preset = preset;
  req.page_size = page_size;
  req.budget_bytes = budget_bytes;
  return req;
}

/* marconi_plan of a request, checked. */
static inline marconi_memory_plan plan_of(const marconi_plan_request *req) {
  marconi_memory_plan p;
  VERSIONED(p);
  OK(marconi_plan(req, &p));
  return p;
}

/* The default cache configuration of the model `preset` at `page_size`
 * tokens a page. */
static inline marconi_cache_config cache_config(const char *preset, uint32_t page_size) {
  marconi_cache_config cc;
  OK(marconi_cache_config_init(&cc, sizeof cc));
  cc.model_preset = preset;
  cc.page_size = page_size;
  return cc;
}

/* A cache over pools (marconi_cache_config.pools) of `backend`: the
 * policy with a fixed alpha of 1, the model's unit sizes, and the pools'
 * budget, migration and split; NULL after a failed check. */
static inline marconi_cache *new_pooled_cache(const char *preset, uint32_t page_size,
                                              uint32_t backend, uint64_t budget_bytes,
                                              uint32_t migration, double state_fraction) {
  marconi_cache_config cc = cache_config(preset, page_size);
  cc.alpha_mode = MARCONI_ALPHA_MODE_FIXED;
  cc.alpha = 1.0;
  marconi_pool_config pc = pool_config(backend, migration, budget_bytes, 0, 0, state_fraction);
  cc.pools = &pc;
  marconi_cache *c = NULL;
  OK(marconi_cache_new(&cc, &c));
  CHECK(c != NULL);
  return c;
}

/* After marconi_cache_admit_pooled: frees, checked, the caller's units the
 * cache did not take (the reserved pages kv_pages[n_hit..n_kv_pages)
 * outside r's taken range, the slots of states[i] with taken[i] 0); writes
 * their handles to mine[0..n_kv_pages + n_states] and returns their number. */
static inline size_t free_untaken(const marconi_cache *c, const uint64_t *kv_pages, size_t n_hit,
                                  size_t n_kv_pages, const marconi_admit_result *r,
                                  const marconi_pooled_state *states, size_t n_states,
                                  const uint8_t *taken, uint64_t *mine) {
  size_t n_mine = 0;
  for (size_t i = n_hit; i < n_kv_pages; i++)
    if (i < r->kv_pages_taken_start || i >= r->kv_pages_taken_end) mine[n_mine++] = kv_pages[i];
  for (size_t i = 0; i < n_states; i++)
    if (!taken[i]) mine[n_mine++] = states[i].state_handle;
  OK(marconi_cache_free_units(c, mine, n_mine));
  return n_mine;
}

/* The end of a cache's life in a test: its invariants hold, then it is
 * freed. */
static inline void check_and_free(marconi_cache *cache) {
  OK(marconi_cache_check(cache));
  marconi_cache_free(cache);
}

/* The end of a test's main: the pass line, or the number of failed checks;
 * the exit status. */
static inline int check_summary(const char *test) {
  if (failures) {
    fprintf(stderr, "%s: %d check(s) failed\n", test, failures);
    return 1;
  }
  printf("%s: all checks passed (libmarconi %s)\n", test, marconi_version());
  return 0;
}

/* Writes byte `v` over the whole unit behind handle `h` (host or device
 * memory, per backend). */
typedef void (*unit_fill_fn)(const marconi_pool *pool, uint64_t h, unsigned char v);
/* 1 when every byte of the unit behind `h` is `v`. */
typedef int (*unit_holds_fn)(const marconi_pool *pool, uint64_t h, unsigned char v);

/* Snapshot copy / fork / promote over eight state slots `st` of `pool`,
 * checked byte for byte through `fill` and `holds`: every backend passes
 * these. Leaves st[1] holding 0x11 and st[0] 0x55 after a refused batch;
 * the handles stay allocated. */
static inline void check_pool_snapshots(const marconi_pool *pool, const uint64_t st[8],
                                        unit_fill_fn fill, unit_holds_fn holds) {
  for (int i = 0; i < 8; i++) fill(pool, st[i], (unsigned char)(i + 1));
  marconi_state_copy pairs[2] = {{st[0], st[1]}, {st[2], st[3]}};
  OK(marconi_pool_copy_states(pool, pairs, 2));
  CHECK(holds(pool, st[1], 1));
  CHECK(holds(pool, st[3], 3));
  CHECK(holds(pool, st[0], 1));
  CHECK(holds(pool, st[2], 3));
  uint64_t dsts[3] = {st[4], st[5], st[6]};
  OK(marconi_pool_fork_state(pool, st[7], dsts, 3));
  for (int i = 4; i < 7; i++) CHECK(holds(pool, st[i], 8));
  /* Promote COPY_INTO: candidate 1 (st[5], after a change) into st[0]. */
  fill(pool, st[5], 0x55);
  uint64_t now = 0;
  OK(marconi_pool_promote_state(pool, st[0], dsts, 3, 1, MARCONI_PROMOTE_MODE_COPY_INTO, &now));
  CHECK_EQ(now, st[0]);
  CHECK(holds(pool, st[0], 0x55));
  /* SWAP: no bytes move, the candidate's handle is the state now. */
  OK(marconi_pool_promote_state(pool, st[0], dsts, 3, 2, MARCONI_PROMOTE_MODE_SWAP, &now));
  CHECK_EQ(now, st[6]);
  CHECK(holds(pool, st[0], 0x55));
  /* A batch refused whole moves nothing. */
  fill(pool, st[1], 0x11);
  marconi_state_copy chain[2] = {{st[0], st[1]}, {st[1], st[2]}};
  CHECK_EQ(marconi_pool_copy_states(pool, chain, 2), MARCONI_STATUS_INVALID_ARGUMENT);
  CHECK(holds(pool, st[1], 0x11));
}

/* Writes byte `v` over the first `n` bytes of the unit at `loc` (host or
 * device memory, per backend); 0 when it did. */
typedef int (*unit_write_fn)(const marconi_unit_location *loc, unsigned char v, size_t n);
/* Prepares a new thread for the backend (a CUDA context current); 0 when
 * it did. */
typedef int (*thread_setup_fn)(void);

typedef struct {
  const marconi_pool *pool;
  int rounds;
  unit_write_fn write;
  thread_setup_fn setup;
  int refused; /* allocations refused: the pool was full, allowed */
  int failed;  /* a live handle that did not resolve, write or free */
} pool_worker;

static inline void *pool_worker_main(void *p) {
  pool_worker *w = p;
  if (w->setup && w->setup() != 0) {
    w->failed++;
    return NULL;
  }
  uint64_t h[6];
  for (int r = 0; r < w->rounds; r++) {
    uint32_t kind = (uint32_t)(r % 2);
    if (marconi_pool_allocate(w->pool, kind, 6, h, 6) != MARCONI_STATUS_OK) {
      w->refused++;
      continue;
    }
    marconi_unit_location l[6];
    if (marconi_pool_resolve(w->pool, h, 6, l, 6) != MARCONI_STATUS_OK) {
      w->failed++;
    } else {
      for (int i = 0; i < 6; i++)
        if (w->write(&l[i], (unsigned char)(r & 0xff), 256) != 0) w->failed++;
    }
    if (marconi_pool_free_units(w->pool, h, 6) != MARCONI_STATUS_OK) w->failed++;
  }
  return NULL;
}

/* Four threads share `pool`, each allocating, resolving, writing and
 * freeing six units `rounds` times: no live handle fails, and afterwards
 * every unit is free and physical bytes are within the budget. */
static inline void check_pool_threads(const marconi_pool *pool, int rounds, unit_write_fn write,
                                      thread_setup_fn setup) {
  pthread_t t[4];
  pool_worker w[4];
  for (int i = 0; i < 4; i++) {
    w[i] = (pool_worker){pool, rounds, write, setup, 0, 0};
    CHECK_EQ(pthread_create(&t[i], NULL, pool_worker_main, &w[i]), 0);
  }
  for (int i = 0; i < 4; i++) {
    pthread_join(t[i], NULL);
    CHECK_EQ(w[i].failed, 0);
  }
  marconi_pool_stats s;
  VERSIONED(s);
  OK(marconi_pool_get_stats(pool, &s));
  CHECK_EQ(s.kv_free, s.kv_capacity);
  CHECK_EQ(s.state_free, s.state_capacity);
  CHECK(s.physical_bytes <= s.budget_bytes);
}

#endif
