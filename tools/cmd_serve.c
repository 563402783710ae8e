/* cmd_serve.c — `kvpq serve`: options, start-up and shutdown of the OpenAI-compatible server
 * (serve.h lists its parts; docs/serve.md its use). */
#include <errno.h>
#include <stddef.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "cli_spec.h"
#include "serve.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: kvpq serve --model M [--cache SPEC] [--host 127.0.0.1] [--port 8080] [--parallel N]\n"
            "                  [--kv-budget BYTES] [--cache-dir DIR] [--api-key KEY] [--ctx N] [--threads N]\n"
            "                  [--max-body BYTES] [--max-conversations N] [--template auto|chatml|gemma] [--alias NAME]\n"
            "An OpenAI-compatible HTTP server (docs/serve.md): POST /v1/chat/completions and /v1/completions\n"
            "(streaming by server-sent events with \"stream\": true), GET /v1/models, /health, /metrics.\n"
            "Each conversation keeps its own KV cache; a request that continues one evaluates only its new tokens.\n"
            "  --model M          GGUF model\n"
            "  --cache SPEC       KV cache of every conversation, as kvpq generate's (default fp32)\n"
            "  --host H           address to listen on (default 127.0.0.1: this machine only)\n"
            "  --port P           port (default 8080; 0: any free port, printed at start)\n"
            "  --parallel N       sequences evaluated at once, in one batched forward pass (default 4); more\n"
            "                     requests wait\n"
            "  --kv-budget BYTES  bound on the resident caches of all conversations (K, M, G suffixes: powers of\n"
            "                     1024); the least recently used idle conversation is evicted beyond it: saved to\n"
            "                     --cache-dir and loaded back when it continues, or dropped without one\n"
            "  --cache-dir DIR    where evicted conversations are saved (checksummed cache files); idle ones are\n"
            "                     saved there at shutdown and found there at the next start\n"
            "  --api-key KEY      require Authorization: Bearer KEY on every endpoint but /health\n"
            "  --ctx N            positions a conversation may hold (default: the model's context length)\n"
            "  --threads N        CPU threads of the model (default: OpenMP default)\n"
            "  --max-body BYTES   largest request body (default 8M); larger ones get 413\n"
            "  --max-conversations N  conversations held, resident or saved (default 256); the oldest idle one\n"
            "                     is dropped beyond it\n"
            "  --template T       chat template form (as kvpq chat's)\n"
            "  --alias NAME       the model's id in the API (default: the file name)\n"
            "SIGINT or SIGTERM: stop accepting, finish the requests in flight, save idle conversations, exit 0.\n");
}

#define F(field) offsetof(serve_opts, field)
static const cli_opt OPTS[] = {
    {"--model", "-m", CLI_OPT_STR, F(model_path), 0, 0},
    {"--cache", NULL, CLI_OPT_STR, F(cache_spec), 0, 0},
    {"--host", NULL, CLI_OPT_STR, F(host), 0, 0},
    {"--api-key", NULL, CLI_OPT_STR, F(api_key), 0, 0},
    {"--cache-dir", NULL, CLI_OPT_STR, F(cache_dir), 0, 0},
    {"--template", NULL, CLI_OPT_STR, F(template_name), 0, 0},
    {"--alias", NULL, CLI_OPT_STR, F(alias), 0, 0},
    {"--port", NULL, CLI_OPT_LONG, F(port), 0, 65535},
    {"--parallel", NULL, CLI_OPT_LONG, F(parallel), 1, 256},
    {"--ctx", NULL, CLI_OPT_LONG, F(ctx), 2, 1 << 24},
    {"--threads", "-t", CLI_OPT_LONG, F(threads), 0, 1024},
    {"--max-conversations", NULL, CLI_OPT_LONG, F(max_conversations), 1, 1 << 20},
    {"--kv-budget", NULL, CLI_OPT_BYTES, F(kv_budget), 0, 0},
    {"--max-body", NULL, CLI_OPT_BYTES, F(max_body), 0, 0},
    {NULL, NULL, 0, 0, 0, 0},
};
#undef F

/* argv into *o: -1 to go on, else the exit code (0 after --help). */
static int parse_opts(int argc, char **argv, serve_opts *o) {
    memset(o, 0, sizeof *o);
    o->cache_spec = "fp32";
    o->host = "127.0.0.1";
    o->port = 8080;
    o->parallel = 4;
    o->max_conversations = 256;
    o->max_body = 8u << 20;
    int rc = cli_parse_options("serve", argc, argv, OPTS, o, usage);
    if (rc >= 0) return rc;
    if (!o->model_path) return cli_usage_error("serve: --model is required (see --help)");
    if (o->api_key && !o->api_key[0]) return cli_usage_error("serve: --api-key is empty");
    if (o->max_body < 16) return cli_usage_error("serve: --max-body below 16 bytes");
    return cli_cache_spec_check(o->cache_spec) ? 2 : -1;
}

/* --cache-dir: made when missing; must be a writable directory. */
static int check_cache_dir(const char *dir) {
    struct stat st;
    if (!dir) return 0;
    if (mkdir(dir, 0700) != 0 && errno != EEXIST)
        return cli_usage_error("serve: --cache-dir '%s': cannot create it: %s", dir, strerror(errno));
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode) || access(dir, W_OK | X_OK) != 0)
        return cli_usage_error("serve: --cache-dir '%s': not a writable directory", dir);
    return 0;
}

/* The model, its template and the cache prototype; 0 or an exit code (message printed). */
static int load(serve_server *sv) {
    kvpq_model_params mp = kvpq_model_params_default();
    mp.n_threads = (int)sv->o.threads;
    kvpq_status s = kvpq_model_load(&sv->model, sv->o.model_path, &mp);
    if (s != KVPQ_OK) return cli_fail("serve", s);
    kvpq_model_get_info(sv->model, &sv->mi);
    const char *note = NULL;
    int rc = cli_chat_template_init(&sv->tmpl, sv->model, sv->o.template_name, "serve", &note);
    if (rc) return rc;
    if (note) fprintf(stderr, "kvpq serve: %s\n", note);
    if (sv->o.ctx == 0 || sv->o.ctx > sv->mi.n_ctx_train) sv->o.ctx = sv->mi.n_ctx_train;
    if ((rc = cli_cache_open(&sv->proto, sv->o.cache_spec, sv->model, (int)sv->o.ctx, (int)sv->o.threads))) return rc;
    kvpq_cache_free(sv->proto.cache); /* kept: its params and codebook */
    sv->proto.cache = NULL;
    const char *base = strrchr(sv->o.model_path, '/');
    snprintf(sv->model_id, sizeof sv->model_id, "%s", sv->o.alias ? sv->o.alias : base ? base + 1 : sv->o.model_path);
    return 0;
}

/* SIGINT / SIGTERM: stop taking requests, let those in flight end, stop. */
static void drain(serve_server *sv, serve_http *h) {
    pthread_mutex_lock(&sv->mu);
    sv->draining = 1;
    pthread_mutex_unlock(&sv->mu);
    serve_http_quiesce(h);
    pthread_mutex_lock(&sv->mu);
    while (sv->live_requests > 0) pthread_cond_wait(&sv->job_cond, &sv->mu);
    pthread_mutex_unlock(&sv->mu);
    serve_engine_stop(sv);
    serve_http_stop(h);
    serve_convs_save_all(sv->convs);
}

static int run(serve_server *sv) {
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL); /* every thread started from here on: sigwait below takes them */
    signal(SIGPIPE, SIG_IGN);
    if (!(sv->convs = serve_convs_new(sv)) || serve_engine_start(sv)) return 1;
    serve_http *h = serve_http_start(sv);
    if (!h) {
        serve_engine_stop(sv);
        return 1;
    }
    fprintf(stderr, "kvpq serve: listening on http://%s:%ld (model %s, cache %s, ctx %ld, parallel %ld%s)\n",
            sv->o.host, sv->o.port, sv->model_id, sv->o.cache_spec, sv->o.ctx, sv->o.parallel,
            sv->o.api_key ? ", API key required" : "");
    if (!sv->o.api_key && strcmp(sv->o.host, "127.0.0.1") && strcmp(sv->o.host, "::1") && strcmp(sv->o.host, "localhost"))
        fprintf(stderr, "kvpq serve: warning: listening beyond this machine without --api-key\n");
    int sig = 0;
    sigwait(&sigs, &sig);
    fprintf(stderr, "kvpq serve: %s: finishing the requests in flight\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
    drain(sv, h);
    fprintf(stderr, "kvpq serve: stopped\n");
    return 0;
}

int cmd_serve(int argc, char **argv) {
    serve_server sv;
    memset(&sv, 0, sizeof sv);
    int rc = parse_opts(argc, argv, &sv.o);
    if (rc >= 0) return rc;
    if ((rc = check_cache_dir(sv.o.cache_dir))) return rc;
    pthread_mutex_init(&sv.mu, NULL);
    pthread_cond_init(&sv.engine_cond, NULL);
    pthread_cond_init(&sv.job_cond, NULL);
    if (!(rc = load(&sv))) rc = run(&sv);
    serve_convs_free(sv.convs);
    cli_cache_close(&sv.proto);
    kvpq_model_free(sv.model);
    return rc;
}
