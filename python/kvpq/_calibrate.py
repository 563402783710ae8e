"""kvpq.calibrate(model, text, bits=...): the library's calibration driver (kvpq_model.h,
kvpq_model_calibrate), the same call `kvpq calibrate` makes, so the same options give the same file
bytes as the CLI."""
import os
from typing import Any, Callable, List, Optional, Sequence, Union

import numpy as np

from ._ffi import ffi, lib

_GRANULARITY = {"shared": lib.KVPQ_CODEBOOK_SHARED, "subspace": lib.KVPQ_CODEBOOK_SUBSPACE,
                "head": lib.KVPQ_CODEBOOK_HEAD}
_INIT = {"random": lib.KVPQ_KMEANS_INIT_RANDOM, "pp": lib.KVPQ_KMEANS_INIT_PP}
_SELECT = {"auto": lib.KVPQ_WINDOW_SELECT_AUTO, "predicted": lib.KVPQ_WINDOW_SELECT_PREDICTED,
           "measured": lib.KVPQ_WINDOW_SELECT_MEASURED}


def _core():
    from . import _core  # late: _core imports this module
    return _core


def _layers_spec(x, where):
    """keys_layers / values_layers: "CFG:A-B[,...]" as the CLI takes it, or {layer: preset}."""
    if x is None or isinstance(x, str):
        return x
    if isinstance(x, dict):
        return ",".join(f"{preset}:{int(layer)}" for layer, preset in sorted(x.items()))
    raise _core()._arg_error(where, f"expected a 'CFG:A-B,...' string or a {{layer: preset}} dict, got {type(x).__name__}")


def _choice(table, value, name, where):
    if value not in table:
        raise _core()._arg_error(where, f"{name}: {value!r}: expected one of {', '.join(table)}")
    return table[value]


def _recipe(r, keep, where, keys, values, keys2, keys_layers, values_layers, granularity, value_rotate, center,
            smooth_query, key_norm, value_norm, key_rope, norm_bits, iters, init, max_points_per_centroid, seed):
    """Fill the C recipe r; keep collects the C strings (they must outlive the call)."""
    def cstr(s):
        if s is None:
            return ffi.NULL
        b = ffi.new("char[]", str(s).encode())
        keep.append(b)
        return b
    c = _core()
    r.keys, r.values, r.keys2 = cstr(keys), cstr(values), cstr(keys2)
    r.keys_layers = cstr(_layers_spec(keys_layers, where + ": keys_layers"))
    r.values_layers = cstr(_layers_spec(values_layers, where + ": values_layers"))
    r.granularity = _choice(_GRANULARITY, granularity, "granularity", where)
    r.value_rotate, r.center, r.smooth_query = int(bool(value_rotate)), int(bool(center)), int(bool(smooth_query))
    r.key_norm, r.value_norm = int(bool(key_norm)), int(bool(value_norm))
    if isinstance(key_rope, str) and key_rope != "auto":
        raise c._arg_error(where, f"key_rope: {key_rope!r}: expected False, True or 'auto'")
    r.key_rope = lib.KVPQ_KEY_ROPE_CHOOSE if key_rope == "auto" else int(bool(key_rope))
    r.norm_bits = 0 if norm_bits is None else c._int(norm_bits, "norm_bits", where, 8, 16)
    r.iters = c._int(iters, "iters", where, 1)
    r.kmeans_init = _choice(_INIT, init, "init", where)
    r.max_points_per_centroid = c._int(max_points_per_centroid or 0, "max_points_per_centroid", where, 0)
    r.seed = c._int(seed, "seed", where, 0, 2**63 - 1)


def _tokens(model, text, where):
    if isinstance(text, (str, bytes)):
        return model.tokenize(text.decode() if isinstance(text, bytes) else text, add_bos=False)
    ids = np.ascontiguousarray(text, dtype=np.int32)
    if ids.ndim != 1:
        raise _core()._arg_error(where, f"text: expected a str or a 1-D array of token ids, got shape {ids.shape}")
    return ids


def calibrate_model(model: Any, text: Any, bits: Any = None, *, tokens: int = 32768, ctx: int = 2048,
                    n_threads: int = 0, keys: str = "d4b8", values: Optional[str] = None, keys2: Optional[str] = None,
                    keys_layers: Any = None, values_layers: Any = None, granularity: str = "shared",
                    value_rotate: bool = False, center: bool = True, smooth_query: bool = True, key_norm: bool = True,
                    value_norm: bool = True, key_rope: Union[bool, str] = False, norm_bits: Optional[int] = None, iters: int = 25,
                    init: str = "random",
                    max_points_per_centroid: Optional[int] = None, seed: int = 1234,
                    candidates: Optional[Union[str, Sequence[str]]] = None, windows: Optional[Sequence[int]] = None,
                    sinks: int = 1, holdout_ctx: Optional[int] = None, holdout_chunks: int = 1,
                    holdout_repeat: Union[bool, int] = False,
                    full_sensitivity: bool = False, alloc_values: Optional[bool] = None,
                    verify_ctx: Optional[int] = None, window_select: str = "auto", window_trust: float = 0.3,
                    model_file: Optional[str] = None, text_name: Optional[str] = None,
                    progress: Optional[Callable[[str, float, float], Any]] = None,
                    report: Optional[List[dict]] = None) -> Any:
    """Train a model's codebook on a text, as `kvpq calibrate` does (the same library call:
    kvpq_model_calibrate; docs/allocation.md).

    model: a kvpq.Model. text: a str (tokenized without BOS, as the CLI does) or int32 token ids.
    bits: None (one codebook of the recipe `keys`/`values`/...), a budget in effective bits per
      element at context `ctx` (a per-layer allocation among `candidates`, with its fp16 window chosen
      among `windows` and recorded with `sinks` in the codebook: alloc.window / alloc.sinks), or a
      sequence of budgets (one codebook each, from the same measurements).
    The other options are the CLI's (`kvpq calibrate --help`), with the same defaults: tokens
      (--tokens), ctx (--ctx), keys_layers / values_layers ("CFG:A-B,..." or {layer: preset}),
      key_rope (--key-rope: True keys coded before RoPE; "auto" with budgets: chosen per layer), iters, init ("random" or "pp"), holdout_ctx (None: min(ctx, 1024)), holdout_repeat (--holdout-repeat: True is 1, an int
      0..16 the repeated chunk's weight), verify_ctx (None: ctx,
      skipped when the text is too short; 0: off), window_select ("auto", "predicted", "measured").
    model_file, text_name: the file names recorded as metadata (model_file defaults to the Model's).
    progress: None or a callable(stage, done, total) (stages "forward", "k-means", "sensitivity",
      "check"); returning True cancels (kvpq.Error "cancelled").
    report: None or a list that receives one dict per budget (effective_bits, predicted_kl, window,
      holdout_kl, ...; kvpq_alloc_report).
    Returns a Codebook (bits None or a number) or a list of Codebooks (a sequence of budgets).
    Errors: kvpq.Error naming the option; a budget no allocation fits raises (status CAPACITY)."""
    c = _core()
    where = "calibrate"
    if not isinstance(model, c.Model):
        raise c._arg_error(where, f"model: expected a kvpq.Model, got {type(model).__name__}")
    ids = _tokens(model, text, where)
    budgets = [] if bits is None else [float(b) for b in (bits if hasattr(bits, "__len__") else [bits])]
    keep = []
    o = ffi.new("kvpq_calibrate_opts *", lib.kvpq_calibrate_opts_default())
    o.tokens = c._int(tokens, "tokens", where, 16, 2**62)
    o.ctx = c._int(ctx, "ctx", where, 16)
    o.n_threads = c._int(n_threads, "n_threads", where, 0, 1024)
    _recipe(o.recipe, keep, where, keys, values, keys2, keys_layers, values_layers, granularity, value_rotate, center,
            smooth_query, key_norm, value_norm, key_rope, norm_bits, iters, init, max_points_per_centroid, seed)
    _alloc(o.alloc, keep, where, budgets, candidates, windows, sinks, holdout_ctx, holdout_chunks, holdout_repeat,
           full_sensitivity, alloc_values, verify_ctx, window_select, window_trust)
    mf = model_file if model_file is not None else os.path.basename(getattr(model, "path", "") or "") or None
    for field, value in (("model_file", mf), ("text_name", text_name)):
        if value is not None:
            b = ffi.new("char[]", str(value).encode())
            keep.append(b)
            setattr(o, field, b)
    cb_handle = _progress_handle(progress, o, keep)
    n_out = max(1, len(budgets))
    out = ffi.new("kvpq_codebook *[]", n_out)
    rep = ffi.new("kvpq_alloc_report[]", n_out)
    status = lib.kvpq_model_calibrate(model._h, ffi.cast("int32_t *", ids.ctypes.data), len(ids), o, out, rep)
    del cb_handle
    books = [c.Codebook(0, 0, 0, _handle=out[i]) if out[i] != ffi.NULL else None for i in range(n_out)]
    if report is not None and budgets:
        report.extend(_report_dict(rep[i]) for i in range(n_out))
    c._check(status, where)
    return books if bits is not None and hasattr(bits, "__len__") else books[0]


def _alloc(a, keep, where, budgets, candidates, windows, sinks, holdout_ctx, holdout_chunks, holdout_repeat,
           full_sensitivity, alloc_values, verify_ctx, window_select, window_trust):
    c = _core()
    if len(budgets) > 9:
        raise c._arg_error(where, f"bits: at most 9 budgets, got {len(budgets)}")
    if budgets:
        arr = ffi.new("double[]", budgets)
        keep.append(arr)
        a.bits, a.n_bits = arr, len(budgets)
    if candidates is not None:
        b = ffi.new("char[]", (candidates if isinstance(candidates, str) else ",".join(candidates)).encode())
        keep.append(b)
        a.candidates = b
    if windows is not None:
        w = [c._int(x, "windows", where, 0) for x in windows]
        arr = ffi.new("int[]", w)
        keep.append(arr)
        a.windows, a.n_windows = arr, len(w)
    a.sinks = c._int(sinks, "sinks", where, 0)
    a.holdout_ctx = c._int(holdout_ctx or 0, "holdout_ctx", where, 0)
    a.holdout_chunks = c._int(holdout_chunks, "holdout_chunks", where, 1)
    if holdout_repeat is None or isinstance(holdout_repeat, (bool, np.bool_)):
        a.holdout_repeat = int(bool(holdout_repeat))  # the flag's form: True is weight 1
    else:
        a.holdout_repeat = c._int(holdout_repeat, "holdout_repeat", where, 0, lib.KVPQ_HOLDOUT_REPEAT_MAX)
    a.full_sensitivity = int(bool(full_sensitivity))
    a.alloc_values = -1 if alloc_values is None else int(bool(alloc_values))
    a.verify_ctx = -1 if verify_ctx is None else c._int(verify_ctx, "verify_ctx", where, 0)
    a.window_select = _choice(_SELECT, window_select, "window_select", where)
    a.window_trust = float(window_trust)


def _progress_handle(progress, o, keep):
    if progress is None:
        return None

    @ffi.callback("int(void *, const char *, double, double)")
    def cb(user, stage, done, total):
        return 1 if progress(ffi.string(stage).decode(), done, total) else 0
    o.progress = cb
    keep.append(cb)
    return cb


def _report_dict(r):
    n = r.n_windows
    return {"bits": r.bits, "effective_bits": r.effective_bits, "lightest_bits": r.lightest_bits,
            "predicted_kl": r.predicted_kl, "window": r.window, "holdout_kl": r.holdout_kl,
            "holdout_top1": r.holdout_top1, "holdout_ppl": r.holdout_ppl, "base_ppl": r.base_ppl,
            "windows": [r.windows[i] for i in range(n)],
            "predicted_kl_per_window": [r.predicted_kl_w[i] for i in range(n)],
            "measured_kl_per_window": [r.measured_kl_w[i] for i in range(n)]}
