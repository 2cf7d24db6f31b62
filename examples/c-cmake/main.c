/* Checks that the header and the library agree on the version, then caches a
 * state and finds it again. Prints one line; exits non-zero on any failure. */
#include <marconi.h>
#include <stdio.h>
#include <string.h>

static int fail(const char *what) {
  char err[256];
  marconi_last_error(err, sizeof err);
  fprintf(stderr, "%s: %s\n", what, err);
  return 1;
}

int main(void) {
  if (strcmp(marconi_version(), MARCONI_VERSION_STRING) != 0) {
    fprintf(stderr, "header %s, library %s\n", MARCONI_VERSION_STRING, marconi_version());
    return 1;
  }
  marconi_cache_config cfg;
  marconi_cache_config_init(&cfg, sizeof cfg);
  cfg.model_preset = "nemotron-h-8b";
  cfg.capacity_bytes = 1ull << 30;
  marconi_cache *cache;
  if (marconi_cache_new(&cfg, &cache) != MARCONI_STATUS_OK) return fail("marconi_cache_new");

  uint32_t seq[80];
  for (uint32_t i = 0; i < 80; i++) seq[i] = 7 + i;
  marconi_lookup l;
  marconi_saved_state state = {.position = 64, .slot = 3};
  marconi_admit_result r;
  if (marconi_cache_lookup(cache, 0, seq, 48, MARCONI_NO_SLOT, &l) != MARCONI_STATUS_OK ||
      marconi_cache_admit(cache, l.lease, seq, 64, &state, 1, NULL, 0, NULL, &r) !=
          MARCONI_STATUS_OK ||
      marconi_cache_release(cache, l.lease) != MARCONI_STATUS_OK)
    return fail("first request");
  if (marconi_cache_lookup(cache, 0, seq, 80, 4, &l) != MARCONI_STATUS_OK)
    return fail("second lookup");
  printf("libmarconi %s: hit %u tokens\n", marconi_version(), l.hit_tokens);
  marconi_cache_release(cache, l.lease);
  marconi_cache_free(cache);
  return l.hit_tokens == 64 ? 0 : 1;
}
