/* cli_json.c — the common --json document (cli_json.h, docs/json.md). */
#include <math.h>
#include <stdio.h>

#include "cli_json.h"
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
