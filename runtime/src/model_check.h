/* What the model checks at pyrt_decoder_create share (decode_check.c for every block,
 * mla_step.c for a multi-head latent attention block). Not part of the public API (pyrt.h). */
#ifndef PYRT_MODEL_CHECK_H
#define PYRT_MODEL_CHECK_H

#include "linear.h"

/* m is a valid matrix (pyrt_matrix_check) of shape [n_out, n_in]; its name in the message is
 * blk.<layer>.<what>, or <what> for a model-level tensor (layer < 0) (decode_check.c). */
int pyrt_check_model_matrix(const pyrt_matrix *m, int n_out, int n_in, const char *what,
                            int layer);

/* Returns the call's status from the enclosing function unless it is PYRT_OK. */
#define PYRT_CHECK(call)                                                                          \
    do {                                                                                          \
        int rc_ = (call);                                                                         \
        if (rc_ != PYRT_OK)                                                                       \
            return rc_;                                                                           \
    } while (0)

#endif /* PYRT_MODEL_CHECK_H */
