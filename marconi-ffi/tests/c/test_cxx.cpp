// The header compiles as C++ (its declarations are extern "C") and links.
#include "marconi.h"
#include "marconi.h"

#include <cstdio>
#include <cstring>

int main() {
  marconi_cache_config cfg;
  if (marconi_cache_config_init(&cfg, sizeof cfg) != MARCONI_STATUS_OK) return 1;
  cfg.model_preset = "nemotron-h-8b";
  cfg.capacity_bytes = 1ull << 32;
  marconi_cache *cache = nullptr;
  if (marconi_cache_new(&cfg, &cache) != MARCONI_STATUS_OK) return 2;
  const uint32_t tokens[] = {1, 2, 3, 4, 5};
  marconi_lookup l{};
  if (marconi_cache_lookup(cache, 0, tokens, 5, MARCONI_NO_SLOT, &l) != MARCONI_STATUS_OK) return 3;
  if (marconi_cache_release(cache, l.lease) != MARCONI_STATUS_OK) return 4;
  marconi_cache_free(cache);
  if (std::strcmp(marconi_version(), MARCONI_VERSION_STRING) != 0) return 5;
  std::printf("test_cxx: header compiles and links as C++ (libmarconi %s)\n", marconi_version());
  return 0;
}
