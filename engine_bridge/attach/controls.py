"""An attached engine driven by JSON commands on stdin, one answer per line on
stdout (``python -m engine_bridge.attach ... --control``: for scripts and
tests).

Every engine answers ``add``, ``page_out``, ``remove``, ``detach`` and
``exit`` alike; the others (``step``, ``state``, ...) are the engine's own,
given by its folder's live module.  An answer is ``{"ok": true, ...}``, or
``{"ok": false, "error": "<exception>: <message>"}``.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable, Mapping

from engine_bridge.attach.agent import Agent
from engine_bridge.attach.engine_adapter import EngineAdapter

#: An engine's own control command: the command's JSON object -> the answer's fields.
Command = Callable[[dict[str, Any]], dict[str, Any]]


class ControlLoop:
    """The control commands of *engine*, attached through *agent*: those every
    engine answers alike, then the engine's own *commands* by name."""

    def __init__(self, engine, adapter: EngineAdapter, agent: Agent, commands: Mapping[str, Command]):
        self.engine, self.adapter, self.agent = engine, adapter, agent
        self.commands = commands

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        engine, adapter, c = self.engine, self.adapter, cmd.get("cmd")
        if c == "add":
            with adapter.lock:
                engine.add_request(cmd["id"], cmd["prompt"])
            return {}
        if c == "page_out":
            with adapter.lock:
                m = engine.page_out(cmd["dest"], cmd.get("ids"))
            return {"pages": len(m.pages)}
        if c == "remove":
            with adapter.lock:
                engine.remove(cmd["id"])
            return {}
        if c == "detach":
            self.agent.detach()
            return {}
        own = self.commands.get(c) if isinstance(c, str) else None
        if own is None:
            raise ValueError(f"unknown command {c!r}")
        return own(cmd)

    def run(self) -> None:
        """Answer the commands read from stdin, one reply line each, until ``exit``."""
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                cmd = json.loads(line)
                if cmd.get("cmd") == "exit":
                    break
                reply = {"ok": True, **self.handle(cmd)}
            except Exception as ex:
                reply = {"ok": False, "error": f"{type(ex).__name__}: {ex}"}
            print(json.dumps(reply), flush=True)
