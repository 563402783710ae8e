/* cli_json.c — the common --json document (cli_json.h, docs/json.md). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli_json.h"
#include "cli_model.h"
#include "kvpq.h"

cJSON *cli_json_new(const char *command, cJSON **settings, cJSON **results) {
    cJSON *root = cJSON_CreateObject();
    if (!root) return NULL;
    char schema[96];
    snprintf(schema, sizeof schema, "kvpq.%s/1", command);
    cJSON_AddStringToObject(root, "schema", schema);
    cJSON_AddStringToObject(root, "kvpq_version", kvpq_version());
    *settings = cJSON_AddObjectToObject(root, "settings");
    *results = cJSON_AddArrayToObject(root, "results");
    if (!*settings || !*results) {
        cJSON_Delete(root);
        return NULL;
    }
    return root;
}

int cli_json_print(cJSON *root) {
    char *txt = root ? cJSON_Print(root) : NULL;
    cJSON_Delete(root);
    if (!txt) {
        fprintf(stderr, "kvpq: out of memory writing the JSON output\n");
        return 1;
    }
    puts(txt);
    cJSON_free(txt);
    return 0;
}

void cli_json_num(cJSON *o, const char *key, double v) {
    if (isfinite(v)) cJSON_AddNumberToObject(o, key, v);
    else cJSON_AddNullToObject(o, key);
}

/* s (n bytes) as valid UTF-8: each byte of an invalid or truncated sequence becomes U+FFFD (a reply
 * cut inside a character, or a token of stray bytes); the JSON row needs valid UTF-8. */
char *cli_utf8_clean(const char *s, size_t n) {
    char *o = malloc(3 * n + 1);
    if (!o) return NULL;
    size_t k = 0;
    for (size_t i = 0; i < n;) {
        size_t bad = 0, l = 1;
        unsigned char c = (unsigned char)s[i];
        l = c < 0x80 ? 1 : (c & 0xe0) == 0xc0 ? 2 : (c & 0xf0) == 0xe0 ? 3 : (c & 0xf8) == 0xf0 ? 4 : 0;
        if (l && i + l <= n && cli_utf8_valid((const unsigned char *)s + i, l, &bad)) {
            memcpy(o + k, s + i, l);
            k += l;
            i += l;
        } else {
            memcpy(o + k, "\xef\xbf\xbd", 3);
            k += 3;
            i++;
        }
    }
    o[k] = '\0';
    return o;
}

cJSON *cli_json_ids(const int32_t *t, size_t n) {
    cJSON *a = cJSON_CreateArray();
    for (size_t i = 0; a && i < n; i++) cJSON_AddItemToArray(a, cJSON_CreateNumber(t[i]));
    return a;
}
