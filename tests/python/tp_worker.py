"""One rank of test_transformers.py's tensor-parallel test (run by torch.distributed.run): loads
the tiny model sharded over the ranks (transformers' tp_plan="auto", gloo on the CPU), generates
greedily with a KVPQCache from the whole model's codebook, and saves what the test compares.
usage: tp_worker.py MODEL_DIR CODEBOOK IDS.npy OUT_PREFIX"""
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from kvpq.transformers import KVPQCache


def main():
    model_dir, codebook, ids_path, out = sys.argv[1:5]
    model = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto").eval()
    ids = torch.from_numpy(np.load(ids_path))
    cache = KVPQCache(codebook, model, window=0, max_seq=64)
    with torch.no_grad():
        gen = model.generate(ids, past_key_values=cache, max_new_tokens=12, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, attention_mask=torch.ones_like(ids), pad_token_id=0)
    rank = torch.distributed.get_rank()
    np.savez(f"{out}_{rank}.npz", tokens=gen.sequences.numpy(), logits=torch.stack(gen.logits, 1).numpy(),
             stored_bytes=cache.stats()["stored_bytes"], n_head_kv=cache.kv_cache(row=0).n_head_kv,
             heads=cache.kv_cache(row=0)._codebook.get_meta("heads") or "")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
