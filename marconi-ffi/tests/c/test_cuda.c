/*
 * C tests of the CUDA pool backend through include/marconi.h, for a GPU
 * machine and a libmarconi built with `--features cuda`: pools whose units
 * are device memory mapped with cuMemCreate/cuMemMap, read and written here
 * through the CUDA driver (loaded with dlopen, as libmarconi loads it):
 *
 * - units resolve to device addresses that keep what is written there;
 * - AVMP migration remaps chunks from one pool to the other while the units
 *   that stay keep their bytes, and physical bytes stay within the budget;
 * - snapshot copy / fork / promote run on the device, byte for byte;
 * - the cache over a CUDA pool serves multi-turn conversations through the
 *   whole request cycle, and a resumed request's slot holds exactly the
 *   bytes of the state it resumed from (copied by the kernel);
 * - several threads share one CUDA pool.
 *
 * Without a driver or a GPU it prints SKIPPED and exits 0, which is not a
 * pass of the GPU path; with MARCONI_REQUIRE_GPU=1 that is a failure.
 * Built and run by scripts/gpu-check.sh (docs/testing.md, "On a GPU").
 */
#include "marconi.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

#define MIB (1024ull * 1024ull)

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;

static struct {
  CUresult (*init)(unsigned);
  CUresult (*device_get)(CUdevice *, int);
  CUresult (*primary_retain)(CUcontext *, CUdevice);
  CUresult (*primary_release)(CUdevice);
  CUresult (*set_current)(CUcontext);
  CUresult (*htod)(CUdeviceptr, const void *, size_t);
  CUresult (*dtoh)(void *, CUdeviceptr, size_t);
  CUresult (*memset8)(CUdeviceptr, unsigned char, size_t);
  CUresult (*sync)(void);
  CUdevice dev;
  CUcontext ctx;
} cu;

#define CU(call)                                                                 \
  do {                                                                           \
    CUresult r_ = (call);                                                        \
    if (r_ != 0) {                                                               \
      fprintf(stderr, "%s:%d: %s failed with CUresult %d\n", __FILE__, __LINE__, \
              #call, r_);                                                        \
      failures++;                                                                \
    }                                                                            \
  } while (0)

/* Loads the driver and makes device 0's primary context (the one libmarconi
 * retains) current on this thread; 0 when there is no usable GPU. */
static int open_driver(void) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) h = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
  if (!h) return 0;
#define SYM(field, name)                       \
  *(void **)(&cu.field) = dlsym(h, name);      \
  if (!cu.field) return 0;
  SYM(init, "cuInit");
  SYM(device_get, "cuDeviceGet");
  SYM(primary_retain, "cuDevicePrimaryCtxRetain");
  SYM(primary_release, "cuDevicePrimaryCtxRelease_v2");
  SYM(set_current, "cuCtxSetCurrent");
  SYM(htod, "cuMemcpyHtoD_v2");
  SYM(dtoh, "cuMemcpyDtoH_v2");
  SYM(memset8, "cuMemsetD8_v2");
  SYM(sync, "cuCtxSynchronize");
#undef SYM
  if (cu.init(0) != 0 || cu.device_get(&cu.dev, 0) != 0) return 0;
  if (cu.primary_retain(&cu.ctx, cu.dev) != 0) return 0;
  return cu.set_current(cu.ctx) == 0;
}

STATS_OF(stats_of, marconi_pool_stats, marconi_pool, marconi_pool_get_stats)

static marconi_pool *new_cuda_pool(uint32_t migration, double fraction) {
  marconi_pool_config cfg =
      pool_config(MARCONI_POOL_BACKEND_CUDA, migration, 32 * MIB, 64 * 1024, 128 * 1024, fraction);
  cfg.migration_batch_units = 16;
  return pool_from(&cfg);
}

static marconi_unit_location where(const marconi_pool *pool, uint64_t h) {
  marconi_unit_location l;
  memset(&l, 0, sizeof l);
  OK(marconi_pool_resolve(pool, &h, 1, &l, 1));
  return l;
}

static void fill(const marconi_pool *pool, uint64_t h, unsigned char v) {
  marconi_unit_location l = where(pool, h);
  CHECK(l.address != 0);
  CU(cu.memset8(l.address, v, (size_t)l.unit_bytes));
}

/* 1 when every byte of the unit behind `h` is `v`. */
static int holds(const marconi_pool *pool, uint64_t h, unsigned char v) {
  marconi_unit_location l;
  if (marconi_pool_resolve(pool, &h, 1, &l, 1) != MARCONI_STATUS_OK) return 0;
  unsigned char *buf = malloc((size_t)l.unit_bytes);
  CU(cu.dtoh(buf, l.address, (size_t)l.unit_bytes));
  int ok = 1;
  for (uint64_t i = 0; i < l.unit_bytes && ok; i++) ok = buf[i] == v;
  free(buf);
  return ok;
}

static void test_units_keep_their_bytes(void) {
  marconi_pool *pool = new_cuda_pool(MARCONI_POOL_MIGRATION_STATIC, 0.25);
  marconi_pool_stats s = stats_of(pool);
  CHECK_EQ(s.backend, MARCONI_POOL_BACKEND_CUDA);
  CHECK(s.budget_chunks > 0);
  CHECK(s.kv_capacity > 0 && s.state_capacity > 0);
  uint64_t kv[16];
  OK(marconi_pool_allocate(pool, MARCONI_POOL_KIND_KV, 16, kv, 16));
  marconi_unit_location loc[16];
  OK(marconi_pool_resolve(pool, kv, 16, loc, 16));
  /* A distinct pattern per page, written from the host, read back. */
  unsigned char *page = malloc(64 * 1024), *back = malloc(64 * 1024);
  for (int i = 0; i < 16; i++) {
    CHECK_EQ(loc[i].kind, MARCONI_POOL_KIND_KV);
    CHECK_EQ(loc[i].unit_bytes, 64 * 1024);
    CHECK(loc[i].address != 0);
    for (int b = 0; b < 64 * 1024; b++) page[b] = (unsigned char)(b * 13 + i * 31);
    CU(cu.htod(loc[i].address, page, 64 * 1024));
  }
  for (int i = 0; i < 16; i++) {
    CU(cu.dtoh(back, loc[i].address, 64 * 1024));
    for (int b = 0; b < 64 * 1024; b++) page[b] = (unsigned char)(b * 13 + i * 31);
    CHECK(memcmp(page, back, 64 * 1024) == 0);
  }
  free(page);
  free(back);
  s = stats_of(pool);
  CHECK(s.physical_bytes <= s.budget_bytes);
  CHECK(s.mapped_chunks <= s.budget_chunks);
  OK(marconi_pool_free_units(pool, kv, 16));
  CHECK_EQ(marconi_pool_free_units(pool, kv, 1), MARCONI_STATUS_DOUBLE_FREE);
  CHECK_EQ(stats_of(pool).kv_free, stats_of(pool).kv_capacity);
  marconi_pool_free(pool);
}

static void test_migration_keeps_live_units(void) {
  marconi_pool *pool = new_cuda_pool(MARCONI_POOL_MIGRATION_AVMP, 0.5);
  marconi_pool_stats s0 = stats_of(pool);
  uint32_t n = (uint32_t)s0.kv_capacity;
  uint64_t *kv = malloc((n + 64) * sizeof *kv);
  OK(marconi_pool_allocate(pool, MARCONI_POOL_KIND_KV, n, kv, n));
  for (uint32_t i = 0; i < n; i++) fill(pool, kv[i], (unsigned char)(i * 7 + 1));
  /* The KV pool is full: more pages take capacity from the state pool. */
  OK(marconi_pool_allocate(pool, MARCONI_POOL_KIND_KV, 8, kv + n, 8));
  marconi_pool_stats s = stats_of(pool);
  CHECK(s.migrations >= 1);
  CHECK(s.kv_capacity > s0.kv_capacity);
  CHECK(s.state_capacity < s0.state_capacity);
  CHECK(s.physical_bytes <= s.budget_bytes);
  CHECK(s.mapped_chunks <= s.budget_chunks);
  for (uint32_t i = 0; i < 8; i++) fill(pool, kv[n + i], 0xEE);
  int kept = 1;
  for (uint32_t i = 0; i < n; i++) kept &= holds(pool, kv[i], (unsigned char)(i * 7 + 1));
  CHECK(kept); /* pages that did not move keep their bytes across the remap */
  for (uint32_t i = 0; i < 8; i++) CHECK(holds(pool, kv[n + i], 0xEE));
  OK(marconi_pool_free_units(pool, kv, n + 8));
  /* And back: the KV tail is free, state slots take it. A migration moves
   * whole chunks (the device's granularity, 2 MiB on current GPUs): half a
   * chunk of pages is refused, one chunk's worth moves. */
  uint64_t chunk = s.budget_bytes / s.budget_chunks;
  marconi_migration m;
  CHECK_EQ(marconi_pool_migrate(pool, MARCONI_POOL_KIND_STATE, (uint32_t)(chunk / (128 * 1024)), &m),
           MARCONI_STATUS_OUT_OF_MEMORY);
  OK(marconi_pool_migrate(pool, MARCONI_POOL_KIND_STATE, (uint32_t)(chunk / (64 * 1024)), &m));
  CHECK_EQ(m.donor, MARCONI_POOL_KIND_KV);
  CHECK(m.recipient_units > 0);
  s = stats_of(pool);
  CHECK(s.physical_bytes <= s.budget_bytes);
  uint64_t st[4];
  OK(marconi_pool_allocate(pool, MARCONI_POOL_KIND_STATE, 4, st, 4));
  for (int i = 0; i < 4; i++) fill(pool, st[i], (unsigned char)(0x30 + i));
  for (int i = 0; i < 4; i++) CHECK(holds(pool, st[i], (unsigned char)(0x30 + i)));
  OK(marconi_pool_free_units(pool, st, 4));
  free(kv);
  marconi_pool_free(pool);
}

static void test_snapshots_on_the_device(void) {
  marconi_pool *pool = new_cuda_pool(MARCONI_POOL_MIGRATION_AVMP, 0.5);
  uint64_t st[8];
  OK(marconi_pool_allocate(pool, MARCONI_POOL_KIND_STATE, 8, st, 8));
  /* The memfd pool's copy / fork / promote checks (test_pool.c), on the
   * device: the kernel moves the bytes, a refused batch moves none. */
  check_pool_snapshots(pool, st, fill, holds);
  /* A patterned slot (every byte different) is copied exactly. */
  marconi_unit_location a = where(pool, st[3]), b = where(pool, st[4]);
  unsigned char *src = malloc((size_t)a.unit_bytes), *dst = malloc((size_t)a.unit_bytes);
  for (uint64_t i = 0; i < a.unit_bytes; i++) src[i] = (unsigned char)(i * 131 + (i >> 9));
  CU(cu.htod(a.address, src, (size_t)a.unit_bytes));
  marconi_state_copy one[1] = {{st[3], st[4]}};
  OK(marconi_pool_copy_states(pool, one, 1));
  CU(cu.dtoh(dst, b.address, (size_t)b.unit_bytes));
  CHECK(memcmp(src, dst, (size_t)a.unit_bytes) == 0);
  free(src);
  free(dst);
  OK(marconi_pool_free_units(pool, st, 8));
  marconi_pool_free(pool);
}

/* Device memory: cuMemsetD8. */
static int write_device(const marconi_unit_location *loc, unsigned char v, size_t n) {
  return cu.memset8(loc->address, v, n) != 0;
}

/* A new thread makes device 0's primary context current. */
static int set_context(void) { return cu.set_current(cu.ctx) != 0; }

static void test_threads(void) {
  marconi_pool *pool = new_cuda_pool(MARCONI_POOL_MIGRATION_AVMP, 0.5);
  check_pool_threads(pool, 200, write_device, set_context);
  marconi_pool_free(pool);
}

/* The cache over a CUDA pool (a marconi_cache made with
 * marconi_cache_config.pools): conversations through the request cycle; the
 * final state of each request is written with a byte that names it, and a
 * request that resumes checks, after the library's device copy, that its
 * own slot holds that byte. */
#define PAGE 16u
#define MAX_UNITS 4096

static void test_cache_over_cuda_pools(void) {
  marconi_plan_request req = plan_request("nemotron-h-8b", PAGE, 1ull << 30);
  marconi_memory_plan p = plan_of(&req);
  uint64_t budget = 6 * p.state_slot_bytes + 2600 / PAGE * p.kv_page_bytes;
  budget = (budget + (2u << 20) - 1) / (2u << 20) * (2u << 20);

  marconi_cache *c = new_pooled_cache("nemotron-h-8b", PAGE, MARCONI_POOL_BACKEND_CUDA, budget,
                                      MARCONI_POOL_MIGRATION_AVMP, 0.3);
  if (!c) return;

  static uint32_t conv[4][4096];
  uint32_t len[4] = {0, 0, 0, 0};
  for (int k = 0; k < 4; k++)
    for (int i = 0; i < 4096; i++) conv[k][i] = (uint32_t)(i < 160 ? i : k * 100000 + i);
  int served = 0, resumed = 0, resumed_exact = 0;
  static uint64_t pages[MAX_UNITS];
  static uint64_t hit_pages[MAX_UNITS];
  unsigned char probe[4096];
  for (int turn = 0; turn < 10; turn++) {
    for (int k = 0; k < 4; k++) {
      uint32_t input = len[k] + 160, full = input + 48;
      if (full > 4096) continue;
      len[k] = full;
      marconi_pooled_lookup l;
      OK(marconi_cache_lookup_pooled(c, 0, conv[k], input, &l));
      size_t n_hit = 0;
      OK(marconi_cache_lease_kv_handles(c, l.lease, hit_pages, MAX_UNITS, &n_hit));
      uint32_t plan[64];
      size_t n_plan = 0;
      OK(marconi_cache_lease_plan(c, l.lease, plan, 64, &n_plan));
      uint32_t full_pages = full / PAGE;
      uint64_t slots[65];
      marconi_status st = marconi_cache_reserve(c, full_pages - (uint32_t)n_hit,
                                                (uint32_t)n_plan + 1, pages + n_hit,
                                                MAX_UNITS - n_hit, slots, 65);
      if (st != MARCONI_STATUS_OK) {
        CHECK_EQ(st, MARCONI_STATUS_OUT_OF_MEMORY);
        OK(marconi_cache_release(c, l.lease));
        continue;
      }
      memcpy(pages, hit_pages, n_hit * sizeof pages[0]);
      marconi_unit_location sl;
      if (l.state_handle != 0) {
        /* The cached state was written as (its end position & 0xff). */
        marconi_unit_location cl;
        OK(marconi_cache_resolve(c, &l.state_handle, 1, &cl, 1));
        CU(cu.dtoh(probe, cl.address, sizeof probe));
        unsigned char want = probe[0];
        marconi_state_copy o = {l.state_handle, slots[0]};
        OK(marconi_cache_copy_states(c, &o, 1));
        OK(marconi_cache_resolve(c, &slots[0], 1, &sl, 1));
        CU(cu.dtoh(probe, sl.address, sizeof probe));
        int same = 1;
        for (size_t i = 0; i < sizeof probe; i++) same &= probe[i] == want;
        resumed++;
        resumed_exact += same && want == (unsigned char)(l.hit_tokens & 0xff);
      }
      marconi_pooled_state states[65];
      for (size_t i = 0; i < n_plan; i++) {
        states[i] = (marconi_pooled_state){plan[i], 0, slots[i + 1]};
        OK(marconi_cache_resolve(c, &slots[i + 1], 1, &sl, 1));
        CU(cu.memset8(sl.address, (unsigned char)(plan[i] & 0xff), (size_t)sl.unit_bytes));
      }
      uint32_t end = full / PAGE * PAGE;
      states[n_plan] = (marconi_pooled_state){end, 0, slots[0]};
      OK(marconi_cache_resolve(c, &slots[0], 1, &sl, 1));
      CU(cu.memset8(sl.address, (unsigned char)(end & 0xff), (size_t)sl.unit_bytes));
      uint8_t taken[65];
      marconi_admit_result r;
      OK(marconi_cache_admit_pooled(c, l.lease, conv[k], full, states, n_plan + 1, pages,
                                    full_pages, taken, &r));
      uint64_t mine[MAX_UNITS + 65];
      free_untaken(c, pages, n_hit, full_pages, &r, states, n_plan + 1, taken, mine);
      OK(marconi_cache_release(c, l.lease));
      OK(marconi_cache_check(c));
      size_t nf = 0;
      static uint64_t freed[MAX_UNITS * 2];
      OK(marconi_cache_drain_freed_units(c, freed, MAX_UNITS * 2, &nf));
      served++;
    }
  }
  marconi_pooled_stats s;
  VERSIONED(s);
  OK(marconi_cache_pool_stats(c, &s));
  CHECK(served > 0);
  CHECK(resumed > 0);
  CHECK_EQ(resumed_exact, resumed);
  CHECK(s.hit_tokens > 0);
  CHECK(s.physical_bytes <= budget);
  CHECK_EQ(s.leases, 0);
  printf("cache over CUDA pools: %d served, %d resumed (%d with the exact bytes), %llu hit tokens, "
         "%llu evictions, %llu migrations, %llu physical bytes of %llu\n",
         served, resumed, resumed_exact, (unsigned long long)s.hit_tokens,
         (unsigned long long)s.evictions, (unsigned long long)s.migrations,
         (unsigned long long)s.physical_bytes, (unsigned long long)budget);
  marconi_cache_free(c);
}

int main(void) {
  const char *req = getenv("MARCONI_REQUIRE_GPU");
  int required = req && strcmp(req, "1") == 0;
  if (!open_driver()) {
    fprintf(stderr, "%s: no CUDA driver or GPU here\n", required ? "FAILED" : "SKIPPED");
    return required ? 1 : 0;
  }
  /* A libmarconi without the `cuda` feature refuses the backend. */
  marconi_pool_config cfg;
  OK(marconi_pool_config_init(&cfg, sizeof cfg));
  cfg.backend = MARCONI_POOL_BACKEND_CUDA;
  cfg.budget_bytes = 8 * MIB;
  cfg.kv_page_bytes = 4096;
  cfg.state_slot_bytes = 8192;
  marconi_pool *probe = NULL;
  marconi_status st = marconi_pool_new(&cfg, &probe);
  if (st != MARCONI_STATUS_OK) {
    char why[512];
    marconi_last_error(why, sizeof why);
    fprintf(stderr, "%s: backend CUDA refused (status %d: %s)\n", required ? "FAILED" : "SKIPPED",
            (int)st, why);
    return required ? 1 : 0;
  }
  marconi_pool_free(probe);
  test_units_keep_their_bytes();
  test_migration_keeps_live_units();
  test_snapshots_on_the_device();
  test_threads();
  test_cache_over_cuda_pools();
  CU(cu.sync());
  cu.primary_release(cu.dev);
  return check_summary("test_cuda on the GPU");
}
