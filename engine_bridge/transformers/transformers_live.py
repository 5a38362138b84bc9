"""A transformers continuous-batching engine attached to a mount as a live engine.

:class:`TransformersLiveAdapter` is the :class:`~engine_bridge.attach.agent.EngineAdapter`
of a :class:`~engine_bridge.transformers.transformers_adapter.TransformersEngine` (or of a
bare :class:`~engine_bridge.transformers.transformers_adapter.TransformersAdapter`): its
live requests are the engine's sessions under ``MNT/engines/<name>/``, a pin
is one more reference in the cache group's block ledger (the reference count
transformers itself uses for shared prefixes), so a pinned block is neither
returned to the free pool nor reused while a reader copies it, and sessions
copied into the engine become decoding requests through the adapter's
page-in.  The engine must be stepped under ``lock`` (:meth:`step` does).

``python -m engine_bridge.transformers.transformers_live MNT --name N --control`` runs a
small greedy engine (the reference engine's seeded weights as a
``LlamaForCausalLM``) attached as N and takes JSON commands on stdin, one
answer per line on stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
from contextlib import AbstractContextManager
from typing import Any, Sequence

from engine_bridge.attach.agent import Agent, StepLock, _size, attach_or_report, command_loop, common_command
from engine_bridge.core.bridge import SeqBlocks
from engine_bridge.core.pool import BlockId
from engine_bridge.transformers.transformers_adapter import (
    StepOutput,
    TransformersAdapter,
    TransformersEngine,
    llama_model,
)
from engine_bridge.transport.folders import SessionSource


class TransformersLiveAdapter:
    """The agent's view of a transformers engine: pins are block-ledger references.

    A pinned block whose request finishes (or is removed) keeps its
    reference until :meth:`unpin`, which releases it the way the engine
    does.  The engine keeps writing decode slots into a pinned, partly
    filled last block; those slots lie past the pinned fill, which the
    agent zeroes in the page bytes.
    """

    def __init__(self, engine: TransformersEngine | TransformersAdapter,
                 lock: AbstractContextManager | None = None):
        self.engine = engine
        self.tf = engine.adapter if isinstance(engine, TransformersEngine) else engine
        self.bridge = self.tf.bridge
        self.lock = lock or StepLock()

    def sequences(self) -> list[SeqBlocks]:
        return self.tf.seq_blocks()

    def pin(self, blocks: Sequence[BlockId]) -> None:
        ledger = self.tf.pool_group().ledger
        for b in blocks:
            ledger.acquire(int(b))

    def unpin(self, blocks: Sequence[BlockId]) -> None:
        group = self.tf.pool_group()
        released = [int(b) for b in blocks if group.ledger.release(int(b))]
        if released:
            group.pool.free_blocks(group.index, released)

    def page_in(self, source: SessionSource) -> list[str]:
        return self.tf.page_in(source)

    def step(self, request_ids: Sequence[str] | None = None) -> dict[str, StepOutput]:
        """One batch of the engine, between the agent's pins and page-ins."""
        with self.lock:
            if isinstance(self.engine, TransformersEngine):
                return self.engine.step(request_ids)
            return self.tf.step()


# ---------------------------------------------------------------------------- control


class _Controller:
    """JSON commands on stdin, one answer per line on stdout (for scripts and tests)."""

    def __init__(self, engine: TransformersEngine, adapter: TransformersLiveAdapter, agent: Agent):
        self.engine, self.adapter, self.agent = engine, adapter, agent

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        e, c = self.engine, cmd.get("cmd")
        done = common_command(e, self.adapter, self.agent, cmd)
        if done is not None:
            return done
        if c == "step":
            toks: dict[str, list[int]] = {}
            lps: dict[str, list[str | None]] = {}
            for _ in range(int(cmd.get("n", 1))):
                for rid, o in self.adapter.step(cmd.get("ids")).items():
                    toks.setdefault(rid, []).append(o.token)
                    lps.setdefault(rid, []).append(None if o.logprob is None else float(o.logprob).hex())
            return {"tokens": toks, "logprobs": lps}
        if c == "state":
            with self.adapter.lock:
                group = e.adapter.pool_group()
                seqs = {r.id: {"n_tokens": r.kv_length, "blocks": [int(b) for b in r.block_ids],
                               "tokens": r.prompt_ids + r.generated_tokens} for r in e.requests()}
                return {"seqs": seqs, "free": e.allocator.num_free(),
                        "shared": {str(b): n for b, n in group.ledger.shared_ref_counts.items()},
                        "groups": dict(self.agent.groups), "attached": not self.agent.detached.is_set()}
        raise ValueError(f"unknown command {c!r}")

    def loop(self) -> None:
        command_loop(self.handle)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine_bridge.transformers.transformers_live",
                                 description="Run a transformers continuous-batching engine attached "
                                             "to a pffs mount.")
    ap.add_argument("mount", help="mount point (or the engine socket's path)")
    ap.add_argument("--name", required=True, help="the engine's folder name under MNT/engines/")
    ap.add_argument("--blocks", type=int, default=64, help="KV cache blocks")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-batch-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--seed", type=int, default=0, help="weights seed (engines must share it to exchange sessions)")
    ap.add_argument("--staging", default="16M", help="shared staging buffer size")
    ap.add_argument("--control", action="store_true", help="JSON commands on stdin, answers on stdout")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    engine = TransformersEngine(llama_model(dtype=args.dtype, seed=args.seed), num_blocks=args.blocks,
                                page_size=args.page_size, max_batch_tokens=args.max_batch_tokens,
                                name=args.name)
    adapter = TransformersLiveAdapter(engine)
    gone = threading.Event()
    agent = Agent(adapter, args.mount, args.name, staging_bytes=_size(args.staging),
                  on_detach=lambda a: gone.set())
    if not attach_or_report(agent, args.name):
        return 2
    try:
        if args.control:
            print(json.dumps({"ok": True, "attached": args.name, "pid": os.getpid()}), flush=True)
            _Controller(engine, adapter, agent).loop()
        else:
            gone.wait()
    except KeyboardInterrupt:
        pass
    finally:
        agent.detach()
    return 0


if __name__ == "__main__":
    sys.exit(main())
