/*
 * The checks every C test of include/marconi.h uses: a failed check prints
 * where it failed, the values and libmarconi's last error, and counts; the
 * test's main returns non-zero when `failures` is not 0. Included once per
 * test program (each test is its own executable).
 */
#ifndef MARCONI_TEST_CHECK_H
#define MARCONI_TEST_CHECK_H

#include "marconi.h"

#include <stdio.h>

static int failures = 0;

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      char err_[512];                                                          \
      marconi_last_error(err_, sizeof err_);                                   \
      fprintf(stderr, "%s:%d: CHECK failed: %s (last error: %s)\n", __FILE__,  \
              __LINE__, #cond, err_);                                          \
      failures++;                                                              \
    }                                                                          \
  } while (0)

#define CHECK_EQ(a, b)                                                         \
  do {                                                                         \
    unsigned long long a_ = (unsigned long long)(a);                           \
    unsigned long long b_ = (unsigned long long)(b);                           \
    if (a_ != b_) {                                                            \
      char err_[512];                                                          \
      marconi_last_error(err_, sizeof err_);                                   \
      fprintf(stderr, "%s:%d: %s == %llu, expected %s == %llu (last error: %s)\n", \
              __FILE__, __LINE__, #a, a_, #b, b_, err_);                       \
      failures++;                                                              \
    }                                                                          \
  } while (0)

#define OK(call) CHECK_EQ((call), MARCONI_STATUS_OK)

#endif
