"""A document's fingerprint and intrinsic verdict: one home for both, below everything that
reads documents (``traind data prepare``'s filters, the shards' checksums, the trainer's corpus
cache). No imports beyond the standard library, so the trainer's start-up pays nothing for it.
"""

from __future__ import annotations

import hashlib


def content_hash(data: bytes | memoryview) -> str:
    """blake2b-128 of ``data``, hex: exact duplicates, the val split, shard checksums and the
    hashes of a preparation's arguments and tokenizer."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def intrinsic(raw: bytes) -> str | None:
    """``"empty"``, ``"binary"`` (a NUL byte or invalid UTF-8: byte-level training on either
    teaches the model noise it will never be asked to write), or ``None``: text."""
    if not raw:
        return "empty"
    if b"\0" in raw:
        return "binary"
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return "binary"
    return None
