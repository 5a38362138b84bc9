"""Level t1, units: no mount and no engine.
A model's identity (engine_bridge.core.identity, SPEC §2): the weights
fingerprint of a checkpoint folder and of tensors in memory, what it reads of
a large file, page-in's check of it (other weights refused, naming both
fingerprints; a session without one only when trusted), and the key
namespace it parts."""

from __future__ import annotations

import json

import pytest
import torch

from engine_bridge.core import identity
from engine_bridge.core.bridge import check_manifest
from engine_bridge.core.identity import (SPAN, SPANS, checkpoint_weights_sha256, span_offsets,
                                         weights_sha256_of_folder, weights_sha256_of_tensors)
from engine_bridge.errors import ModelMismatch, Unfingerprinted
from pffs.client import chainkeys as ck
from pffs.manifest import Manifest

GEOM = {"page_size_tokens": 16, "n_layers": 2, "n_heads": 2, "head_dim": 8, "dtype": "f32"}
A, B = "aa" * 32, "bb" * 32
CONFIG = "cc" * 32


def tiny_checkpoint(path, seed: int) -> None:
    """A tiny Llama saved with save_pretrained: one config, weights of *seed*."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                   max_position_embeddings=64)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)


def test_a_folder_has_one_fingerprint_and_other_weights_another(tmp_path):
    tiny_checkpoint(tmp_path / "a", 0)
    tiny_checkpoint(tmp_path / "b", 1)
    tiny_checkpoint(tmp_path / "a2", 0)
    assert (tmp_path / "a" / "config.json").read_bytes() == (tmp_path / "b" / "config.json").read_bytes()
    a = weights_sha256_of_folder(tmp_path / "a")
    assert len(a) == 64 and a == weights_sha256_of_folder(str(tmp_path / "a"))
    assert a == weights_sha256_of_folder(tmp_path / "a2")       # the same weights saved again
    assert a != weights_sha256_of_folder(tmp_path / "b")
    assert checkpoint_weights_sha256(tmp_path / "a") == a
    # Only weight files count: other files in the folder do not.
    (tmp_path / "a" / "README.md").write_text("notes")
    assert weights_sha256_of_folder(tmp_path / "a") == a


def test_one_byte_in_a_sampled_span_changes_it_and_unsampled_bytes_do_not(tmp_path):
    size = 3 * SPANS * SPAN + 12_345
    data = bytearray(torch.randint(0, 256, (size,), generator=torch.Generator().manual_seed(3),
                                   dtype=torch.uint8).numpy().tobytes())
    (tmp_path / "model.bin").write_bytes(data)
    base = weights_sha256_of_folder(tmp_path)
    offsets = span_offsets(size)
    assert offsets[0] == 0 and offsets[-1] == size - SPAN and len(offsets) == SPANS

    def flipped(at: int) -> str:
        changed = bytearray(data)
        changed[at] ^= 1
        (tmp_path / "model.bin").write_bytes(changed)
        return weights_sha256_of_folder(tmp_path)
    assert flipped(offsets[17] + 100) != base
    assert flipped(size - 1) != base
    gap = offsets[17] + SPAN + 10          # between two spans: the miss the design accepts
    assert gap < offsets[18]
    assert flipped(gap) == base
    (tmp_path / "model.bin").write_bytes(data + b"\0")   # the size is part of it
    assert weights_sha256_of_folder(tmp_path) != base


def test_a_huge_file_costs_a_bounded_number_of_small_reads(tmp_path, monkeypatch):
    """A sparse 4 GiB safetensors file: its header whole and SPANS spans, nothing more."""
    header = json.dumps({"w": {"dtype": "BF16", "shape": [65536, 32768],
                               "data_offsets": [0, 4 << 30]}}).encode()
    path = tmp_path / "model-00001-of-00001.safetensors"
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(8 + len(header) + (4 << 30))
    reads: list[int] = []
    real = identity._read_at

    def counted(fd: int, n: int, offset: int) -> bytes:
        got = real(fd, n, offset)
        reads.append(len(got))
        return got
    monkeypatch.setattr(identity, "_read_at", counted)
    a = weights_sha256_of_folder(tmp_path)
    assert len(reads) == 2 + SPANS
    assert sum(reads) == 8 + (8 + len(header)) + SPANS * SPAN
    # The header counts whole: another tensor name is another fingerprint.
    with open(path, "r+b") as f:
        f.seek(8 + header.index(b'"w"') + 1)
        f.write(b"v")
    assert weights_sha256_of_folder(tmp_path) != a


def test_a_folder_without_weight_files_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=str(tmp_path)):
        weights_sha256_of_folder(tmp_path)
    assert checkpoint_weights_sha256(tmp_path) is None
    assert checkpoint_weights_sha256(tmp_path / "nowhere") is None
    assert checkpoint_weights_sha256("") is None


def test_tensors_fingerprint_their_names_dtypes_shapes_and_samples():
    g = torch.Generator().manual_seed(0)
    sd = {"big": torch.randn(1024, 1024, generator=g), "small": torch.randn(7, 3, generator=g)}
    a = weights_sha256_of_tensors(sd)
    assert a == weights_sha256_of_tensors(list(reversed(list(sd.items()))))   # order does not count
    assert a == weights_sha256_of_tensors({k: v.clone() for k, v in sd.items()})
    assert a != weights_sha256_of_tensors({**sd, "small": sd["small"].to(torch.float64)})
    assert a != weights_sha256_of_tensors({**sd, "small": sd["small"].reshape(3, 7)})
    assert a != weights_sha256_of_tensors({"other": sd["big"], "small": sd["small"]})
    small = sd["small"].clone()
    small[6, 2] += 1                       # small: read whole
    assert a != weights_sha256_of_tensors({**sd, "small": small})
    big = sd["big"].clone()
    at = span_offsets(big.numel() * 4)[40] // 4
    big.view(-1)[at] += 1                  # in a sampled span
    assert a != weights_sha256_of_tensors({**sd, "big": big})
    # A non-contiguous view fingerprints as its contiguous copy.
    t = sd["big"].t()
    assert weights_sha256_of_tensors({"t": t}) == weights_sha256_of_tensors({"t": t.contiguous()})


def manifest(model) -> Manifest:
    return Manifest(**GEOM, pages=[], layout="paged-batchinvariant-v1", model=model,
                    kv={"k_has_rope": True, "scales": None})


ENGINE = {"name": "m", "revision": "r", "config_sha256": CONFIG, "weights_sha256": A}


def check(model, **kw) -> None:
    check_manifest(manifest(model), GEOM, None, ENGINE, **kw)


def test_page_in_refuses_other_weights_naming_both_fingerprints():
    check(dict(ENGINE))
    with pytest.raises(ModelMismatch) as ei:
        check({**ENGINE, "weights_sha256": B})
    assert ei.value.field == "model.weights_sha256"
    assert A in str(ei.value) and B in str(ei.value)
    # Other weights are named first, whatever else differs too.
    with pytest.raises(ModelMismatch, match="model.weights_sha256"):
        check({**ENGINE, "revision": "r2", "weights_sha256": B})
    check({**ENGINE, "weights_sha256": B}, force=True)


@pytest.mark.parametrize("model", [{"name": "m", "revision": "r", "config_sha256": CONFIG},
                                   {"name": "m"}, None])
def test_a_session_without_a_fingerprint_loads_only_when_trusted(model):
    with pytest.raises(Unfingerprinted) as ei:
        check(model)
    assert isinstance(ei.value, ModelMismatch) and ei.value.errno == 22
    assert A in str(ei.value) and "trust_unfingerprinted=True" in str(ei.value)
    check(model, trust_unfingerprinted=True)
    check(model, force=True)
    # Trusted, the rest of the identity is still compared.
    if model:
        with pytest.raises(ModelMismatch, match="model.name"):
            check({**model, "name": "other"}, trust_unfingerprinted=True)
    # An engine without a fingerprint compares what both sides give.
    check_manifest(manifest(model), GEOM, None, {"name": "m"})


def test_the_key_namespace_includes_the_weights():
    geom = dict(dtype="f32", n_layers=2, n_heads=2, head_dim=8, page_size_tokens=16, kv=None)
    base = {"name": "m", "revision": "r", "config_sha256": CONFIG}
    a = ck.key_namespace({**base, "weights_sha256": A}, **geom)
    assert a == ck.key_namespace({"name": "mirror/m", "config_sha256": CONFIG, "weights_sha256": A}, **geom)
    assert a != ck.key_namespace({**base, "weights_sha256": B}, **geom)
    assert a != ck.key_namespace(base, **geom)                 # no fingerprint: never a hit
    assert ck.model_identity({**base, "weights_sha256": A}) == {"config_sha256": CONFIG, "weights_sha256": A}
    assert ck.model_identity({"name": "m", "weights_sha256": A}) == \
        {"name": "m", "revision": None, "weights_sha256": A}
