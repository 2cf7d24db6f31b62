/*
 * C tests of the pool and snapshot API of include/marconi.h: memfd pools
 * (allocate, resolve to addresses that hold what is written there, free,
 * AVMP migration, physical bytes within the budget), snapshot copy / fork /
 * promote over a pool's state slots and over a caller's buffer, several
 * threads sharing a pool, and misuse (each refused with its status and
 * leaving the pool unchanged). Built by ci/test.d/c.sh with
 * -fsanitize=address,undefined.
 */
#include "marconi.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

#define MIB (1024ull * 1024ull)

STATS_OF(stats_of, marconi_pool_stats, marconi_pool, marconi_pool_get_stats)

static marconi_pool *new_pool(uint32_t backend, uint32_t migration, double fraction) {
  marconi_pool_config cfg = pool_config(backend, migration, 16 * MIB, 64 * 1024, 128 * 1024, fraction);
  cfg.chunk_bytes = 1 * MIB;
  cfg.migration_batch_units = 8;
  return pool_from(&cfg);
}

static void test_config_misuse(void) {
  marconi_pool_config cfg;
  CHECK_CONFIG_INIT(marconi_pool_config_init, cfg);
  CHECK_EQ(cfg.backend, MARCONI_POOL_BACKEND_MEMFD);
  CHECK_EQ(cfg.migration, MARCONI_POOL_MIGRATION_AVMP);
  marconi_pool *pool = (marconi_pool *)0x1;
  /* Budget, unit sizes unset: a configuration error, and *out untouched. */
  CHECK_EQ(marconi_pool_new(&cfg, &pool), MARCONI_STATUS_INVALID_CONFIG);
  CHECK(pool == (marconi_pool *)0x1);
  CHECK_EQ(marconi_pool_new(NULL, &pool), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_pool_new(&cfg, NULL), MARCONI_STATUS_NULL_ARGUMENT);
  cfg.budget_bytes = 16 * MIB;
  cfg.kv_page_bytes = 4096;
#define REFUSED(field, bad, good)                                              \
  CHECK_WITH(field, bad, good, marconi_pool_new(&cfg, &pool), MARCONI_STATUS_INVALID_CONFIG)
  REFUSED(cfg.state_slot_bytes, 0, 8192);
  REFUSED(cfg.state_fraction, 0.0, 0.5);
  REFUSED(cfg.backend, 7, MARCONI_POOL_BACKEND_MEMFD);
  REFUSED(cfg.budget_bytes, 3 * MIB, 16 * MIB); /* one chunk of 2 MiB: no room for two pools */
  REFUSED(cfg.chunk_bytes, 1000, 0);            /* not a multiple of the OS page size */
  REFUSED(cfg.reserved, 1, 0);
#undef REFUSED
  /* No GPU here (CI) or no `cuda` feature: a status, never a crash. */
  cfg.backend = MARCONI_POOL_BACKEND_CUDA;
  marconi_status st = marconi_pool_new(&cfg, &pool);
  if (st == MARCONI_STATUS_OK) {
    marconi_pool_free(pool);
  } else {
    CHECK_EQ(st, MARCONI_STATUS_UNSUPPORTED);
  }
  CHECK(pool == (marconi_pool *)0x1);
  /* A newer caller's struct with unknown non-zero bytes is refused. */
  struct {
    marconi_pool_config c;
    uint64_t future;
  } big;
  OK(marconi_pool_config_init(&big.c, sizeof big));
  CHECK_EQ(big.future, 0);
  big.c.budget_bytes = 16 * MIB;
  big.c.kv_page_bytes = 4096;
  big.c.state_slot_bytes = 8192;
  big.future = 1;
  CHECK_EQ(marconi_pool_new(&big.c, &pool), MARCONI_STATUS_UNSUPPORTED_STRUCT_SIZE);
  big.future = 0;
  OK(marconi_pool_new(&big.c, &pool));
  marconi_pool_free(pool);
  marconi_pool_free(NULL);
}

static void test_memfd_allocate_resolve_free(void) {
  marconi_pool *pool = new_pool(MARCONI_POOL_BACKEND_MEMFD, MARCONI_POOL_MIGRATION_STATIC, 0.25);
  marconi_pool_stats s = stats_of(pool);
  CHECK_EQ(s.backend, MARCONI_POOL_BACKEND_MEMFD);
  CHECK_EQ(s.budget_bytes, 16 * MIB);
  CHECK_EQ(s.budget_chunks, 16);
  /* 4 MiB of state slots of 128 KiB: 32; 12 MiB of KV pages of 64 KiB: 192. */
  CHECK_EQ(s.state_capacity, 32);
  CHECK_EQ(s.kv_capacity, 192);
  CHECK(s.mapped_chunks <= s.budget_chunks);
  CHECK_EQ(s.physical_bytes, 0); /* nothing written yet */

  uint64_t kv[16];
  OK(marconi_pool_allocate(pool, MARCONI_POOL_KIND_KV, 16, kv, 16));
  marconi_unit_location loc[16];
  OK(marconi_pool_resolve(pool, kv, 16, loc, 16));
  for (int i = 0; i < 16; i++) {
    CHECK(kv[i] != 0);
    CHECK_EQ(loc[i].kind, MARCONI_POOL_KIND_KV);
    CHECK_EQ(loc[i].unit_bytes, 64 * 1024);
    CHECK_EQ(loc[i].byte_offset, (uint64_t)loc[i].index * 64 * 1024);
    CHECK(loc[i].address != 0);
    memset((void *)(uintptr_t)loc[i].address, 0x40 + i, 64 * 1024);
  }
  for (int i = 0; i < 16; i++) {
    const unsigned char *p = (const unsigned char *)(uintptr_t)loc[i].address;
    CHECK_EQ(p[0], 0x40 + i);
    CHECK_EQ(p[64 * 1024 - 1], 0x40 + i);
  }
  s = stats_of(pool);
  CHECK_EQ(s.kv_free, 192 - 16);
  CHECK(s.physical_bytes >= 16 * 64 * 1024);
  CHECK(s.physical_bytes <= s.budget_bytes);

  /* Misuse, each refused and changing nothing. */
  uint64_t out[4] = {0, 0, 0, 0};
  CHECK_EQ(marconi_pool_allocate(pool, MARCONI_POOL_KIND_KV, 4, out, 3), MARCONI_STATUS_BUFFER_TOO_SMALL);
  CHECK_EQ(marconi_pool_allocate(pool, MARCONI_POOL_KIND_KV, 4, NULL, 4), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_pool_allocate(pool, 5, 1, out, 4), MARCONI_STATUS_INVALID_ARGUMENT);
  CHECK_EQ(marconi_pool_allocate(NULL, MARCONI_POOL_KIND_KV, 1, out, 4), MARCONI_STATUS_NULL_ARGUMENT);
  OK(marconi_pool_allocate(pool, MARCONI_POOL_KIND_KV, 0, NULL, 0));
  CHECK_EQ(out[0], 0);
  /* More than the pool holds (static split): all or nothing. */
  uint64_t *many = malloc(200 * sizeof *many);
  CHECK_EQ(marconi_pool_allocate(pool, MARCONI_POOL_KIND_KV, 200, many, 200), MARCONI_STATUS_OUT_OF_MEMORY);
  CHECK_EQ(stats_of(pool).kv_free, 192 - 16);
  free(many);
  uint64_t zero = 0;
  CHECK_EQ(marconi_pool_resolve(pool, &zero, 1, loc, 16), MARCONI_STATUS_UNKNOWN_HANDLE);
  CHECK_EQ(marconi_pool_resolve(pool, kv, 16, loc, 15), MARCONI_STATUS_BUFFER_TOO_SMALL);
  CHECK_EQ(marconi_pool_resolve(pool, NULL, 2, loc, 16), MARCONI_STATUS_NULL_ARGUMENT);
  /* A list naming one handle twice frees nothing. */
  uint64_t twice[3] = {kv[0], kv[1], kv[0]};
  CHECK_EQ(marconi_pool_free_units(pool, twice, 3), MARCONI_STATUS_DOUBLE_FREE);
  CHECK_EQ(stats_of(pool).kv_free, 192 - 16);
  /* A made-up handle in the list frees nothing. */
  uint64_t bad[2] = {kv[2], 0x7fffff00u};
  CHECK_EQ(marconi_pool_free_units(pool, bad, 2), MARCONI_STATUS_UNKNOWN_HANDLE);
  OK(marconi_pool_resolve(pool, &kv[2], 1, loc, 1));

  OK(marconi_pool_free_units(pool, kv, 8));
  CHECK_EQ(stats_of(pool).kv_free, 192 - 8);
  /* Double free, use after free: statuses. */
  CHECK_EQ(marconi_pool_free_units(pool, kv, 1), MARCONI_STATUS_DOUBLE_FREE);
  CHECK_EQ(marconi_pool_resolve(pool, kv, 1, loc, 1), MARCONI_STATUS_DOUBLE_FREE);
  /* A freed handle whose unit was reused is stale, never the new owner's. */
  uint64_t again[8];
  OK(marconi_pool_allocate(pool, MARCONI_POOL_KIND_KV, 8, again, 8));
  for (int i = 0; i < 8; i++) {
    marconi_status st = marconi_pool_resolve(pool, &kv[i], 1, loc, 1);
    CHECK(st == MARCONI_STATUS_UNKNOWN_HANDLE || st == MARCONI_STATUS_DOUBLE_FREE);
    for (int j = 0; j < 8; j++) CHECK(kv[i] != again[j]);
  }
  OK(marconi_pool_free_units(pool, again, 8));
  OK(marconi_pool_free_units(pool, kv + 8, 8));
  s = stats_of(pool);
  CHECK_EQ(s.kv_free, 192);
  CHECK_EQ(s.migrations, 0);
  /* A static pool does not migrate. */
  CHECK_EQ(marconi_pool_migrate(pool, MARCONI_POOL_KIND_STATE, 0, NULL), MARCONI_STATUS_UNSUPPORTED);
  /* Stats: too small a struct_size, and an older (shorter) caller. */
  marconi_pool_stats small;
  memset(&small, 0xAB, sizeof small);
  small.struct_size = 8;
  CHECK_EQ(marconi_pool_get_stats(pool, &small), MARCONI_STATUS_UNSUPPORTED_STRUCT_SIZE);
  small.struct_size = 16;
  OK(marconi_pool_get_stats(pool, &small));
  CHECK_EQ(small.budget_bytes, 16 * MIB);
  CHECK_EQ(small.kv_unit_bytes, 0xABABABABABABABABull); /* past struct_size: untouched */
  marconi_pool_free(pool);
}

static void test_memfd_avmp_migration(void) {
  marconi_pool *pool = new_pool(MARCONI_POOL_BACKEND_MEMFD, MARCONI_POOL_MIGRATION_AVMP, 0.5);
  marconi_pool_stats s = stats_of(pool);
  CHECK_EQ(s.kv_capacity, 128);   /* 8 MiB / 64 KiB */
  CHECK_EQ(s.state_capacity, 64); /* 8 MiB / 128 KiB */
  /* Fill the KV pool, then ask for more: capacity moves from the state pool. */
  uint64_t *kv = malloc(160 * sizeof *kv);
  OK(marconi_pool_allocate(pool, MARCONI_POOL_KIND_KV, 128, kv, 128));
  OK(marconi_pool_allocate(pool, MARCONI_POOL_KIND_KV, 8, kv + 128, 8));
  s = stats_of(pool);
  CHECK_EQ(s.migrations, 1);
  /* A batch of 8 state slots (1 MiB, one chunk) became 16 KV pages. */
  CHECK_EQ(s.state_capacity, 56);
  CHECK_EQ(s.kv_capacity, 144);
  CHECK(s.kv_capacity > 128);
  CHECK(s.mapped_chunks <= s.budget_chunks);
  /* Every page written: physical memory within the budget all the same. */
  marconi_unit_location *loc = malloc(136 * sizeof *loc);
  OK(marconi_pool_resolve(pool, kv, 136, loc, 136));
  for (int i = 0; i < 136; i++) memset((void *)(uintptr_t)loc[i].address, i & 0xff, 64 * 1024);
  s = stats_of(pool);
  CHECK(s.physical_bytes <= s.budget_bytes);
  CHECK(s.physical_bytes >= 136ull * 64 * 1024);
  /* Explicit migration back toward the state pool is refused while the KV
   * tail is in use, and changes nothing. */
  marconi_migration m;
  CHECK_EQ(marconi_pool_migrate(pool, MARCONI_POOL_KIND_STATE, 8, &m), MARCONI_STATUS_OUT_OF_MEMORY);
  CHECK_EQ(stats_of(pool).kv_capacity, s.kv_capacity);
  OK(marconi_pool_free_units(pool, kv, 136));
  OK(marconi_pool_migrate(pool, MARCONI_POOL_KIND_STATE, 16, &m));
  CHECK_EQ(m.donor, MARCONI_POOL_KIND_KV);
  CHECK_EQ(m.donor_units, 16);
  CHECK_EQ(m.donor_bytes, 16 * 64 * 1024);
  CHECK_EQ(m.recipient_units, 8); /* 1 MiB / 128 KiB */
  s = stats_of(pool);
  CHECK_EQ(s.migrations, 2);
  CHECK(s.mapped_chunks <= s.budget_chunks);
  CHECK(s.physical_bytes <= s.budget_bytes);
  CHECK_EQ(marconi_pool_migrate(pool, 3, 0, &m), MARCONI_STATUS_INVALID_ARGUMENT);
  free(loc);
  free(kv);
  marconi_pool_free(pool);
}

static void fill(const marconi_pool *pool, uint64_t h, unsigned char v) {
  marconi_unit_location l;
  OK(marconi_pool_resolve(pool, &h, 1, &l, 1));
  memset((void *)(uintptr_t)l.address, v, (size_t)l.unit_bytes);
}

static int holds(const marconi_pool *pool, uint64_t h, unsigned char v) {
  marconi_unit_location l;
  if (marconi_pool_resolve(pool, &h, 1, &l, 1) != MARCONI_STATUS_OK) return 0;
  const unsigned char *p = (const unsigned char *)(uintptr_t)l.address;
  for (uint64_t i = 0; i < l.unit_bytes; i++)
    if (p[i] != v) return 0;
  return 1;
}

static void test_pool_snapshots(void) {
  marconi_pool *pool = new_pool(MARCONI_POOL_BACKEND_MEMFD, MARCONI_POOL_MIGRATION_AVMP, 0.5);
  uint64_t st[8];
  OK(marconi_pool_allocate(pool, MARCONI_POOL_KIND_STATE, 8, st, 8));
  check_pool_snapshots(pool, st, fill, holds);

  /* More bad batches, each refused whole: nothing copied (st[1] keeps the
   * 0x11 check_pool_snapshots left there). */
  marconi_state_copy dup[2] = {{st[0], st[1]}, {st[2], st[1]}};
  CHECK_EQ(marconi_pool_copy_states(pool, dup, 2), MARCONI_STATUS_INVALID_ARGUMENT);
  marconi_state_copy self[1] = {{st[3], st[3]}};
  CHECK_EQ(marconi_pool_copy_states(pool, self, 1), MARCONI_STATUS_INVALID_ARGUMENT);
  CHECK(holds(pool, st[1], 0x11));
  uint64_t dsts[3] = {st[4], st[5], st[6]};
  uint64_t now = 0;
  uint64_t kv;
  OK(marconi_pool_allocate(pool, MARCONI_POOL_KIND_KV, 1, &kv, 1));
  marconi_state_copy wrong_kind[1] = {{kv, st[1]}};
  CHECK_EQ(marconi_pool_copy_states(pool, wrong_kind, 1), MARCONI_STATUS_UNKNOWN_HANDLE);
  CHECK_EQ(marconi_pool_fork_state(pool, st[0], NULL, 2), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_pool_promote_state(pool, st[0], dsts, 3, 3, MARCONI_PROMOTE_MODE_SWAP, &now),
           MARCONI_STATUS_INVALID_ARGUMENT);
  CHECK_EQ(marconi_pool_promote_state(pool, st[0], dsts, 3, 0, 9, &now), MARCONI_STATUS_INVALID_ARGUMENT);
  CHECK_EQ(marconi_pool_promote_state(pool, st[0], dsts, 3, 0, 0, NULL), MARCONI_STATUS_NULL_ARGUMENT);
  /* A freed state handle is refused. */
  OK(marconi_pool_free_units(pool, &st[7], 1));
  marconi_state_copy freed[1] = {{st[7], st[1]}};
  CHECK_EQ(marconi_pool_copy_states(pool, freed, 1), MARCONI_STATUS_DOUBLE_FREE);
  CHECK(holds(pool, st[1], 0x11));
  OK(marconi_pool_copy_states(pool, NULL, 0));
  OK(marconi_pool_free_units(pool, st, 7));
  OK(marconi_pool_free_units(pool, &kv, 1));
  marconi_pool_free(pool);

  /* A pool without memory gives offsets, and no copies. */
  pool = new_pool(MARCONI_POOL_BACKEND_NONE, MARCONI_POOL_MIGRATION_AVMP, 0.5);
  OK(marconi_pool_allocate(pool, MARCONI_POOL_KIND_STATE, 2, st, 8));
  marconi_unit_location l[2];
  OK(marconi_pool_resolve(pool, st, 2, l, 2));
  CHECK_EQ(l[0].address, 0);
  CHECK_EQ(l[1].byte_offset, (uint64_t)l[1].index * 128 * 1024);
  marconi_state_copy one[1] = {{st[0], st[1]}};
  CHECK_EQ(marconi_pool_copy_states(pool, one, 1), MARCONI_STATUS_UNSUPPORTED);
  CHECK_EQ(stats_of(pool).physical_bytes, 0);
  marconi_pool_free(pool);
}

static void test_caller_buffer_snapshots(void) {
  enum { LAYERS = 3, SLOTS = 8, BYTES = 40 };
  unsigned char *mem = malloc(LAYERS * SLOTS * BYTES);
  for (int l = 0; l < LAYERS; l++)
    for (int s = 0; s < SLOTS; s++) memset(mem + (l * SLOTS + s) * BYTES, 16 * l + s, BYTES);
  marconi_state_buffer buf = {mem, BYTES, SLOTS, LAYERS};
  marconi_copy_order pairs[2] = {{0, 5}, {1, 6}};
  OK(marconi_snapshot_copy(&buf, pairs, 2));
  for (int l = 0; l < LAYERS; l++) {
    CHECK_EQ(mem[(l * SLOTS + 5) * BYTES + BYTES - 1], 16 * l + 0);
    CHECK_EQ(mem[(l * SLOTS + 6) * BYTES], 16 * l + 1);
    CHECK_EQ(mem[(l * SLOTS + 7) * BYTES], 16 * l + 7);
  }
  uint32_t dsts[2] = {2, 3};
  OK(marconi_snapshot_fork(&buf, 7, dsts, 2));
  for (int l = 0; l < LAYERS; l++) {
    CHECK_EQ(mem[(l * SLOTS + 2) * BYTES], 16 * l + 7);
    CHECK_EQ(mem[(l * SLOTS + 3) * BYTES + 7], 16 * l + 7);
  }
  uint32_t slot = 99;
  uint32_t cands[2] = {4, 6};
  OK(marconi_snapshot_promote(&buf, 0, cands, 2, 1, MARCONI_PROMOTE_MODE_COPY_INTO, &slot));
  CHECK_EQ(slot, 0);
  CHECK_EQ(mem[0], 1); /* slot 6 held slot 1's state */
  OK(marconi_snapshot_promote(&buf, 0, cands, 2, 0, MARCONI_PROMOTE_MODE_SWAP, &slot));
  CHECK_EQ(slot, 4);
  /* Misuse. */
  marconi_copy_order out_of_range[1] = {{0, SLOTS}};
  CHECK_EQ(marconi_snapshot_copy(&buf, out_of_range, 1), MARCONI_STATUS_INVALID_ARGUMENT);
  CHECK_EQ(marconi_snapshot_copy(&buf, NULL, 1), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_snapshot_copy(NULL, pairs, 1), MARCONI_STATUS_NULL_ARGUMENT);
  uint32_t dup[2] = {2, 2};
  CHECK_EQ(marconi_snapshot_fork(&buf, 7, dup, 2), MARCONI_STATUS_INVALID_ARGUMENT);
  CHECK_EQ(marconi_snapshot_promote(&buf, 4, cands, 2, 0, MARCONI_PROMOTE_MODE_SWAP, &slot),
           MARCONI_STATUS_INVALID_ARGUMENT);
  marconi_state_buffer empty = {mem, BYTES, 0, LAYERS};
  CHECK_EQ(marconi_snapshot_copy(&empty, pairs, 2), MARCONI_STATUS_INVALID_ARGUMENT);
  marconi_state_buffer nobase = {NULL, BYTES, SLOTS, LAYERS};
  CHECK_EQ(marconi_snapshot_copy(&nobase, pairs, 2), MARCONI_STATUS_NULL_ARGUMENT);
  marconi_state_buffer huge = {mem, SIZE_MAX / 2, SLOTS, LAYERS};
  CHECK_EQ(marconi_snapshot_copy(&huge, pairs, 2), MARCONI_STATUS_INVALID_ARGUMENT);
  free(mem);
}

/* Host memory: a memset. */
static int write_host(const marconi_unit_location *loc, unsigned char v, size_t n) {
  memset((void *)(uintptr_t)loc->address, v, n);
  return 0;
}

/* Two live pools never accept each other's handles, whatever their values,
 * and a unit larger than the budget is refused. */
static void test_two_pools(void) {
  marconi_pool *a = new_pool(MARCONI_POOL_BACKEND_MEMFD, MARCONI_POOL_MIGRATION_AVMP, 0.5);
  marconi_pool *b = new_pool(MARCONI_POOL_BACKEND_MEMFD, MARCONI_POOL_MIGRATION_AVMP, 0.5);
  uint64_t ha[4], hb[4];
  OK(marconi_pool_allocate(a, MARCONI_POOL_KIND_KV, 4, ha, 4));
  OK(marconi_pool_allocate(b, MARCONI_POOL_KIND_KV, 4, hb, 4));
  marconi_unit_location l;
  for (int i = 0; i < 4; i++) {
    CHECK(ha[i] != hb[i]);
    fill(a, ha[i], 0xA0);
    CHECK_EQ(marconi_pool_resolve(b, &ha[i], 1, &l, 1), MARCONI_STATUS_UNKNOWN_HANDLE);
    CHECK_EQ(marconi_pool_free_units(b, &ha[i], 1), MARCONI_STATUS_UNKNOWN_HANDLE);
  }
  CHECK_EQ(stats_of(b).kv_free, stats_of(b).kv_capacity - 4);
  for (int i = 0; i < 4; i++) CHECK(holds(a, ha[i], 0xA0));
  OK(marconi_pool_free_units(a, ha, 4));
  OK(marconi_pool_free_units(b, hb, 4));
  marconi_pool_free(a);
  marconi_pool_free(b);

  marconi_pool_config c;
  OK(marconi_pool_config_init(&c, sizeof c));
  c.backend = MARCONI_POOL_BACKEND_NONE;
  c.budget_bytes = 1 << 20;
  c.kv_page_bytes = UINT64_MAX;
  c.state_slot_bytes = 4096;
  marconi_pool *none = (marconi_pool *)0x1;
  CHECK_EQ(marconi_pool_new(&c, &none), MARCONI_STATUS_INVALID_CONFIG);
  CHECK(none == (marconi_pool *)0x1);
}

static void test_threads(void) {
  marconi_pool *pool = new_pool(MARCONI_POOL_BACKEND_MEMFD, MARCONI_POOL_MIGRATION_AVMP, 0.5);
  check_pool_threads(pool, 300, write_host, NULL);
  marconi_pool_free(pool);
}

int main(void) {
  test_config_misuse();
  test_memfd_allocate_resolve_free();
  test_memfd_avmp_migration();
  test_pool_snapshots();
  test_caller_buffer_snapshots();
  test_two_pools();
  test_threads();
  return check_summary("test_pool");
}
