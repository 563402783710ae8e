/* codebook_model.c — the model a codebook was calibrated on (kvpq_model.h): recorded in and checked
 * against the codebook file's metadata. Model tier: uses only the codebook's public metadata API. */
#include <string.h>

#include "internal.h"
#include "kvpq_model.h"

kvpq_status kvpq_codebook_set_model(kvpq_codebook *cb, const kvpq_model_info *mi) {
    if (!cb || !mi) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_codebook_set_model: NULL argument");
    KVPQ_TRY(kvpq_codebook_set_meta(cb, "model", mi->name[0] ? mi->name : "(unnamed)"));
    KVPQ_TRY(kvpq_codebook_set_meta(cb, "model.arch", mi->arch[0] ? mi->arch : "(none)"));
    return kvpq_codebook_set_meta(cb, "model.fingerprint", mi->fingerprint);
}

kvpq_status kvpq_codebook_check_model(const kvpq_codebook *cb, const kvpq_model_info *mi, int *unchecked) {
    if (unchecked) *unchecked = 0;
    if (!cb || !mi) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_codebook_check_model: NULL argument");
    const char *fp = kvpq_codebook_get_meta(cb, "model.fingerprint"), *arch = kvpq_codebook_get_meta(cb, "model.arch");
    const char *name = kvpq_codebook_get_meta(cb, "model");
    if (!fp) {
        if (unchecked) *unchecked = 1;
        return KVPQ_OK;
    }
    if ((arch && strcmp(arch, mi->arch[0] ? mi->arch : "(none)")) || strcmp(fp, mi->fingerprint))
        return kvpq__err(KVPQ_ERR_MISMATCH,
                         "codebook calibrated on model '%.128s' (%.32s, fingerprint %.32s), loaded model is '%s' (%s, "
                         "fingerprint %s): another model's codebook, with the same shapes or not, gives wrong "
                         "attention",
                         name ? name : "?", arch ? arch : "?", fp, mi->name, mi->arch, mi->fingerprint);
    return KVPQ_OK;
}

