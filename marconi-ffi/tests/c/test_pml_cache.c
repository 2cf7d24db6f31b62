/*
 * The module store from C: a hybrid model's store, a schema registered
 * (its modules pinned), a prompt looked up under each mode (misses, then
 * exact and composed hits after admission), a mode that does not apply,
 * registration over the budget refused, eviction after unregistering and
 * the evicted ids drained; bad input: NULL, foreign and freed handles, zero
 * budget, oversized and malformed arrays, unknown ids. Built with ASan +
 * UBSan by ci/test.d/pml-c.sh.
 */
#include "check.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Byte tokenizer: sys 0..3, doc 3..9, q 9..13 (its param 10..12), tail
 * 13..15; 15 module tokens. */
static const char S[] =
    "<schema name=\"r\"><module name=\"sys\">SYS</module><module name=\"doc\">DOCDOC</module>"
    "<module name=\"q\">Q<param name=\"p\" len=\"2\"/>Z</module><module name=\"tail\">TT</module>"
    "</schema>";
/* Head 0..4 (anonymous), union a 4..7 / b 4..6, c 7..11; 13 tokens. */
static const char U[] =
    "<schema name=\"u\">Head<union><module name=\"a\">AAA</module><module name=\"b\">BB</module>"
    "</union><module name=\"c\">CCCC</module></schema>";
static const char P[] = "<prompt schema=\"r\"><sys/><doc/><tail/>ask</prompt>";

/* How the prompt's four segments (sys, doc, tail, text) were served. */
static void check_served(const marconi_pml_served *out, size_t n_out, uint32_t sys, uint32_t doc,
                         uint32_t tail, uint32_t text) {
  CHECK_EQ(n_out, 4);
  CHECK_EQ(out[0].how, sys);
  CHECK_EQ(out[1].how, doc);
  CHECK_EQ(out[2].how, tail);
  CHECK_EQ(out[3].how, text);
}

static marconi_pml_schema *schema(const char *xml) {
  marconi_pml_schema *s = NULL;
  OK(marconi_pml_schema_new((const uint8_t *)xml, strlen(xml), NULL, NULL, &s, NULL));
  return s;
}

int main(void) {
  marconi_pml_cache_config cfg;
  CHECK_EQ(marconi_pml_cache_config_init(&cfg, 4), MARCONI_STATUS_UNSUPPORTED_STRUCT_SIZE);
  OK(marconi_pml_cache_config_init(&cfg, sizeof cfg));
  CHECK_EQ(cfg.flops_per_token, 1);
  marconi_pml_cache *c = NULL;
  /* Zero budget, zero KV bytes, bad FLOPs. */
  cfg.kv_bytes_per_token = 10;
#define REFUSED(field, bad, good)                                              \
  CHECK_WITH(field, bad, good, marconi_pml_cache_new(&cfg, &c), MARCONI_STATUS_INVALID_CONFIG)
  REFUSED(cfg.capacity_bytes, 0, 1100);
  REFUSED(cfg.kv_bytes_per_token, 0, 10);
  REFUSED(cfg.flops_per_token, -1, 1);
#undef REFUSED
  CHECK(c == NULL);
  cfg.state_bytes = 100;
  cfg.operator_bytes = 50;
  CHECK_EQ(marconi_pml_cache_new(NULL, &c), MARCONI_STATUS_NULL_ARGUMENT);
  OK(marconi_pml_cache_new(&cfg, &c));

  /* Register: 15 tokens * 10 + 4 modules * (100 + 50) = 750 pinned. */
  marconi_pml_schema *s = schema(S), *u = schema(U);
  uint64_t sid = 0, uid = 0;
  OK(marconi_pml_cache_register(c, s, &sid));
  CHECK(sid != 0);
  marconi_pml_cache_stats st;
  memset(&st, 0, sizeof st);
  st.struct_size = 4;
  CHECK_EQ(marconi_pml_cache_get_stats(c, &st), MARCONI_STATUS_UNSUPPORTED_STRUCT_SIZE);
  st.struct_size = sizeof st;
  OK(marconi_pml_cache_get_stats(c, &st));
  CHECK_EQ(st.pinned_bytes, 750);
  CHECK_EQ(st.schemas, 1);

  /* The prompt's layout: sys, doc, tail, text; the run is sys, doc. */
  marconi_pml_segment seg[8];
  uint32_t tok[64];
  size_t n_seg = 0, n_tok = 0;
  OK(marconi_pml_layout(s, (const uint8_t *)P, strlen(P), NULL, NULL, seg, 8, &n_seg, tok, 64,
                        &n_tok, NULL));
  CHECK_EQ(n_seg, 4);

  marconi_pml_served out[8];
  size_t n_out = 0;
  CHECK_EQ(marconi_pml_cache_lookup(c, sid, seg, n_seg, MARCONI_PML_REUSE_MODE_ATTENTION, 0, out,
                                    8, &n_out),
           MARCONI_STATUS_UNSUPPORTED);
  CHECK_EQ(marconi_pml_cache_lookup(c, sid, seg, n_seg, MARCONI_PML_REUSE_MODE_COMPOSED, 1, out,
                                    2, &n_out),
           MARCONI_STATUS_BUFFER_TOO_SMALL);
  CHECK_EQ(n_out, 4);
  OK(marconi_pml_cache_lookup(c, sid, seg, n_seg, MARCONI_PML_REUSE_MODE_COMPOSED, 1, out, 8,
                              &n_out));
  check_served(out, n_out, MARCONI_PML_SERVED_HOW_MISS, MARCONI_PML_SERVED_HOW_MISS,
               MARCONI_PML_SERVED_HOW_MISS, MARCONI_PML_SERVED_HOW_COMPUTED);
  CHECK_EQ(out[2].module, 3);
  CHECK_EQ(out[0].entry, 0);
  CHECK(out[0].in_run && out[1].in_run && !out[2].in_run && !out[3].in_run);

  /* The engine computes and admits: the run's exact entries, tail's module. */
  uint64_t e0 = 0, e1 = 0, et = 0, again = 0;
  OK(marconi_pml_cache_admit_exact(c, sid, seg, n_seg, 0, &e0));
  OK(marconi_pml_cache_admit_exact(c, sid, seg, n_seg, 1, &e1));
  CHECK_EQ(marconi_pml_cache_admit_exact(c, sid, seg, n_seg, 2, &again),
           MARCONI_STATUS_INVALID_ARGUMENT);
  OK(marconi_pml_cache_admit(c, sid, out[2].kind, (uint32_t)out[2].module, &et));
  OK(marconi_pml_cache_admit(c, sid, MARCONI_PML_SEGMENT_KIND_MODULE, 3, &again));
  CHECK_EQ(again, et);
  CHECK(e0 && e1 && et && e0 != e1 && e1 != et);
  OK(marconi_pml_cache_lookup(c, sid, seg, n_seg, MARCONI_PML_REUSE_MODE_COMPOSED, 1, out, 8,
                              &n_out));
  check_served(out, n_out, MARCONI_PML_SERVED_HOW_EXACT, MARCONI_PML_SERVED_HOW_EXACT,
               MARCONI_PML_SERVED_HOW_COMPOSED, MARCONI_PML_SERVED_HOW_COMPUTED);
  CHECK_EQ(out[0].entry, e0);
  CHECK_EQ(out[1].entry, e1);
  CHECK_EQ(out[2].recomputed, 1);
  CHECK_EQ(out[2].entry, et);
  CHECK_EQ(out[2].start, 13);
  CHECK_EQ(out[2].len, 2);
  OK(marconi_pml_cache_lookup(c, sid, seg, n_seg, MARCONI_PML_REUSE_MODE_EXACT, 0, out, 8,
                              &n_out));
  check_served(out, n_out, MARCONI_PML_SERVED_HOW_EXACT, MARCONI_PML_SERVED_HOW_EXACT,
               MARCONI_PML_SERVED_HOW_RECOMPUTED, MARCONI_PML_SERVED_HOW_COMPUTED);
  CHECK_EQ(out[2].entry, 0);

  /* 750 pinned + 290 exact = 1040; U needs 130 + 4 * 150 = 730: refused,
   * nothing evicted. */
  CHECK_EQ(marconi_pml_cache_register(c, u, &uid), MARCONI_STATUS_OUT_OF_MEMORY);
  OK(marconi_pml_cache_get_stats(c, &st));
  CHECK_EQ(st.used_bytes, 1040);
  CHECK_EQ(st.refused, 1);
  CHECK_EQ(st.evictions, 0);
  /* Unregistered, S's entries stay (460 bytes); U's 730 then need room:
   * tail's module entry goes (least recent, fewest FLOPs per byte). */
  OK(marconi_pml_cache_unregister(c, sid));
  CHECK_EQ(marconi_pml_cache_unregister(c, sid), MARCONI_STATUS_INVALID_ARGUMENT);
  OK(marconi_pml_cache_register(c, u, &uid));
  OK(marconi_pml_cache_get_stats(c, &st));
  CHECK_EQ(st.evictions, 1);
  CHECK_EQ(st.used_bytes, 730 + 290);
  uint64_t ev[4] = {0};
  size_t n_ev = 0;
  CHECK_EQ(marconi_pml_cache_evicted(c, NULL, 0, &n_ev), MARCONI_STATUS_BUFFER_TOO_SMALL);
  CHECK_EQ(n_ev, 1);
  OK(marconi_pml_cache_evicted(c, ev, 4, &n_ev));
  CHECK_EQ(n_ev, 1);
  CHECK_EQ(ev[0], et);
  OK(marconi_pml_cache_evicted(c, ev, 4, &n_ev));
  CHECK_EQ(n_ev, 0);

  /* Bad input. */
  /* S again: 730 + 750 > 1100. */
  CHECK_EQ(marconi_pml_cache_register(c, s, &sid), MARCONI_STATUS_OUT_OF_MEMORY);
  CHECK_EQ(marconi_pml_cache_lookup(NULL, uid, seg, n_seg, 1, 0, out, 8, &n_out),
           MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_pml_cache_lookup(c, uid, NULL, 3, 1, 0, out, 8, &n_out),
           MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_pml_cache_lookup(c, uid, seg, 0, 1, 0, out, 8, &n_out),
           MARCONI_STATUS_EMPTY_TOKENS);
  CHECK_EQ(marconi_pml_cache_lookup(c, uid, seg, (size_t)MARCONI_PML_MAX_SEGMENTS + 1, 1, 0, out,
                                    8, &n_out),
           MARCONI_STATUS_INVALID_ARGUMENT);
  CHECK_EQ(marconi_pml_cache_lookup(c, uid, seg, n_seg, 7, 0, out, 8, &n_out),
           MARCONI_STATUS_INVALID_ARGUMENT);
  /* S's layout under U's id, and an unknown id. */
  CHECK_EQ(marconi_pml_cache_lookup(c, uid, seg, n_seg, 1, 0, out, 8, &n_out),
           MARCONI_STATUS_INVALID_ARGUMENT);
  CHECK_EQ(marconi_pml_cache_lookup(c, 99, seg, n_seg, 1, 0, out, 8, &n_out),
           MARCONI_STATUS_INVALID_ARGUMENT);
  marconi_pml_segment bad[8];
  memcpy(bad, seg, sizeof bad);
  {
    uint32_t nine = 9;
    memcpy(&bad[1].kind, &nine, sizeof nine);
  }
  CHECK_EQ(marconi_pml_cache_lookup(c, uid, bad, n_seg, 1, 0, out, 8, &n_out),
           MARCONI_STATUS_INVALID_ARGUMENT);
  CHECK_EQ(marconi_pml_cache_admit(c, uid, 2, 0, &again), MARCONI_STATUS_INVALID_ARGUMENT);
  CHECK_EQ(marconi_pml_cache_admit(c, uid, MARCONI_PML_SEGMENT_KIND_MODULE, 4, &again),
           MARCONI_STATUS_INVALID_ARGUMENT);
  CHECK_EQ(marconi_pml_cache_admit(c, uid, MARCONI_PML_SEGMENT_KIND_MODULE, 0, NULL),
           MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_pml_cache_register(c, NULL, &uid), MARCONI_STATUS_NULL_ARGUMENT);
  /* A foreign handle is refused without being read as a store. */
  uint64_t fake[8] = {0};
  marconi_pml_cache *foreign = (marconi_pml_cache *)fake;
  CHECK_EQ(marconi_pml_cache_register(foreign, s, &uid), MARCONI_STATUS_INVALID_ARGUMENT);
  CHECK_EQ(marconi_pml_cache_get_stats(foreign, &st), MARCONI_STATUS_INVALID_ARGUMENT);
  CHECK_EQ(marconi_pml_cache_free(foreign), MARCONI_STATUS_INVALID_ARGUMENT);
  OK(marconi_pml_cache_get_stats(c, &st));
  CHECK_EQ(st.schemas, 1);

  /* Free, then a double free and a use after free: refused, not read. */
  OK(marconi_pml_cache_free(c));
  CHECK_EQ(marconi_pml_cache_free(c), MARCONI_STATUS_INVALID_ARGUMENT);
  CHECK_EQ(marconi_pml_cache_get_stats(c, &st), MARCONI_STATUS_INVALID_ARGUMENT);
  OK(marconi_pml_cache_free(NULL));
  marconi_pml_schema_free(s);
  marconi_pml_schema_free(u);
  return check_summary("test_pml_cache");
}
