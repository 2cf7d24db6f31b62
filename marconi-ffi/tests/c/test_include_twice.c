/* A second translation unit: the header included twice must compile (include
 * guard), and its declarations link against the same library. */
#include "marconi.h"
#include "marconi.h"

#include <string.h>

int second_tu_version_ok(void);

int second_tu_version_ok(void) {
  char buf[8];
  size_t n = marconi_status_message(MARCONI_STATUS_OK, buf, sizeof buf);
  return n == 2 && strcmp(buf, "ok") == 0 &&
         strcmp(marconi_version(), MARCONI_VERSION_STRING) == 0;
}
