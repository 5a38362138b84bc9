"""Where an engine's paged KV pool is described, gathered and scattered.

An engine keeps one tensor per layer in its own layout (vLLM FlashAttention
``[2, num_blocks, block_size, n_kv_heads, head_dim]``, FlashInfer
``[num_blocks, 2, block_size, n_kv_heads, head_dim]``, ...).  A
:class:`KVPool` wraps those tensors without copying them and moves whole
blocks between them and contract §1 page bytes: K then V, each C-ordered
``[n_layers, page_size_tokens, n_heads, head_dim]``.  One engine block is one
page.  All moves work on byte views of the tensors, so every dtype (fp8
included) takes the same path and the bytes are exactly the engine's.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, NewType, Protocol, Sequence

import numpy as np
import torch

from pffs.manifest import DTYPE_SIZES

BlockId = NewType("BlockId", int)

if sys.byteorder != "little":  # pragma: no cover - every torch platform today
    raise ImportError("engine_bridge writes page bytes from memory and needs a little-endian host")

#: Page dtype names (contract §1) of the torch dtypes a pool may hold.
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.bfloat16: "bf16",
    torch.float16: "f16",
    torch.float32: "f32",
    torch.float8_e4m3fn: "fp8e4m3",
    torch.float8_e5m2: "fp8e5m2",
}
TORCH_DTYPES: dict[str, torch.dtype] = {v: k for k, v in DTYPE_NAMES.items()}

#: KV conventions assumed for a session whose manifest gives none.
DEFAULT_KV: dict[str, Any] = {"k_has_rope": True, "scales": None}


@dataclass(frozen=True)
class KVLayout:
    """A per-layer tensor layout: its name and the permutation to canonical form.

    Canonical form is ``[2, num_blocks, block_size, n_heads, head_dim]`` (K/V,
    block, token slot, head, dim); ``to_canonical`` permutes a layer tensor's
    dimensions into that order.
    """

    name: str
    to_canonical: tuple[int, int, int, int, int]

    def shape(self, num_blocks: int, block_size: int, n_heads: int, head_dim: int) -> tuple[int, ...]:
        """The layer tensor shape of this layout for the given geometry."""
        canon = (2, num_blocks, block_size, n_heads, head_dim)
        out = [0] * 5
        for canon_dim, tensor_dim in enumerate(self.to_canonical):
            out[tensor_dim] = canon[canon_dim]
        return tuple(out)


FLASH_ATTN = KVLayout("flash_attn NHD", (0, 1, 2, 3, 4))
FLASHINFER = KVLayout("flashinfer NHD", (1, 0, 2, 3, 4))
FLASHINFER_HND = KVLayout("flashinfer HND", (1, 0, 3, 2, 4))
LAYOUTS: dict[str, KVLayout] = {k.name: k for k in (FLASH_ATTN, FLASHINFER, FLASHINFER_HND)}


def layout_of(layout: str | KVLayout) -> KVLayout:
    if isinstance(layout, KVLayout):
        return layout
    try:
        return LAYOUTS[layout]
    except KeyError:
        raise ValueError(f"unknown KV layout {layout!r} (known: {', '.join(LAYOUTS)})") from None


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype name (contract §1) of a torch dtype (ValueError for one pages cannot hold)."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"KV dtype {dtype} has no page dtype (use one of "
                         f"{', '.join(str(d) for d in DTYPE_NAMES)})") from None


class BlockAllocator(Protocol):
    """What the bridge needs from an engine's block allocator.

    ``allocate`` is all-or-nothing: it returns *n* distinct free blocks or
    raises :class:`~engine_bridge.errors.NoFreeBlocks` taking none.
    ``free(allocate(n))`` right after must leave the allocator as it was:
    the bridge relies on that to roll back a refused page-in exactly.
    """

    def num_free(self) -> int: ...

    def allocate(self, n: int) -> list[BlockId]: ...

    def free(self, blocks: Sequence[BlockId]) -> None: ...


class KVPool:
    """An engine's per-layer KV tensors plus the layout that gives them meaning.

    The tensors are used in place (never copied); they may live on any torch
    device.  ``kv`` holds the conventions recorded in the manifest's ``kv``
    field (whether stored K has RoPE applied, quantisation scales).
    """

    def __init__(self, layers: Sequence[torch.Tensor], layout: str | KVLayout = FLASH_ATTN,
                 kv: dict[str, Any] | None = None):
        if not layers:
            raise ValueError("a KV pool needs at least one layer")
        self.layout = layout_of(layout)
        self.layers = list(layers)
        first = self.layers[0]
        if first.dim() != 5:
            raise ValueError(f"layer tensors must have 5 dimensions for {self.layout.name}, "
                             f"not shape {tuple(first.shape)}")
        for i, t in enumerate(self.layers):
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ValueError(f"layer {i} differs from layer 0 in shape, dtype or device")
            if t.stride(-1) != 1:
                raise ValueError(f"layer {i}: head_dim must be the innermost, contiguous dimension")
        canon = [first.shape[d] for d in self.layout.to_canonical]
        if canon[0] != 2:
            raise ValueError(f"shape {tuple(first.shape)} is not {self.layout.name}: the K/V dimension is not 2")
        _, self.num_blocks, self.block_size, self.n_heads, self.head_dim = canon
        self._describe(first, kv)
        # Byte views in canonical order: [2, num_blocks, block_size, n_heads, head_dim * itemsize].
        self._canon = [t.view(torch.uint8).permute(self.layout.to_canonical) for t in self.layers]
        self._np: list | None = None
        self._stacked: Any = None     # (see _layers_np)

    def _describe(self, first: torch.Tensor, kv: dict[str, Any] | None) -> None:
        # dtype, device, layer count and kv conventions, from layer 0 and self.layers.
        self.dtype = first.dtype
        self.dtype_name = dtype_name(first.dtype)
        self.itemsize = DTYPE_SIZES[self.dtype_name]
        self.device = first.device
        self.n_layers = len(self.layers)
        self.kv = dict(DEFAULT_KV if kv is None else kv)

    @classmethod
    def allocate(cls, *, num_blocks: int, block_size: int, n_layers: int, n_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", layout: str | KVLayout = FLASH_ATTN,
                 kv: dict[str, Any] | None = None) -> "KVPool":
        """A zero-filled pool of the given geometry (what an engine allocates at start)."""
        lay = layout_of(layout)
        shape = lay.shape(num_blocks, block_size, n_heads, head_dim)
        # One allocation for every layer (as vLLM makes its KV cache): a CPU
        # pool's gather and scatter then copy a block of all layers at once.
        stack = torch.zeros((n_layers, *shape), dtype=dtype, device=device)
        return cls(list(stack.unbind(0)), lay, kv)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (= one block across all layers, K and V)."""
        return 2 * self.n_layers * self.block_size * self.n_heads * self.head_dim * self.itemsize

    @property
    def geometry(self) -> dict[str, Any]:
        """The manifest geometry fields this pool's pages have."""
        return {"page_size_tokens": self.block_size, "n_layers": self.n_layers,
                "n_heads": self.n_heads, "head_dim": self.head_dim, "dtype": self.dtype_name}

    def engine_info(self, name: str) -> dict[str, Any]:
        """The manifest's ``engine`` field for an engine called *name*."""
        return {"name": name, "kv_layout": self.layout.name, "block_size": self.block_size}

    def block_index(self, blocks: Sequence[int]) -> torch.Tensor:
        """Block ids as an index tensor on the pool's device."""
        return torch.tensor(list(blocks), dtype=torch.long).to(self.device, non_blocking=True)

    def as_index(self, index: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """*index* as block_index gives it (a CPU pool's gather and scatter also
        take block ids as they are, and spare the tensor)."""
        return index if isinstance(index, torch.Tensor) else self.block_index(index)

    def _tok_shape(self) -> tuple[int, ...]:
        # A canonical view's dimensions after K/V and block: token slot(s), head, bytes.
        return tuple(self._canon[0].shape[2:])

    def _page_view(self, buf: torch.Tensor) -> torch.Tensor:
        return buf.view(buf.shape[0], 2, self.n_layers, *self._tok_shape())

    def _page_np(self, buf: torch.Tensor):
        return buf.numpy().reshape(buf.shape[0], 2, self.n_layers, *self._tok_shape())

    def _canon_np(self) -> list:
        """numpy views of the canonical byte views (a CPU pool's)."""
        if self._np is None:
            self._np = [c.numpy() for c in self._canon]
        return self._np

    def _layers_np(self):
        """A numpy view ``[n_layers, *canonical]`` of every layer at once (a CPU
        pool's), when the layers are equally spaced views of one allocation (as
        ``allocate`` and vLLM make them): a block of all layers is then one
        strided copy, not one a layer.  None otherwise."""
        if self._stacked is None:
            self._stacked = self._find_stack()
        return self._stacked if self._stacked is not False else None

    def _find_stack(self):
        canon = self._canon_np()
        if len(canon) < 2 or len({t.untyped_storage().data_ptr() for t in self.layers}) != 1:
            return False
        c0 = canon[0]
        ptrs = [c.__array_interface__["data"][0] for c in canon]
        step = ptrs[1] - ptrs[0]
        if step == 0 or any(p - ptrs[0] != i * step for i, p in enumerate(ptrs)) \
                or any(c.shape != c0.shape or c.strides != c0.strides for c in canon):
            return False
        return np.lib.stride_tricks.as_strided(c0, (len(canon), *c0.shape), (step, *c0.strides))

    def gather(self, index: torch.Tensor | Sequence[int], out: torch.Tensor) -> None:
        """Copy blocks ``index`` into ``out`` ([n, page_bytes] uint8) as page bytes.

        One index_select per layer for the whole batch of pages; ``out`` must be
        on the pool's device.
        """
        if self.device.type == "cpu":
            # numpy copies a block and layer at a time, one copy each, on the
            # calling thread (torch's own CPU copies of such small pieces cost
            # several times more and start its thread pool from every caller).
            o = self._page_np(out)
            blocks = index.tolist() if isinstance(index, torch.Tensor) else list(index)
            stack = self._layers_np()
            if stack is not None:
                for r, b in enumerate(blocks):
                    o[r] = stack[:, :, b].swapaxes(0, 1)
                return
            for layer, c in enumerate(self._canon_np()):
                for r, b in enumerate(blocks):
                    o[r, :, layer] = c[:, b]
            return
        o = self._page_view(out)
        index = self.as_index(index)
        for layer, c in enumerate(self._canon):
            o.select(2, layer).transpose(0, 1).copy_(c.index_select(1, index))

    def zero_tail(self, out: torch.Tensor, row: int, fill: int) -> None:
        """Zero token slots ``fill..block_size-1`` of page ``row`` in ``out``."""
        out.view(out.shape[0], 2, self.n_layers, self.block_size, -1)[row, :, :, fill:].zero_()

    def scatter(self, index: torch.Tensor | Sequence[int], src: torch.Tensor) -> None:
        """Copy page bytes ``src`` ([n, page_bytes] uint8) into blocks ``index``."""
        if self.device.type == "cpu":
            # As in gather (one kernel a layer, below, suits a GPU).
            s = self._page_np(src)
            blocks = index.tolist() if isinstance(index, torch.Tensor) else list(index)
            stack = self._layers_np()
            if stack is not None:
                for r, b in enumerate(blocks):
                    stack[:, :, b] = s[r].swapaxes(0, 1)
                return
            for layer, c in enumerate(self._canon_np()):
                for r, b in enumerate(blocks):
                    c[:, b] = s[r, :, layer]
            return
        s = self._page_view(src)
        index = self.as_index(index)
        for layer, c in enumerate(self._canon):
            c.index_copy_(1, index, s.select(2, layer).transpose(0, 1))

    def clone_layers(self) -> list[torch.Tensor]:
        """A copy of every layer tensor (for tests and rollback checks)."""
        return [t.clone() for t in self.layers]


#: vLLM's physical orders of its logical ``[L, B, H, N, C]`` KV cache
#: (``vllm.v1.kv_cache_layout.KVCacheLayout`` names).
VLLM_ORDERS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")

#: Integer numpy types of each item size: packed pools copy elements, not bytes.
_ELEMENT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass(frozen=True, eq=False)
class BlockPacking:
    """Where an attention kernel keeps each K and V element of one head in a kernel block.

    vLLM hands a connector each layer as ``[B, H, N, C]`` (kernel blocks, KV
    heads, token slots, content); what ``C`` holds, and in which order, is
    the attention kernel's.  ``pos[kv, n, d]`` is where element *d* of token
    *n*'s K (kv 0) or V (kv 1) lies in one head's ``[N, C]`` of a kernel
    block, counted in C order.  Flash-attention-style kernels keep token
    *n*'s K then V in its row (:func:`token_packing`).  vLLM's CPU kernels
    keep a K region then a V region, each packed for the kernel in use
    (``engine_bridge.vllm.packing`` asks the engine's own kernel).
    """

    name: str
    pos: np.ndarray     # [2, N, D] integers: a permutation of range(2 * N * D)

    def __post_init__(self) -> None:
        if self.pos.ndim != 3 or self.pos.shape[0] != 2:
            raise ValueError(f"{self.name}: positions must be [2, N, D], not {self.pos.shape}")
        if not np.array_equal(np.sort(self.pos, axis=None), np.arange(self.pos.size)):
            raise ValueError(f"{self.name}: positions do not place every K and V element once")

    @property
    def is_token_rows(self) -> bool:
        """Token n's K then V in row n (what a pool reads as plain strided bytes)."""
        _, n, d = self.pos.shape
        return np.array_equal(self.pos, token_packing(n, d).pos)


def token_packing(n: int, d: int) -> BlockPacking:
    """Token *n*'s K then V in row *n* of ``[N, 2D]`` (vLLM's flash-attention,
    Triton and FlashInfer backends)."""
    kv, tok, dim = np.meshgrid(np.arange(2), np.arange(n), np.arange(d), indexing="ij")
    return BlockPacking("token rows", tok * 2 * d + kv * d + dim)


def _digits(f: np.ndarray) -> list[tuple[int, int]] | None:
    """*f* over ``range(len(f))`` as mixed-radix digits ``(size, stride)``, outer
    first, with ``f[i]`` the sum of each digit of *i* times its stride; None
    when *f* is no such sum."""
    size, p, inner = len(f), 1, []
    while p < size:
        s, c = int(f[p]), 2
        while p * (c + 1) <= size and int(f[p * c]) == c * s:
            c += 1
        while size % (p * c):
            c -= 1
        if c < 2:
            return None
        inner.append((c, s))
        p *= c
    got = np.zeros(size, dtype=np.int64)
    p = 1
    for c, s in inner:
        got += (np.arange(size) // p % c) * s
        p *= c
    return inner[::-1] if np.array_equal(got, f) else None


class VllmKVPool(KVPool):
    """vLLM's per-layer KV views as a bridge pool (no copy).

    vLLM hands a connector one view per layer, logically ``[B, H, N, C]``
    (kernel blocks, KV heads, token slots, content), laid out in memory in one
    of :data:`VLLM_ORDERS` through its strides; *packing* says where K and V
    lie in one head's ``[N, C]`` (the attention kernel's choice; default
    token rows).  When the attention kernel splits each of the scheduler's
    blocks into ``r`` kernel blocks, the view's first dimension is ``r *
    num_blocks``: a block of this pool is one scheduler block, ``r`` kernel
    blocks whose token slots follow each other.  Page bytes are SPEC §1's
    whatever the order, the split or the packing: the model's K and V, the
    same on every kernel and engine.
    """

    def __init__(self, views: Sequence[torch.Tensor], order: str, num_blocks: int,
                 kv: dict[str, Any] | None = None, packing: BlockPacking | None = None):
        if order not in VLLM_ORDERS:
            raise ValueError(f"unknown vLLM KV cache layout {order!r} (known: {', '.join(VLLM_ORDERS)})")
        if not views:
            raise ValueError("a KV pool needs at least one layer")
        first = views[0]
        if first.dim() != 4:
            raise ValueError(f"vLLM layer views have 4 dimensions [B, H, N, C], not shape {tuple(first.shape)}")
        kblocks, H, Nk, C = first.shape
        if num_blocks <= 0 or kblocks % num_blocks:
            raise ValueError(f"{kblocks} kernel blocks do not split into {num_blocks} blocks")
        if C % 2:
            raise ValueError(f"K and V differ in head size (packed {C}): pages need one head_dim")
        r = kblocks // num_blocks
        for i, t in enumerate(views):
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ValueError(f"layer {i} differs from layer 0 in shape, dtype or device")
            if t.stride(-1) != 1:
                raise ValueError(f"layer {i}: the packed K/V dimension must be contiguous")
        self.packing = packing or token_packing(Nk, C // 2)
        if self.packing.pos.shape != (2, Nk, C // 2):
            raise ValueError(f"{self.packing.name}: positions for [2, {self.packing.pos.shape[1]}, "
                             f"{self.packing.pos.shape[2]}], not the pool's [2, {Nk}, {C // 2}]")
        rows = self.packing.is_token_rows
        self.layout = KVLayout(f"vllm {order}" + ("" if rows else f" {self.packing.name}"), (3, 0, 2, 1, 4))
        self.layers = list(views)
        self.num_blocks, self.block_size, self.n_heads, self.head_dim = num_blocks, r * Nk, H, C // 2
        self.kernel_blocks_per_block = r
        self._describe(first, kv)
        d = self.head_dim * self.itemsize
        # [B*r, H, Nk, 2*d] bytes -> [B, r, H, Nk, 2, d] -> canonical [2, B, r, Nk, H, d].
        self._canon = [t.view(torch.uint8).unflatten(0, (num_blocks, r)).unflatten(-1, (2, d))
                       .permute(4, 0, 1, 3, 2, 5) for t in self.layers]
        self._np = None
        self._stacked = None
        self._packed = None if rows else self._packed_views()

    def _packed_views(self) -> list[tuple[list[Any], tuple[int, ...], Any]]:
        """For K and for V: element views ``[B, L, r, *n, H, *d]`` over every
        layer at once (or one a layer, ``L`` of 1, when the layers do not lie
        equally spaced), token and dim split into the digits the packing
        strides them by, and the shape of a page's half they copy to."""
        if self.device.type != "cpu":
            raise ValueError(f"{self.packing.name}: a packed KV pool must be in host memory, "
                             f"not on {self.device}")
        t0 = self.layers[0]
        sB, sH, sN, _ = t0.stride()
        C = t0.shape[3]
        isz, r = self.itemsize, self.kernel_blocks_per_block
        el = _ELEMENT[isz]
        ptrs = [t.data_ptr() for t in self.layers]
        step = ptrs[1] - ptrs[0] if len(ptrs) > 1 else 0
        stacked = len(ptrs) > 1 and step > 0 and all(p - ptrs[0] == i * step for i, p in enumerate(ptrs))
        halves = []
        for kv in (0, 1):
            pos = self.packing.pos[kv].astype(np.int64)
            off = pos // C * sN + pos % C                     # elements from the head's block start
            start = int(off[0, 0])
            nd, dd = _digits(off[:, 0] - start), _digits(off[0, :] - start)
            if nd is None or dd is None or not np.array_equal(off, off[:, :1] + off[:1, :] - start):
                raise ValueError(f"{self.packing.name}: the kernel's packing is not a strided view")
            # Dims whose innermost digit lies contiguous on both sides (a page's
            # dim is): copied as one wider element (AMX keeps K in pairs).
            wide = dd[-1][0] * isz if dd and dd[-1][1] == 1 else isz
            if wide in _ELEMENT and wide > isz:
                dd = dd[:-1]
            else:
                wide = isz
            sizes = [r] + [c for c, _ in nd] + [self.n_heads] + [c for c, _ in dd]
            strides = [sB * isz] + [s * isz for _, s in nd] + [sH * isz] + [s * isz for _, s in dd]
            views = []
            for t in (self.layers[:1] if stacked else self.layers):
                base = _offset(t.view(_torch_int(isz)).numpy().view(el), start, wide // isz)
                views.append(np.lib.stride_tricks.as_strided(
                    base.view(_ELEMENT[wide]), (self.num_blocks, len(self.layers) if stacked else 1, *sizes),
                    (r * sB * isz, step, *strides)))
            halves.append((views, (self.n_layers, *sizes), _ELEMENT[wide]))
        return halves

    def _packed_rows(self, buf: torch.Tensor) -> list[Any]:
        """Page rows ``[n, page_bytes]`` as their K and V halves in the packed views' shapes."""
        assert self._packed is not None
        rows = buf.numpy().reshape(buf.shape[0], 2, -1)
        return [rows[:, kv].view(el).reshape(buf.shape[0], *shape)
                for kv, (_, shape, el) in enumerate(self._packed)]

    def gather(self, index: torch.Tensor | Sequence[int], out: torch.Tensor) -> None:
        if self._packed is None:
            return super().gather(index, out)
        blocks = index.tolist() if isinstance(index, torch.Tensor) else list(index)
        for (views, _, _), o in zip(self._packed, self._packed_rows(out)):
            for r, b in enumerate(blocks):
                if len(views) == 1:
                    o[r] = views[0][b]
                else:
                    for layer, v in enumerate(views):
                        o[r, layer:layer + 1] = v[b]

    def scatter(self, index: torch.Tensor | Sequence[int], src: torch.Tensor) -> None:
        if self._packed is None:
            return super().scatter(index, src)
        blocks = index.tolist() if isinstance(index, torch.Tensor) else list(index)
        for (views, _, _), s in zip(self._packed, self._packed_rows(src)):
            for r, b in enumerate(blocks):
                if len(views) == 1:
                    views[0][b] = s[r]
                else:
                    for layer, v in enumerate(views):
                        v[b] = s[r, layer:layer + 1]

    @classmethod
    def allocate_vllm(cls, *, num_blocks: int, block_size: int, n_layers: int, n_heads: int,
                      head_dim: int, dtype: torch.dtype = torch.bfloat16, order: str = "LBNHC",
                      device: str | torch.device = "cpu", kernel_blocks_per_block: int = 1,
                      kv: dict[str, Any] | None = None,
                      packing: BlockPacking | None = None) -> "VllmKVPool":
        """A zero-filled pool laid out as vLLM lays out *order* (for tests and benchmarks)."""
        r = kernel_blocks_per_block
        if order not in VLLM_ORDERS or block_size % r:
            raise ValueError(f"bad order {order!r} or kernel split {r} of {block_size}")
        names = "LBHNC"
        sizes = {"L": n_layers, "B": num_blocks * r, "H": n_heads, "N": block_size // r,
                 "C": 2 * head_dim}
        raw = torch.zeros([sizes[a] for a in order], dtype=dtype, device=device)
        logical = raw.permute([order.index(a) for a in names])
        return cls([logical[i] for i in range(n_layers)], order, num_blocks, kv, packing)


def _offset(a: np.ndarray, start: int, n: int = 1) -> np.ndarray:
    """*n* elements of *a*'s memory from *start* elements past its first (numpy
    shows a strided array's memory only through as_strided)."""
    return np.lib.stride_tricks.as_strided(a, (start + n,), (a.itemsize,))[start:]


def _torch_int(itemsize: int) -> torch.dtype:
    """The torch integer type of *itemsize* bytes (numpy has no bf16 or fp8)."""
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]


def mla_kv(kv_lora_rank: int, qk_rope_head_dim: int) -> dict[str, Any]:
    """The manifest's ``kv`` of MLA pages (SPEC §1.1): each latent vector is
    ``kv_lora_rank`` compressed values, then ``qk_rope_head_dim`` rotary ones (after RoPE)."""
    return {**DEFAULT_KV, "kv_lora_rank": int(kv_lora_rank), "qk_rope_head_dim": int(qk_rope_head_dim)}


class MlaKVPool(KVPool):
    """An engine's per-layer latent caches (multi-head latent attention) as a bridge pool.

    A layer is ``[B, N, latent]`` or ``[B, 1, N, latent]`` (kernel blocks, token
    slots, latent vector: ``kv_lora_rank`` compressed values, then the rotary
    part), a token's vector one contiguous row, as vLLM's MLA backends keep it.
    A page is SPEC §1.1's: ``[n_layers, page_size_tokens, latent]``, no K/V
    pair; its geometry says ``attention: mla``, one head of ``latent`` values.
    When the kernel splits a block into ``r`` kernel blocks, the view's first
    dimension is ``r * num_blocks`` and a block of this pool is ``r`` of them.
    Every tensor-parallel rank holds the whole latent.
    """

    def __init__(self, views: Sequence[torch.Tensor], num_blocks: int, *, kv_lora_rank: int,
                 qk_rope_head_dim: int, layout_name: str = "vllm mla BNC"):
        if not views:
            raise ValueError("a KV pool needs at least one layer")
        layers = [v.squeeze(1) if v.dim() == 4 and v.shape[1] == 1 else v for v in views]
        first = layers[0]
        if first.dim() != 3:
            raise ValueError(f"latent caches are [B, N, latent] or [B, 1, N, latent], not "
                             f"shape {tuple(views[0].shape)}")
        kblocks, nk, latent = first.shape
        if latent != kv_lora_rank + qk_rope_head_dim:
            raise ValueError(f"a latent of {latent} values is not kv_lora_rank {kv_lora_rank} + "
                             f"qk_rope_head_dim {qk_rope_head_dim}")
        if num_blocks <= 0 or kblocks % num_blocks:
            raise ValueError(f"{kblocks} kernel blocks do not split into {num_blocks} blocks")
        for i, t in enumerate(layers):
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ValueError(f"layer {i} differs from layer 0 in shape, dtype or device")
            if t.stride(-1) != 1 or t.stride(1) != latent:
                raise ValueError(f"layer {i}: a token's latent vector must be one contiguous row")
        r = kblocks // num_blocks
        self.layout = KVLayout(layout_name, (0, 1, 2, 3, 4))    # (a name: MLA has no K/V axis)
        self.layers = layers
        self.num_blocks, self.block_size, self.n_heads, self.head_dim = num_blocks, r * nk, 1, latent
        self.kernel_blocks_per_block = r
        self._describe(first, mla_kv(kv_lora_rank, qk_rope_head_dim))
        # Byte views [B, r, N, latent bytes]: a block's kernel blocks, each of token rows.
        self._canon = [t.view(torch.uint8).unflatten(0, (num_blocks, r)) for t in self.layers]
        self._np = None
        self._stacked = None

    @property
    def page_bytes(self) -> int:
        return self.n_layers * self.block_size * self.head_dim * self.itemsize

    @property
    def geometry(self) -> dict[str, Any]:
        return {**super().geometry, "attention": "mla"}

    def _page_view(self, buf: torch.Tensor) -> torch.Tensor:
        return buf.view(buf.shape[0], self.n_layers, *self._canon[0].shape[1:])

    def gather(self, index: torch.Tensor | Sequence[int], out: torch.Tensor) -> None:
        o = self._page_view(out)
        if self.device.type == "cpu":      # (numpy, as KVPool.gather says why)
            on = o.numpy()
            blocks = index.tolist() if isinstance(index, torch.Tensor) else list(index)
            for layer, c in enumerate(self._canon_np()):
                for r, b in enumerate(blocks):
                    on[r, layer] = c[b]
            return
        index = self.as_index(index)
        for layer, c in enumerate(self._canon):
            o.select(1, layer).copy_(c.index_select(0, index))

    def zero_tail(self, out: torch.Tensor, row: int, fill: int) -> None:
        out.view(out.shape[0], self.n_layers, self.block_size, -1)[row, :, fill:].zero_()

    def scatter(self, index: torch.Tensor | Sequence[int], src: torch.Tensor) -> None:
        s = self._page_view(src)
        if self.device.type == "cpu":
            sn = s.numpy()
            blocks = index.tolist() if isinstance(index, torch.Tensor) else list(index)
            for layer, c in enumerate(self._canon_np()):
                for r, b in enumerate(blocks):
                    c[b] = sn[r, layer]
            return
        index = self.as_index(index)
        for layer, c in enumerate(self._canon):
            c.index_copy_(0, index, s.select(1, layer))

    @classmethod
    def allocate_mla(cls, *, num_blocks: int, block_size: int, n_layers: int, kv_lora_rank: int,
                     qk_rope_head_dim: int, dtype: torch.dtype = torch.bfloat16,
                     device: str | torch.device = "cpu") -> "MlaKVPool":
        """A zero-filled pool of one allocation, ``[L, B, 1, N, latent]`` (for tests)."""
        raw = torch.zeros((n_layers, num_blocks, 1, block_size, kv_lora_rank + qk_rope_head_dim),
                          dtype=dtype, device=device)
        return cls(list(raw.unbind(0)), num_blocks, kv_lora_rank=kv_lora_rank,
                   qk_rope_head_dim=qk_rope_head_dim)
