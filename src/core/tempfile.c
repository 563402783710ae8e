/* tempfile.c — temporary files of atomic saves (write PATH.kvpq.tmp.PID.XXXXXX, fsync, rename over PATH):
 * created here, listed while they exist, so that a program's signal handler can remove them
 * (kvpq_remove_temp_files, async-signal-safe), and the target path resolved through symlinks so
 * that saving to a link replaces the file it names, not the link. */
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
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

/* Remove DIR/NAME.kvpq.tmp.PID.* files whose PID no longer runs and that nothing wrote for a minute:
 * a save killed by SIGKILL (no handler runs) left them, full size. A PID alive (another writer, or
 * reused) keeps its file; so does a recent one, which may be a writer's in another PID namespace
 * (a container sharing the folder), where this process cannot see its PID. */
static void remove_stale(const char *target) {
    const char *slash = strrchr(target, '/');
    char dir[PATH_MAX];
    if (slash) snprintf(dir, sizeof dir, "%.*s", (int)(slash - target) > 0 ? (int)(slash - target) : 1, target);
    else snprintf(dir, sizeof dir, ".");
    const char *base = slash ? slash + 1 : target;
    char prefix[PATH_MAX];
    int np = snprintf(prefix, sizeof prefix, "%s.kvpq.tmp.", base);
    DIR *d = opendir(dir);
    if (!d || np <= 0 || (size_t)np >= sizeof prefix) {
        if (d) closedir(d);
        return;
    }
    for (struct dirent *e; (e = readdir(d));) {
        if (strncmp(e->d_name, prefix, (size_t)np)) continue;
        char *end;
        long pid = strtol(e->d_name + np, &end, 10);
        if (end == e->d_name + np || *end != '.' || pid <= 0) continue;
        if (kill((pid_t)pid, 0) == 0 || errno != ESRCH) continue; /* alive, or another user's (EPERM) */
        char path[PATH_MAX];
        struct stat st;
        if (snprintf(path, sizeof path, "%s/%s", dir, e->d_name) < (int)sizeof path && lstat(path, &st) == 0 &&
            S_ISREG(st.st_mode) && time(NULL) - st.st_mtime > 60)
            unlink(path);
    }
    closedir(d);
}

char *kvpq__temp_name(const char *target) {
    remove_stale(target);
    size_t n = strlen(target) + 48;
    char *t = malloc(n);
    if (t) snprintf(t, n, "%s.kvpq.tmp.%ld.XXXXXX", target, (long)getpid());
    return t;
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
