"""A real vLLM engine (the CPU build) with the PffsConnector, driven over stdin/stdout.

Run by tests/vllm_real.py as its own process (vLLM's engine core and workers
are processes of their own; one engine per driver).  Each line on stdin is
a JSON command, each answer a line ``@@ {json}`` on stdout (vLLM logs there
too):

- ``{"op": "generate", "requests": [{"prompt": [...], "max_tokens": n,
  "kv": {...kv_transfer_params}, "cache_salt": s}], "logprobs": k}``: greedy
  generation of every request in one batch; the answer lists, per request,
  its ``tokens``, each token's ``logprobs`` (sampled token's) and the
  output's ``kv`` transfer params.
- ``{"op": "digests"}``: per worker, the sha256 of every block of its KV
  pool as page bytes (the connector's pool: its heads).
- ``{"op": "reset"}``: vLLM's prefix cache emptied (once no block is held:
  a save's blocks are until its page-out ends); answers true.
- ``{"op": "quit"}``.

Nothing here changes vLLM: the model is a random-weights Llama (or, with
``--kind deepseek``, a DeepSeek-V2 of multi-head latent attention) saved
with ``save_pretrained`` (no hub access).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if os.environ.get("PFFS_TEST_ATTN_ISA"):
    # A host of another CPU kernel, as far as vLLM's CPU attention can tell:
    # its builder (in every process: spawned children import this module
    # too) chooses the kernel named here instead of the host's best.
    import vllm.v1.attention.backends.cpu_attn as _cpu_attn
    _cpu_attn._get_attn_isa = lambda *a, **k: os.environ["PFFS_TEST_ATTN_ISA"]


if os.environ.get("PFFS_TEST_NATIVE_ROPE"):
    # vLLM 0.32's CPU rotary kernel takes the strides of the key view MLA hands
    # it wrongly (the connector refuses such an engine at start): here its own
    # reference code rotates instead, in every process, as on a GPU host.
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding as _Rope
    _Rope.forward_cpu = _Rope.forward_native


def model_dir(path: str, n_heads: int, seed: int = 0) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM
    import torch
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(seed)
        cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=n_heads, head_dim=64,
                          vocab_size=1000, max_position_embeddings=2048, eos_token_id=999,
                          bos_token_id=998, torch_dtype="bfloat16",
                          # Weights ten times the default spread: logits far
                          # enough apart that greedy tokens do not hang on
                          # rounding (at 0.02 every token is about as likely).
                          initializer_range=0.2)
        LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def deepseek_dir(path: str, seed: int = 0) -> str:
    """A tiny random DeepSeek-V2 (MLA): vLLM's CPU MLA kernel takes only a latent of
    512 + 64 values, so kv_lora_rank and qk_rope_head_dim are the real model's."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
    import torch
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(seed)
        cfg = DeepseekV2Config(hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                               n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                               first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None,
                               qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                               topk_method="greedy", n_group=1, topk_group=1, vocab_size=1000,
                               max_position_embeddings=2048, eos_token_id=999, bos_token_id=998,
                               torch_dtype="bfloat16", initializer_range=0.2)
        DeepseekV2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


#: The layer kinds of ``--kind window-mixed`` and ``--kind window-all`` (Ministral:
#: Llama's layers, a sliding window of :data:`WINDOW` tokens on those named so).
WINDOW = 48
WINDOW_LAYERS = {"window-mixed": ["full_attention", "sliding_attention"] * 2,
                 "window-all": ["sliding_attention"] * 4}


def ministral_dir(path: str, kind: str, seed: int = 0) -> str:
    """A tiny random Ministral: a sliding window on some layers (Gemma's pattern) or on
    every one (Mistral's).  vLLM runs it as its MistralForCausalLM, which reads the
    config's ``layer_types``; transformers as MinistralForCausalLM."""
    from transformers import MinistralConfig, MinistralForCausalLM
    import torch
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(seed)
        cfg = MinistralConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                              vocab_size=1000, max_position_embeddings=2048, eos_token_id=999,
                              bos_token_id=998, torch_dtype="bfloat16", initializer_range=0.2,
                              sliding_window=WINDOW, layer_types=WINDOW_LAYERS[kind])
        MinistralForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def pool_digests(worker) -> list[str]:
    """(Runs in a worker.) sha256 of each block of the connector's pool."""
    import hashlib

    import torch
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    pool = get_kv_transfer_group().kv_pool()
    out = []
    row = torch.empty((1, pool.page_bytes), dtype=torch.uint8)
    for b in range(pool.num_blocks):
        pool.gather([b], row)
        out.append("sha256:" + hashlib.sha256(row.numpy().tobytes()).hexdigest())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--root", required=True)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--kind", default="llama", choices=("llama", "deepseek", *WINDOW_LAYERS), help="the model made")
    ap.add_argument("--seed", type=int, default=0, help="the weights' seed, when the model folder is made")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--blocks", type=int, default=0, help="num_gpu_blocks_override (0: vLLM's)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-dtype", default="auto", help="vLLM's kv_cache_dtype (fp8_e4m3, ...)")
    ap.add_argument("--extra", default="{}", help="more kv_connector_extra_config (JSON)")
    a = ap.parse_args()
    from vllm import LLM, SamplingParams
    kw: dict = {}
    if a.blocks:
        kw["num_gpu_blocks_override"] = a.blocks
    if a.tp > 1:
        kw["distributed_executor_backend"] = "mp"
    deepseek = a.kind == "deepseek"
    if a.kind in WINDOW_LAYERS:
        path = ministral_dir(a.model, a.kind, a.seed)
        kw["hf_overrides"] = {"architectures": ["MistralForCausalLM"]}
    else:
        path = deepseek_dir(a.model, a.seed) if deepseek else model_dir(a.model, a.kv_heads, a.seed)
    # (vLLM's CPU MLA kernel takes blocks of 16 tokens only)
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="bfloat16",
              seed=0, block_size=16 if deepseek else 32, max_model_len=a.max_model_len, enforce_eager=True,
              max_num_batched_tokens=a.batched_tokens, max_num_seqs=8,
              enable_prefix_caching=True, tensor_parallel_size=a.tp, kv_cache_dtype=a.kv_cache_dtype,
              kv_transfer_config={"kv_connector": "PffsConnector",
                                  "kv_connector_module_path": "engine_bridge.vllm",
                                  "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                                  "kv_connector_extra_config": {"root": a.root,
                                                                **json.loads(a.extra)}},
              **kw)

    def say(obj) -> None:
        sys.stdout.write("@@ " + json.dumps(obj) + "\n")
        sys.stdout.flush()
    say({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "reset":
            import time
            end = time.monotonic() + 120
            while not llm.reset_prefix_cache() and time.monotonic() < end:
                time.sleep(0.05)
            say(True)
            continue
        if cmd["op"] == "digests":
            say(llm.collective_rpc(pool_digests))
            continue
        prompts, params = [], []
        for r in cmd["requests"]:
            p = {"prompt_token_ids": r["prompt"]}
            if r.get("cache_salt"):
                p["cache_salt"] = r["cache_salt"]
            prompts.append(p)
            params.append(SamplingParams(max_tokens=r.get("max_tokens", 8), temperature=0.0,
                                         ignore_eos=True, logprobs=cmd.get("logprobs", 1),
                                         extra_args={"kv_transfer_params": r["kv"]} if r.get("kv") else None))
        outs = llm.generate(prompts, params, use_tqdm=False)
        got = []
        for o in outs:
            c = o.outputs[0]
            lps = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [])]
            got.append({"tokens": list(c.token_ids), "logprobs": lps,
                        "kv": o.kv_transfer_params or {}})
        say(got)


if __name__ == "__main__":
    main()
