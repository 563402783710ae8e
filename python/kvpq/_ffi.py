"""cffi binding of libkvpq, declared from the C header itself.

The declarations handed to cffi are the public header(s) (include/kvpq*.h) with comments and
preprocessor lines removed: struct layouts, enums and signatures are never copied by hand, so the
binding cannot drift from the library it loads. cffi's ABI mode (dlopen) lays out the structs by
the platform's C rules; tests/python/test_binding_layout.py compiles a C program against the same
header and checks every struct's size and field offsets against cffi's.

Where the library and header are found (first hit wins):
  1. KVPQ_LIB (path of libkvpq.so or libkvpq_model.so; the other is looked for beside it) and
     KVPQ_INCLUDE (folder of kvpq.h and kvpq_model.h); KVPQ_INCLUDE defaults to the
     source tree's include/ when KVPQ_SOURCE_DIR is set, else to the package's own include/;
  2. the copies `pip install` put in the package: kvpq/lib/libkvpq*.so, kvpq/include/kvpq*.h;
  3. a source checkout: <repo>/build/libkvpq.so and <repo>/include (python/kvpq/ inside <repo>).
"""
import os
import re
from pathlib import Path

import cffi

_PKG = Path(__file__).resolve().parent
_REPO = _PKG.parents[1]


def _find():
    """(library path, include folder)."""
    lib = os.environ.get("KVPQ_LIB")
    inc = os.environ.get("KVPQ_INCLUDE")
    if not inc and os.environ.get("KVPQ_SOURCE_DIR"):
        inc = str(Path(os.environ["KVPQ_SOURCE_DIR"]) / "include")
    if lib:
        if not inc:
            inc = str(_PKG / "include") if (_PKG / "include" / "kvpq.h").exists() else str(_REPO / "include")
        return lib, inc
    cand = _PKG / "lib" / "libkvpq.so"
    if cand.exists():
        return str(cand), inc or str(_PKG / "include")
    cand = _REPO / "build" / "libkvpq.so"
    if cand.exists():
        return str(cand), inc or str(_REPO / "include")
    raise ImportError("kvpq: libkvpq not found: install the package (pip install kvpq, or pip install . in the "
                      "repository) or set KVPQ_LIB to "
                      "build/libkvpq.so of a CMake build")


def header_files(inc):
    """The public headers in load order: kvpq.h first (the others include it), then the rest by name."""
    inc = Path(inc)
    main = inc / "kvpq.h"
    if not main.exists():
        raise ImportError(f"kvpq: header {main} not found (set KVPQ_INCLUDE)")
    return [main] + sorted(p for p in inc.glob("kvpq*.h") if p.name != "kvpq.h")


_INT_DEFINE = re.compile(r"#\s*define\s+(KVPQ_\w+)\s+(-?\d+)\s*$")


def cdef_from_header(text):
    """Header text -> cffi cdef text: comments removed, preprocessor lines dropped (integer
    #defines kept, which cffi understands), the bodies of `#ifdef __cplusplus` blocks dropped, and
    the KVPQ_API visibility macro erased."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    out, skip = [], []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("#"):
            d = s[1:].strip()
            if d.startswith(("if", "ifdef", "ifndef")):
                skip.append(d.startswith("ifdef") and "__cplusplus" in d)
            elif d.startswith("endif"):
                skip.pop()
            else:
                m = _INT_DEFINE.match(s)
                if m and not any(skip):
                    out.append(f"#define {m.group(1)} {m.group(2)}")
            continue
        if any(skip):
            continue
        out.append(line)
    return re.sub(r"\bKVPQ_API\b", "", "\n".join(out))


def _openblas_coretype():
    """OpenBLAS 0.3.21 (Debian 12) does not recognize some recent CPUs and falls back to SSE3 kernels
    (3.6x slower prefill); it reads OPENBLAS_CORETYPE once, when it loads, so set it before loading
    libkvpq (the CLI does the same, tools/cli_env.c). A value the user set is kept."""
    if "OPENBLAS_CORETYPE" in os.environ:
        return
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(l for l in f if l.startswith("flags")).split()
    except (OSError, StopIteration):
        return
    if all(f in flags for f in ("avx512f", "avx512bw", "avx512dq", "avx512vl")):
        os.environ["OPENBLAS_CORETYPE"] = "SkylakeX"
    elif "avx2" in flags and "fma" in flags:
        os.environ["OPENBLAS_CORETYPE"] = "Haswell"


def _openblas_threads():
    """OpenBLAS's own thread pool beside kvpq's OpenMP threads: one thread, as the CLI sets it
    (tools/cli_env.c), so that the package and the CLI split the prefill's sgemm alike and give the
    same bits (with OpenBLAS's default of one thread per core the logits differed in the last bits,
    and a 2-bit cache's codes amplify that). Read when libopenblas loads; a value the user set is kept."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


LIB_PATH, INCLUDE_DIR = _find()
HEADERS = header_files(INCLUDE_DIR)
CDEF = "\n".join(cdef_from_header(h.read_text()) for h in HEADERS)

ffi = cffi.FFI()
ffi.cdef(CDEF)
def _libraries(path):
    """(core, model) library paths from the one found: libkvpq.so (include/kvpq.h) and, beside it,
    libkvpq_model.so (include/kvpq_model.h: GGUF, tokenizer, forward pass), which depends on the
    core. KVPQ_LIB may name either. A build with one library (both APIs in libkvpq.so) has no model
    file: then model is None."""
    p = Path(path)
    if p.name.startswith("libkvpq_model"):
        core = p.with_name(p.name.replace("libkvpq_model", "libkvpq", 1))
        return (str(core) if core.exists() else None), str(p)
    model = p.with_name(p.name.replace("libkvpq", "libkvpq_model", 1))
    return str(p), (str(model) if model.exists() else None)


_openblas_coretype()
_openblas_threads()
CORE_PATH, MODEL_PATH = _libraries(LIB_PATH)
# The core first and global: libkvpq_model.so's dependency on it (by SONAME) then resolves to it
# wherever the files lie. Symbols are looked up through the last library opened, whose handle also
# searches its dependencies.
# RTLD_NODELETE: the libraries stay mapped until the process ends. At interpreter teardown the module
# dicts are cleared and the library objects die (cffi then dlcloses them) before the last garbage
# collection frees the handles that ffi.gc gave a destructor from these libraries (kvpq_cache_free,
# kvpq_model_free, ...): without it that destructor jumped into unmapped code (SIGSEGV after the
# full test_transformers.py run; core dump: cdatagcp_finalize -> ffi_call into an address no
# library held, libkvpq*.so no longer loaded). tests/python/test_python_api.py checks it.
_FLAGS = ffi.RTLD_NOW | getattr(os, "RTLD_NODELETE", 0)
_core_lib = ffi.dlopen(CORE_PATH, ffi.RTLD_GLOBAL | _FLAGS) if CORE_PATH else None
lib = ffi.dlopen(MODEL_PATH, _FLAGS) if MODEL_PATH else _core_lib
