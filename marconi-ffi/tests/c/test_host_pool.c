/*
 * C tests of the host tier memory API of include/marconi.h: a host pool
 * (allocate, resolve to host addresses, free, stats), demote and promote
 * between a memfd device pool's handles and the host pool's (bytes arrive
 * byte for byte, both ways), and misuse, each refused with its status and
 * nothing copied or freed: NULL pointers, a device handle given to the host
 * pool and the reverse, stale handles, a page into a state slot, a
 * destination twice, units of other sizes, a NONE device pool. Built by
 * ci/test.d/host-tier.sh with -fsanitize=address,undefined.
 */
#include "marconi.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

#define MIB (1024ull * 1024ull)
#define PAGE (16u * 1024u)
#define STATE (64u * 1024u)

static marconi_pool *device_pool(uint32_t backend, uint64_t page) {
  marconi_pool_config cfg =
      pool_config(backend, MARCONI_POOL_MIGRATION_STATIC, 8 * MIB, page, STATE, 0.5);
  return pool_from(&cfg);
}

static marconi_host_pool *host_pool(uint64_t page) {
  marconi_host_pool_config cfg;
  OK(marconi_host_pool_config_init(&cfg, sizeof cfg));
  cfg.capacity_bytes = 8 * MIB;
  cfg.page_bytes = page;
  cfg.state_bytes = STATE;
  marconi_host_pool *pool = NULL;
  OK(marconi_host_pool_new(&cfg, &pool));
  return pool;
}

STATS_OF(host_stats, marconi_host_pool_stats, marconi_host_pool, marconi_host_pool_get_stats)

static unsigned char *address_of(const marconi_unit_location *loc) {
  return (unsigned char *)(uintptr_t)loc->address;
}

static void test_config(void) {
  marconi_host_pool_config cfg;
  CHECK_CONFIG_INIT(marconi_host_pool_config_init, cfg);
  CHECK(cfg.state_fraction == 0.5);
  marconi_host_pool *p = (marconi_host_pool *)0x1;
  CHECK_EQ(marconi_host_pool_new(&cfg, &p), MARCONI_STATUS_INVALID_CONFIG);
  CHECK(p == (marconi_host_pool *)0x1);
  CHECK_EQ(marconi_host_pool_new(NULL, &p), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_host_pool_new(&cfg, NULL), MARCONI_STATUS_NULL_ARGUMENT);
  cfg.capacity_bytes = 3 * MIB; /* one 2 MiB chunk: no room for both kinds */
  cfg.page_bytes = PAGE;
  cfg.state_bytes = STATE;
  CHECK_EQ(marconi_host_pool_new(&cfg, &p), MARCONI_STATUS_INVALID_CONFIG);
  cfg.capacity_bytes = 8 * MIB;
#define REFUSED(field, bad, good)                                              \
  CHECK_WITH(field, bad, good, marconi_host_pool_new(&cfg, &p), MARCONI_STATUS_INVALID_CONFIG)
  REFUSED(cfg.reserved, 1, 0);
  REFUSED(cfg.state_fraction, 1.0, 0.5);
  REFUSED(cfg.chunk_bytes, 1000, 0); /* not a multiple of the OS page size */
#undef REFUSED
  cfg.state_fraction = 0.25;
  OK(marconi_host_pool_new(&cfg, &p));
  marconi_host_pool_stats s = host_stats(p);
  CHECK_EQ(s.capacity_bytes, 8 * MIB);
  CHECK_EQ(s.state_capacity, 2 * MIB / STATE);
  CHECK_EQ(s.page_capacity, 6 * MIB / PAGE);
  s.struct_size = 4;
  CHECK_EQ(marconi_host_pool_get_stats(p, &s), MARCONI_STATUS_UNSUPPORTED_STRUCT_SIZE);
  CHECK_EQ(marconi_host_pool_get_stats(p, NULL), MARCONI_STATUS_NULL_ARGUMENT);
  marconi_host_pool_free(p);
  marconi_host_pool_free(NULL);
}

static void test_round_trip(void) {
  marconi_pool *dev = device_pool(MARCONI_POOL_BACKEND_MEMFD, PAGE);
  marconi_host_pool *host = host_pool(PAGE);
  uint64_t d[3], h[3];
  OK(marconi_pool_allocate(dev, MARCONI_POOL_KIND_STATE, 1, d, 1));
  OK(marconi_pool_allocate(dev, MARCONI_POOL_KIND_KV, 2, d + 1, 2));
  OK(marconi_host_pool_allocate(host, MARCONI_POOL_KIND_STATE, 1, h, 1));
  OK(marconi_host_pool_allocate(host, MARCONI_POOL_KIND_KV, 2, h + 1, 2));
  CHECK_EQ(host_stats(host).pages_live, 2);
  CHECK_EQ(host_stats(host).states_live, 1);
  marconi_unit_location dl[3], hl[3];
  OK(marconi_pool_resolve(dev, d, 3, dl, 3));
  OK(marconi_host_pool_resolve(host, h, 3, hl, 3));
  CHECK_EQ(hl[0].unit_bytes, STATE);
  CHECK_EQ(hl[0].kind, MARCONI_POOL_KIND_STATE);
  CHECK_EQ(hl[1].unit_bytes, PAGE);
  for (int i = 0; i < 3; i++) {
    for (uint64_t b = 0; b < dl[i].unit_bytes; b++) {
      address_of(&dl[i])[b] = (unsigned char)(b * 7 + (uint64_t)i * 31);
    }
  }
  marconi_unit_move down[3] = {{d[0], h[0]}, {d[1], h[1]}, {d[2], h[2]}};
  uint64_t bytes = 0;
  OK(marconi_host_pool_demote(host, dev, down, 3, &bytes));
  CHECK_EQ(bytes, STATE + 2 * PAGE);
  for (int i = 0; i < 3; i++) {
    CHECK(memcmp(address_of(&dl[i]), address_of(&hl[i]), dl[i].unit_bytes) == 0);
  }
  /* Change the host copies, promote them back (page 1 into page 2 too). */
  for (int i = 0; i < 3; i++) {
    memset(address_of(&hl[i]), 0xA0 + i, hl[i].unit_bytes);
  }
  marconi_unit_move up[3] = {{h[0], d[0]}, {h[1], d[1]}, {h[1], d[2]}};
  OK(marconi_host_pool_promote(host, dev, up, 3, NULL));
  CHECK(memcmp(address_of(&dl[0]), address_of(&hl[0]), STATE) == 0);
  CHECK(memcmp(address_of(&dl[1]), address_of(&hl[1]), PAGE) == 0);
  CHECK(memcmp(address_of(&dl[2]), address_of(&hl[1]), PAGE) == 0);
  marconi_host_pool_stats s = host_stats(host);
  CHECK_EQ(s.bytes_demoted, STATE + 2 * PAGE);
  CHECK_EQ(s.bytes_promoted, STATE + 2 * PAGE);
  CHECK_EQ(s.units_moved, 6);
  OK(marconi_host_pool_demote(host, dev, NULL, 0, &bytes));
  CHECK_EQ(bytes, 0);
  OK(marconi_host_pool_free_units(host, h, 3));
  OK(marconi_pool_free_units(dev, d, 3));
  marconi_host_pool_free(host);
  marconi_pool_free(dev);
}

static void test_misuse(void) {
  marconi_pool *dev = device_pool(MARCONI_POOL_BACKEND_MEMFD, PAGE);
  marconi_host_pool *host = host_pool(PAGE);
  uint64_t ds, dk, hs, hk[2], gone;
  OK(marconi_pool_allocate(dev, MARCONI_POOL_KIND_STATE, 1, &ds, 1));
  OK(marconi_pool_allocate(dev, MARCONI_POOL_KIND_KV, 1, &dk, 1));
  OK(marconi_host_pool_allocate(host, MARCONI_POOL_KIND_STATE, 1, &hs, 1));
  OK(marconi_host_pool_allocate(host, MARCONI_POOL_KIND_KV, 2, hk, 2));
  OK(marconi_host_pool_allocate(host, MARCONI_POOL_KIND_KV, 1, &gone, 1));
  OK(marconi_host_pool_free_units(host, &gone, 1));
  marconi_unit_location hl;
  OK(marconi_host_pool_resolve(host, &hs, 1, &hl, 1));
  memset(address_of(&hl), 0x5A, STATE);

  /* NULL arguments. */
  marconi_unit_move ok = {ds, hs};
  CHECK_EQ(marconi_host_pool_demote(NULL, dev, &ok, 1, NULL), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_host_pool_demote(host, NULL, &ok, 1, NULL), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_host_pool_demote(host, dev, NULL, 1, NULL), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_host_pool_allocate(NULL, 0, 1, hk, 1), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_host_pool_allocate(host, 0, 1, NULL, 1), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_host_pool_allocate(host, 9, 1, hk, 2), MARCONI_STATUS_INVALID_ARGUMENT);
  CHECK_EQ(marconi_host_pool_allocate(host, 0, 3, hk, 2), MARCONI_STATUS_BUFFER_TOO_SMALL);
  CHECK_EQ(marconi_host_pool_free_units(host, NULL, 1), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_host_pool_resolve(host, &hs, 1, NULL, 1), MARCONI_STATUS_NULL_ARGUMENT);

  /* Handles of the other pool, stale ones, 0. */
  CHECK_EQ(marconi_host_pool_free_units(host, &ds, 1), MARCONI_STATUS_UNKNOWN_HANDLE);
  CHECK_EQ(marconi_pool_free_units(dev, &hs, 1), MARCONI_STATUS_UNKNOWN_HANDLE);
  marconi_unit_location loc;
  CHECK_EQ(marconi_host_pool_resolve(host, &dk, 1, &loc, 1), MARCONI_STATUS_UNKNOWN_HANDLE);
  CHECK_EQ(marconi_host_pool_resolve(host, &gone, 1, &loc, 1), MARCONI_STATUS_DOUBLE_FREE);
  uint64_t zero = 0;
  CHECK_EQ(marconi_host_pool_free_units(host, &zero, 1), MARCONI_STATUS_UNKNOWN_HANDLE);
  /* All or nothing: a bad handle after a good one frees neither. */
  uint64_t mixed[2] = {hk[0], ds};
  CHECK_EQ(marconi_host_pool_free_units(host, mixed, 2), MARCONI_STATUS_UNKNOWN_HANDLE);
  uint64_t twice[2] = {hk[0], hk[0]};
  CHECK_EQ(marconi_host_pool_free_units(host, twice, 2), MARCONI_STATUS_DOUBLE_FREE);
  CHECK_EQ(host_stats(host).pages_live, 2);

  /* Bad move batches: nothing copied (the host state keeps its 0x5A). */
  marconi_unit_move swapped = {hs, ds};
  CHECK_EQ(marconi_host_pool_demote(host, dev, &swapped, 1, NULL), MARCONI_STATUS_UNKNOWN_HANDLE);
  marconi_unit_move stale[2] = {{ds, hs}, {dk, gone}};
  CHECK_EQ(marconi_host_pool_demote(host, dev, stale, 2, NULL), MARCONI_STATUS_DOUBLE_FREE);
  marconi_unit_move kinds[2] = {{ds, hs}, {dk, hs}};
  CHECK_EQ(marconi_host_pool_demote(host, dev, kinds, 2, NULL), MARCONI_STATUS_INVALID_ARGUMENT);
  marconi_unit_move cross = {dk, hs};
  CHECK_EQ(marconi_host_pool_demote(host, dev, &cross, 1, NULL), MARCONI_STATUS_INVALID_ARGUMENT);
  marconi_unit_move dup[2] = {{dk, hk[0]}, {dk, hk[0]}};
  CHECK_EQ(marconi_host_pool_demote(host, dev, dup, 2, NULL), MARCONI_STATUS_INVALID_ARGUMENT);
  unsigned char *h0 = address_of(&hl);
  int untouched = 1;
  for (unsigned b = 0; b < STATE; b++) untouched &= h0[b] == 0x5A;
  CHECK(untouched);
  CHECK_EQ(host_stats(host).units_moved, 0);

  /* Units of another size: a host pool of other pages refuses the pair. */
  marconi_host_pool *big = host_pool(2 * PAGE);
  uint64_t bk;
  OK(marconi_host_pool_allocate(big, MARCONI_POOL_KIND_KV, 1, &bk, 1));
  marconi_unit_move size = {dk, bk};
  CHECK_EQ(marconi_host_pool_demote(big, dev, &size, 1, NULL), MARCONI_STATUS_INVALID_ARGUMENT);
  marconi_host_pool_free(big);

  /* A pool with no memory cannot be copied to or from. */
  marconi_pool *none = device_pool(MARCONI_POOL_BACKEND_NONE, PAGE);
  uint64_t ns;
  OK(marconi_pool_allocate(none, MARCONI_POOL_KIND_STATE, 1, &ns, 1));
  marconi_unit_move from_none = {ns, hs};
  CHECK_EQ(marconi_host_pool_demote(host, none, &from_none, 1, NULL), MARCONI_STATUS_UNSUPPORTED);
  marconi_pool_free(none);

  marconi_host_pool_free(host);
  marconi_pool_free(dev);
}

int main(void) {
  test_config();
  test_round_trip();
  test_misuse();
  return check_summary("test_host_pool");
}
