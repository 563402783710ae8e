"""kvpq inside Hugging Face transformers: a KV cache that stores product-quantization codes and an
attention function that computes attention from them.

    import kvpq
    from kvpq.transformers import KVPQCache
    model = AutoModelForCausalLM.from_pretrained(...)           # CPU, float32
    cb = kvpq.transformers.calibrate(model, tokenizer, text, "d4b8")   # or kvpq.Codebook.load(path)
    out = model.generate(ids, past_key_values=KVPQCache(cb, model), max_new_tokens=64)

How it fits transformers (v5): KVPQCache is a `transformers.Cache` whose layers return each new
token's own post-RoPE keys and values, never a float copy of the coded ones. The attention function
registered under the name "kvpq" (AttentionInterface) recognizes them and calls
kvpq_cache_append_attend, which stores them in a kvpq VQ cache (codes, plus the newest `window`
positions in fp16) and attends each query with the cache as it was at its own position, as `kvpq ppl`
and `kvpq generate` do: it scores the coded keys through per-query lookup tables and sums the coded
values per centroid (VecInfer, arXiv 2510.06175). On the CPU an update() whose tensors never reach
that function (the model's attention implementation is not "kvpq") is an error at the next update. `KVPQCache(codebook, model)` switches the
model's attention implementation to "kvpq" (for any other cache the "kvpq" function falls back to
transformers' SDPA, so the model keeps working with DynamicCache).

Limits (errors say so): batch rows may be left-padded (as `generate` pads them; CPU only), nothing else
hidden by the attention mask; no beam search (kvpq caches cannot be copied: refused at the first
update, before the prefill); attention logit soft-capping (Gemma 2) and attention sinks are refused;
on CUDA (kvpq_cuda_cache, when libkvpq has CUDA) no sliding-window layers. The codebook's head_dim,
n_head_kv and n_layer must be the model's.
"""
from __future__ import annotations

import os
import sys
import threading
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from . import _core

__all__ = ["ATTN_NAME", "KVPQCache", "KVPQLayer", "calibrate", "collect_kv", "kvpq_attention_forward", "register",
           "use_kvpq_attention"]
ATTN_NAME = "kvpq"
# model_type of transformers models whose GGUF files (convert_hf_to_gguf) permute the Q/K rows so
# that rotary pairs are adjacent: kvpq's engine sees their keys with channels (2i, 2i+1) paired.
_GGUF_INTERLEAVED = ("llama", "mistral", "granite")

# Tensors a KVPQ layer's update() returned, by id, to the layer that can attend over them. The entry
# lives from update() to the attention call of the same layer (the tensor is alive in between, so its
# id cannot be reused); thread-local so two models generating in two threads do not mix.
_pending = threading.local()


def _in_beam_search():
    """Whether transformers' beam search (GenerationMixin._beam_search) is on the call stack. generate
    gives a user's cache no other sign of num_beams before the first reorder_cache, which comes after
    the prefill has run; checked at a sequence's first update so the refusal comes before any work."""
    f = sys._getframe(1)
    while f is not None:
        if "beam_search" in f.f_code.co_name and f.f_globals.get("__name__", "").startswith("transformers."):
            return True
        f = f.f_back
    return False


def _pending_map():
    if not hasattr(_pending, "m"):
        _pending.m = {}
    return _pending.m


def _to_numpy_rows(x):
    """(heads, n, head_dim) torch (one batch row) -> (n, heads, head_dim) float32 C-contiguous numpy
    (may share memory with x: read only)."""
    return np.ascontiguousarray(x.detach().to("cpu", torch.float32).transpose(0, 1).numpy())


def _to_device_rows(x):
    """(heads, n, head_dim) torch (one batch row, CUDA) -> (n, heads, head_dim) float32 contiguous on
    the same device."""
    return x.detach().to(torch.float32).transpose(0, 1).contiguous()


def _error(msg, where="KVPQCache", status=None):
    return _core.Error(_core.ERR_INVALID_ARG if status is None else status, msg, where)


class KVPQLayer(CacheLayerMixin):
    """One model layer of a KVPQCache: a view of layer `layer_idx` of the shared kvpq caches (one
    kvpq.Cache per batch row on the CPU; one kvpq.CudaCache per layer, holding every row, on CUDA)."""

    is_compileable = False
    is_croppable = True

    def __init__(self, owner: "KVPQCache", layer_idx: int, sliding_window: int = 0) -> None:
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window > 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> Tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        o = self.owner
        if self.layer_idx == 0 and self.get_seq_length() == 0 and _in_beam_search():
            raise _error("beam search (generate(num_beams > 1)) reorders and copies batch rows, which a KVPQCache "
                         "cannot do (kvpq has no cache copy); use greedy decoding or sampling", "KVPQCache.update")
        o._ensure(key_states)
        B, n = key_states.shape[0], key_states.shape[-2]
        if o.on_cuda and self.is_sliding:  # exact, bounded by the window: transformers' own layer
            return o._sliding[self.layer_idx].update(key_states, value_states, *args, **kwargs)
        prev = self.get_seq_length()
        if prev + n > o.max_seq:  # before any batch row takes them: rows stay of one length
            raise _error(f"layer {self.layer_idx}: {prev} positions held and {n} more exceed max_seq={o.max_seq}",
                         "KVPQCache.update", status=_core.lib.KVPQ_ERR_CAPACITY)
        deferred = False
        if o.on_cuda and n == 1:  # decode: stored now, attended from the device codes
            c = o._cuda[self.layer_idx]
            for b in range(B):
                c.append(b, o._key_order_t(_to_device_rows(key_states[b])), _to_device_rows(value_states[b]))
        else:
            # appended in attend(), together with the queries (each query sees the window as it was at
            # its own position, as `kvpq ppl` and `generate` do: kvpq_cache_append_attend on the CPU,
            # codes read back and a masked SDPA on CUDA)
            if o._awaiting.get(self.layer_idx):
                raise _error(f"layer {self.layer_idx}: the keys and values of the previous forward pass never reached "
                             "kvpq attention, so they are not in the cache (is the model's attention implementation "
                             "'kvpq'? KVPQCache(codebook, model) sets it)", "KVPQCache.update")
            o._awaiting[self.layer_idx] = True
            deferred = True
        _pending_map()[id(key_states)] = (o, self.layer_idx, prev, deferred, value_states)
        return key_states, value_states

    def get_seq_length(self) -> int:
        o = self.owner
        if o.on_cuda and self.is_sliding:
            return o._sliding[self.layer_idx].get_seq_length()
        if o._cuda:
            return o._cuda[self.layer_idx].seq_len(0)
        # positions as transformers counts them: a left-padded row's padding too (every row alike)
        return o._held[self.layer_idx] if o._cpu else 0

    def get_mask_sizes(self, query_length: int) -> Tuple[int, int]:
        if self.owner.on_cuda and self.is_sliding:
            return self.owner._sliding[self.layer_idx].get_mask_sizes(query_length)
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1 if not self.owner._cpu and not self.owner._cuda else self.owner.max_seq

    def reset(self) -> None:
        if self.layer_idx == 0:
            self.owner._truncate(0)

    def crop(self, max_length: int) -> None:
        """Keep the first max_length positions (a negative max_length removes that many from the end),
        as transformers' DynamicLayer.crop."""
        n = self.get_seq_length()
        keep = n + max_length if max_length < 0 else max_length
        if self.layer_idx == 0 and keep < n:  # kvpq_cache_truncate cuts every layer at once
            self.owner._truncate(max(keep, 0))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        idx = [int(i) for i in beam_idx.reshape(-1)]
        if idx != list(range(len(idx))):
            raise _error(f"reorder_cache {idx}: beam search reorders batch rows, which a KVPQCache cannot copy (kvpq "
                         "has no cache copy); use greedy or sampling", "KVPQCache.reorder_cache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise _error(f"repeat {repeats}: a KVPQCache cannot copy batch rows (kvpq has no cache copy)",
                         "KVPQCache.batch_repeat_interleave")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.layer_idx == 0:
            self.owner._select(indices)


class KVPQCache(Cache):
    """A transformers Cache holding keys and values as kvpq product-quantization codes.

    codebook: a kvpq.Codebook for this model (kvpq.transformers.calibrate, `kvpq calibrate`, or
      Codebook.load), or the path of a codebook file; its n_layer, n_head_kv and head_dim must be the
      model's.
    model: when given, its attention implementation is set to "kvpq" (restore_attention(), or
      leaving a `with KVPQCache(...) as cache:` block, gives it back), and n_head, max_seq and the
      sliding-window layers are read from its config. Without it, n_head= and key_layout= are needed
      and the model's attention must be set with kvpq.transformers.use_kvpq_attention(model).
    window: newest positions kept uncoded beside the codes: in fp16 in the CPU cache
      (src/cache/cache_vq.c), in float32 in kvpq_cuda_cache; each query attends to the window as it
      was at its own position and to earlier positions through their codes (prompts too). sinks: the first positions kept in fp16
      (attention sinks; CPU only). Both as `kvpq ppl --cache vq:FILE` takes them
      (kvpq.cache_settings): given, else what the codebook's allocation was made for (alloc.window /
      alloc.sinks, `kvpq calibrate --bits`), else window 128 and 1 sink (0 on CUDA, which keeps none:
      sinks= there is refused by name, a codebook's alloc.sinks gives a warning).
    max_seq: positions the cache may hold per sequence (default: the model's max_position_embeddings,
      else 32768; on CUDA device pages are taken as positions arrive, from a pool that grows on demand).
    n_head: query heads (needed when model is not given; else from the model's config).
    n_threads: kvpq threads (0 = OpenMP default).
    key_layout: channel order of the codebook's keys, "hf" or "gguf" (default: the codebook's
      key_layout metadata, else "gguf": a codebook from `kvpq calibrate` on the model's GGUF file).
    sliding_window, swa_layers: local attention (Gemma 2/3, Mistral): a layer l with swa_layers[l]
      attends to the newest sliding_window positions only, and the kvpq cache frees older ones
      (kvpq_cache_params.sliding_window). On CUDA such a layer keeps its newest sliding_window
      positions exactly, in the model's dtype (transformers' DynamicSlidingWindowLayer): bounded by
      the window, it is not coded. Default: from the model's config (sliding_window and
      layer_types "sliding_attention"; every layer when the config has no layer_types).
    device: "auto" (default): CUDA tensors go to kvpq_cuda_cache when libkvpq has CUDA and a device
      (kvpq.cuda_available()), else they are moved to the CPU cache and back; "cpu" forces the CPU cache.

    Batch: each batch row is its own kvpq sequence (one kvpq.Cache per row on the CPU; one
    kvpq_cuda_cache of n_seq rows per layer on CUDA). On the CPU a row may be left-padded (an attention
    mask hiding its first positions, as `generate` pads a batch): its padding is not stored, and the
    row's tokens give what that row alone gives. Any other mask (right padding, holes; any padding on
    CUDA) raises kvpq.Error.
    On CUDA: kvpq_cuda_cache_attend serves one query per sequence (decode, from the codes on the
    device); a prompt or a chunk of several tokens is appended as codes, read back decoded
    (kvpq_cuda_cache_read) and attended by SDPA in the model's dtype with a mask that gives each
    query its window exactly and earlier positions through their codes, as the CPU cache does.
    """

    def __init__(self, codebook: Union[_core.Codebook, str, "os.PathLike[str]"], model: Optional[torch.nn.Module] = None,
                 window: Optional[int] = None, max_seq: Optional[int] = None, n_head: Optional[int] = None,
                 n_threads: int = 0, fast_scan: bool = False, key_layout: Optional[str] = None,
                 sliding_window: Optional[int] = None, swa_layers: Optional[Sequence[bool]] = None,
                 device: str = "auto", sinks: Optional[int] = None) -> None:
        if isinstance(codebook, (str, os.PathLike)):
            codebook = _core.Codebook.load(os.fspath(codebook))
        if not isinstance(codebook, _core.Codebook):
            raise _error(f"codebook: expected a kvpq.Codebook or a codebook file's path, got {type(codebook).__name__}")
        if device not in ("auto", "cpu"):
            raise _error(f"device: '{device}': expected 'auto' or 'cpu'")
        self.codebook = codebook
        n = codebook.n_layer
        cfg = getattr(model, "config", None)
        if cfg is None:  # no silent wrong path: what the model would have told must be given (issue 33)
            if n_head is None:
                raise _error("n_head: unknown without model=; pass model= (or n_head=)")
            if key_layout is None and codebook.get_meta("key_layout") != "hf":
                raise _error("key_layout: without model= the channel order of the codebook's keys cannot be matched "
                             "to the model's (GGUF files of Llama-family models pair rotary channels otherwise); pass "
                             "model=, or key_layout='hf' (keys as transformers computes them) or 'gguf'")
        if cfg is not None:
            cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
            self._check_config(cfg)
            n_head = n_head or cfg.num_attention_heads
            max_seq = max_seq or getattr(cfg, "max_position_embeddings", None)
            if sliding_window is None:
                sliding_window, swa_layers = _swa_from_config(cfg, n)
        sliding_window = int(sliding_window or 0)
        if sliding_window and swa_layers is None:
            swa_layers = [True] * n
        if swa_layers is not None and len(swa_layers) != n:
            raise _error(f"swa_layers: {len(swa_layers)} flags for {n} layers")
        self.sliding_window = sliding_window
        self.swa_layers = [bool(x) for x in swa_layers] if sliding_window else [False] * n
        super().__init__(layers=[KVPQLayer(self, i, sliding_window if self.swa_layers[i] else 0) for i in range(n)])
        self._model, self._attn_before = model, None
        if model is not None:
            self._attn_before = use_kvpq_attention(model)
        self.n_head = n_head
        self.max_seq = max_seq or 32768
        # window and sinks as `kvpq ppl --cache vq:FILE` makes them: given, else the codebook's
        # alloc.window / alloc.sinks (calibrate --bits), else the defaults (kvpq_cache_params_resolve)
        self.window, self.sinks = _core.cache_settings("vq", codebook, window, sinks)
        self._sinks_given = sinks is not None
        self.n_threads, self.fast_scan, self.device = n_threads, fast_scan, device
        # Channel order of the codebook's keys: "hf" (kvpq.transformers.calibrate writes key_layout=hf)
        # or the GGUF engine's (`kvpq calibrate`), which for the llama architecture interleaves the
        # rotary pairs; key_layout="hf" or "gguf" overrides.
        layout = key_layout or codebook.get_meta("key_layout") or "gguf"
        if layout not in ("hf", "gguf"):
            raise _error(f"key_layout: '{layout}': expected 'hf' or 'gguf'")
        model_type = getattr(cfg, "model_type", None) if cfg is not None else None
        self.interleave = layout == "gguf" and model_type in _GGUF_INTERLEAVED
        self._cpu = []    # one kvpq.Cache per batch row
        self._pad = []    # CPU: per batch row, the left padding a prefill's attention mask showed (not stored)
        self._held = [0] * n  # CPU: per layer, positions attended so far as transformers counts them (padding too)
        self._awaiting = {}  # CPU: layer -> keys and values handed out by update(), appended by attend()
        self._cuda = []   # one kvpq.CudaCache per layer (every batch row); None for a sliding-window layer
        self._sliding = {}  # CUDA: layer -> DynamicSlidingWindowLayer (exact newest sliding_window positions)
        self.on_cuda = False
        self.n_batch = 0

    def restore_attention(self) -> None:
        """Give the model back the attention implementation it had before KVPQCache(codebook, model)
        set "kvpq" (the "kvpq" function serves other caches as SDPA, but a model shared with other
        code may expect its own). Idempotent; a no-op without model=."""
        if self._model is not None and self._attn_before not in (None, ATTN_NAME):
            self._model.set_attn_implementation(self._attn_before)
        self._attn_before = None

    def __enter__(self) -> "KVPQCache":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore_attention()
        return False

    def _check_config(self, cfg):
        cb = self.codebook
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        got = (cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", cfg.num_attention_heads), hd)
        if got != (cb.n_layer, cb.n_head_kv, cb.head_dim):
            raise _error(f"codebook has n_layer {cb.n_layer}, n_head_kv {cb.n_head_kv}, head_dim {cb.head_dim}; the "
                         f"model has {got[0]}, {got[1]}, {got[2]}", status=lib_mismatch())
        if getattr(cfg, "attn_logit_softcapping", None):
            # kvpq attention (CPU and CUDA) computes softmax(q.k / sqrt(d)) from codes with no hook
            # between the scores and the softmax, so c * tanh(s / c) cannot be applied
            raise _error(f"the model uses attn_logit_softcapping={cfg.attn_logit_softcapping} (Gemma-2 style "
                         "attention logit soft-capping), which kvpq attention does not implement",
                         status=_core.lib.KVPQ_ERR_UNSUPPORTED)

    def _ensure(self, like):
        """Create the kvpq caches at the first update (batch size, device and query heads known)."""
        B = like.shape[0]
        if self._cpu or self._cuda:
            if B != self.n_batch:
                raise _error(f"batch size {B}: this KVPQCache holds {self.n_batch} sequences", "KVPQCache.update")
            return
        if self.n_head is None:
            raise _error("n_head: unknown; pass model= or n_head= to KVPQCache")
        cb, n_head = self._rank_heads(like)
        self.n_batch = B
        if like.is_cuda and self.device == "auto" and _core.cuda_available()[0]:
            if self.sinks and self._sinks_given:
                raise _error(f"sinks={self.sinks} on CUDA: kvpq_cuda_cache keeps no attention sinks; pass sinks=0 (or "
                             "device='cpu')", status=_core.lib.KVPQ_ERR_UNSUPPORTED)
            if self.sinks and self.codebook.get_meta("alloc.sinks") is not None:
                warnings.warn(f"the codebook's allocation was made for {self.sinks} attention sink(s), which "
                              "kvpq_cuda_cache does not keep: the cache on CUDA holds none (device='cpu' keeps them)",
                              stacklevel=3)
            self.sinks = 0  # the kind's default sink is not kept on CUDA (kvpq_cuda_cache has none)
            with torch.cuda.device(like.device):
                self._cuda = [None if self.swa_layers[l] else
                              _core.CudaCache(cb, l, n_head, B, self.max_seq, window=self.window)
                              for l in range(cb.n_layer)]
            self._sliding = {l: DynamicSlidingWindowLayer(self.sliding_window)
                             for l in range(cb.n_layer) if self.swa_layers[l]}
            if all(self.swa_layers):
                warnings.warn(f"every layer attends to a sliding window of {self.sliding_window}: on CUDA such layers "
                              "are kept exact (DynamicSlidingWindowLayer), so nothing is coded", stacklevel=3)
            self.on_cuda = True
        else:
            self._pad = [0] * B
            self._cpu = [_core.Cache("vq", cb.n_layer, n_head, cb.n_head_kv, cb.head_dim, self.max_seq,
                                     codebook=cb, window=self.window, sinks=self.sinks, n_threads=self.n_threads,
                                     fast_scan=self.fast_scan, sliding_window=self.sliding_window,
                                     swa_layers=self.swa_layers if self.sliding_window else None)
                         for _ in range(B)]

    def _rank_heads(self, like):
        """(codebook, query heads) for the KV heads `like` (B, n_head_kv, n, d) holds: the whole codebook,
        or under tensor parallelism (transformers' tp_plan shards k_proj / v_proj column-wise, so rank r
        of R holds KV heads [r N / R, (r + 1) N / R) and their query heads) this rank's slice."""
        cb, n = self.codebook, like.shape[1]
        if n == cb.n_head_kv:
            return cb, self.n_head
        rank, ranks = self._tp_rank()
        if n * ranks != cb.n_head_kv:
            raise _error(f"keys of {n} KV heads for a codebook of {cb.n_head_kv}: expected all of them, or under "
                         f"tensor parallelism 1/{ranks} each ({ranks} ranks)", status=lib_mismatch())
        return cb.slice_heads(rank * n, n), self.n_head * n // cb.n_head_kv

    def _tp_rank(self):
        """(rank, ranks) of this process in the tensor-parallel group: the model's device mesh's "tp"
        dimension (transformers' tp_plan, also when combined with other dimensions), else the world."""
        mesh = getattr(self._model, "_device_mesh", None)
        if mesh is not None and "tp" in (getattr(mesh, "mesh_dim_names", None) or ()):
            tp = mesh["tp"]
            return tp.get_local_rank(), tp.size()
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def _truncate(self, n_pos):
        self._awaiting.clear()
        for b, c in enumerate(self._cpu):
            c.truncate(max(n_pos - self._pad[b], 0))
        self._held = [min(h, n_pos) for h in self._held]
        if n_pos == 0:
            self._pad = [0] * len(self._pad)
        if self._cuda:
            if n_pos != 0:
                raise _error(f"crop to {n_pos} positions: kvpq_cuda_cache can only be cleared", "KVPQCache.crop")
            for c in self._cuda:
                for b in range(self.n_batch if c is not None else 0):
                    c.clear(b)
            for layer in self._sliding.values():
                layer.reset()

    def _select(self, indices):
        idx = [int(i) for i in torch.as_tensor(indices).reshape(-1)]
        if self._cuda:
            if idx != list(range(self.n_batch)):
                raise _error("batch_select_indices: kvpq_cuda_cache rows cannot be dropped", "KVPQCache")
            return
        self._cpu = [self._cpu[i] for i in idx]
        self._pad = [self._pad[i] for i in idx]
        self.n_batch = len(idx)

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

    def _key_order_t(self, x):
        """_key_order for a torch tensor (..., head_dim), contiguous."""
        if not self.interleave:
            return x.contiguous()
        d = x.shape[-1]
        return x.reshape(*x.shape[:-1], 2, d // 2).transpose(-1, -2).reshape(x.shape).contiguous()

    def kv_cache(self, like: Any = None, row: int = 0) -> _core.Cache:
        """The underlying kvpq.Cache of batch row `row` (CPU; made at the first update)."""
        if not self._cpu:
            if like is None:
                raise _error("no kvpq cache yet: it is made at the first update", "KVPQCache.kv_cache")
            self._ensure(like)
        return self._cpu[row]

    @property
    def resident_bytes(self) -> int:
        """Bytes the kvpq caches hold for K and V (codes, float32 window, norms, codebooks; on CUDA,
        device bytes of kvpq_cuda_cache_resident_bytes, and the exact sliding-window layers' tensors),
        every batch row."""
        exact = sum(t.numel() * t.element_size() for layer in self._sliding.values() if layer.is_initialized
                    for t in (layer.keys, layer.values))
        return (sum(c.resident_bytes for c in self._cpu) + sum(c.resident_bytes for c in self._cuda if c is not None)
                + exact)

    def stats(self) -> Dict[str, Any]:
        if not self._cpu:
            return {}
        st = [c.stats() for c in self._cpu]
        return {k: (sum(s[k] for s in st) if k != "bits_per_element" else st[0][k]) for k in st[0]}

    def _scaled_query(self, query, scaling):
        d = query.shape[-1]
        scale_fix = float(scaling) * d ** 0.5  # kvpq uses 1/sqrt(head_dim)
        return query * scale_fix if abs(scale_fix - 1.0) > 1e-6 else query  # not in place

    def attend(self, layer_idx: int, query: torch.Tensor, scaling: float, key: Optional[torch.Tensor] = None,
               value: Optional[torch.Tensor] = None, prev: int = 0, deferred: bool = False) -> torch.Tensor:
        """Attention output (B, n_q, n_head, head_dim) for query (B, n_head, n_q, head_dim) over every
        position of layer layer_idx (the newest n_q are the query's own: causal). key/value: the new
        tokens' tensors (CUDA prefill and chunks); prev: positions held before them."""
        self._awaiting.pop(layer_idx, None)  # what update() handed out arrives here
        if self.on_cuda:
            return self._attend_cuda(layer_idx, query, scaling, key, value, prev, deferred)
        q = self._scaled_query(query, scaling)
        B, H, n_q, d = query.shape
        out = np.zeros((B, n_q, H, d), np.float32)  # a padding position's query attends to nothing: zeros
        for b in range(B):
            skip = min(max(self._pad[b] - prev, 0), n_q)  # this call's positions that are row b's padding
            if skip == n_q:
                continue
            out[b, skip:] = self._cpu[b].append_attend(
                layer_idx, self._key_order(_to_numpy_rows(key[b, :, skip:])), _to_numpy_rows(value[b, :, skip:]),
                self._key_order(_to_numpy_rows(q[b, :, skip:])))
        self._held[layer_idx] = prev + n_q
        return torch.from_numpy(out).to(query.device, query.dtype)

    def _attend_cuda(self, layer_idx, query, scaling, key, value, prev, deferred):
        if deferred:
            return self._attend_cuda_chunk(layer_idx, query, scaling, key, value, prev)
        c = self._cuda[layer_idx]  # decode: one query per sequence, from the codes on the device
        q = self._key_order_t(self._scaled_query(query, scaling).to(torch.float32)[:, :, 0])  # (B, H, d)
        with torch.cuda.device(query.device):
            out = c.attend(q)  # enqueued on the current stream, which reads `out` after it
        return out.unsqueeze(1).to(query.dtype)

    # query rows per SDPA call of a prompt or chunk on CUDA: the mask of a block has at most
    # max(CHUNK_MASK_ENTRIES, CHUNK_MIN_ROWS x keys) entries (tests make blocks small)
    CHUNK_MASK_ENTRIES = 1 << 28
    CHUNK_MIN_ROWS = 256

    def _attend_cuda_chunk(self, layer_idx, query, scaling, key, value, prev):
        """A prompt or chunk of n tokens after `prev` held: appended as codes, then SDPA in the query's
        dtype over the codes read back decoded and the exact rows, each query attending to its own
        window exactly and to earlier positions through their codes (kvpq_cache_append_attend's rule),
        a block of queries per call."""
        c = self._cuda[layer_idx]
        W, n = c.window, query.shape[2]
        n_codes = max(prev + n - W, 0)  # the last query's window starts there (W = 0: everything coded)
        e0 = max(prev + 1 - W, 0) if W else prev + n  # the first query's window starts there (W = 0: none)
        k, v = self._chunk_kv(c, key, value, prev, n_codes, e0)
        q = self._key_order_t(query)
        out = torch.empty_like(q)
        step = max(self.CHUNK_MIN_ROWS, self.CHUNK_MASK_ENTRIES // k.shape[2])
        for i in range(0, n, step):
            p0, p1 = prev + i, min(prev + i + step, prev + n)  # the block's query positions [p0, p1)
            out[:, :, i:i + step] = _masked_block(q[:, :, i:i + step], k, v, p0, p1, W, n_codes, e0, float(scaling))
        return out.transpose(1, 2).to(query.dtype)

    def _chunk_kv(self, c, key, value, prev, n_codes, e0):
        """(k, v) of every batch row, (B, n_head_kv, n_codes + n_exact, d) in the key's dtype: the codes
        of positions [0, n_codes) read back decoded after the chunk is appended, then the exact rows of
        positions [e0, prev + n) (the ring's, read before the append overwrites them, then the chunk's);
        see _attend_cuda_chunk for n_codes and e0."""
        B, W = key.shape[0], c.window
        ks, vs = [], []
        with torch.cuda.device(key.device):
            for b in range(B):
                kb, vb = self._key_order_t(_to_device_rows(key[b])), _to_device_rows(value[b])
                ek, ev = c.read(b, e0, prev - e0) if W else (kb[:0], vb[:0])
                c.append(b, kb, vb)
                ck, cv = c.read(b, 0, n_codes, from_codes=True)
                ks.append(torch.cat([ck, ek, kb]) if W else ck)
                vs.append(torch.cat([cv, ev, vb]) if W else cv)
        return tuple(torch.stack(x).transpose(1, 2).to(key.dtype) for x in (ks, vs))


def _masked_block(q, k, v, p0, p1, W, n_codes, e0, scale):
    """SDPA of the queries at positions [p0, p1), q (B, H, p1 - p0, d), over the keys they may see: the
    codes [0, c1) and the exact rows [x0, p1) of k, v (B, n_head_kv, n_codes + exact rows from e0, d),
    the mask giving a query at p the exact rows [p + 1 - W, p] and the codes before them."""
    c1 = min(max(p1 - W, 0), n_codes) if W else p1
    x0 = max(p0 + 1 - W, e0) if W else e0
    x1 = max(x0, p1)  # exact rows [x0, x1): none with W = 0 (e0 is then past every query)
    g = q.shape[1] // k.shape[1]
    kk, vv = (torch.cat([x[:, :, :c1], x[:, :, n_codes + x0 - e0:n_codes + x1 - e0]], 2).repeat_interleave(g, 1)
              for x in (k, v))
    dev = q.device
    t = torch.cat([torch.arange(c1, device=dev), torch.arange(x0, x1, device=dev)])[None, :]  # key positions
    pos = torch.arange(p0, p1, device=dev)[:, None]
    first = pos + 1 - W if W else pos + 1  # a query's window: [first, pos]
    coded = (torch.arange(t.shape[1], device=dev) < c1)[None, :]
    mask = torch.where(coded, t < first, (t >= first) & (t <= pos))
    return torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=scale)


def _swa_from_config(cfg, n_layer):
    """(sliding_window, swa_layers) of a transformers config: layer_types "sliding_attention" (Gemma 2/3,
    Qwen2, ...) or, without layer_types, every layer when sliding_window is set (Mistral)."""
    w = getattr(cfg, "sliding_window", None)
    if not w or not getattr(cfg, "use_sliding_window", True):
        return 0, None
    types = getattr(cfg, "layer_types", None)
    if types is None:
        return int(w), [True] * n_layer
    swa = [t == "sliding_attention" for t in types]
    return (int(w), swa) if any(swa) else (0, None)


def lib_mismatch() -> int:
    return _core.lib.KVPQ_ERR_MISMATCH


def _visible(mask):
    """A 4D attention mask (B, 1, q, kv) as booleans, True where a query may attend."""
    return mask if mask.dtype == torch.bool else mask == 0


def _row_pads(mask, layer_window, prev, n_q, known):
    """Per batch row, its left padding (positions hidden from every query, at the start of the row),
    or None for no mask. A prefill (prev 0) reads it from the mask's diagonal (a padding key is hidden
    even from its own query; a real one never is); a later call takes `known` (the prefill's). The
    newest query must then see exactly [max(pad, kv_len - window), kv_len): any other shape (right
    padding, holes) is refused by name, since kvpq attends to every position a row holds."""
    if mask is None or not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return None
    vis = _visible(mask)
    B, kv = vis.shape[0], vis.shape[-1]
    if prev == 0 and n_q == kv:
        diag = torch.diagonal(vis[:, 0], dim1=-2, dim2=-1)  # (B, kv)
        pads = [int(diag[b].int().argmax()) if bool(diag[b].any()) else kv for b in range(B)]
    else:
        pads = list(known) if known else [0] * B
    bad = []
    for b in range(B):
        start = pads[b]
        if layer_window and kv - layer_window > start:
            start = kv - layer_window
        want = torch.zeros(kv, dtype=torch.bool)
        want[min(start, kv):] = True
        if not torch.equal(vis[b, 0, -1, :].cpu(), want):
            bad.append(b)
    if bad:
        raise _core.Error(_core.ERR_INVALID_ARG, f"batch rows {bad}: the attention mask hides positions other than a "
                          "row's left padding (right padding or holes); a KVPQCache holds each row's positions from "
                          "its first unpadded one on", "kvpq_attention_forward")
    return pads


def kvpq_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                           dropout: float = 0.0, **kwargs: Any) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The attention function registered as "kvpq" (transformers AttentionInterface). For key/value
    tensors a KVPQCache layer just stored, attention comes from the kvpq cache (codes + window);
    for anything else (no cache, another Cache class) it is transformers' SDPA attention."""
    entry = _pending_map().pop(id(key), None)
    if entry is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    cache, layer_idx, prev, deferred, _ = entry
    cache._awaiting.pop(layer_idx, None)  # a refusal below is the error; the next update need not add one
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise _core.Error(_core.lib.KVPQ_ERR_UNSUPPORTED, f"{name}={kwargs[name]} is not implemented by kvpq "
                                                              "attention", "kvpq_attention_forward")
    layer_window = cache.layers[layer_idx].sliding_window
    sw = kwargs.get("sliding_window")
    if (sw or 0) != layer_window:
        raise _core.Error(_core.ERR_INVALID_ARG, f"layer {layer_idx}: the model attends with sliding_window={sw}, the "
                          f"KVPQCache layer was made with {layer_window or None} (pass the model to KVPQCache, or "
                          "sliding_window= and swa_layers=)", "kvpq_attention_forward")
    pads = _row_pads(attention_mask, layer_window, prev, query.shape[2], cache._pad)
    if pads is not None and not cache.on_cuda:
        if prev == 0:
            cache._pad = pads  # the prefill fixes each row's padding
    elif pads is not None and any(pads):
        raise _core.Error(_core.ERR_INVALID_ARG, f"batch rows {[b for b, p in enumerate(pads) if p]} are padded: "
                          "kvpq_cuda_cache holds unpadded rows of equal length", "kvpq_attention_forward")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return cache.attend(layer_idx, query, scaling, key, value, prev, deferred), None


_registered = False


def register() -> None:
    """Register the "kvpq" attention function (and its mask function: SDPA's, for the fallback) with
    transformers. Idempotent; KVPQCache(model=...) calls it."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTN_NAME, kvpq_attention_forward)
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, sdpa_mask)
        _registered = True


def use_kvpq_attention(model: torch.nn.Module) -> Optional[str]:
    """Set a model's attention implementation to "kvpq". Returns the one it had."""
    register()
    before = getattr(model.config, "_attn_implementation", None)
    if before != ATTN_NAME:
        model.set_attn_implementation(ATTN_NAME)
    return before


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

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        self.is_initialized = True
        self.k.append(key_states)
        self.v.append(value_states)
        return torch.cat(self.k, dim=-2), torch.cat(self.v, dim=-2)

    def get_seq_length(self) -> int:
        return sum(k.shape[-2] for k in self.k)

    def get_mask_sizes(self, query_length: int) -> Tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1


def collect_kv(model: torch.nn.Module, input_ids: torch.Tensor, ctx: int = 2048
               ) -> List[Tuple[np.ndarray, np.ndarray]]:
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
                ks[i].append(_to_numpy_rows(torch.cat(layer.k, dim=-2)[0]))
                vs[i].append(_to_numpy_rows(torch.cat(layer.v, dim=-2)[0]))
    return [(np.concatenate(ks[i]), np.concatenate(vs[i])) for i in range(n_layer)]


def calibrate(model: torch.nn.Module, tokenizer: Any, text: str, preset: str = "d4b8", tokens: int = 32768,
              ctx: int = 2048, **kw: Any) -> _core.Codebook:
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
