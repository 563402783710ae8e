/* cli_line.c — the chat's message reader (cli_line.h). */
#include <stdlib.h>
#include <string.h>

#include "cli_line.h"

/* Room for n + 2 bytes in *msg (a byte and the terminating NUL): 0, or -1 when out of memory. */
static int message_room(char **msg, size_t *cap, size_t n) {
    if (n + 2 <= *cap) return 0;
    size_t nc = *cap ? 2 * *cap : 256;
    char *nm = realloc(*msg, nc);
    if (!nm) return -1;
    *msg = nm;
    *cap = nc;
    return 0;
}

ssize_t cli_read_message(char **msg, size_t *cap, FILE *in) {
    size_t n = 0;
    int any = 0, c, nul = 0;
    for (;;) {
        size_t start = n;
        int eol = 0;
        if (message_room(msg, cap, n)) return -1; /* the NUL of an empty line too */
        while ((c = getc(in)) != EOF) {
            any = 1;
            if (c == '\n') {
                eol = 1;
                break;
            }
            if (n + 2 > CHAT_MAX_MESSAGE) {
                fprintf(stderr, "kvpq chat: a message longer than %zu bytes on stdin: refused\n", CHAT_MAX_MESSAGE);
                return -2;
            }
            if (message_room(msg, cap, n)) return -1;
            nul |= c == '\0';
            (*msg)[n++] = (char)c;
        }
        if (!any) return -1;
        while (n > start && (*msg)[n - 1] == '\r') n--;
        int more = eol && n > start && (*msg)[n - 1] == '\\';
        if (more) (*msg)[n - 1] = '\n';
        (*msg)[n] = '\0';
        if (!more) break;
    }
    if (nul) {
        fprintf(stderr, "kvpq chat: a message on stdin holds a NUL byte (at byte %zu): refused\n", strlen(*msg));
        return -2;
    }
    return (ssize_t)n;
}
