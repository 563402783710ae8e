#!/usr/bin/env bash
# Install the build tree into a temporary prefix (cmake --install --prefix), then check that both
# tiers are there (kvpq.h + libkvpq, kvpq_model.h + libkvpq_model: static and shared; kvpq.pc,
# kvpq_model.pc, the CMake package), the CLI, and that:
#  - a PQ + codebook program (kvpq.h only, KVPQ_ADVANCED) builds with `pkg-config --cflags --libs kvpq`
#    (shared) and against libkvpq.a (static), runs, and neither links PCRE2 nor OpenBLAS (ldd, nm);
#  - a stable-tier cache program (kvpq.h without KVPQ_ADVANCED) builds and runs, and the same header
#    hides the advanced tier (a call to kvpq_pq_new does not compile without the define);
#  - a model-tier program builds with `pkg-config kvpq_model` and runs;
#  - both build through find_package(kvpq) (kvpq::kvpq, kvpq::kvpq_model) and run.
# usage: install_check.sh BUILD_DIR [CC]     (registered in ctest as install_check)
set -euo pipefail
build=${1:?usage: install_check.sh BUILD_DIR [CC]}
cc=${2:-${CC:-cc}}
prefix=$(mktemp -d "${TMPDIR:-/tmp}/kvpq_install.XXXXXX")
trap 'rm -rf "$prefix"' EXIT
cmake --install "$build" --prefix "$prefix" >/dev/null

pc=$(find "$prefix" -name kvpq.pc -path '*/pkgconfig/*' | head -n1)
[ -n "$pc" ] || { echo "install_check: kvpq.pc not installed" >&2; exit 1; }
libdir=$(dirname "$(dirname "$pc")")
for f in "$prefix/include/kvpq.h" "$prefix/include/kvpq_model.h" "$prefix/bin/kvpq" "$libdir/libkvpq.a" \
  "$libdir/libkvpq.so" "$libdir/libkvpq_model.a" "$libdir/libkvpq_model.so" "$libdir/pkgconfig/kvpq_model.pc" \
  "$libdir/cmake/kvpq/kvpqConfig.cmake" "$libdir/cmake/kvpq/kvpqTargets.cmake"; do
  [ -e "$f" ] || { echo "install_check: missing $f" >&2; exit 1; }
done
export PKG_CONFIG_PATH="$(dirname "$pc")${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
want_version=$(sed -n 's/^#define KVPQ_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\)/\2/p' "$prefix/include/kvpq.h" | paste -sd.)
[ "$(pkg-config --modversion kvpq)" = "$want_version" ] || { echo "install_check: kvpq.pc version != header" >&2; exit 1; }
"$prefix/bin/kvpq" version | grep -q "kvpq $want_version" || { echo "install_check: installed CLI fails" >&2; exit 1; }
# The installed CLI carries a run path to the lib/ beside it, and runs from elsewhere without LD_LIBRARY_PATH.
readelf -d "$prefix/bin/kvpq" | grep -Eq '(RUNPATH|RPATH).*\$ORIGIN/\.\./' ||
  { echo "install_check: installed CLI has no \$ORIGIN/../lib run path" >&2; exit 1; }
(cd / && env -u LD_LIBRARY_PATH "$prefix/bin/kvpq" version >/dev/null) ||
  { echo "install_check: installed CLI fails outside the build tree" >&2; exit 1; }

cat > "$prefix/prog.c" <<'C'
#include <stdio.h>
#include <string.h>
#define KVPQ_ADVANCED /* codebooks built layer by layer: the advanced tier */
#include "kvpq.h"
int main(int argc, char **argv) {
    kvpq_codebook_params p = kvpq_codebook_params_default();
    p.n_layer = 2;
    kvpq_codebook *cb, *back;
    if (kvpq_codebook_new(&cb, &p) != KVPQ_OK) { fprintf(stderr, "%s\n", kvpq_last_error()); return 1; }
    kvpq_codebook_key_smooth(cb, 1)[3] = 2.5f;
    if (kvpq_codebook_save(cb, argv[1]) != KVPQ_OK || kvpq_codebook_load(&back, argv[1]) != KVPQ_OK) {
        fprintf(stderr, "%s\n", kvpq_last_error());
        return 1;
    }
    int ok = kvpq_codebook_key_smooth(back, 1)[3] == 2.5f;
    kvpq_codebook_free(cb);
    kvpq_codebook_free(back);
    printf("kvpq %s %s\n", kvpq_version(), ok ? "ok" : "MISMATCH");
    return ok && argc == 2 ? 0 : 1;
}
C
# Shared: exactly what a user types.
"$cc" -std=c11 -Wall -Werror -o "$prefix/prog_shared" "$prefix/prog.c" $(pkg-config --cflags --libs kvpq)
LD_LIBRARY_PATH="$libdir" "$prefix/prog_shared" "$prefix/a.safetensors" | grep -q " ok$"
# The stable tier alone: a q8_0 cache appended, attended, saved and loaded back, attention unchanged.
cat > "$prefix/prog_stable.c" <<'C'
#include <stdio.h>
#include <string.h>
#include "kvpq.h"
int main(int argc, char **argv) {
    kvpq_cache_params p = kvpq_cache_params_default();
    p.type = KVPQ_CACHE_Q8_0; p.n_layer = 1; p.n_head = 2; p.n_head_kv = 1; p.head_dim = 32; p.max_seq = 64;
    float k[4 * 32], v[4 * 32], q[2 * 32], a[2 * 32], b[2 * 32];
    for (int i = 0; i < 4 * 32; i++) { k[i] = (float)((i * 7) % 13) / 13.0f; v[i] = (float)((i * 5) % 11) / 11.0f; }
    for (int i = 0; i < 2 * 32; i++) q[i] = (float)((i * 3) % 7) / 7.0f;
    kvpq_cache *c, *back;
    if (kvpq_cache_new(&c, &p) != KVPQ_OK || kvpq_cache_append(c, 0, 4, k, v) != KVPQ_OK ||
        kvpq_cache_attend(c, 0, 1, q, a) != KVPQ_OK || kvpq_cache_save(c, argv[1], NULL, 0) != KVPQ_OK ||
        kvpq_cache_load(&back, &p, argv[1], NULL, NULL) != KVPQ_OK || kvpq_cache_attend(back, 0, 1, q, b) != KVPQ_OK) {
        fprintf(stderr, "%s\n", kvpq_last_error());
        return 1;
    }
    int ok = memcmp(a, b, sizeof a) == 0 && kvpq_cache_seq_len(back, 0) == 4;
    kvpq_cache_free(c);
    kvpq_cache_free(back);
    printf("kvpq stable tier %s\n", ok ? "ok" : "MISMATCH");
    return ok && argc == 2 ? 0 : 1;
}
C
"$cc" -std=c11 -Wall -Werror -o "$prefix/prog_stable" "$prefix/prog_stable.c" $(pkg-config --cflags --libs kvpq)
LD_LIBRARY_PATH="$libdir" "$prefix/prog_stable" "$prefix/s.kvpq" | grep -q " ok$"
printf '#include "kvpq.h"\nint main(void) { kvpq_pq *pq; return kvpq_pq_new(&pq, 0); }\n' > "$prefix/prog_hidden.c"
if "$cc" -std=c11 -Werror=implicit-function-declaration -c -o /dev/null "$prefix/prog_hidden.c" \
     $(pkg-config --cflags kvpq) 2>/dev/null; then
  echo "install_check: kvpq.h declares the advanced tier without KVPQ_ADVANCED" >&2; exit 1
fi
# Static: the archive plus the private dependencies kvpq.pc lists.
static_libs=$(pkg-config --static --libs kvpq | sed 's/\(^\| \)-lkvpq\( \|$\)/ /')
"$cc" -std=c11 -Wall -Werror -o "$prefix/prog_static" "$prefix/prog.c" $(pkg-config --cflags kvpq) \
  "$libdir/libkvpq.a" $static_libs
if ldd "$prefix/prog_static" | grep -q libkvpq; then echo "install_check: static program needs libkvpq.so" >&2; exit 1; fi
"$prefix/prog_static" "$prefix/b.safetensors" | grep -q " ok$"
# The first tier alone: no PCRE2, no OpenBLAS, in the link line, the loaded libraries or the binary.
if pkg-config --static --libs kvpq | grep -qE 'pcre2|openblas'; then
  echo "install_check: kvpq.pc links PCRE2 or OpenBLAS: $(pkg-config --static --libs kvpq)" >&2; exit 1
fi
if ldd "$prefix/prog_shared" | grep -qE 'pcre2|openblas'; then
  echo "install_check: a kvpq.h program loads PCRE2 or OpenBLAS:" >&2; ldd "$prefix/prog_shared" >&2; exit 1
fi
if nm "$prefix/prog_static" | grep -iE 'pcre2_|cblas_' >/dev/null; then  # no -q: an early grep exit + pipefail would hide a match
  echo "install_check: the static kvpq.h program contains PCRE2 or BLAS symbols" >&2; exit 1
fi

# The model tier: kvpq_model.h, pkg-config kvpq_model (which requires kvpq).
cat > "$prefix/prog_model.c" <<'C'
#include <stdio.h>
#include <string.h>
#include "kvpq_model.h"
int main(int argc, char **argv) {
    kvpq_vocab *v = NULL;
    kvpq_status s = kvpq_vocab_load(&v, argv[1]); /* no such file: a named I/O error, not a crash */
    int ok = s == KVPQ_ERR_IO && v == NULL && strstr(kvpq_last_error(), argv[1]) != NULL;
    kvpq_cache_params cp = kvpq_cache_params_default(); /* the first tier through the second's header */
    printf("kvpq_model %s %s\n", kvpq_version(), ok && cp.max_seq > 0 ? "ok" : "MISMATCH");
    return ok && argc == 2 ? 0 : 1;
}
C
"$cc" -std=c11 -Wall -Werror -o "$prefix/prog_model" "$prefix/prog_model.c" $(pkg-config --cflags --libs kvpq_model)
LD_LIBRARY_PATH="$libdir" "$prefix/prog_model" "$prefix/none.gguf" | grep -q " ok$"

# find_package(kvpq): both tiers from a CMake project.
mkdir -p "$prefix/cmk"
cat > "$prefix/cmk/CMakeLists.txt" <<'CM'
cmake_minimum_required(VERSION 3.20)
project(kvpq_consumer C)
find_package(kvpq REQUIRED)
add_executable(prog ../prog.c)
target_link_libraries(prog PRIVATE kvpq::kvpq)
add_executable(prog_model ../prog_model.c)
target_link_libraries(prog_model PRIVATE kvpq::kvpq_model)
add_executable(prog_static ../prog.c)
target_link_libraries(prog_static PRIVATE kvpq::kvpq_static)
CM
cmake -S "$prefix/cmk" -B "$prefix/cmk/build" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_C_COMPILER="$cc" >/dev/null
cmake --build "$prefix/cmk/build" >/dev/null
LD_LIBRARY_PATH="$libdir" "$prefix/cmk/build/prog" "$prefix/c.safetensors" | grep -q " ok$"
LD_LIBRARY_PATH="$libdir" "$prefix/cmk/build/prog_model" "$prefix/none.gguf" | grep -q " ok$"
"$prefix/cmk/build/prog_static" "$prefix/d.safetensors" | grep -q " ok$"
if ldd "$prefix/cmk/build/prog" | grep -qE 'pcre2|openblas'; then
  echo "install_check: kvpq::kvpq pulls in PCRE2 or OpenBLAS" >&2; exit 1
fi
echo "install_check: ok ($prefix: both tiers' headers, libraries, .pc files and CMake package, CLI; kvpq.h programs" \
  "(pkg-config shared/static, find_package) build, run and link neither PCRE2 nor OpenBLAS; kvpq_model.h programs too)"
