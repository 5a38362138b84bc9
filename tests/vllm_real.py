"""A real vLLM engine in a process of its own (tests/vllm_engine.py), for t4 tests.

``VllmEngine(tmp, root, ...)`` starts it and waits until it is ready;
``generate`` and ``digests`` send it one command and wait, with a deadline,
for its answer; ``close`` ends it (also on a test's failure: use it as a
context manager).  Its log is kept in a file and printed when it fails.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


class EngineDied(AssertionError):
    pass


class VllmEngine:
    def __init__(self, tmp: Path, root: Path, *, kv_heads: int = 4, tp: int = 1, blocks: int = 0,
                 max_model_len: int = 1024, batched_tokens: int = 2048,
                 extra: dict[str, Any] | None = None, start_timeout: float = 300.0,
                 isa: str | None = None, inproc: bool = False, seed: int = 0, kind: str = "llama",
                 kv_cache_dtype: str = "auto", native_rope: bool = False):
        self.log_path = tmp / f"vllm-{os.getpid()}-{id(self):x}.log"
        env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1",
                   VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="INFO",
                   # (digests sends a function to the workers: pickled)
                   VLLM_ALLOW_INSECURE_SERIALIZATION="1",
                   PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
        if inproc:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"     # (engine core in the driver's process)
        if isa:
            env["PFFS_TEST_ATTN_ISA"] = isa     # (the CPU attention kernel vLLM is to use)
        if native_rope:
            env["PFFS_TEST_NATIVE_ROPE"] = "1"     # (vLLM's reference rotary code: tests/vllm_engine.py)
        if tp > 1:
            # One core per rank: the ranks' OpenMP threads must not share them.
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1))
                                                         for i in range(tp))
        # (a model folder a seed: the same config, other weights)
        self.model = tmp.parent / ((f"random-llama-h{kv_heads}" if kind == "llama" else f"random-{kind}")
                                   + (f"-seed{seed}" if seed else ""))
        cmd = [sys.executable, str(HERE / "vllm_engine.py"), "--model", str(self.model),
               "--root", str(root), "--seed", str(seed), "--kind", kind,
               "--kv-heads", str(kv_heads), "--tp", str(tp), "--blocks", str(blocks),
               "--max-model-len", str(max_model_len), "--batched-tokens", str(batched_tokens),
               "--kv-cache-dtype", kv_cache_dtype, "--extra", json.dumps(extra or {})]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, env=env, start_new_session=True)
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._wait(start_timeout)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                self._answers.put(json.loads(line[3:]))
            else:
                self._log.write(line)
        self._answers.put(None)

    def _wait(self, timeout: float) -> Any:
        try:
            got = self._answers.get(timeout=timeout)
        except queue.Empty:
            tail = self.tail()
            self.close()
            raise EngineDied(f"no answer from the vLLM engine in {timeout} s\n{tail}") from None
        if got is None:
            tail = self.tail()
            self.close()
            raise EngineDied(f"the vLLM engine ended (status {self.proc.returncode})\n{tail}")
        return got

    def tail(self, n: int = 60) -> str:
        self._log.flush()
        return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-n:])

    def _ask(self, cmd: dict[str, Any], timeout: float) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._wait(timeout)

    def generate(self, requests: list[dict[str, Any]], *, logprobs: int = 1,
                 timeout: float = 300.0) -> list[dict[str, Any]]:
        return self._ask({"op": "generate", "requests": requests, "logprobs": logprobs}, timeout)

    def one(self, prompt: list[int], kv: dict[str, Any] | None = None, max_tokens: int = 8,
            **kw: Any) -> dict[str, Any]:
        return self.generate([{"prompt": prompt, "kv": kv, "max_tokens": max_tokens, **kw}])[0]

    def reset(self, timeout: float = 180.0) -> None:
        """Empty vLLM's prefix cache (a later request computes, or loads, its prompt)."""
        assert self._ask({"op": "reset"}, timeout) is True

    def digests(self, timeout: float = 120.0) -> list[list[str]]:
        return self._ask({"op": "digests"}, timeout)

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
        else:
            try:
                os.killpg(self.proc.pid, 9)     # (vLLM's own processes, if any are left)
            except ProcessLookupError:
                pass
        self._log.close() if not self._log.closed else None

    def __enter__(self) -> "VllmEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


#: vLLM's CPU build without AVX-512: no AMX or fp8 kernels, and, measured on such a host,
#: a request's greedy tokens change with the batch it runs in (a request with no load at
#: all parted from its own solo run at token 54), so tests comparing runs across batches
#: or tensor-parallel sizes cannot tell pffs's faults from the engine's there.
NO_AVX512 = "avx512f" not in _cpu_flags()
needs_avx512 = __import__("pytest").mark.skipif(
    NO_AVX512, reason="vLLM's CPU kernels on this host (no AVX-512) are not batch-invariant "
                      "or lack this kernel: see tests/vllm_real.py NO_AVX512")
