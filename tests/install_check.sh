#!/usr/bin/env bash
# Install the build tree into a temporary prefix (cmake --install --prefix), then check that the
# library (static and shared), header, CLI and kvpq.pc are there, and that a small program builds
# with `pkg-config --cflags --libs kvpq` (shared) and against libkvpq.a (static), and runs.
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
for f in "$prefix/include/kvpq.h" "$prefix/bin/kvpq" "$libdir/libkvpq.a" "$libdir/libkvpq.so"; do
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
# Static: the archive plus the private dependencies kvpq.pc lists.
static_libs=$(pkg-config --static --libs kvpq | sed 's/\(^\| \)-lkvpq\( \|$\)/ /')
"$cc" -std=c11 -Wall -Werror -o "$prefix/prog_static" "$prefix/prog.c" $(pkg-config --cflags kvpq) \
  "$libdir/libkvpq.a" $static_libs
if ldd "$prefix/prog_static" | grep -q libkvpq; then echo "install_check: static program needs libkvpq.so" >&2; exit 1; fi
"$prefix/prog_static" "$prefix/b.safetensors" | grep -q " ok$"
echo "install_check: ok ($prefix: lib, header, CLI, kvpq.pc; shared and static programs build and run)"
