"""kvpq inside Hugging Face transformers: a KV cache that stores product-quantization codes and an
attention function that computes attention from them.

    import kvpq
    from kvpq.transformers import KVPQCache
    model = AutoModelForCausalLM.from_pretrained(...)           # CPU, float32
    cb = kvpq.transformers.calibrate(model, tokenizer, text, "d4b8")   # or kvpq.Codebook.load(path)
    out = model.generate(ids, past_key_values=KVPQCache(cb, model), max_new_tokens=64)

How it fits transformers (v5): KVPQCache is a `transformers.Cache` whose layers hand each new token's
post-RoPE keys and values to a kvpq VQ cache (kvpq_cache_append: codes, plus the newest `window`
positions in float32) and return only those new tokens' own tensors, never a float copy of the coded
ones. The attention function registered under the name "kvpq" (AttentionInterface) recognizes them
and calls kvpq_cache_attend, which scores the coded keys through per-query lookup tables and sums the
coded values per centroid (VecInfer, arXiv 2510.06175). `KVPQCache(codebook, model)` switches the
model's attention implementation to "kvpq" (for any other cache the "kvpq" function falls back to
transformers' SDPA, so the model keeps working with DynamicCache).

Limits (errors say so): batch size 1 (one sequence per cache); the CPU library (CUDA tensors are
moved to the CPU and back: the device-resident kvpq_cuda_cache is not wired here yet); causal
attention without sliding window, logit soft-capping or attention sinks; the codebook's head_dim,
n_head_kv and n_layer must be the model's.
"""
import threading

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from . import _core

ATTN_NAME = "kvpq"
# model_type of transformers models whose GGUF files (convert_hf_to_gguf) permute the Q/K rows so
# that rotary pairs are adjacent: kvpq's engine sees their keys with channels (2i, 2i+1) paired.
_GGUF_INTERLEAVED = ("llama", "mistral", "granite")

# Tensors a KVPQ layer's update() returned, by id, to the layer that can attend over them. The entry
# lives from update() to the attention call of the same layer (the tensor is alive in between, so its
# id cannot be reused); thread-local so two models generating in two threads do not mix.
_pending = threading.local()


def _pending_map():
    if not hasattr(_pending, "m"):
        _pending.m = {}
    return _pending.m


def _to_numpy_rows(x):
    """(1, heads, n, head_dim) torch -> (n, heads, head_dim) float32 C-contiguous numpy (may share
    memory with x: read only)."""
    return np.ascontiguousarray(x[0].detach().to("cpu", torch.float32).transpose(0, 1).numpy())


class KVPQLayer(CacheLayerMixin):
    """One model layer of a KVPQCache: a view of layer `layer_idx` of the shared kvpq.Cache."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, owner, layer_idx):
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx

    def lazy_initialization(self, key_states, value_states):
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != 1:
            raise _core.Error(_core.ERR_INVALID_ARG, f"batch size {key_states.shape[0]}: a KVPQCache holds one "
                                                     "sequence (batch size 1)", "KVPQCache.update")
        c = self.owner.kv_cache(key_states)
        c.append(self.layer_idx, self.owner._key_order(_to_numpy_rows(key_states)), _to_numpy_rows(value_states))
        _pending_map()[id(key_states)] = (self.owner, self.layer_idx)
        return key_states, value_states

    def get_seq_length(self):
        c = self.owner._cache
        return 0 if c is None else c.seq_len(self.layer_idx)

    def get_mask_sizes(self, query_length):
        return self.get_seq_length() + query_length, 0

    def get_max_length(self):
        return -1 if self.owner._cache is None else self.owner._cache.max_seq

    def reset(self):
        if self.owner._cache is not None:
            self.owner._cache.truncate(0)

    def crop(self, tokens_to_remove):
        c = self.owner._cache
        if c is None:
            return
        n = c.seq_len(self.layer_idx)
        keep = n + tokens_to_remove if tokens_to_remove < 0 else n - tokens_to_remove
        if self.layer_idx == 0:  # kvpq_cache_truncate cuts every layer at once
            c.truncate(max(keep, 0))

    def reorder_cache(self, beam_idx):
        if beam_idx.numel() != 1 or int(beam_idx[0]) != 0:
            raise _core.Error(_core.ERR_INVALID_ARG, "beam search needs batch size > 1, which a KVPQCache does not "
                                                     "hold", "KVPQCache.reorder_cache")

    def batch_repeat_interleave(self, repeats):
        if repeats != 1:
            raise _core.Error(_core.ERR_INVALID_ARG, f"repeat {repeats}: a KVPQCache holds one sequence",
                              "KVPQCache.batch_repeat_interleave")

    def batch_select_indices(self, indices):
        if indices.numel() != 1:
            raise _core.Error(_core.ERR_INVALID_ARG, "a KVPQCache holds one sequence", "KVPQCache.batch_select_indices")


class KVPQCache(Cache):
    """A transformers Cache holding keys and values as kvpq product-quantization codes.

    codebook: a kvpq.Codebook for this model (kvpq.transformers.calibrate, `kvpq calibrate`, or
      Codebook.load); its n_layer, n_head_kv and head_dim must be the model's.
    model: optional; when given, its attention implementation is set to "kvpq" (else call
      kvpq.transformers.use_kvpq_attention(model) once), and n_head / max_seq are read from its config.
    window: newest positions kept in float32 beside the codes (default 128, the library's).
    max_seq: positions the cache may hold (default: the model's max_position_embeddings, else 32768).
    n_head: query heads (needed when model is not given; else from the model's config).
    n_threads: kvpq threads (0 = OpenMP default).
    key_layout: channel order of the codebook's keys, "hf" or "gguf" (default: the codebook's
      key_layout metadata, else "gguf": a codebook from `kvpq calibrate` on the model's GGUF file).
    """

    def __init__(self, codebook, model=None, window=None, max_seq=None, n_head=None, n_threads=0, fast_scan=False,
                 key_layout=None):
        if not isinstance(codebook, _core.Codebook):
            raise _core.Error(_core.ERR_INVALID_ARG, f"codebook: expected a kvpq.Codebook, got {type(codebook).__name__}",
                              "KVPQCache")
        self.codebook = codebook
        n = codebook.n_layer
        super().__init__(layers=[KVPQLayer(self, i) for i in range(n)])
        cfg = getattr(model, "config", None)
        if cfg is not None:
            cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
            self._check_config(cfg)
            n_head = n_head or cfg.num_attention_heads
            max_seq = max_seq or getattr(cfg, "max_position_embeddings", None)
            use_kvpq_attention(model)
        self.n_head = n_head
        self.max_seq = max_seq or 32768
        self.window, self.n_threads, self.fast_scan = window, n_threads, fast_scan
        # Channel order of the codebook's keys: "hf" (kvpq.transformers.calibrate writes key_layout=hf)
        # or the GGUF engine's (`kvpq calibrate`), which for the llama architecture interleaves the
        # rotary pairs; key_layout="hf" or "gguf" overrides.
        layout = key_layout or codebook.get_meta("key_layout") or "gguf"
        if layout not in ("hf", "gguf"):
            raise _core.Error(_core.ERR_INVALID_ARG, f"key_layout: '{layout}': expected 'hf' or 'gguf'", "KVPQCache")
        model_type = getattr(cfg, "model_type", None) if cfg is not None else None
        self.interleave = layout == "gguf" and model_type in _GGUF_INTERLEAVED
        self._cache = None

    def _check_config(self, cfg):
        cb = self.codebook
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        got = (cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", cfg.num_attention_heads), hd)
        if got != (cb.n_layer, cb.n_head_kv, cb.head_dim):
            raise _core.Error(lib_mismatch(), f"codebook has n_layer {cb.n_layer}, n_head_kv {cb.n_head_kv}, head_dim "
                                              f"{cb.head_dim}; the model has {got[0]}, {got[1]}, {got[2]}", "KVPQCache")
        unsupported = []
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
            unsupported.append(f"sliding_window={cfg.sliding_window}")
        if getattr(cfg, "attn_logit_softcapping", None):
            unsupported.append(f"attn_logit_softcapping={cfg.attn_logit_softcapping}")
        if unsupported:
            raise _core.Error(_core.lib.KVPQ_ERR_UNSUPPORTED, f"the model uses {', '.join(unsupported)}, which kvpq "
                              "attention does not implement", "KVPQCache")

    def _key_order(self, x):
        """Keys and queries (n, heads, head_dim) in the codebook's channel order. transformers
        keeps Llama's rotary pairs as (i, i + head_dim/2) ("rotate_half"); GGUF files of the llama
        architecture, and so kvpq's engine and `kvpq calibrate`, hold them as (2i, 2i+1). q . k is the
        same in either order, but a codebook's per-channel mean, smoothing factors and sub-vectors
        are not: a codebook calibrated by the engine is applied to keys put in its order."""
        if not self.interleave:
            return x
        n, h, d = x.shape
        return np.ascontiguousarray(x.reshape(n, h, 2, d // 2).swapaxes(2, 3).reshape(n, h, d))

    def kv_cache(self, like=None):
        """The underlying kvpq.Cache (made at the first update, when the query head count is known)."""
        if self._cache is None:
            if self.n_head is None:
                raise _core.Error(_core.ERR_INVALID_ARG, "n_head: unknown; pass model= or n_head= to KVPQCache",
                                  "KVPQCache")
            cb = self.codebook
            self._cache = _core.Cache("vq", cb.n_layer, self.n_head, cb.n_head_kv, cb.head_dim, self.max_seq,
                                      codebook=cb, window=self.window, n_threads=self.n_threads,
                                      fast_scan=self.fast_scan)
        return self._cache

    @property
    def resident_bytes(self):
        """Bytes the kvpq cache holds for K and V (codes, float32 window, norms, codebooks)."""
        return 0 if self._cache is None else self._cache.resident_bytes

    def stats(self):
        return {} if self._cache is None else self._cache.stats()

    def attend(self, layer_idx, query, scaling):
        """Attention output (1, n_q, n_head, head_dim) for query (1, n_head, n_q, head_dim) over every
        position of layer layer_idx (the newest n_q are the query's own: causal)."""
        c = self._cache
        q = self._key_order(_to_numpy_rows(query))
        d = q.shape[-1]
        scale_fix = float(scaling) * d ** 0.5  # kvpq uses 1/sqrt(head_dim)
        if abs(scale_fix - 1.0) > 1e-6:
            q = q * np.float32(scale_fix)  # not in place: q may share the model's query tensor
        out = c.attend(layer_idx, q)  # (n_q, n_head, head_dim)
        return torch.from_numpy(out).unsqueeze(0).to(query.device, query.dtype)


def lib_mismatch():
    return _core.lib.KVPQ_ERR_MISMATCH


def kvpq_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention function registered as "kvpq" (transformers AttentionInterface). For key/value
    tensors a KVPQCache layer just stored, attention comes from the kvpq cache (codes + window);
    for anything else (no cache, another Cache class) it is transformers' SDPA attention."""
    entry = _pending_map().pop(id(key), None)
    if entry is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    cache, layer_idx = entry
    for name in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise _core.Error(_core.lib.KVPQ_ERR_UNSUPPORTED, f"{name}={kwargs[name]} is not implemented by kvpq "
                                                              "attention", "kvpq_attention_forward")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return cache.attend(layer_idx, query, scaling), None


_registered = False


def register():
    """Register the "kvpq" attention function (and its mask function: SDPA's, for the fallback) with
    transformers. Idempotent; KVPQCache(model=...) calls it."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTN_NAME, kvpq_attention_forward)
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, sdpa_mask)
        _registered = True


def use_kvpq_attention(model):
    """Set a model's attention implementation to "kvpq"."""
    register()
    if getattr(model.config, "_attn_implementation", None) != ATTN_NAME:
        model.set_attn_implementation(ATTN_NAME)


# ---- calibration from a transformers model ------------------------------------------------------------

class _Collect(Cache):
    """A cache that records every layer's post-RoPE keys and values (float32, CPU) of one forward
    pass and returns them for exact attention, as DynamicCache does."""

    def __init__(self, n_layer):
        super().__init__(layers=[_CollectLayer() for _ in range(n_layer)])


class _CollectLayer(CacheLayerMixin):
    is_sliding = False

    def __init__(self):
        super().__init__()
        self.k, self.v = [], []

    def lazy_initialization(self, key_states, value_states):
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        self.is_initialized = True
        self.k.append(key_states)
        self.v.append(value_states)
        return torch.cat(self.k, dim=-2), torch.cat(self.v, dim=-2)

    def get_seq_length(self):
        return sum(k.shape[-2] for k in self.k)

    def get_mask_sizes(self, query_length):
        return self.get_seq_length() + query_length, 0

    def get_max_length(self):
        return -1


def collect_kv(model, input_ids, ctx=2048):
    """Post-RoPE keys and values of every layer for input_ids (n,) or (1, n), run in chunks of
    `ctx` tokens each from an empty cache (as `kvpq calibrate --ctx`). Returns a list over layers of
    (k, v), each (n, n_head_kv, head_dim) float32 numpy."""
    ids = torch.as_tensor(input_ids).reshape(1, -1)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n_layer = cfg.num_hidden_layers
    ks, vs = [[] for _ in range(n_layer)], [[] for _ in range(n_layer)]
    with torch.no_grad():
        for p0 in range(0, ids.shape[1], ctx):
            col = _Collect(n_layer)
            model(ids[:, p0:p0 + ctx], past_key_values=col, use_cache=True)
            for i, layer in enumerate(col.layers):
                ks[i].append(_to_numpy_rows(torch.cat(layer.k, dim=-2)))
                vs[i].append(_to_numpy_rows(torch.cat(layer.v, dim=-2)))
    return [(np.concatenate(ks[i]), np.concatenate(vs[i])) for i in range(n_layer)]


def calibrate(model, tokenizer, text, preset="d4b8", tokens=32768, ctx=2048, **kw):
    """Train a kvpq.Codebook for a transformers model on its own keys and values over `text`:
    the first `tokens` tokens (tokenizer without special tokens, as `kvpq calibrate`), run in chunks
    of `ctx`, then kvpq.calibrate (centering, smoothing, Hadamard, normalization, k-means per layer)
    with key preset `preset` (values too unless values= is given). Other keywords go to
    kvpq.calibrate. Returns the Codebook."""
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0][:tokens]
    if ids.numel() < 16:
        raise _core.Error(_core.ERR_INVALID_ARG, f"text: {ids.numel()} tokens (need at least 16)", "calibrate")
    kv = collect_kv(model, ids, ctx)
    meta = {"tokens": ids.numel(), "ctx": ctx, "model": getattr(model.config, "_name_or_path", ""),
            "key_layout": "hf"}
    meta.update(kw.pop("meta", {}) or {})
    return _core.calibrate(kv, keys=preset, meta=meta, **kw)
