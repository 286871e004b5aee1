/* Thread-local last-error message: every failing pyrt_* call writes one line here; and the API
 * version the library was built with. */
#include <stdarg.h>
#include <stdio.h>

#include "error.h"

static _Thread_local char last_error[512];

const char *pyrt_last_error(void) {
    return last_error;
}

void pyrt_clear_error(void) {
    last_error[0] = '\0';
}

int pyrt_fail(int status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return status;
}

int pyrt_api_version(void) {
    return PYRT_API_VERSION;
}
