"""The checksums S3 and GCS keep of an object, and how a model file fetched in pieces
(byte ranges, possibly across a cut or a restart) is checked against them without a
second read: each piece's digest is kept with the piece, and the whole file's is made
from them at the end.

    expect = expectation(storage.stored_checksums(file))   # core/storage: S3, GCS
    pieces = expect.pieces(size, PART_BYTES)       # [(offset, length), ...]
    h = expect.hasher(); h.update(bytes_of_piece); digest = h.digest()
    expect.problem([digest, ...], pieces, path)    # None, or what is wrong

Full-object CRCs (CRC64NVME, CRC32C, CRC32; GCS crc32c) combine over pieces of any
size (awscrt's combine_*). A composite checksum or a multipart ETag is over the parts:
its pieces are the parts, each part's real size from a HEAD with PartNumber=N. Any
other full-object checksum (SHA*, MD5, XXHASH*) of a file in more than one piece is
computed by reading the finished file once more.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import zlib
from dataclasses import dataclass
from pathlib import Path

from diffq.core.storage import StoredChecksums

log = logging.getLogger("diffq.worker")

# Cheapest first among what S3 can keep (botocore's S3 model: ChecksumAlgorithm; GCS's
# CRC32C and MD5 are among them). The CRCs first: hardware-assisted in awscrt (several
# GB/s per core) and, alone, they combine over pieces (no second read); then XXHASH (fast, but no combine), SHA
# (~1-2 GB/s with SHA extensions), MD5 (~0.8 GB/s). docs/BENCHMARKS.md.
ALGORITHMS = ("CRC64NVME", "CRC32C", "CRC32", "XXHASH3", "XXHASH64", "XXHASH128",
              "SHA1", "SHA256", "SHA512", "MD5")
_COMBINABLE = ("CRC64NVME", "CRC32C", "CRC32")
_CRC_BYTES = {"CRC64NVME": 8, "CRC32C": 4, "CRC32": 4}
_HASH_CHUNK = 8 * 1024 * 1024


class _Crc:
    def __init__(self, algorithm: str):
        from awscrt import checksums

        self.width = _CRC_BYTES[algorithm]
        self.step = {"CRC64NVME": checksums.crc64nvme, "CRC32C": checksums.crc32c}.get(algorithm)
        self.value = 0

    def update(self, data) -> None:
        if self.step is None:
            self.value = zlib.crc32(data, self.value)  # releases the GIL over 5 KiB
        else:
            self.value = self.step(data, self.value)

    def digest(self) -> bytes:
        return self.value.to_bytes(self.width, "big")


class _XXHash:
    def __init__(self, algorithm: str):
        from awscrt.checksums import XXHash

        self.state = {"XXHASH64": XXHash.new_xxhash64, "XXHASH3": XXHash.new_xxhash3_64,
                      "XXHASH128": XXHash.new_xxhash3_128}[algorithm]()

    def update(self, data) -> None:
        self.state.update(bytes(data))

    def digest(self) -> bytes:
        return self.state.finalize()


def hasher(algorithm: str):
    if algorithm in _COMBINABLE:
        return _Crc(algorithm)
    if algorithm.startswith("XXHASH"):
        return _XXHash(algorithm)
    return hashlib.new(algorithm.lower())  # SHA*, MD5: release the GIL over 2 KiB


def combine(algorithm: str, digests: list[bytes], lengths: list[int]) -> bytes:
    """The CRC of the concatenation, from each piece's CRC and length."""
    from awscrt import checksums

    if not digests:
        return hasher(algorithm).digest()
    join = {"CRC64NVME": checksums.combine_crc64nvme, "CRC32C": checksums.combine_crc32c,
            "CRC32": checksums.combine_crc32}[algorithm]
    value = int.from_bytes(digests[0], "big")
    for digest, length in zip(digests[1:], lengths[1:]):
        value = join(value, int.from_bytes(digest, "big"), length)
    return value.to_bytes(_CRC_BYTES[algorithm], "big")


@dataclass(frozen=True)
class Expectation:
    """What one object's bytes must hash to. `kind`: "full" (a checksum of the whole
    object), "composite" (a checksum of its parts' checksums), "etag" (an S3 ETag: MD5,
    or for a multipart upload MD5 of the parts' MD5s), or None (nothing stored: the
    size alone). `parts`: a multipart object's real part sizes, in order."""

    kind: str | None
    algorithm: str = ""
    expected: str = ""  # as the store says it (base64, or the ETag's hex)
    parts: tuple[int, ...] = ()
    no_checksum_note: str = ""  # why only the size is checked (said once, as a warning)

    def pieces(self, size: int, piece_bytes: int) -> list[tuple[int, int]]:
        """The byte ranges the file is fetched in: its parts where the check is over
        parts, else pieces of `piece_bytes`."""
        if self.parts:
            offsets, at = [], 0
            for length in self.parts:
                offsets.append((at, length))
                at += length
            return offsets
        return [(at, min(piece_bytes, size - at)) for at in range(0, size, piece_bytes)] or [(0, 0)]

    def hasher(self):
        return hasher(self.algorithm) if self.kind else None

    def needs_reread(self, pieces: list) -> bool:
        """A whole-object hash that does not combine, of a file in more than one piece."""
        whole = (self.kind == "full" and self.algorithm not in _COMBINABLE) or (self.kind == "etag" and not self.parts)
        return whole and len(pieces) > 1

    def problem(self, digests: list[bytes], pieces: list[tuple[int, int]], path: Path, name: str) -> str | None:
        """None when the file matches; else what differs. `digests`: each piece's."""
        if self.kind is None:
            if self.no_checksum_note:
                log.warning("%s: %s: only its size is checked", name, self.no_checksum_note)
            return None
        if self.needs_reread(pieces):
            raw = _file_digest(path, hasher(self.algorithm))
        elif self.kind == "full" and len(digests) > 1:
            raw = combine(self.algorithm, digests, [length for _, length in pieces])
        elif self.kind == "full" or (self.kind == "etag" and not self.parts):
            raw = digests[0]
        else:  # over the parts' digests
            outer = hasher(self.algorithm)
            outer.update(b"".join(digests))
            raw = outer.digest()
        if self.kind == "etag":
            got = raw.hex() + (f"-{len(digests)}" if self.parts else "")
            return None if got == self.expected else f"ETag {got}, the store's {self.expected}"
        got = base64.b64encode(raw).decode()
        if self.kind == "composite":
            value, _, count = self.expected.partition("-")
            ok = got == value and (not count or int(count) == len(digests))
            got += f"-{len(digests)}"
        else:
            ok = got == self.expected
        return None if ok else f"{self.algorithm} {got}, the store's {self.expected}"


def _file_digest(path: Path, h) -> bytes:
    buffer = bytearray(_HASH_CHUNK)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(view):
            h.update(view[:n])
    return h.digest()


def expectation(stored: StoredChecksums) -> Expectation:
    """The cheapest check of an object from what its store keeps of it: a full-object
    checksum, else a composite one over its parts, else an ETag that is an MD5; else
    the size alone (with the store's reason, said once)."""
    if algorithm := next((a for a in ALGORITHMS if a in stored.full), None):
        return Expectation("full", algorithm, stored.full[algorithm])
    if algorithm := next((a for a in ALGORITHMS if a in stored.composite), None):
        return Expectation("composite", algorithm, stored.composite[algorithm], stored.parts)
    if stored.etag_md5:
        return Expectation("etag", "MD5", stored.etag_md5, stored.parts)
    return Expectation(None, no_checksum_note=stored.none_note)
