"""A model's identity in a manifest: ``name``, ``revision``, ``config_sha256``, ``weights_sha256``.

``config_sha256`` is the sha256 of the model config's canonical JSON.
``weights_sha256`` fingerprints the weights themselves, so that two
checkpoints with the same config and name (a base model and its fine-tune,
a model updated in place) never take each other's KV.  Both are hex.

The fingerprint reads little, so an engine computes it at every start:

- a checkpoint folder (:func:`weights_sha256_of_folder`): every weight file
  under it (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``),
  in sorted order of relative path.  Of each: its relative path and size;
  its header whole (a safetensors file's 8-byte length and JSON header,
  which name every tensor with its dtype, shape and offsets); and
  :data:`SPANS` spans of :data:`SPAN` bytes at evenly spaced offsets, the
  first at the start and the last at the end.  A file smaller than that is
  read whole.  A 16 GB checkpoint in four files is about 260 reads of 4 KiB.
- weights made in memory (:func:`weights_sha256_of_tensors`): each tensor's
  name, dtype and shape, and spans of its bytes chosen the same way (the
  whole tensor when small).

What it can miss: a change confined to bytes between the samples, such as
a few rows of one large tensor trained again.  That is accepted: the
fingerprint guards against another checkpoint under the same name and
config, where every tensor, or all of several, differs; reading every byte
would cost a full read of the checkpoint at each start.

The two forms do not agree with each other: a folder's fingerprint and that
of the same weights in memory differ.  Engines that load the same folder
agree; a session between the two forms is refused as another model
(``force`` loads it).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Iterable, Mapping

import torch

#: Spans sampled from each weight file or tensor, and their size in bytes.
SPANS, SPAN = 64, 4096
#: The names of weight files in a checkpoint folder.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
#: The largest safetensors JSON header read (the format's own limit).
MAX_HEADER = 100 << 20
_VERSION = b"pffs-weights-v1\0"


def config_sha256(config: dict[str, Any]) -> str:
    """sha256 hex of a model config's canonical JSON (sorted keys, no spaces)."""
    data = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(data.encode()).hexdigest()


#: Hugging Face config keys that say nothing about what the KV bytes mean
#: (bookkeeping, output switches, the attention kernel an engine may switch).
_CONFIG_NOISE = {"transformers_version", "dtype", "torch_dtype", "_name_or_path", "use_cache",
                 "output_hidden_states", "output_attentions", "return_dict"}


def hf_config_sha256(config) -> str:
    """:func:`config_sha256` of a Hugging Face model config without its bookkeeping keys.

    The transformers adapter, the vLLM connector and the SGLang backend all
    use it, so the same checkpoint gets the same identity in each engine.
    """
    return config_sha256({k: v for k, v in config.to_dict().items()
                          if k not in _CONFIG_NOISE and not k.startswith("_")})


def span_offsets(size: int) -> list[int]:
    """Where the spans of an object of *size* bytes start: [0] and the whole
    object when it holds no more than SPANS spans, else SPANS evenly spaced
    offsets from 0 to ``size - SPAN``."""
    if size <= SPANS * SPAN:
        return [0]
    last = size - SPAN
    return [i * last // (SPANS - 1) for i in range(SPANS)]


def _read_at(fd: int, n: int, offset: int) -> bytes:
    """*n* bytes of *fd* at *offset* (fewer at its end)."""
    return os.pread(fd, n, offset)


def _file_into(h, path: str, rel: str) -> None:
    # One weight file: its name, size, header and samples.
    with open(path, "rb") as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        h.update(f"{rel}\0{size}\0".encode())
        if rel.endswith(".safetensors") and size >= 8:
            n = int.from_bytes(_read_at(fd, 8, 0), "little")
            if n <= min(MAX_HEADER, size - 8):
                h.update(b"H" + _read_at(fd, 8 + n, 0))
        if size <= SPANS * SPAN:
            h.update(b"W" + _read_at(fd, size, 0))
            return
        for off in span_offsets(size):
            h.update(b"S" + _read_at(fd, SPAN, off))


def weight_files(folder: str) -> list[str]:
    """The weight files under *folder*, as sorted relative paths (hidden folders skipped)."""
    found = []
    for top, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            if name.endswith(WEIGHT_SUFFIXES):
                found.append(os.path.relpath(os.path.join(top, name), folder).replace(os.sep, "/"))
    return sorted(found)


def weights_sha256_of_folder(folder: str | os.PathLike) -> str:
    """The fingerprint of a checkpoint folder's weight files (hex; see the module).

    Raises ValueError naming the folder when it holds no weight file.
    """
    folder = os.fspath(folder)
    files = weight_files(folder)
    if not files:
        raise ValueError(f"{folder}: no weight files ({', '.join('*' + s for s in WEIGHT_SUFFIXES)})")
    h = hashlib.sha256(_VERSION + b"files\0")
    for rel in files:
        _file_into(h, os.path.join(folder, rel), rel)
    return h.hexdigest()


def _tensor_into(h, name: str, t: torch.Tensor) -> None:
    t = t.detach()
    if t.device.type == "meta":
        raise ValueError(f"tensor {name!r} has no data (meta device)")
    h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
    flat = t.contiguous().reshape(-1).view(torch.uint8)
    size = flat.numel()
    if size <= SPANS * SPAN:
        data = flat.cpu()
    else:
        # One gather on the tensor's device, one copy to the host.
        starts = torch.tensor(span_offsets(size), dtype=torch.long, device=flat.device)
        data = flat[(starts[:, None] + torch.arange(SPAN, device=flat.device)).reshape(-1)].cpu()
    h.update(data.numpy())


def weights_sha256_of_tensors(named_tensors: Mapping[str, torch.Tensor]
                              | Iterable[tuple[str, torch.Tensor]]) -> str:
    """The fingerprint of weights made in memory: *named_tensors* (a state dict,
    or ``(name, tensor)`` pairs) by name, dtype, shape and samples of their bytes."""
    pairs = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    h = hashlib.sha256(_VERSION + b"tensors\0")
    for name, t in sorted(pairs, key=lambda p: p[0]):
        _tensor_into(h, name, t)
    return h.hexdigest()


def checkpoint_weights_sha256(model: str | os.PathLike | None, revision: str | None = None) -> str | None:
    """The fingerprint of the checkpoint an engine loads as *model*: a local
    folder, one weight file (a ``.gguf``), or a hub name already in the
    Hugging Face cache (at *revision*).  None when none of these holds a
    weight file."""
    if not model:
        return None
    path = os.fspath(model)
    if os.path.isfile(path) and path.endswith(WEIGHT_SUFFIXES):
        h = hashlib.sha256(_VERSION + b"files\0")
        _file_into(h, path, os.path.basename(path))
        return h.hexdigest()
    if not os.path.isdir(path):
        try:
            from huggingface_hub import snapshot_download
            path = snapshot_download(path, revision=revision, local_files_only=True)
        except Exception:       # (not a hub name, or not in the cache)
            return None
    return weights_sha256_of_folder(path) if weight_files(path) else None
