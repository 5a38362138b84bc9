"""A transformers continuous-batching engine attached to a mount as a live engine.

:class:`TransformersLiveAdapter` is the :class:`~engine_bridge.attach.engine_adapter.EngineAdapter`
of a :class:`~engine_bridge.transformers.transformers_adapter.TransformersEngine` (or of a
bare :class:`~engine_bridge.transformers.transformers_adapter.TransformersAdapter`): its
live requests are the engine's sessions under ``MNT/engines/<name>/``, a pin
is one more reference in the cache group's block ledger (the reference count
transformers itself uses for shared prefixes), so a pinned block is neither
returned to the free pool nor reused while a reader copies it, and sessions
copied into the engine become decoding requests through the adapter's
page-in.  The engine must be stepped under ``lock`` (:meth:`step` does).

``python -m engine_bridge.attach MNT --engine transformers --name N --control``
runs a small greedy engine (the reference engine's seeded weights as a
``LlamaForCausalLM``) attached as N and takes JSON commands on stdin, one
answer per line on stdout (its own: ``step``, ``state``).
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from typing import Any, Sequence

from engine_bridge.attach.agent import Agent
from engine_bridge.attach.controls import Command
from engine_bridge.attach.engine_adapter import StepLock
from engine_bridge.core.bridge import SeqBlocks
from engine_bridge.core.pool import BlockId
from engine_bridge.transformers.transformers_adapter import (
    TransformersAdapter,
    TransformersEngine,
    TransformersStepOutput,
    llama_model,
)
from engine_bridge.transport.session_io import SessionSource


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

    def step(self, request_ids: Sequence[str] | None = None) -> dict[str, TransformersStepOutput]:
        """One batch of the engine, between the agent's pins and page-ins."""
        with self.lock:
            if isinstance(self.engine, TransformersEngine):
                return self.engine.step(request_ids)
            return self.tf.step()


# ---------------------------------------------------------------------------- control


class TransformersCommands:
    """A transformers engine's own control commands (engine_bridge.attach.controls)."""

    def __init__(self, engine: TransformersEngine, adapter: TransformersLiveAdapter, agent: Agent):
        self.engine, self.adapter, self.agent = engine, adapter, agent

    def by_name(self) -> dict[str, Command]:
        return {"step": self.step, "state": self.state}

    def step(self, cmd: dict[str, Any]) -> dict[str, Any]:
        toks: dict[str, list[int]] = {}
        lps: dict[str, list[str | None]] = {}
        for _ in range(int(cmd.get("n", 1))):
            for rid, o in self.adapter.step(cmd.get("ids")).items():
                toks.setdefault(rid, []).append(o.token)
                lps.setdefault(rid, []).append(None if o.logprob is None else float(o.logprob).hex())
        return {"tokens": toks, "logprobs": lps}

    def state(self, cmd: dict[str, Any]) -> dict[str, Any]:
        e = self.engine
        with self.adapter.lock:
            group = e.adapter.pool_group()
            seqs = {r.id: {"n_tokens": r.kv_length, "blocks": [int(b) for b in r.block_ids],
                           "tokens": r.prompt_ids + r.generated_tokens} for r in e.requests()}
            return {"seqs": seqs, "free": e.allocator.num_free(),
                    "shared": {str(b): n for b, n in group.ledger.shared_ref_counts.items()},
                    "groups": dict(self.agent.groups), "attached": not self.agent.detached.is_set()}


# ---------------------------------------------------------------------------- python -m engine_bridge.attach


def add_options(ap, mode) -> None:
    """A transformers engine's options of the attach command (engine_bridge.attach.attach_cli)."""
    ap.set_defaults(blocks=64, staging="16M")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-batch-tokens", type=int, default=128)


def build(args) -> tuple[TransformersEngine, TransformersLiveAdapter]:
    engine = TransformersEngine(llama_model(dtype=args.dtype, seed=args.seed), num_blocks=args.blocks,
                                page_size=args.page_size, max_batch_tokens=args.max_batch_tokens,
                                name=args.name)
    return engine, TransformersLiveAdapter(engine)


def commands(engine: TransformersEngine, adapter: TransformersLiveAdapter, agent: Agent) -> dict[str, Command]:
    return TransformersCommands(engine, adapter, agent).by_name()


def serve(engine: TransformersEngine, adapter: TransformersLiveAdapter, args, gone: threading.Event) -> None:
    """Without ``--control`` the engine only stays attached (its requests come in as sessions copied in)."""
