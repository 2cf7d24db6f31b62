/*
 * PML from C: a schema registered with a tokenizer callback, a prompt laid
 * out into caller buffers (too small first, then sized from the needed
 * counts), names of modules and parameters, a PML error with its line and
 * column, NULL checks. Built with ASan + UBSan by ci/test.d/pml-c.sh.
 */
#include "check.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static const char SCHEMA[] =
    "<schema name=\"cities\">\n"
    "  <module name=\"trip-plan\">\n"
    "    Plan a trip of <param name=\"duration\" len=\"2\"/>.\n"
    "  </module>\n"
    "  <union>\n"
    "    <module name=\"tokyo\">Tokyo is the capital city of Japan.</module>\n"
    "    <module name=\"miami\">Miami is a city in Florida.</module>\n"
    "  </union>\n"
    "</schema>\n";

static const char PROMPT[] =
    "<prompt schema=\"cities\">\n"
    "  <trip-plan duration=\"3 days\"/>\n"
    "  <miami/>\n"
    "  Highlight the surf spots.\n"
    "</prompt>\n";

/* One token per space-separated word, its id the word's length; counts
 * its calls through `user`. */
static int64_t words(void *user, const uint8_t *text, size_t len, uint32_t *out, size_t cap) {
  size_t n = 0, i = 0;
  ++*(int *)user;
  while (i < len) {
    while (i < len && text[i] == ' ') i++;
    size_t start = i;
    while (i < len && text[i] != ' ') i++;
    if (i > start) {
      if (n < cap) out[n] = (uint32_t)(i - start);
      n++;
    }
  }
  return (int64_t)n;
}

static int64_t broken(void *user, const uint8_t *text, size_t len, uint32_t *out, size_t cap) {
  (void)user, (void)text, (void)len, (void)out, (void)cap;
  return -7;
}

int main(void) {
  int calls = 0;
  marconi_pml_schema *s = NULL;
  marconi_pml_error err;
  memset(&err, 0, sizeof err);
  OK(marconi_pml_schema_new((const uint8_t *)SCHEMA, strlen(SCHEMA), words, &calls, &s, &err));
  CHECK(s != NULL);
  CHECK(calls >= 4);

  size_t n_modules = 0;
  uint32_t total = 0;
  uint64_t ns = 0;
  OK(marconi_pml_schema_info(s, &n_modules, &total, &ns));
  CHECK_EQ(n_modules, 3);
  CHECK_EQ(total, 14);

  /* Too small: the needed counts come back. */
  marconi_pml_segment one[1];
  size_t n_seg = 0, n_tok = 0;
  CHECK_EQ(marconi_pml_layout(s, (const uint8_t *)PROMPT, strlen(PROMPT), words, &calls, one, 1,
                              &n_seg, NULL, 0, &n_tok, &err),
           MARCONI_STATUS_BUFFER_TOO_SMALL);
  CHECK_EQ(n_seg, 5);
  CHECK_EQ(n_tok, 17);

  marconi_pml_segment *segs = calloc(n_seg, sizeof *segs);
  uint32_t *toks = calloc(n_tok, sizeof *toks);
  OK(marconi_pml_layout(s, (const uint8_t *)PROMPT, strlen(PROMPT), words, &calls, segs, n_seg,
                        &n_seg, toks, n_tok, &n_tok, &err));
  static const uint32_t kind[5] = {MARCONI_PML_SEGMENT_KIND_MODULE, MARCONI_PML_SEGMENT_KIND_PARAM,
                                   MARCONI_PML_SEGMENT_KIND_MODULE, MARCONI_PML_SEGMENT_KIND_MODULE,
                                   MARCONI_PML_SEGMENT_KIND_TEXT};
  static const uint32_t start[5] = {0, 4, 6, 7, 13}, len[5] = {4, 2, 1, 6, 4};
  static const int cached[5] = {1, 0, 1, 1, 0};
  for (size_t i = 0; i < 5 && i < n_seg; i++) {
    CHECK_EQ(segs[i].kind, kind[i]);
    CHECK_EQ(segs[i].start, start[i]);
    CHECK_EQ(segs[i].len, len[i]);
    CHECK_EQ(segs[i].cached, cached[i]);
  }
  char name[32];
  CHECK_EQ(marconi_pml_name(s, segs[1].module, segs[1].param, name, sizeof name), 8);
  CHECK(strcmp(name, "duration") == 0);
  CHECK_EQ(marconi_pml_name(s, segs[3].module, -1, name, sizeof name), 5);
  CHECK(strcmp(name, "miami") == 0);
  CHECK_EQ(segs[4].module, -1);
  CHECK_EQ(toks[segs[1].tokens_offset], 1); /* "3" */
  CHECK_EQ(toks[segs[1].tokens_offset + 1], 4); /* "days" */
  free(segs);
  free(toks);

  /* A PML error: line, column, reason. */
  static const char BAD[] = "<prompt schema=\"cities\">\n  <tokyo/><miami/>\n</prompt>";
  CHECK_EQ(marconi_pml_layout(s, (const uint8_t *)BAD, strlen(BAD), NULL, NULL, NULL, 0, &n_seg,
                              NULL, 0, &n_tok, &err),
           MARCONI_STATUS_INVALID_ARGUMENT);
  CHECK_EQ(err.line, 2);
  CHECK_EQ(err.col, 11);
  CHECK(strstr(err.message, "members of one <union>") != NULL);

  /* A failing tokenizer, NULL arguments. */
  marconi_pml_schema *t = NULL;
  CHECK_EQ(marconi_pml_schema_new((const uint8_t *)SCHEMA, strlen(SCHEMA), broken, NULL, &t, NULL),
           MARCONI_STATUS_INVALID_ARGUMENT);
  CHECK(t == NULL);
  CHECK_EQ(marconi_pml_schema_new(NULL, 3, NULL, NULL, &t, NULL), MARCONI_STATUS_NULL_ARGUMENT);
  CHECK_EQ(marconi_pml_layout(NULL, (const uint8_t *)PROMPT, strlen(PROMPT), NULL, NULL, NULL, 0,
                              &n_seg, NULL, 0, &n_tok, NULL),
           MARCONI_STATUS_NULL_ARGUMENT);
  marconi_pml_schema_free(s);
  marconi_pml_schema_free(NULL);
  return check_summary("test_pml");
}
