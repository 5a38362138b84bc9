"""The reference engine attached to a mount as a live engine.

:class:`ReferenceAdapter` is the
:class:`~engine_bridge.attach.engine_adapter.EngineAdapter` of a
:class:`~engine_bridge.reference.reference_engine.ReferenceEngine`: a pin is
one more allocator reference.  ``python -m engine_bridge.attach MNT --name N``
(``--engine reference``, the default) runs one attached as N: ``--demo``
decodes a prompt, ``--control`` takes JSON commands on stdin, one per line
(its own: ``step``, ``run``, ``pause``, ``page_in``, ``state``).
"""

from __future__ import annotations

import hashlib
import sys
import threading
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Sequence

import torch

from engine_bridge.attach.agent import Agent
from engine_bridge.attach.controls import Command
from engine_bridge.attach.engine_adapter import StepLock
from engine_bridge.core.bridge import SeqBlocks
from engine_bridge.core.pool import BlockId
from engine_bridge.demo import PROMPT, tokenize
from engine_bridge.reference.reference_engine import ModelConfig, ReferenceEngine
from engine_bridge.transport.session_io import SessionSource
from pffs.names import ENGINES_DIR


class ReferenceAdapter:
    """The reference engine's adapter: pins are allocator references.

    Step the engine through :meth:`step` (or hold ``lock`` around
    ``engine.step``).  A pinned, partly filled last block is copied on write
    by the engine's next step, so a snapshot costs that one block.
    """

    def __init__(self, engine, lock: AbstractContextManager | None = None):
        self.engine = engine
        self.bridge = engine.bridge
        self.lock = lock or StepLock()

    def sequences(self) -> list[SeqBlocks]:
        return self.engine.seq_blocks()

    def pin(self, blocks: Sequence[BlockId]) -> None:
        self.engine.allocator.incref(blocks)

    def unpin(self, blocks: Sequence[BlockId]) -> None:
        self.engine.allocator.free(blocks)

    def page_in(self, source: SessionSource) -> list[str]:
        return self.engine.page_in(source)

    def step(self, seq_ids=None):
        with self.lock:
            return self.engine.step(seq_ids)


# ---------------------------------------------------------------------------- control


def _logits_digest(logits: torch.Tensor) -> str:
    return hashlib.sha256(logits.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()


class ReferenceCommands:
    """The reference engine's own control commands (engine_bridge.attach.controls)."""

    def __init__(self, engine: ReferenceEngine, adapter: ReferenceAdapter, agent: Agent):
        self.engine, self.adapter, self.agent = engine, adapter, agent
        self._run: threading.Thread | None = None
        self._stop = threading.Event()
        self._history: dict[str, Any] = {}

    def by_name(self) -> dict[str, Command]:
        return {"step": self.step, "run": self.run, "pause": self.pause, "page_in": self.page_in,
                "state": self.state}

    def _record(self, out, toks, logs) -> None:
        for sid, o in out.items():
            toks.setdefault(sid, []).append(o.token)
            logs.setdefault(sid, []).append(_logits_digest(o.logits))

    def _background(self, ids) -> None:
        toks, logs = self._history["tokens"], self._history["logits"]
        while not self._stop.is_set():
            self._record(self.adapter.step(ids), toks, logs)
            self._history["steps"] += 1

    def step(self, cmd: dict[str, Any]) -> dict[str, Any]:
        toks: dict[str, list[int]] = {}
        logs: dict[str, list[str]] = {}
        for _ in range(int(cmd.get("n", 1))):
            self._record(self.adapter.step(cmd.get("ids")), toks, logs)
        return {"tokens": toks, "logits": logs}

    def run(self, cmd: dict[str, Any]) -> dict[str, Any]:
        if self._run is not None:
            raise ValueError("already running")
        self._stop.clear()
        self._history = {"steps": 0, "tokens": {}, "logits": {}}
        self._run = threading.Thread(target=self._background, args=(cmd.get("ids"),), daemon=True)
        self._run.start()
        return {}

    def pause(self, cmd: dict[str, Any]) -> dict[str, Any]:
        if self._run is None:
            raise ValueError("not running")
        self._stop.set()
        self._run.join()
        self._run = None
        return dict(self._history)

    def page_in(self, cmd: dict[str, Any]) -> dict[str, Any]:
        # Straight from a session folder (a live one too), not through engines/.
        e = self.engine
        with self.adapter.lock:
            ids = e.page_in(cmd["src"])
            return {"seqs": ids, "n_tokens": {s.id: s.n_tokens for s in e.seq_blocks(ids)}}

    def state(self, cmd: dict[str, Any]) -> dict[str, Any]:
        e = self.engine
        with self.adapter.lock:
            seqs = {s.id: {"n_tokens": s.n_tokens, "blocks": [int(b) for b in s.block_ids],
                           "tokens": e.tokens(s.id)} for s in e.seq_blocks()}
            return {"seqs": seqs, "free": e.allocator.num_free(),
                    "free_list": [int(b) for b in e.allocator.free_list()],
                    "groups": dict(self.agent.groups), "attached": not self.agent.detached.is_set()}


# ---------------------------------------------------------------------------- python -m engine_bridge.attach


def add_options(ap, mode) -> None:
    """The reference engine's options of the attach command (engine_bridge.attach.attach_cli)."""
    ap.set_defaults(blocks=256, staging="64M")
    ap.add_argument("--block-size", type=int, default=16)
    mode.add_argument("--demo", action="store_true", help="decode a prompt as request demo-1, then idle")
    ap.add_argument("--steps", type=int, default=200, help="--demo: steps to run (each decodes every sequence)")
    ap.add_argument("--interval", type=float, default=0.05, help="--demo: seconds between steps")


def build(args) -> tuple[ReferenceEngine, ReferenceAdapter]:
    engine = ReferenceEngine(ModelConfig(), dtype=args.dtype, num_blocks=args.blocks, block_size=args.block_size,
                             seed=args.seed, name=args.name)
    return engine, ReferenceAdapter(engine)


def commands(engine: ReferenceEngine, adapter: ReferenceAdapter, agent: Agent) -> dict[str, Command]:
    return ReferenceCommands(engine, adapter, agent).by_name()


def serve(engine: ReferenceEngine, adapter: ReferenceAdapter, args, gone: threading.Event) -> None:
    """``--demo``: decode a prompt as request demo-1, stepping every sequence
    (sessions copied in too) for ``--steps`` steps; else nothing."""
    if not args.demo:
        return
    prompt = tokenize(PROMPT, engine.config.vocab_size)
    with adapter.lock:
        engine.add_request("demo-1", prompt)
    print(f"engine {args.name}: request demo-1 ({len(prompt)} prompt tokens) is live under "
          f"{Path(args.mount) / ENGINES_DIR / args.name / 'demo-1'}", file=sys.stderr)
    for _ in range(args.steps):
        if gone.wait(args.interval):
            break
        with adapter.lock:
            # Every sequence with its tokens decodes, sessions copied in too.
            ids = [s.id for s in engine.seq_blocks() if s.token_ids is not None]
            if ids:
                engine.step(ids)
