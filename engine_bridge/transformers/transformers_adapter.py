"""Attach a Hugging Face transformers continuous-batching engine to the bridge.

transformers' continuous batching (``model.init_continuous_batching()``,
:class:`ContinuousBatchingManager`) keeps the KV cache of every layer in one
flat tensor owned by a ``PagedAttentionCache``.  With only full-attention
layers there is one cache allocator; its block *b* is one contiguous byte
range of that tensor, laid out ``[n_layers, 2, page_size, n_kv_heads,
head_dim]`` (each layer's K page then its V page).  Block ids are absolute
in the tensor (the first two sectors are never-allocated trash) and a
request's blocks are not in ascending order.  Which blocks a request holds
lives in the allocator's ``block_table``; the request itself (prompt,
generated tokens, KV length) is a ``RequestState`` in the batch processor's
scheduler.

Those are private internals of one release, so this module checks the
installed version at import and refuses any other (``pip install
'pffs[transformers]'`` installs the pinned one).  It provides:

- :class:`TransformersKVPool` — a :class:`~engine_bridge.core.pool.KVPool` over the
  cache tensor, moving whole blocks with one gather or scatter;
- :class:`TransformersAllocator` — the bridge's allocator protocol over the
  cache's sectors and free blocks, with an exact undo;
- :class:`TransformersAdapter` — live requests, page-out, page-in as a
  decoding request the manager continues, with the manager paused (when its
  thread runs) or between hand steps;
- :class:`TransformersEngine` — a greedy engine stepped by hand, for tests,
  benchmarks and the demo.

Like the reference engine, a restored request holds KV for every token of
the session; its first step re-feeds the last token (recomputing that
token's KV, which equals the saved bytes when the step runs as the original
did) to get the logits that pick the next one.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

#: The transformers release whose continuous-batching internals this adapter reads.
REQUIRED_VERSION = "5.24.0"


class TransformersVersionError(ImportError):
    """transformers is missing or is not the release this adapter was written against."""


try:
    import transformers
except ImportError as e:  # pragma: no cover - exercised only without transformers
    raise TransformersVersionError(
        f"engine_bridge.transformers.transformers_adapter needs transformers=={REQUIRED_VERSION}: "
        "pip install 'pffs[transformers]'") from e
if transformers.__version__ != REQUIRED_VERSION:
    raise TransformersVersionError(
        f"engine_bridge.transformers.transformers_adapter reads the continuous-batching internals of "
        f"transformers {REQUIRED_VERSION} and refuses {transformers.__version__}: "
        f"pip install 'pffs[transformers]' (or transformers=={REQUIRED_VERSION})")

from transformers import ContinuousBatchingConfig, GenerationConfig  # noqa: E402
from transformers.generation.continuous_batching import (  # noqa: E402
    ContinuousBatchingManager,
    PagedAttentionCache,
    RequestState,
    RequestStatus,
)
from transformers.generation.continuous_batching.cache_allocators import (  # noqa: E402
    FULL_ATTENTION,
    FullAttentionCacheAllocator,
)

from engine_bridge.core.bridge import Bridge, PageInResult, SeqBlocks  # noqa: E402
from engine_bridge.core.identity import (  # noqa: E402
    checkpoint_weights_sha256,
    hf_config_sha256,
    weights_sha256_of_tensors,
)
from engine_bridge.core.pool import BlockId, KVLayout, KVPool  # noqa: E402
from engine_bridge.core.staging import DEFAULT_STAGING_BYTES  # noqa: E402
from engine_bridge.errors import NoFreeBlocks, Refused  # noqa: E402
from engine_bridge.reference.reference_engine import weights_digest  # noqa: E402
from engine_bridge.transport.session_io import SinkLike, SourceLike  # noqa: E402
from pffs.manifest import Manifest  # noqa: E402

#: One layer's view of the cache: [num_blocks, 2, page_size, n_kv_heads, head_dim].
TRANSFORMERS_PAGED = KVLayout("transformers paged", (1, 0, 2, 3, 4))



def model_identity(model, *, name: str | None = None, revision: str | None = None) -> dict[str, Any]:
    """The manifest's ``model`` field for a transformers model.

    ``name`` defaults to the checkpoint the model was loaded from (else its
    ``model_type``), ``revision`` to the hub commit it came from, else the
    first 16 hex digits of the weights digest that the reference engine also
    uses (sha256 over every tensor's name, dtype, shape and bytes; hashing
    reads all weights once).  ``config_sha256`` covers the config without
    bookkeeping keys.  ``weights_sha256`` fingerprints the checkpoint folder
    the model was loaded from (a local folder, or a hub name in the Hugging
    Face cache), as the vLLM connector does, so that the two engines meet on
    one checkpoint; a model made in memory, without one, gets the fingerprint
    of its state dict's tensors, as the reference engine does.  (A model
    changed after loading still carries its folder's.)
    """
    config = model.config
    commit = getattr(config, "_commit_hash", None)
    if name is None:
        name = config.name_or_path or config.model_type
    if revision is None:
        revision = commit or weights_digest(model.state_dict())[:16]
    weights = checkpoint_weights_sha256(config.name_or_path, commit) \
        or weights_sha256_of_tensors(model.state_dict())
    return {"name": name, "revision": revision, "config_sha256": hf_config_sha256(config),
            "weights_sha256": weights}


class TransformersKVPool(KVPool):
    """The full-attention cache of a ``PagedAttentionCache`` as a bridge pool.

    ``layers[j]`` views model layer *j* as ``[num_blocks, 2, page_size,
    n_kv_heads, head_dim]`` (in place, no copy).  Gather and scatter move
    whole blocks of the flat tensor at once and reorder ``[n_layers, 2, ...]``
    into page bytes' ``[2, n_layers, ...]``.
    """

    def __init__(self, cache: PagedAttentionCache, group: str = FULL_ATTENTION):
        alloc = cache.cache_allocators[group]
        if not isinstance(alloc, FullAttentionCacheAllocator):  # (sliding attention's is one too)
            raise ValueError(f"unexpected transformers cache allocator {type(alloc).__name__}")
        if sorted(alloc.layer_indices) != list(range(cache.config.num_hidden_layers)):
            raise ValueError("the transformers cache does not hold every layer in one group")
        P, H, D = alloc.tokens_per_page, alloc.num_key_value_heads, alloc.head_dim
        L = len(alloc.layer_indices)
        itemsize = alloc.cache_dtype.itemsize
        if alloc.bytes_per_block != L * 2 * P * H * D * itemsize:
            raise ValueError("unexpected transformers block size: not [n_layers, 2, page, heads, dim]")
        raw = cache.cache_tensor
        nb = raw.numel() // alloc.bytes_per_block
        # Blocks as rows of bytes, and as typed [block, layer position, K/V, slot, head, dim].
        self._raw = raw[:nb * alloc.bytes_per_block].view(nb, L, 2, P * H * D * itemsize)
        typed = raw[:nb * alloc.bytes_per_block].view(alloc.cache_dtype).view(nb, L, 2, P, H, D)
        layers = [typed[:, alloc.layer_indices.index(j)] for j in range(L)]
        super().__init__(layers, TRANSFORMERS_PAGED, {"k_has_rope": True, "scales": None})

    def engine_info(self, name: str) -> dict[str, Any]:
        return {**super().engine_info(name), "version": transformers.__version__}

    def gather(self, index: torch.Tensor | Sequence[int], out: torch.Tensor) -> None:
        index = self.as_index(index)
        n = index.numel()
        out.view(n, 2, self.n_layers, -1).copy_(self._raw.index_select(0, index).transpose(1, 2))

    def scatter(self, index: torch.Tensor | Sequence[int], src: torch.Tensor) -> None:
        index = self.as_index(index)
        n = index.numel()
        blocks = src.view(n, 2, self.n_layers, -1).transpose(1, 2).contiguous()
        self._raw.index_copy_(0, index, blocks)

    def copy_block(self, src: BlockId, dst: BlockId) -> None:
        self._raw[dst].copy_(self._raw[src])


class TransformersAllocator:
    """The bridge's allocator protocol over a transformers cache group.

    Blocks come from the group's free blocks, then from free sectors, then
    from blocks kept only for prefix caching (evicted, as the scheduler does
    under memory pressure; an eviction is not undone).  ``free`` of exactly
    the blocks the last ``allocate`` returned, before anything else changed
    the pool, restores the pool as it was; other frees release references
    the way the engine does.
    """

    def __init__(self, cache: PagedAttentionCache, group: str = FULL_ATTENTION):
        self.cache = cache
        self.group = cache.cache_allocators[group]
        self.pool = cache.pool
        self.index = self.group.index
        self._undo: tuple[list[BlockId], Any] | None = None

    def _free_now(self) -> int:
        return (self.pool.count_free_blocks(self.index)
                + self.pool.num_free_sectors * self.group.blocks_per_sector)

    def num_free(self) -> int:
        return self._free_now() + len(self.group.ledger.cached_blocks)

    def _pool_state(self):
        trees = self.pool._free_blocks[self.index]
        return (list(self.pool.free_sectors), [(r, list(t)) for r, t in trees.trees.items()], len(trees))

    def state(self) -> Any:
        """Everything allocation touches, as plain values (for checks and tests)."""
        ledger = self.group.ledger
        return (self._pool_state(), {k: list(v) for k, v in self.group.block_table.items()},
                dict(ledger.shared_ref_counts), dict(ledger.block_to_hash), list(ledger.cached_blocks))

    def allocate(self, n: int) -> list[BlockId]:
        if n < 0:
            raise ValueError("cannot allocate a negative number of blocks")
        if n > self.num_free():
            raise NoFreeBlocks(n, self.num_free())
        if n > self._free_now():
            self.cache.evict_cached_blocks()
        before = self._pool_state()
        missing = n - self.pool.count_free_blocks(self.index)
        if missing > 0:
            for _ in range(-(-missing // self.group.blocks_per_sector)):
                self.pool.allocate_sector(self.index)
        blocks = [BlockId(b) for b in self.pool.get_free_blocks(self.index, n)]
        self._undo = (list(blocks), before)
        return blocks

    def free(self, blocks: Sequence[BlockId]) -> None:
        if self._undo is not None and list(blocks) == self._undo[0]:
            sectors, trees, length = self._undo[1]
            self.pool.free_sectors[:] = sectors
            ft = self.pool._free_blocks[self.index]
            ft.trees = {r: list(t) for r, t in trees}
            ft._length = length
            self._undo = None
            return
        self._undo = None
        released: list[int] = [b for b in blocks if self.group.ledger.release(b, no_cache=True)]
        self.pool.free_blocks(self.index, released)


@dataclass
class LiveRequest:
    """One request of the engine whose KV is in the pool."""

    id: str
    status: str
    prompt_ids: list[int]
    generated_tokens: list[int]
    kv_length: int
    block_ids: list[BlockId]

    @property
    def kv_token_ids(self) -> list[int]:
        """The tokens whose KV the blocks hold (all but the newest token)."""
        return (self.prompt_ids + self.generated_tokens)[:self.kv_length]


@dataclass
class TransformersStepOutput:
    """One request's result of a step: the greedy token and its logprob (or None)."""

    token: int
    logprob: float | None


class TransformersAdapter:
    """The bridge attached to a transformers :class:`ContinuousBatchingManager`.

    Works with a manager whose generation thread runs (every operation then
    runs inside ``manager.pause()``) or one stepped by hand with
    :meth:`step` (its batch processor is created here; starting the thread
    later resets it).  Needs a model whose layers are all full attention,
    no tensor parallelism and synchronous batching
    (``use_async_batching=False``), so that no batch is in flight while KV
    is copied.
    """

    def __init__(self, manager: ContinuousBatchingManager, *, name: str = "transformers",
                 model_name: str | None = None, revision: str | None = None,
                 staging_bytes: int = DEFAULT_STAGING_BYTES):
        self.manager = manager
        self.name = name
        if manager.distributed_helper.tp_size > 1:
            raise ValueError("the transformers adapter does not support tensor parallelism")
        with self.exclusive():
            if manager.batch_processor is None:
                manager.batch_processor = manager._create_batch_processor()
            bp = manager.batch_processor
            if bp.use_async_batching:
                raise ValueError("the transformers adapter needs use_async_batching=False in the "
                                 "ContinuousBatchingConfig (an async batch is always in flight)")
            groups = list(bp.cache.cache_allocators)
            if groups != [FULL_ATTENTION]:
                raise ValueError(f"the transformers adapter supports full-attention models only, "
                                 f"this one has {', '.join(groups)} layers")
            self.cache = bp.cache
            self.pool = TransformersKVPool(self.cache)
            self.allocator = TransformersAllocator(self.cache)
        self.model_identity = model_identity(manager.model, name=model_name, revision=revision)
        self.bridge = Bridge(self.pool, self.allocator, engine_name=name, model=self.model_identity,
                             staging_bytes=staging_bytes)

    @property
    def processor(self):
        return self.manager.batch_processor

    @property
    def scheduler(self):
        bp = self.manager.batch_processor
        if bp is None:  # (the manager stopped without keeping it for a next session)
            raise AttributeError("the continuous batching manager has no batch processor")
        return bp.scheduler

    @contextlib.contextmanager
    def exclusive(self):
        """The engine held still: paused if its thread runs, else as it is between hand steps.

        A cache created under ``torch.inference_mode`` (a loop started from
        inside it) can only be written in that mode, so the copies run in
        the cache's mode.
        """
        with contextlib.ExitStack() as stack:
            if self.manager.is_running():
                stack.enter_context(self.manager.pause())
            bp = self.manager.batch_processor
            if bp is not None:
                stack.enter_context(torch.inference_mode(bp.cache.cache_tensor.is_inference()))
            yield

    # ------------------------------------------------------------ requests

    def requests(self) -> list[LiveRequest]:
        """The requests whose KV is in the pool, in the scheduler's order."""
        with self.exclusive():
            return self._live()

    def _live(self) -> list[LiveRequest]:
        table = self.pool_group().block_table
        P = self.pool.block_size
        out = []
        for rid, st in self.scheduler.active_requests.items():
            blocks = table.get(rid)
            if not blocks or st.is_cpu_offloaded:
                continue
            known = len(st.initial_tokens) + len(st.generated_tokens)
            n = min(st.position_offset, known)
            out.append(LiveRequest(rid, st.status.name, list(st.initial_tokens),
                                   list(st.generated_tokens), n,
                                   [BlockId(b) for b in blocks[:-(-n // P)]]))
        return out

    def pool_group(self):
        return self.cache.cache_allocators[FULL_ATTENTION]

    def seq_blocks(self, request_ids: Iterable[str] | None = None) -> list[SeqBlocks]:
        """The bridge's view of live requests (default: all with KV)."""
        with self.exclusive():
            live = {r.id: r for r in self._live()}
            ids = list(live) if request_ids is None else list(request_ids)
            for rid in ids:
                if rid not in live:
                    raise KeyError(f"no live request {rid!r} with KV in engine {self.name!r}")
            return [SeqBlocks(rid, live[rid].block_ids, live[rid].kv_length, live[rid].kv_token_ids)
                    for rid in ids]

    # --------------------------------------------------------------- bridge

    def page_out(self, dest: SinkLike, request_ids: Iterable[str] | None = None, *,
                 include_token_ids: bool = True) -> Manifest:
        """Write live requests (default: all) as one session; returns its manifest."""
        with self.exclusive():
            return self.bridge.page_out(self.seq_blocks(request_ids), dest,
                                        include_token_ids=include_token_ids)

    def page_in(self, src: SourceLike, *, force: bool = False, trust_unfingerprinted: bool = False,
                max_new_tokens: int | None = None,
                eos_token_id: int | list[int] | None = None) -> list[str]:
        """Load a session's sequences as decoding requests; returns their ids.

        *force* and *trust_unfingerprinted* are
        :func:`~engine_bridge.core.bridge.check_manifest`'s.  Each becomes a request whose tokens are the session's ``token_ids``
        and whose next step re-feeds the last of them.  *max_new_tokens*
        counts from there (None: no limit); *eos_token_id* defaults to the
        manager's generation config.  Refusals leave the pool, the
        allocator and the scheduler as they were.
        """
        with self.exclusive():
            extra: list[int] = []

            def accept(m: Manifest) -> None:
                self._refuse(m)
                # Blocks for private copies of shared last pages (the replay writes
                # there); without any, the bridge's own check counts the pages.
                extra.append(_private_last_pages(m))
                if extra[0]:
                    need = len({ix for s in m.logical_seqs for ix in s.page_ixs}) + extra[0]
                    free = self.allocator.num_free()
                    if free < need:
                        raise NoFreeBlocks(need, free)

            res = self.bridge.page_in(src, force=force, trust_unfingerprinted=trust_unfingerprinted,
                                      accept=accept)
            return self._adopt(res, max_new_tokens, eos_token_id)

    def _refuse(self, m: Manifest) -> None:
        taken = set(self.scheduler.active_requests) | set(self.scheduler.waiting_requests)
        taken |= {s.request_id for s in list(self.manager.input_queue.queue)}
        for s in m.logical_seqs:
            if s.id in taken:
                raise Refused(f"request {s.id!r} is already live in engine {self.name!r}")
            if s.token_ids is None:
                raise Refused(f"sequence {s.id!r} has no token_ids; a transformers request "
                              "needs the tokens of its KV to continue")
            if not s.page_ixs:
                raise Refused(f"sequence {s.id!r} holds no tokens")

    def _adopt(self, res: PageInResult, max_new_tokens: int | None,
               eos_token_id: int | list[int] | None) -> list[str]:
        group = self.pool_group()
        seqs = [SeqBlocks(s.id, list(s.block_ids), s.n_tokens, s.token_ids) for s in res.seqs]
        # A sequence whose last block another holder shares gets a private copy
        # (the order and count match _private_last_pages, checked before page-in).
        uses = Counter(b for s in seqs for b in s.block_ids)
        copies = []
        for s in seqs:
            if uses[s.block_ids[-1]] > 1:
                uses[s.block_ids[-1]] -= 1
                copies.append(s)
        fresh = self.allocator.allocate(len(copies)) if copies else []
        for s, new in zip(copies, fresh):
            self.pool.copy_block(s.block_ids[-1], new)
            s.block_ids[-1] = new
        seen: set[BlockId] = set()
        for s in seqs:
            for b in s.block_ids:
                if b in seen:
                    group.ledger.acquire(b)
                seen.add(b)
        if eos_token_id is None:
            eos_token_id = self.manager.generation_config.eos_token_id
        for s in seqs:
            assert s.token_ids is not None  # _refuse refused every sequence without them
            toks = [int(t) for t in s.token_ids]
            st = RequestState(request_id=s.id, initial_tokens=toks, max_new_tokens=max_new_tokens,
                              eos_token_id=eos_token_id)
            st.remaining_prefill_tokens = []
            st.tokens_to_process = [toks[-1]]
            st.position_offset = s.n_tokens - 1
            st.allocated_blocks = len(s.block_ids)
            st.status = RequestStatus.DECODING
            group.block_table[s.id] = list(s.block_ids)
            self.scheduler.active_requests[s.id] = st
            if self.cache.use_prefix_sharing:
                # Blocks before the one the replay rewrites become shareable prefixes.
                done = (s.n_tokens - 1) // self.pool.block_size
                if done:
                    group.mark_complete_blocks(s.id, toks, done)
        return [s.id for s in seqs]

    def remove(self, request_id: str) -> None:
        """Drop a live request and release its blocks (as when it finishes)."""
        with self.exclusive():
            if request_id not in self.scheduler.active_requests:
                raise KeyError(f"no live request {request_id!r} in engine {self.name!r}")
            self.scheduler.finish_request(request_id)

    # ------------------------------------------------------------- stepping

    def step(self) -> dict[str, TransformersStepOutput]:
        """Run one batch by hand (the manager's thread must not run); new tokens by request."""
        if self.manager.is_running():
            raise RuntimeError("the manager's generation thread is running: it steps the engine")
        bp = self.processor
        if not bp.prepare_next_batch():
            return {}
        self.manager._generation_step()
        bp.update_batch()
        out = {}
        for fs in bp.inputs_and_outputs.requests_in_batch:
            if fs.has_new_token:
                st = fs.state
                lp = st.logprobs[-1] if bp.return_logprobs and st.logprobs else None
                out[st.request_id] = TransformersStepOutput(st.generated_tokens[-1], lp)
        return out


def _private_last_pages(m: Manifest) -> int:
    """How many sequences need a private copy of their last page at page-in."""
    uses = Counter(ix for s in m.logical_seqs for ix in s.page_ixs)
    n = 0
    for s in m.logical_seqs:
        last = s.page_ixs[-1]
        if uses[last] > 1:
            uses[last] -= 1
            n += 1
    return n


class TransformersEngine:
    """A greedy transformers continuous-batching engine stepped by hand, with the bridge attached.

    Wraps ``model.init_continuous_batching()`` with a paged cache of
    *num_blocks* blocks of *page_size* tokens, at most *max_batch_tokens*
    tokens a step, logprobs on, no EOS (requests run until removed or
    *max_new_tokens*).  :meth:`step` runs one batch of every scheduled
    request, like the manager's own loop.
    """

    def __init__(self, model, *, num_blocks: int = 256, page_size: int = 16,
                 max_batch_tokens: int = 512, name: str = "transformers",
                 model_name: str | None = None, revision: str | None = None,
                 staging_bytes: int = DEFAULT_STAGING_BYTES):
        gen = GenerationConfig(do_sample=False, max_new_tokens=None, eos_token_id=-1)
        cb = ContinuousBatchingConfig(page_size=page_size, num_blocks=num_blocks,
                                      max_batch_tokens=max_batch_tokens, return_logprobs=True,
                                      use_async_batching=False, use_cuda_graph=False,
                                      cpu_offload_space=0.0)
        self.model = model
        self.manager = model.init_continuous_batching(generation_config=gen,
                                                      continuous_batching_config=cb)
        self.adapter = TransformersAdapter(self.manager, name=name, model_name=model_name,
                                           revision=revision, staging_bytes=staging_bytes)
        self.name = name
        self.pool = self.adapter.pool
        self.allocator = self.adapter.allocator
        self.bridge = self.adapter.bridge
        self.model_identity = self.adapter.model_identity

    def add_request(self, request_id: str, prompt: Sequence[int], max_new_tokens: int | None = None) -> None:
        """Queue a request; its first steps prefill the prompt."""
        self.manager.add_request(list(prompt), request_id=request_id, max_new_tokens=max_new_tokens)

    def step(self, request_ids: Sequence[str] | None = None) -> dict[str, TransformersStepOutput]:
        """One batch; checks that each of *request_ids* got a token."""
        out = self.adapter.step()
        for rid in request_ids or ():
            if rid not in out:
                raise RuntimeError(f"request {rid!r} got no token this step (still prefilling?)")
        return out

    def generate(self, request_ids: Sequence[str], n_steps: int
                 ) -> tuple[dict[str, list[int]], dict[str, list[float | None]]]:
        """*n_steps* steps: tokens and logprobs of each of *request_ids*."""
        toks: dict[str, list[int]] = {r: [] for r in request_ids}
        lps: dict[str, list[float | None]] = {r: [] for r in request_ids}
        for _ in range(n_steps):
            out = self.step(request_ids)
            for r in request_ids:
                toks[r].append(out[r].token)
                lps[r].append(out[r].logprob)
        return toks, lps

    def requests(self) -> list[LiveRequest]:
        return self.adapter.requests()

    def remove(self, request_id: str) -> None:
        self.adapter.remove(request_id)

    def seq_blocks(self, request_ids: Iterable[str] | None = None) -> list[SeqBlocks]:
        return self.adapter.seq_blocks(request_ids)

    def page_out(self, dest: SinkLike, request_ids: Iterable[str] | None = None, *,
                 include_token_ids: bool = True) -> Manifest:
        return self.adapter.page_out(dest, request_ids, include_token_ids=include_token_ids)

    def page_in(self, src: SourceLike, *, force: bool = False, trust_unfingerprinted: bool = False,
                max_new_tokens: int | None = None) -> list[str]:
        return self.adapter.page_in(src, force=force, trust_unfingerprinted=trust_unfingerprinted,
                                    max_new_tokens=max_new_tokens)


def llama_model(config=None, *, state_dict=None, dtype: str = "f32", seed: int = 0):
    """A small ``LlamaForCausalLM`` (f32 or bf16) with the weights of *state_dict*.

    *config* is a reference :class:`~engine_bridge.reference.reference_engine.ModelConfig`
    (default: the reference engine's); without *state_dict* the weights are
    the reference engine's seeded random ones, so both engines hold the same
    model.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine_bridge.reference.reference_engine import ModelConfig, random_state_dict
    c = config or ModelConfig()
    hf = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.ffn_dim,
                     num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
                     num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim,
                     max_position_embeddings=c.max_position,
                     rope_parameters={"rope_theta": c.rope_theta, "rope_type": "default"},
                     rms_norm_eps=c.rms_eps, tie_word_embeddings=False, attention_bias=False,
                     mlp_bias=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch_dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = LlamaForCausalLM(hf)
    sd = random_state_dict(c, seed) if state_dict is None else state_dict
    model.load_state_dict({k: v.to(torch.float32) for k, v in sd.items()})
    # (PreTrainedModel.to is @wraps(Module.to): mypy sees an unbound wrapper wanting the model first.)
    model = model.to(torch_dtype).eval()  # type: ignore[arg-type]
    # RoPE frequencies stay f32 (a dtype cast of the module casts its buffers too).
    rot = model.model.rotary_emb
    rot.inv_freq = rot.compute_default_rope_parameters(hf)[0]
    rot.original_inv_freq = rot.inv_freq.clone()
    return model
