/* fuzz_chat_line.c — libFuzzer target for the chat's message reader (tools/cli_line.c, what `kvpq
 * chat` reads stdin with): any bytes give messages or a refusal, never a crash or a read or write
 * out of bounds. Each message returned is NUL-terminated at its length and holds no NUL byte; a
 * refusal (-2) ends the input, as it ends the chat. Seeds: tests/fuzz/corpus/chat_line/. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli_line.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    FILE *in = size ? fmemopen((void *)data, size, "rb") : NULL;
    if (!in) return 0;
    char *msg = NULL;
    size_t cap = 0, total = 0;
    ssize_t got;
    while ((got = cli_read_message(&msg, &cap, in)) >= 0) {
        if ((size_t)got >= cap || msg[got] != '\0' || strlen(msg) != (size_t)got) abort();
        total += (size_t)got;
        if (total > size) abort(); /* a message is made of input bytes (a "\\\n" becomes one "\n") */
    }
    free(msg);
    fclose(in);
    return 0;
}
