/*
 * The checks every C test of include/marconi.h uses: a failed check prints
 * where it failed, the values and libmarconi's last error, and counts; the
 * test's main ends with check_summary, which returns non-zero when
 * `failures` is not 0. Also the helpers the tests share: versioned output
 * structs (VERSIONED, STATS_OF), configuration refusals (CHECK_WITH), and
 * the snapshot checks every pool backend passes (check_pool_snapshots).
 * Included once per test program (each test is its own executable).
 */
#ifndef MARCONI_TEST_CHECK_H
#define MARCONI_TEST_CHECK_H

#include "marconi.h"

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

#endif
