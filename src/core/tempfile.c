/* tempfile.c — temporary files of atomic saves (write PATH.tmp.XXXXXX, fsync, rename over PATH):
 * created here, listed while they exist, so that a program's signal handler can remove them
 * (kvpq_remove_temp_files, async-signal-safe), and the target path resolved through symlinks so
 * that saving to a link replaces the file it names, not the link. */
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"

#define TEMP_SLOTS 16

/* slot_used[i] is set only once slot_path[i] is complete, and cleared before it is reused: a
 * signal handler reading them sees either nothing or a whole path. */
static char slot_path[TEMP_SLOTS][PATH_MAX];
static volatile sig_atomic_t slot_used[TEMP_SLOTS];
static pthread_mutex_t slot_lock = PTHREAD_MUTEX_INITIALIZER;

void kvpq_remove_temp_files(void) {
    for (int i = 0; i < TEMP_SLOTS; i++)
        if (slot_used[i]) unlink(slot_path[i]);
}

char *kvpq__resolve_target(const char *path) {
    char *cur = strdup(path);
    for (int hop = 0; cur && hop < 40; hop++) {
        char link[PATH_MAX];
        ssize_t n = readlink(cur, link, sizeof link - 1);
        if (n < 0) return cur; /* not a symlink (or absent): this is the file to write */
        link[n] = '\0';
        const char *slash = strrchr(cur, '/');
        size_t dir = link[0] != '/' && slash ? (size_t)(slash - cur + 1) : 0;
        char *next = malloc(dir + (size_t)n + 1);
        if (next) {
            memcpy(next, cur, dir);
            memcpy(next + dir, link, (size_t)n + 1);
        }
        free(cur);
        cur = next;
    }
    if (cur) { /* a loop of links: let the caller's open fail on it (ELOOP) */
        free(cur);
        return strdup(path);
    }
    return NULL;
}

int kvpq__temp_create(char *tmpl) {
    /* SIGINT/SIGTERM held off between creating the file and listing it, so that a handler never
     * misses a file that exists. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int fd = mkstemp(tmpl);
    int e = errno;
    if (fd >= 0) {
        pthread_mutex_lock(&slot_lock);
        size_t len = strlen(tmpl);
        for (int i = 0; i < TEMP_SLOTS && len < PATH_MAX; i++)
            if (!slot_used[i]) {
                memcpy(slot_path[i], tmpl, len + 1);
                slot_used[i] = 1;
                break;
            }
        pthread_mutex_unlock(&slot_lock);
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    errno = e;
    return fd;
}

void kvpq__temp_done(const char *tmpl, int keep) {
    pthread_mutex_lock(&slot_lock);
    for (int i = 0; i < TEMP_SLOTS; i++)
        if (slot_used[i] && !strcmp(slot_path[i], tmpl)) {
            slot_used[i] = 0;
            break;
        }
    pthread_mutex_unlock(&slot_lock);
    if (!keep) unlink(tmpl);
}
