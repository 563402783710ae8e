#!/usr/bin/env python3
"""gguf_slice_layers.py — a GGUF model cut to its first N transformer blocks (metadata and every
non-block tensor kept, <arch>.block_count set to N), for runs where the whole model cannot travel
(the GPU machine takes at most 64 MiB per call: SmolLM2-135M's 94 MB does not, its first 4 blocks
do). Its outputs are not the model's; it serves comparisons of two cache backends on one model.

Usage: bench/gguf_slice_layers.py IN.gguf OUT.gguf N
Uses the gguf package (llama.cpp's gguf-py, PyPI `gguf`) to read and write."""
import re
import sys

import gguf


def main(src, dst, n):
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"]
    arch = bytes(arch.parts[arch.data[0]]).decode()
    w = gguf.GGUFWriter(dst, arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == f"{arch}.block_count":
            w.add_uint32(name, n)
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            et = f.types[1]
            if et == gguf.GGUFValueType.STRING:
                vals = [bytes(f.parts[i]).decode("utf-8", "surrogateescape") for i in f.data]
            else:
                vals = [f.parts[i].tolist()[0] for i in f.data]
            w.add_key_value(name, vals, vt, sub_type=et)
        elif vt == gguf.GGUFValueType.STRING:
            w.add_key_value(name, bytes(f.parts[f.data[0]]).decode("utf-8", "surrogateescape"), vt)
        else:
            w.add_key_value(name, f.parts[f.data[0]].tolist()[0], vt)
    for t in r.tensors:
        m = re.match(r"blk\.(\d+)\.", t.name)
        if m and int(m.group(1)) >= n:
            continue
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
