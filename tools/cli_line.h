/* cli_line.h — the chat's message reader (kvpq chat), alone so that a fuzz target can link it. */
#ifndef KVPQ_CLI_LINE_H
#define KVPQ_CLI_LINE_H

#include <stdio.h>
#include <sys/types.h>

/* Longest message read (bytes, continuation lines included): input without a newline (e.g.
 * /dev/zero) would otherwise be read without limit. */
#define CHAT_MAX_MESSAGE ((size_t)16 << 20)

/* One message from in: a line without its "\n" (and "\r"); a line ending in a backslash goes on
 * with the next line (the backslash becomes a newline of the message), as llama.cpp's interactive
 * mode has it. An empty line is an empty message. *msg (malloc'd, grown as needed; *cap its size)
 * holds it NUL-terminated. Returns its length, -1 at end of input with nothing read (or out of
 * memory), -2 when it exceeds CHAT_MAX_MESSAGE or holds a NUL byte (reported on stderr: a C string
 * would end there and drop the rest). */
ssize_t cli_read_message(char **msg, size_t *cap, FILE *in);

#endif
