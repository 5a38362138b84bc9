"""The reference engine: a small Llama-style decoder with a paged KV pool.

RMSNorm, RoPE, grouped-query attention and a SwiGLU MLP, with seeded random
weights or a Llama state dict (Hugging Face names).  K (with RoPE applied)
and V live in a :class:`~engine_bridge.core.pool.KVPool` (vLLM's FlashAttention
layout by default); each sequence owns a block table, and attention reads
K/V only through it, gathered into a contiguous ``[len, heads, dim]`` tensor.
So what a step computes depends on the tokens and the logical KV contents,
never on which physical blocks hold them: a sequence paged out and paged
into another engine continues bit for bit (same build, same batch shapes).
On the CPU a step runs on a fixed number of intra-op threads (*threads*,
default 1), so neither the host's load nor the BLAS library's own choice of
thread count can change a sum's order between two runs.

Scheduling follows vLLM: a sequence's tokens are prompt plus output, and
its KV covers all but the newest token.  A step feeds, for every sequence
in the batch, the tokens whose KV is missing, writes their KV into the
pool, and greedily appends one token.  A restored sequence holds KV for all
its tokens; its first step re-feeds the last token to get the logits that
pick the next one, and keeps the restored KV as it is.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F

from engine_bridge.core.allocator import RefCountingAllocator
from engine_bridge.core.bridge import Bridge, PageInResult, SeqBlocks
from engine_bridge.core.identity import config_sha256, weights_sha256_of_tensors
from engine_bridge.core.pool import FLASH_ATTN, TORCH_DTYPES, BlockId, KVLayout, KVPool, layout_of
from engine_bridge.core.staging import DEFAULT_STAGING_BYTES
from engine_bridge.errors import Refused
from engine_bridge.transport.session_io import SinkLike, SourceLike

# Queries per attention chunk in a long prefill (bounds the score matrix).
_ATTN_CHUNK = 256


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of the reference model (the default is a tiny one)."""

    vocab_size: int = 512
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 2
    head_dim: int = 16
    ffn_dim: int = 352
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    max_position: int = 8192

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError("n_heads must be a multiple of n_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (RoPE rotates pairs)")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def weight_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of a Llama-style model of config *c*, by its HF name."""
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, c.d_model)}
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, c.d_model),
            p + "self_attn.k_proj.weight": (kv, c.d_model),
            p + "self_attn.v_proj.weight": (kv, c.d_model),
            p + "self_attn.o_proj.weight": (c.d_model, q),
            p + "mlp.gate_proj.weight": (c.ffn_dim, c.d_model),
            p + "mlp.up_proj.weight": (c.ffn_dim, c.d_model),
            p + "mlp.down_proj.weight": (c.d_model, c.ffn_dim),
            p + "input_layernorm.weight": (c.d_model,),
            p + "post_attention_layernorm.weight": (c.d_model,),
        })
    shapes["model.norm.weight"] = (c.d_model,)
    shapes["lm_head.weight"] = (c.vocab_size, c.d_model)
    return shapes


def random_state_dict(c: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random f32 weights (fan-in scaled, norms near one)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in weight_shapes(c).items():
        if len(shape) == 1:
            out[name] = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name == "model.embed_tokens.weight":
            out[name] = torch.randn(shape, generator=g)
        else:
            out[name] = torch.randn(shape, generator=g) / math.sqrt(shape[1])
    return out


def weights_digest(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 hex over every tensor's name, dtype, shape and bytes (sorted by name)."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


@dataclass
class ReferenceStepOutput:
    """One sequence's result of a step: the greedy token and the logits (f32)."""

    token: int
    logits: torch.Tensor


@dataclass
class _Seq:
    id: str
    tokens: list[int | None]  # None: a position restored without its token id
    n_cached: int
    blocks: list[BlockId] = field(default_factory=list)


class ReferenceEngine:
    """A deterministic paged-KV transformer engine for demos and tests.

    *dtype* is ``"f32"`` or ``"bf16"`` (weights, activations and the KV
    pool).  The pool has *num_blocks* blocks of *block_size* tokens in
    *kv_layout*.  With no *state_dict*, weights are drawn from *seed*.
    """

    def __init__(self, config: ModelConfig | None = None, *, dtype: str = "f32",
                 num_blocks: int = 256, block_size: int = 16, seed: int = 0,
                 device: str | torch.device = "cpu", kv_layout: str | KVLayout = FLASH_ATTN,
                 state_dict: Mapping[str, torch.Tensor] | None = None,
                 name: str = "reference", model_name: str = "pffs-reference",
                 staging_bytes: int = DEFAULT_STAGING_BYTES, threads: int = 1):
        self.config = c = config or ModelConfig()
        if threads < 1:
            raise ValueError("threads must be at least 1")
        if dtype not in ("f32", "bf16"):
            raise ValueError(f"dtype must be f32 or bf16, not {dtype!r}")
        self.dtype = TORCH_DTYPES[dtype]
        self.device = torch.device(device)
        self.threads = threads
        self.name = name
        self.block_size = block_size
        if self.device.type == "cuda":
            # Same shapes, same kernels, same bits (cuBLAS also needs
            # CUBLAS_WORKSPACE_CONFIG set before CUDA starts).
            torch.use_deterministic_algorithms(True, warn_only=True)

        shapes = weight_shapes(c)
        state = dict(random_state_dict(c, seed) if state_dict is None else state_dict)
        if set(state) != set(shapes):
            missing, extra = sorted(set(shapes) - set(state)), sorted(set(state) - set(shapes))
            raise ValueError(f"state dict does not fit the config: missing {missing[:4]}, "
                             f"unexpected {extra[:4]}")
        for k, shape in shapes.items():
            if tuple(state[k].shape) != shape:
                raise ValueError(f"{k}: shape {tuple(state[k].shape)}, config needs {shape}")
        self.w = {k: v.detach().to(device=self.device, dtype=self.dtype).contiguous()
                  for k, v in state.items()}
        self.model_identity = {"name": model_name, "revision": weights_digest(self.w)[:16],
                               "config_sha256": config_sha256(c.to_dict()),
                               "weights_sha256": weights_sha256_of_tensors(self.w)}

        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32)
                                           / c.head_dim))
        angles = torch.outer(torch.arange(c.max_position, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self._cos = angles.cos().to(self.device, self.dtype)
        self._sin = angles.sin().to(self.device, self.dtype)

        self.pool = KVPool.allocate(num_blocks=num_blocks, block_size=block_size,
                                    n_layers=c.n_layers, n_heads=c.n_kv_heads,
                                    head_dim=c.head_dim, dtype=self.dtype, device=self.device,
                                    layout=layout_of(kv_layout),
                                    kv={"k_has_rope": True, "scales": None})
        # Canonical views [2, num_blocks, block_size, heads, dim] of the pool tensors.
        self._kv = [t.permute(self.pool.layout.to_canonical) for t in self.pool.layers]
        self.allocator = RefCountingAllocator(num_blocks)
        self.bridge = Bridge(self.pool, self.allocator, engine_name=name,
                             model=self.model_identity, staging_bytes=staging_bytes)
        self.seqs: dict[str, _Seq] = {}

    # ------------------------------------------------------------- weights

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under their Hugging Face Llama names (copies, on the CPU)."""
        return {k: v.detach().cpu().clone() for k, v in self.w.items()}

    @classmethod
    def from_safetensors(cls, path, config: ModelConfig, **kw) -> "ReferenceEngine":
        """An engine with the Llama weights of a safetensors file."""
        from safetensors.torch import load_file
        return cls(config, state_dict=load_file(str(path)), **kw)

    # ----------------------------------------------------------- sequences

    def add_request(self, seq_id: str, prompt: Sequence[int]) -> None:
        """Queue a new sequence; its first step prefills the prompt."""
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} exists")
        if not prompt:
            raise ValueError("a prompt needs at least one token")
        self._check_tokens(prompt)
        self.seqs[seq_id] = _Seq(seq_id, [int(t) for t in prompt], 0)

    def append_tokens(self, seq_id: str, tokens: Sequence[int]) -> None:
        """Add input tokens (e.g. a new user turn); the next step computes them."""
        self._check_tokens(tokens)
        self.seqs[seq_id].tokens.extend(int(t) for t in tokens)

    def fork(self, src_id: str, new_id: str) -> None:
        """A new sequence sharing every block of *src_id* (copy-on-write)."""
        if new_id in self.seqs:
            raise ValueError(f"sequence {new_id!r} exists")
        s = self.seqs[src_id]
        self.allocator.incref(s.blocks)
        self.seqs[new_id] = _Seq(new_id, list(s.tokens), s.n_cached, list(s.blocks))

    def remove(self, seq_id: str) -> None:
        """Drop a sequence and its references to blocks."""
        s = self.seqs.pop(seq_id)
        self.allocator.free(s.blocks)

    def tokens(self, seq_id: str) -> list[int | None]:
        return list(self.seqs[seq_id].tokens)

    def seq_blocks(self, seq_ids: Iterable[str] | None = None) -> list[SeqBlocks]:
        """The bridge's view of sequences: the blocks and tokens whose KV is cached."""
        P = self.block_size
        out = []
        for sid in (self.seqs if seq_ids is None else seq_ids):
            s = self.seqs[sid]
            toks = s.tokens[:s.n_cached]
            known = [t for t in toks if t is not None]
            out.append(SeqBlocks(s.id, list(s.blocks[:-(-s.n_cached // P)]), s.n_cached,
                                 known if len(known) == len(toks) else None))
        return out

    def add_restored(self, restored: PageInResult | Sequence[SeqBlocks]) -> list[str]:
        """Adopt sequences rebuilt by a page-in; they own the blocks from now on.

        A block listed by several sequences (a shared page) gets one
        reference per use.  Sequences restored without token ids need
        :meth:`append_tokens` before they can step.
        """
        seqs = restored.seqs if isinstance(restored, PageInResult) else list(restored)
        self._refuse_taken_ids([s.id for s in seqs])
        seen: set[BlockId] = set()
        extra = []
        for s in seqs:
            for b in s.block_ids:
                (extra.append(b) if b in seen else seen.add(b))
        self.allocator.incref(extra)
        for s in seqs:
            toks: list[int | None] = (list(s.token_ids) if s.token_ids is not None
                                      else [None] * s.n_tokens)
            self.seqs[s.id] = _Seq(s.id, toks, s.n_tokens, list(s.block_ids))
        return [s.id for s in seqs]

    # --------------------------------------------------------------- bridge

    def page_out(self, dest: SinkLike, seq_ids: Iterable[str] | None = None, *,
                 include_token_ids: bool = True):
        """Write sequences (default: all) as one session; returns the manifest."""
        return self.bridge.page_out(self.seq_blocks(seq_ids), dest,
                                    include_token_ids=include_token_ids)

    def page_in(self, src: SourceLike, *, force: bool = False,
                trust_unfingerprinted: bool = False) -> list[str]:
        """Load a session's sequences into this engine; returns their ids
        (*force*, *trust_unfingerprinted*: :func:`~engine_bridge.core.bridge.check_manifest`)."""
        res = self.bridge.page_in(src, force=force, trust_unfingerprinted=trust_unfingerprinted,
                                  accept=lambda m: self._refuse_taken_ids(
                                      [s.id for s in m.logical_seqs]))
        return self.add_restored(res)

    def _refuse_taken_ids(self, ids: list[str]) -> None:
        taken = [i for i in ids if i in self.seqs]
        if taken:
            raise Refused(f"sequence {taken[0]!r} is already live in engine {self.name!r}")

    # ------------------------------------------------------------- decoding

    def step(self, seq_ids: Sequence[str] | None = None) -> dict[str, ReferenceStepOutput]:
        """Run one step over a batch of sequences and append a greedy token to each."""
        with self._fixed_threads():
            return self._step(seq_ids)

    def _step(self, seq_ids: Sequence[str] | None) -> dict[str, ReferenceStepOutput]:
        ids = list(self.seqs if seq_ids is None else seq_ids)
        if len(set(ids)) != len(ids):
            raise ValueError("a sequence appears twice in the batch")
        seqs = [self.seqs[i] for i in ids]
        starts = []
        for s in seqs:
            start = min(s.n_cached, len(s.tokens) - 1)
            if start < 0:
                raise ValueError(f"sequence {s.id!r} has no tokens")
            if any(t is None for t in s.tokens[start:]):
                raise ValueError(f"sequence {s.id!r} was restored without token ids: "
                                 "append input tokens before stepping it")
            starts.append(start)
        self._reserve_blocks(seqs)

        P, dev = self.block_size, self.device
        toks = torch.tensor([t for s, a in zip(seqs, starts) for t in s.tokens[a:]],
                            dtype=torch.long, device=dev)
        tables = [torch.tensor(s.blocks[:-(-len(s.tokens) // P)], dtype=torch.long, device=dev)
                  for s in seqs]
        lengths = [len(s.tokens) for s in seqs]
        spans, pos, w_rows, w_pos, w_blk = [], [], [], [], []
        r = 0
        for s, a, table, n in zip(seqs, starts, tables, lengths):
            spans.append((r, r + n - a))
            p = torch.arange(a, n, device=dev)
            pos.append(p)
            # KV is written only for positions not yet cached (a restored last token keeps its KV).
            w = p[p >= s.n_cached]
            w_rows.append(w - a + r)
            w_pos.append(w)
            w_blk.append(table[w // P])
            r += n - a
        pos_t = torch.cat(pos)
        rows_t, blk_t = torch.cat(w_rows), torch.cat(w_blk)
        slot_t = torch.cat(w_pos) % P
        writes = rows_t.numel() > 0

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kv = self._kv[layer]
            if writes:
                kv[0].index_put_((blk_t, slot_t), k.index_select(0, rows_t))
                kv[1].index_put_((blk_t, slot_t), v.index_select(0, rows_t))
            out = torch.empty_like(q)
            for (a, b), table, n in zip(spans, tables, lengths):
                keys = kv[0].index_select(0, table).flatten(0, 1)[:n]
                vals = kv[1].index_select(0, table).flatten(0, 1)[:n]
                out[a:b] = _attention(q[a:b], keys, vals, n - (b - a))
            return out

        x = self._forward(toks, pos_t, attend)
        last = torch.tensor([b - 1 for _, b in spans], dtype=torch.long, device=dev)
        logits = self._logits(x.index_select(0, last))
        chosen = logits.argmax(dim=-1).tolist()
        out = {}
        for k, s in enumerate(seqs):
            s.n_cached = len(s.tokens)
            s.tokens.append(int(chosen[k]))
            out[s.id] = ReferenceStepOutput(int(chosen[k]), logits[k])
        return out

    def generate(self, seq_ids: Sequence[str], n_steps: int
                 ) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]]]:
        """*n_steps* steps over the same batch: tokens and logits per sequence."""
        toks: dict[str, list[int]] = {i: [] for i in seq_ids}
        logs: dict[str, list[torch.Tensor]] = {i: [] for i in seq_ids}
        for _ in range(n_steps):
            for sid, o in self.step(seq_ids).items():
                toks[sid].append(o.token)
                logs[sid].append(o.logits)
        return toks, logs

    def recompute_logits(self, tokens: Sequence[int]) -> torch.Tensor:
        """Logits at every position of *tokens*, computed at once without the pool."""
        self._check_tokens(tokens)
        toks = torch.tensor(list(tokens), dtype=torch.long, device=self.device)
        pos = torch.arange(len(tokens), device=self.device)

        def attend(layer, q, k, v):
            return _attention(q, k, v, 0)

        with self._fixed_threads():
            return self._logits(self._forward(toks, pos, attend))

    # ------------------------------------------------------------ internals

    @contextlib.contextmanager
    def _fixed_threads(self):
        # torch's thread count is the calling thread's; it is put back after.
        before = torch.get_num_threads()
        if self.device.type != "cpu" or before == self.threads:
            yield
            return
        torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def _check_tokens(self, tokens: Sequence[int]) -> None:
        if any(not 0 <= int(t) < self.config.vocab_size for t in tokens):
            raise ValueError(f"token ids must lie in 0..{self.config.vocab_size - 1}")

    def _reserve_blocks(self, seqs: list[_Seq]) -> None:
        # Blocks for every position the step writes, copy-on-write for a shared
        # partly filled block; all allocated at once or NoFreeBlocks, nothing changed.
        P = self.block_size
        need, cow = 0, []
        for s in seqs:
            if len(s.tokens) > self.config.max_position:
                raise ValueError(f"sequence {s.id!r} exceeds max_position {self.config.max_position}")
            need += max(0, -(-len(s.tokens) // P) - len(s.blocks))
            first_write = s.n_cached
            if first_write < len(s.tokens) and first_write % P:
                j = first_write // P
                if j < len(s.blocks) and self.allocator.refcount(s.blocks[j]) > 1:
                    cow.append((s, j))
        fresh = self.allocator.allocate(need + len(cow))
        for s, j in cow:
            new, old = fresh.pop(), s.blocks[j]
            for kv in self._kv:
                kv[:, new].copy_(kv[:, old])
            self.allocator.free([old])
            s.blocks[j] = new
        for s in seqs:
            want = -(-len(s.tokens) // P) - len(s.blocks)
            if want > 0:
                s.blocks.extend(fresh[:want])
                del fresh[:want]
        assert not fresh

    def _forward(self, toks: torch.Tensor, pos: torch.Tensor, attend) -> torch.Tensor:
        c, w = self.config, self.w
        T = toks.shape[0]
        x = w["model.embed_tokens.weight"].index_select(0, toks)
        cos = self._cos.index_select(0, pos)[:, None, :]
        sin = self._sin.index_select(0, pos)[:, None, :]
        for i in range(c.n_layers):
            p = f"model.layers.{i}."
            h = _rms_norm(x, w[p + "input_layernorm.weight"], c.rms_eps)
            q = F.linear(h, w[p + "self_attn.q_proj.weight"]).view(T, c.n_heads, c.head_dim)
            k = F.linear(h, w[p + "self_attn.k_proj.weight"]).view(T, c.n_kv_heads, c.head_dim)
            v = F.linear(h, w[p + "self_attn.v_proj.weight"]).view(T, c.n_kv_heads, c.head_dim)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            a = attend(i, q, k, v).reshape(T, c.n_heads * c.head_dim)
            x = x + F.linear(a, w[p + "self_attn.o_proj.weight"])
            h = _rms_norm(x, w[p + "post_attention_layernorm.weight"], c.rms_eps)
            m = F.silu(F.linear(h, w[p + "mlp.gate_proj.weight"])) * F.linear(h, w[p + "mlp.up_proj.weight"])
            x = x + F.linear(m, w[p + "mlp.down_proj.weight"])
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        h = _rms_norm(x, self.w["model.norm.weight"], self.config.rms_eps)
        return F.linear(h, self.w["lm_head.weight"]).float()


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int) -> torch.Tensor:
    """Causal GQA attention of queries at positions ``q_start..`` over keys ``0..len(k)``.

    q is [t, Hq, D]; k and v are contiguous [n, Hkv, D].  Scores and softmax
    are f32; the result has q's dtype.  Every shape depends only on t, n and
    the chunking of t, never on where the KV came from.
    """
    t, hq, d = q.shape
    n, hkv, _ = k.shape
    g = hq // hkv
    kf = k.float().permute(1, 2, 0)           # [Hkv, D, n]
    vf = v.float().permute(1, 0, 2)           # [Hkv, n, D]
    out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    scale = 1.0 / math.sqrt(d)
    for a in range(0, t, _ATTN_CHUNK):
        b = min(t, a + _ATTN_CHUNK)
        lim = q_start + b  # keys after the chunk's last query are never attended
        qf = q[a:b].float().view(b - a, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * (b - a), d)
        scores = torch.bmm(qf, kf[:, :, :lim]).mul_(scale).view(hkv, g, b - a, lim)
        if b - a > 1:
            q_pos = torch.arange(q_start + a, q_start + b, device=q.device)
            key_pos = torch.arange(lim, device=q.device)
            scores.masked_fill_(key_pos[None, :] > q_pos[:, None], float("-inf"))
        probs = scores.softmax(dim=-1).view(hkv, g * (b - a), lim)
        o = torch.bmm(probs, vf[:, :lim]).view(hkv, g, b - a, d).permute(2, 0, 1, 3)
        out[a:b] = o.reshape(b - a, hq, d).to(q.dtype)
    return out
