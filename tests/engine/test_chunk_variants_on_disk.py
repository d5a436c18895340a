"""Chunk variants in the disk tier (Cache-Craft §3.3 across tiers), on the random tiny Llama (fp32).

A variant computed exactly is written with its record (attention sums, origin position,
fingerprint, reuse score) in its KV file's checksummed metadata; after a restart, or once memory
has evicted it, the chunk modes read it back and reuse the document at another position exactly as
they would from memory. A record that fails its checksum, or cannot be parsed, is never served.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import save as st_save

from ragcache_backend.cache.chunk_reuse import VariantInfo, VariantStats, variant_from_json, variant_to_json
from ragcache_backend.engine.engine import RAGCacheEngine
from ragcache_backend.model.sampling import SamplingParams
from tests.engine.test_chunk_engine import DOCS, assert_clean
from tests.engine.test_chunk_engine import make as make_chunk_engine

GREEDY = SamplingParams(max_tokens=8)
FIRST = ("What is the GIL?", DOCS[:3])
SECOND = ("Why are tuples hashable?", [DOCS[1], DOCS[2], DOCS[0]])  # every document at a new position


def make(model, profile, folder: Path | None, **kw) -> RAGCacheEngine:
    """test_chunk_engine's chunk engine with its disk tier in ``folder`` (None: memory only)."""
    return make_chunk_engine(model, profile, disk_dir=folder, **kw)


def variant_files(engine: RAGCacheEngine) -> list[Path]:
    assert engine.cache.disk.flush(30)
    out = []
    for path in sorted(engine.cache.disk.directory.glob("*.kv.safetensors")):
        with safe_open(path, "pt") as fh:
            if "variant" in fh.metadata():
                out.append(path)
    return out


def rewrite_metadata(path: Path, **changes: str) -> None:
    """Rewrite ``path`` as a valid safetensors file with some metadata fields changed (its
    checksum left as it was)."""
    with safe_open(path, "pt") as fh:
        meta = dict(fh.metadata(), **changes)
        tensors = {name: fh.get_tensor(name) for name in fh.keys()}
    path.write_bytes(st_save(tensors, metadata=meta))


@pytest.fixture()
def reference(tiny_model, fixed_profile):
    """The second request served from variants held in memory (no disk tier)."""
    eng = make(tiny_model, fixed_profile, None)
    eng.generate(*FIRST, GREEDY)
    return eng.generate(*SECOND, GREEDY)


def test_the_variant_record_round_trips_exactly_and_refuses_bad_input():
    stats = VariantStats("doc", 3, ("sys", "q"), (5, 2), (0.1, 1 / 3), 2.5, (0.1, 0.2, 1 / 7))
    info = VariantInfo(stats, 17, "model/torch.float32", 4.25)
    back = variant_from_json(variant_to_json(info))
    assert back == info and back.stats.token_inter[2] == 1 / 7  # floats exact
    good = json.loads(variant_to_json(info))
    for bad in ("not json", "[]", json.dumps(dict(good, version=99)), json.dumps(dict(good, length=4)),
                json.dumps(dict(good, intra=0.0)), json.dumps(dict(good, prefix="sys")),
                json.dumps({k: v for k, v in good.items() if k != "start"}), json.dumps(dict(good, start=-1)),
                json.dumps(dict(good, inter=[0.1, "x"]))):
        with pytest.raises(ValueError):
            variant_from_json(bad)


def test_after_a_restart_documents_at_new_positions_are_served_from_disk_variants(
        tiny_model, fixed_profile, tmp_path, reference):
    with make(tiny_model, fixed_profile, tmp_path) as first:
        assert first.generate(*FIRST, GREEDY).chunk_hits == 0
        assert len(variant_files(first)) == 3  # one exact variant per document, record in its file
    with make(tiny_model, fixed_profile, tmp_path) as second:
        assert second.cache.num_variants == 0  # nothing in memory: what is reused comes from the files
        got = second.generate(*SECOND, GREEDY)
        assert got.chunk_hits == 3 and got.disk_hits >= 2
        # the same plan and the same answer as with the variants in memory
        assert got.token_ids == reference.token_ids
        assert (got.recomputed_tokens, got.chunk_cached_tokens) == (reference.recomputed_tokens,
                                                                    reference.chunk_cached_tokens)
        assert second.cache.num_variants == 3
        assert_clean(second)


def test_variants_evicted_from_memory_come_back_from_disk(tiny_model, fixed_profile, tmp_path, reference):
    with make(tiny_model, fixed_profile, tmp_path) as eng:
        eng.generate(*FIRST, GREEDY)
        assert len(variant_files(eng)) == 3
        eng.cache.clear()  # as if memory had evicted everything
        assert eng.cache.num_variants == 0
        got = eng.generate(*SECOND, GREEDY)
        assert got.chunk_hits == 3 and got.token_ids == reference.token_ids
        assert_clean(eng)


def test_exact_mode_never_serves_a_disk_variant_at_another_position(tiny_model, fixed_profile, tmp_path):
    with make(tiny_model, fixed_profile, tmp_path) as eng:
        eng.generate(*FIRST, GREEDY)
        variant_files(eng)
    with make(tiny_model, fixed_profile, tmp_path, reuse="exact") as eng:
        got = eng.generate(*SECOND, GREEDY)
        off = eng.generate(*SECOND, GREEDY, use_cache=False)
        assert got.chunk_hits == 0 and got.token_ids == off.token_ids


@pytest.mark.parametrize("damage", ["poisoned record", "unparsable record", "flipped KV"])
def test_a_damaged_variant_file_is_never_served(tiny_model, fixed_profile, tmp_path, damage):
    with make(tiny_model, fixed_profile, tmp_path) as eng:
        eng.generate(*FIRST, GREEDY)
        files = variant_files(eng)
        key = eng.segments_for(*SECOND[:1], [DOCS[1]], GREEDY)[0][1].key
    victim = next(p for p in files if json.loads(safe_open(p, "pt").metadata()["variant"])["chunk"] == key)
    if damage == "poisoned record":  # valid JSON, plausible statistics, checksum not updated
        record = json.loads(safe_open(victim, "pt").metadata()["variant"])
        record["token_inter"] = [0.0] * len(record["token_inter"])
        record["inter"] = [0.0] * len(record["inter"])
        rewrite_metadata(victim, variant=json.dumps(record))
    elif damage == "unparsable record":
        rewrite_metadata(victim, variant="{not json")
    else:
        data = bytearray(victim.read_bytes())
        data[-100] ^= 0x40
        victim.write_bytes(bytes(data))
    with make(tiny_model, fixed_profile, tmp_path) as eng:
        got = eng.generate(*SECOND, GREEDY)
        assert eng.cache.disk.stats.corrupt == 1 and not victim.exists()
        # DOCS[1]'s variant is gone, and DOCS[2]'s was computed after it (its path is unreachable):
        # only DOCS[0] comes from a variant, the rest is computed
        assert got.chunk_hits == 1
        assert_clean(eng)
        again = eng.generate(*SECOND, GREEDY)  # what was computed instead is cached normally
        assert again.cached_tokens == again.prompt_tokens - 1
