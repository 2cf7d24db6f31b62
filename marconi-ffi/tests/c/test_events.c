/*
 * C tests of the event stream through include/marconi.h (docs/events.md):
 * an events handle drains encoded KVEventBatches (size query, whole batch,
 * snapshot), bad inputs are refused with their status, and, in a library
 * built with the publisher, batches are published on a loopback endpoint.
 * Built by ci/test.d/events.sh with -fsanitize=address,undefined.
 */
#include "marconi.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

static marconi_cache *new_cache(uint32_t page_size) {
  marconi_cache_config cfg = cache_config("paper-7b", page_size);
  cfg.capacity_bytes = 10000000000ull;
  marconi_cache *cache = NULL;
  OK(marconi_cache_new(&cfg, &cache));
  return cache;
}

/* One request: lookup, admit tokens with the final state, release. */
static void serve(marconi_cache *cache, const uint32_t *tokens, size_t n, uint32_t page) {
  marconi_lookup l;
  OK(marconi_cache_lookup(cache, 0, tokens, n, MARCONI_NO_SLOT, &l));
  marconi_saved_state st = {(uint32_t)(n - n % page), MARCONI_NO_SLOT};
  marconi_admit_result r;
  OK(marconi_cache_admit(cache, l.lease, tokens, n, &st, 1, NULL, 0, NULL, &r));
  OK(marconi_cache_release(cache, l.lease));
}

static int contains(const uint8_t *buf, size_t n, const char *s) {
  size_t k = strlen(s);
  for (size_t i = 0; i + k <= n; i++)
    if (memcmp(buf + i, s, k) == 0) return 1;
  return 0;
}

static void test_drain(void) {
  marconi_cache *cache = new_cache(4);
  marconi_events_config cfg;
  OK(marconi_events_config_init(&cfg, sizeof cfg));
  CHECK_EQ(cfg.states, 1);
  CHECK_EQ(cfg.layout, MARCONI_EVENT_LAYOUT_MAP);
  CHECK_EQ(cfg.hash_format, MARCONI_HASH_FORMAT_INT);
  marconi_events *ev = NULL;
  OK(marconi_events_new(cache, &cfg, &ev));

  uint32_t a[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  serve(cache, a, 10, 4);
  size_t need = 0;
  CHECK_EQ(marconi_events_drain(ev, cache, 1.5, NULL, 0, &need), MARCONI_STATUS_BUFFER_TOO_SMALL);
  CHECK(need > 20);
  uint8_t *buf = malloc(need);
  size_t len = 0;
  OK(marconi_events_drain(ev, cache, 99.0, buf, need, &len));
  CHECK_EQ(len, need);
  /* [ts, events, rank]: fixarray 3, float 64 (the first call's ts, 1.5) */
  CHECK_EQ(buf[0], 0x93);
  CHECK_EQ(buf[1], 0xcb);
  CHECK_EQ(buf[2], 0x3f);
  CHECK_EQ(buf[3], 0xf8);
  CHECK(contains(buf, len, "AllBlocksCleared"));
  CHECK(contains(buf, len, "BlockStored"));
  CHECK(contains(buf, len, "full_attention"));
  CHECK(contains(buf, len, "mamba"));
  CHECK(contains(buf, len, "state_position"));
  free(buf);
  /* Nothing changed since. */
  OK(marconi_events_drain(ev, cache, 2.0, NULL, 0, &len));
  CHECK_EQ(len, 0);

  uint8_t snap[4096];
  OK(marconi_events_snapshot(ev, cache, 3.0, snap, sizeof snap, &len));
  CHECK(len > 0 && contains(snap, len, "AllBlocksCleared") && contains(snap, len, "BlockStored"));

  /* Bad inputs. */
  CHECK_EQ(marconi_events_drain(NULL, cache, 1.0, snap, sizeof snap, &len), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_events_drain(ev, NULL, 1.0, snap, sizeof snap, &len), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_events_drain(ev, cache, 1.0, NULL, 5, &len), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_events_drain(ev, cache, NAN, snap, sizeof snap, &len), MARCONI_STATUS_INVALID_ARGUMENT);
  marconi_cache *other = new_cache(16);
  CHECK_EQ(marconi_events_drain(ev, other, 1.0, snap, sizeof snap, &len), MARCONI_STATUS_INVALID_ARGUMENT);
  marconi_cache_free(other);
  uint64_t seq = 0;
  char ep[128];
  CHECK_EQ(marconi_events_publish(ev, cache, 1.0, &seq), MARCONI_STATUS_INVALID_ARGUMENT);
  CHECK_EQ(marconi_events_endpoint(ev, 0, ep, sizeof ep, &len), MARCONI_STATUS_INVALID_ARGUMENT);
  CHECK_EQ(marconi_events_config_init(&cfg, sizeof cfg - 8), MARCONI_STATUS_UNSUPPORTED_STRUCT_SIZE);
  OK(marconi_events_config_init(&cfg, sizeof cfg));
  cfg.layout = 7;
  marconi_events *bad = NULL;
  CHECK_EQ(marconi_events_new(cache, &cfg, &bad), MARCONI_STATUS_INVALID_CONFIG);
  CHECK(bad == NULL);
  cfg.layout = MARCONI_EVENT_LAYOUT_ARRAY;
  cfg.struct_size = 8;
  CHECK_EQ(marconi_events_new(cache, &cfg, &bad), MARCONI_STATUS_UNSUPPORTED_STRUCT_SIZE);

  marconi_events_free(ev, cache);
  marconi_events_free(NULL, NULL);
  marconi_cache_free(cache);
}

static void test_publisher(void) {
  marconi_cache *cache = new_cache(4);
  marconi_events_config cfg;
  OK(marconi_events_config_init(&cfg, sizeof cfg));
  cfg.endpoint = "tcp://127.0.0.1:*";
  cfg.replay_endpoint = "tcp://127.0.0.1:*";
  cfg.topic = "kv";
  marconi_events *ev = NULL;
  if (!marconi_events_has_publisher()) {
    CHECK_EQ(marconi_events_new(cache, &cfg, &ev), MARCONI_STATUS_INVALID_CONFIG);
    marconi_cache_free(cache);
    printf("publisher: not built in (refused with INVALID_CONFIG)\n");
    return;
  }
  OK(marconi_events_new(cache, &cfg, &ev));
  char ep[128];
  size_t len = 0;
  OK(marconi_events_endpoint(ev, 0, ep, sizeof ep, &len));
  CHECK(len > 16 && memcmp(ep, "tcp://127.0.0.1:", 16) == 0);
  OK(marconi_events_endpoint(ev, 1, ep, sizeof ep, &len));
  CHECK_EQ(marconi_events_endpoint(ev, 2, ep, sizeof ep, &len), MARCONI_STATUS_INVALID_ARGUMENT);
  uint64_t seq = 7;
  OK(marconi_events_publish(ev, cache, 1.0, &seq));
  CHECK_EQ(seq, 0); /* AllBlocksCleared */
  OK(marconi_events_publish(ev, cache, 1.0, &seq));
  CHECK_EQ(seq, MARCONI_NO_SEQ);
  uint32_t a[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  serve(cache, a, 8, 4);
  OK(marconi_events_publish(ev, cache, 2.0, &seq));
  CHECK_EQ(seq, 1);
  marconi_events_config bad = cfg;
  bad.endpoint = "nonsense://x";
  marconi_events *b = NULL;
  CHECK_EQ(marconi_events_new(cache, &bad, &b), MARCONI_STATUS_INVALID_CONFIG);
  marconi_events_free(ev, NULL);
  marconi_cache_free(cache);
  printf("publisher: ok\n");
}

int main(void) {
  test_drain();
  test_publisher();
  return check_summary("test_events");
}
