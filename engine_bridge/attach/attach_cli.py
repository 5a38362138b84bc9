"""``python -m engine_bridge.attach MNT --engine reference|transformers --name N``:
an engine in this process, attached to the pffs mounted at MNT as
``MNT/engines/N/`` until it is interrupted, detached or unmounted.

``--control`` takes JSON commands on stdin, one answer per line on stdout
(engine_bridge.attach.controls), after a first line saying it attached:
``{"ok": true, "attached": N, "pid": ...}`` (or ``{"ok": false, "errno": ...,
"error": ...}`` and exit status 2 where the daemon refused it).

Each engine's live module (:data:`ENGINES`, in the engine's folder) gives:

- ``add_options(ap, mode)``: its own options, its defaults of ``--blocks``
  and ``--staging``, and its modes beside ``--control`` (in *mode*, a
  mutually exclusive group);
- ``build(args) -> (engine, adapter)``: the engine and its
  :class:`~engine_bridge.attach.engine_adapter.EngineAdapter`;
- ``commands(engine, adapter, agent)``: its own control commands by name;
- ``serve(engine, adapter, args, gone)``: what it does attached without
  ``--control`` (then it stays attached until *gone* is set).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import sys
import threading

from engine_bridge.attach.agent import Agent
from engine_bridge.attach.controls import ControlLoop
from pffs.live import protocol

#: The engines this command attaches, by ``--engine`` name: the module of each
#: one's adapter (imported only when chosen: transformers needs its pinned release).
ENGINES = {
    "reference": "engine_bridge.reference.reference_live",
    "transformers": "engine_bridge.transformers.transformers_live",
}
PROG = "python -m engine_bridge.attach"


def parse_size(text: str) -> int:
    """Bytes of a size such as ``64M``, ``1g`` or ``4096``."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().rstrip("ib")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


def attach_or_report(agent: Agent, name: str) -> bool:
    """Attach; if refused, say so (a JSON answer on stdout, one line on stderr) and return False."""
    try:
        agent.attach()
    except (protocol.Refused, OSError) as e:
        print(json.dumps({"ok": False, "errno": e.errno, "error": str(e)}), flush=True)
        print(f"attach {name}: {e}", file=sys.stderr)
        return False
    return True


def _parser(live) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description="Run an inference engine attached to a pffs mount "
                                                        "(its live sessions under MNT/engines/NAME/).")
    ap.add_argument("mount", help="mount point (or the engine socket's path)")
    ap.add_argument("--engine", choices=list(ENGINES), default="reference",
                    help="the engine to run (default: reference)")
    ap.add_argument("--name", required=True, help="the engine's folder name under MNT/engines/")
    ap.add_argument("--blocks", type=int, help="KV blocks of the engine's pool (default: %(default)s)")
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    ap.add_argument("--seed", type=int, default=0, help="weights seed (engines must share it to exchange sessions)")
    ap.add_argument("--staging", help="shared staging buffer size (default: %(default)s)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--control", action="store_true", help="JSON commands on stdin, answers on stdout")
    live.add_options(ap, mode)
    return ap


def main(argv: list[str] | None = None) -> int:
    first = argparse.ArgumentParser(prog=PROG, add_help=False)
    first.add_argument("--engine", choices=list(ENGINES), default="reference")
    engine_name = first.parse_known_args(argv)[0].engine
    live = importlib.import_module(ENGINES[engine_name])
    args = _parser(live).parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    engine, adapter = live.build(args)
    gone = threading.Event()
    agent = Agent(adapter, args.mount, args.name, staging_bytes=parse_size(args.staging),
                  on_detach=lambda a: gone.set())
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))    # detach on the way out
    if not attach_or_report(agent, args.name):
        return 2
    try:
        if args.control:
            print(json.dumps({"ok": True, "attached": args.name, "pid": os.getpid()}), flush=True)
            ControlLoop(engine, adapter, agent, live.commands(engine, adapter, agent)).run()
        else:
            live.serve(engine, adapter, args, gone)
            while not gone.wait(0.5):   # attached until interrupted or unmounted
                pass
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        agent.detach()
    return 0
