"""Level t4, engines: a real engine (the reference engine, transformers or vLLM).
A transformers continuous-batching engine attached to a real mount as a live engine:
a live request copied out of MNT/engines/<name>/ is byte for byte the adapter's own
page-out, copied into a second transformers engine it continues with the same
tokens and logprobs, and pins hold blocks until they are released."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

pytest.importorskip("transformers")

from conftest import REPO  # noqa: E402
from engine_bridge.transformers.transformers_adapter import TransformersEngine, llama_model  # noqa: E402
from engine_bridge.transformers.transformers_live import TransformersLiveAdapter  # noqa: E402
from mountutil import pffs as pffs_cli  # noqa: E402
from mountutil import wait_for  # noqa: E402
from pffs import manifest as mf  # noqa: E402
from sessions import tree_digest  # noqa: E402
from t4_live import EngineProc, assert_self_consistent, listing, run  # noqa: E402

SEED = 11
PROMPT = [(37 * i + 11) % 512 for i in range(53)]
BLOCKS = 48


class TransformersProc(EngineProc):
    """A transformers engine in its own process, attached to a mount, driven over stdin/stdout."""

    def __init__(self, mnt, name: str):
        self.name = name
        self.stderr_path = mnt.path.parent / f"engine-{name}-{time.monotonic_ns()}.txt"
        self._err = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine_bridge.attach", str(mnt.path), "--engine", "transformers", "--name", name,
             "--control", "--blocks", str(BLOCKS), "--staging", "1M", "--seed", str(SEED)],
            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err)
        self._buf = b""
        self.hello = None


@pytest.fixture
def tf_engines():
    started: list[TransformersProc] = []

    def start(mnt, *names):
        new = [TransformersProc(mnt, n) for n in names]
        started.extend(new)
        for e in new:
            e.wait_attached()
        return new
    yield start
    for e in started:
        e.close()


def test_live_transformers_request_copies_out_and_continues_in_another_engine(mnt, tf_engines, tmp_path):
    t1, t2 = tf_engines(mnt, "t1", "t2")
    assert listing(mnt / "engines") == ["t1", "t2"]
    t1("add", id="r", prompt=PROMPT)
    first = t1("step", ids=["r"], n=20)
    assert listing(mnt / "engines/t1") == ["r"]

    # cp -r of the live request is byte for byte the adapter's own page-out.
    run("cp", "-r", mnt / "engines/t1/r", mnt / "snap")
    t1("page_out", ids=["r"], dest=str(tmp_path / "direct"))
    assert tree_digest(mnt / "snap") == tree_digest(tmp_path / "direct")
    m = assert_self_consistent(mnt / "snap")
    tokens = t1("state")["seqs"]["r"]["tokens"]
    assert m.logical_seqs[0].token_ids == tokens[:-1]      # KV covers all but the newest token
    assert m.engine["name"] == "t1" and m.engine["kv_layout"] == "transformers paged"

    # Copied into the second engine, it is one of its live sessions ...
    run("cp", "-r", mnt / "snap", mnt / "engines/t2/")
    assert listing(mnt / "engines/t2") == ["snap"]
    st = t2("state")
    assert st["groups"] == {"snap": ["r"]} and st["seqs"]["r"]["tokens"] == tokens[:-1]
    # Until its first step re-feeds the last token, the engine holds KV for the
    # tokens before it: read back, the session is one token shorter.
    back = mf.parse((mnt / "engines/t2/snap/manifest.json").read_bytes())
    assert back.logical_seqs[0].token_ids == tokens[:-2]
    assert len(back.pages) == len(m.pages) and back.pages[:-1] == m.pages[:-1]

    # ... and continues as t1 does: the first step replays t1's last one.
    want = t1("step", ids=["r"], n=10)
    replay = t2("step", ids=["r"], n=1)
    assert replay["tokens"]["r"] == first["tokens"]["r"][-1:]
    assert replay["logprobs"]["r"] == first["logprobs"]["r"][-1:]
    assert t2("step", ids=["r"], n=10) == want

    # No pin outlives the copies: requests that end give every block back.
    free = t2("state")["free"]
    t1("remove", id="r")
    t2("remove", id="r")
    wait_for(lambda: t1("state")["free"] == t2("state")["free"] == BLOCKS, what="blocks released")
    assert free < BLOCKS and t2("state")["shared"] == {}


def test_pffs_fork_out_of_and_into_transformers_engines_continues(mnt, tf_engines):
    """``pffs fork`` out of engines/t1 and into engines/t2: the engines move the
    bytes themselves; the session is what ``cp -r`` gives, and it continues."""
    t1, t2 = tf_engines(mnt, "t1", "t2")
    t1("add", id="r", prompt=PROMPT)
    first = t1("step", ids=["r"], n=20)
    run("cp", "-r", mnt / "engines/t1/r", mnt / "copied")
    pffs_cli("fork", mnt / "engines/t1/r", mnt / "snap")
    assert tree_digest(mnt / "snap") == tree_digest(mnt / "copied")
    pffs_cli("fork", mnt / "snap", mnt / "engines/t2/")
    assert listing(mnt / "engines/t2") == ["snap"]
    assert t2("state")["groups"] == {"snap": ["r"]}
    want = t1("step", ids=["r"], n=10)
    replay = t2("step", ids=["r"], n=1)
    assert replay["tokens"]["r"] == first["tokens"]["r"][-1:]
    assert replay["logprobs"]["r"] == first["logprobs"]["r"][-1:]
    assert t2("step", ids=["r"], n=10) == want


def test_pins_hold_blocks_past_the_request():
    e = TransformersEngine(llama_model(seed=SEED), num_blocks=16, page_size=16, max_batch_tokens=128)
    live = TransformersLiveAdapter(e)
    total = e.allocator.num_free()
    e.add_request("r", PROMPT)
    live.step(["r"])
    [seq] = live.sequences()
    assert seq.n_tokens == len(PROMPT) and len(seq.block_ids) == 4
    with live.lock:
        live.pin(seq.block_ids)
    e.remove("r")
    assert live.sequences() == [] and e.allocator.num_free() == total - 4
    # Another prompt (nothing to share) gets other blocks while they are pinned.
    e.add_request("s", [(t + 1) % 512 for t in PROMPT[:40]])
    live.step(["s"])
    [other] = live.sequences()
    assert not set(other.block_ids) & set(seq.block_ids)
    with live.lock:
        live.unpin(seq.block_ids)
    e.remove("s")
    assert e.allocator.num_free() == total
