"""The cffi binding against the C compiler: every struct of the public header(s) has the same size
and field offsets in Python (cffi) as in C, every declared function resolves in the library, and the
declarations come from whatever kvpq*.h files the include folder holds (a split header too).

The binding holds no copy of the header (kvpq._ffi builds its cdef from the header text), so a header
change reaches Python by construction; what could still disagree is cffi's layout of a struct with
the compiler's (packing, enum size, nested structs), which this test compiles a program to check.
The hand-written ctypes mirrors this replaced had drifted: a 48-byte kvpq_cache_params against C's 56.
"""
import os
import shutil
import subprocess

import pytest

import kvpq
from kvpq import _ffi

CC = os.environ.get("CC", "cc")


def struct_typedefs():
    names = []
    for t in _ffi.ffi.list_types()[0]:
        ty = _ffi.ffi.typeof(t)
        if ty.kind == "struct" and ty.fields is not None:  # opaque handles (kvpq_cache) have no layout
            names.append(t)
    return sorted(names)


def test_header_has_structs_and_functions():
    names = struct_typedefs()
    for want in ("kvpq_cache_params", "kvpq_codebook_params", "kvpq_pq_params", "kvpq_kmeans_params",
                 "kvpq_calibrate_params", "kvpq_cuda_cache_params"):
        assert want in names


@pytest.mark.skipif(shutil.which(CC) is None, reason=f"no C compiler '{CC}'")
def test_struct_sizes_and_offsets_equal_the_compilers(tmp_path):
    ffi = _ffi.ffi
    lines, expect = [], []
    for name in struct_typedefs():
        lines.append(f'    printf("%zu\\n", sizeof({name}));')
        expect.append((name, None, ffi.sizeof(name)))
        for fname, field in ffi.typeof(name).fields:
            lines.append(f'    printf("%zu\\n", offsetof({name}, {fname}));')
            expect.append((name, fname, field.offset))
    src = tmp_path / "layout.c"
    includes = "".join(f'#include "{h.name}"\n' for h in _ffi.HEADERS)
    src.write_text("#include <stddef.h>\n#include <stdio.h>\n" + includes + "int main(void) {\n" + "\n".join(lines)
                   + "\n    return 0;\n}\n")
    exe = tmp_path / "layout"
    subprocess.run([CC, "-std=c11", "-DKVPQ_ADVANCED", "-I", _ffi.INCLUDE_DIR, str(src), "-o", str(exe)], check=True)
    got = [int(x) for x in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()]
    assert len(got) == len(expect)
    bad = [f"{n}.{f or 'sizeof'}: C {g}, cffi {e}" for (n, f, e), g in zip(expect, got) if e != g]
    assert not bad, bad
    # the struct the old ctypes mirrors got wrong
    assert ffi.sizeof("kvpq_cache_params") == got[[i for i, e in enumerate(expect)
                                                   if e[:2] == ("kvpq_cache_params", None)][0]]


def test_every_declared_function_resolves():
    missing = []
    for name in dir(_ffi.lib):
        if name.startswith("kvpq_"):
            try:
                getattr(_ffi.lib, name)
            except AttributeError:
                missing.append(name)
    assert not missing
    assert len([n for n in dir(_ffi.lib) if n.startswith("kvpq_")]) > 80


def test_one_header_or_several_give_the_same_declarations(tmp_path):
    """The binding reads whatever kvpq*.h the include folder holds: the API in one kvpq.h, or split
    into kvpq.h + kvpq_model.h (which includes it), declares the same names and layouts."""
    hs = _ffi.header_files(_ffi.INCLUDE_DIR)
    assert hs[0].name == "kvpq.h"
    texts = [h.read_text() for h in hs]
    if len(hs) == 1:  # make a split: the model section to kvpq_model.h
        text = texts[0]
        cut, end = text.index("/* ---- models (GGUF"), text.index("#ifdef __cplusplus\n}")
        one = [text]
        several = [text[:cut] + text[end:], '#ifndef KVPQ_MODEL_H\n#define KVPQ_MODEL_H\n#include "kvpq.h"\n'
                   '#ifdef __cplusplus\nextern "C" {\n#endif\n' + text[cut:end] + '#ifdef __cplusplus\n}\n#endif\n#endif\n']
    else:  # merge the split into one file
        several = texts
        one = ["\n".join(t.replace('#include "kvpq.h"', "") for t in texts)]
    for name, t in zip(["kvpq.h", "kvpq_model.h"], several):
        (tmp_path / name).write_text(t)
    assert [h.name for h in _ffi.header_files(tmp_path)] == ["kvpq.h", "kvpq_model.h"][:len(several)]
    a, b = _ffi.cffi.FFI(), _ffi.cffi.FFI()
    a.cdef("\n".join(_ffi.cdef_from_header(t) for t in several))
    b.cdef("\n".join(_ffi.cdef_from_header(t) for t in one))
    assert sorted(a.list_types()[0]) == sorted(b.list_types()[0])
    assert a.sizeof("kvpq_model_info") == b.sizeof("kvpq_model_info") == _ffi.ffi.sizeof("kvpq_model_info")
    assert hasattr(_ffi.lib, "kvpq_model_load") and hasattr(_ffi.lib, "kvpq_cache_new")


def test_version_matches_header():
    assert kvpq.version() == f"{_ffi.lib.KVPQ_VERSION_MAJOR}.{_ffi.lib.KVPQ_VERSION_MINOR}.{_ffi.lib.KVPQ_VERSION_PATCH}"
