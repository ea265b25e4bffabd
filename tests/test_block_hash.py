"""Golden vectors for the block hash shared by the engine and the router (docs/block-hashing.md)."""

import struct

import pytest
import xxhash

from router.protocol.hashing import block_hashes, chain_seed, hash_block

MODEL = "SmolLM2-135M-Instruct"


def test_golden_vectors():
    seed = chain_seed(MODEL)
    assert seed == 12920817300507522723
    assert chain_seed(MODEL, "tenant-a") == 17777265403738774732
    assert chain_seed(MODEL, None, "sql@0123456789abcdef") == 696903993156663527  # docs/block-hashing.md
    assert chain_seed(MODEL, "tenant-a", "sql@0123456789abcdef") == 6342329426777775409
    assert hash_block(0, []) == 3803688792395291579
    assert hash_block(0, [0] * 16) == 15186522882355062158
    assert block_hashes(list(range(40)), 16, seed) == [8734148479450452188, 5994338326962209068]
    assert block_hashes([1, 2, 3, 4, 70000, 5, 6, 7, 8], 4, 0) == [9751075271494597952, 7817960969538655603]


def test_spec_bytes_are_what_the_doc_says():
    seed = chain_seed(MODEL)
    assert seed == xxhash.xxh64_intdigest(b"prefixgate/v1\x00" + MODEL.encode() + b"\x00")
    tokens = list(range(16))
    expected = xxhash.xxh64_intdigest(struct.pack("<Q", seed) + struct.pack("<16I", *tokens))
    assert block_hashes(tokens, 16, seed) == [expected]


def test_chaining_depends_on_the_whole_prefix():
    a = block_hashes([1] * 16 + [7] * 16, 16, 0)
    b = block_hashes([2] * 16 + [7] * 16, 16, 0)
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different prefix
    assert block_hashes([1] * 16 + [7] * 16 + [9] * 5, 16, 0) == a  # partial tail not hashed


def test_large_token_ids_and_salts():
    big = [70000, 150000, 2**32 - 1, 0]
    assert len(block_hashes(big, 4, 0)) == 1
    assert block_hashes(big, 4, chain_seed(MODEL, "a")) != block_hashes(big, 4, chain_seed(MODEL, "b"))
    assert chain_seed("model-a") != chain_seed("model-b")


def test_incremental_extension_matches_full_hash():
    tokens = list(range(100))
    full = block_hashes(tokens, 8, 5)
    head = block_hashes(tokens[:40], 8, 5)
    assert head + block_hashes(tokens, 8, 5, start=len(head), parent=head[-1]) == full


def test_bad_inputs_raise():
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0, 0)
    with pytest.raises(struct.error):
        hash_block(0, [-1])
