/* The thread's last-error message (error.c): every failing pyrt_* call leaves one line there,
 * which pyrt_last_error() returns. */
#ifndef PYRT_ERROR_H
#define PYRT_ERROR_H

#include "pyrt.h"

/* Formats the thread's last_error message; returns `status` so that callers can
 * `return pyrt_fail(...)`. */
int pyrt_fail(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void pyrt_clear_error(void);

#endif /* PYRT_ERROR_H */
