"""A checkpoint's manifest: each of its files, the rank that wrote it, its size and its checksum.

torch.distributed.checkpoint checks a checkpoint's structure (keys, shapes) but not its bytes:
a flipped byte in a shard's tensor data loads without a word. So every save writes
``manifest.json`` into the checkpoint, after every rank's files are complete and hashed, and
atomically (a temporary file renamed): per file its size in bytes, the rank that wrote it and
its XXH3-128 checksum (the ``xxhash`` library: 10 GB/s on the development machine, where
hashlib's blake2b does 0.5 GB/s and sha256 1.3 GB/s; BENCHMARKS.md has its cost on a save).

Words used here: a *complete* checkpoint has a manifest and every file it lists, at its listed
size (cheap to check: no byte is read); a *verified* one also has every file's checksum equal
to the listed one (every byte is read). A checkpoint without a manifest is *unverified*: written
by fullshard before checksums were added, or by torch.distributed.checkpoint itself.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
METADATA = ".metadata"  # torch.distributed.checkpoint's own index of the checkpoint, written by rank 0
FORMAT = "fullshard-checkpoint-manifest"
ALGORITHM = "xxh3_128"
NO_MANIFEST = "no manifest"


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: the rank that wrote it, its size in bytes and its checksum."""

    rank: int
    size: int
    checksum: str


@dataclasses.dataclass
class Manifest:
    """What a checkpoint holds: its files (by name inside the checkpoint directory), the world
    size and step it was saved at, and the optimizer's class name (None: saved without one)."""

    files: dict[str, FileEntry]
    world_size: int
    step: int | None = None
    optimizer: str | None = None


def checksum(path: str | os.PathLike) -> tuple[int, str]:
    """(size in bytes, XXH3-128 hex digest) of a file, read through a memory map.

    Raises:
        OSError: the file cannot be opened or mapped.
    """
    import xxhash

    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size:  # an empty file cannot be mapped
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                h.update(data)
    return size, h.hexdigest()


def entries(directory: Path, names: Collection[str], rank: int) -> dict[str, FileEntry]:
    """The manifest entries of the files ``names`` in ``directory``, all written by ``rank``."""
    out = {}
    for name in sorted(names):
        size, digest = checksum(directory / name)
        out[name] = FileEntry(rank, size, digest)
    return out


def write(directory: Path, manifest: Manifest) -> None:
    """Write ``manifest`` into ``directory`` atomically (a temporary file, synced, then renamed).

    Raises:
        OSError: it could not be written.
    """
    body = {
        "format": FORMAT,
        "version": 1,
        "algorithm": ALGORITHM,
        "world_size": manifest.world_size,
        "step": manifest.step,
        "optimizer": manifest.optimizer,
        "files": {name: dataclasses.asdict(e) for name, e in sorted(manifest.files.items())},
    }
    tmp = directory / f"{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)


def read(directory: Path) -> Manifest | None:
    """The manifest of the checkpoint in ``directory``; None when it has none.

    Raises:
        ValueError: the manifest is unreadable or not a fullshard manifest (the reason named).
    """
    path = directory / MANIFEST
    try:
        body: Any = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{MANIFEST}: unreadable ({e})") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT or body.get("algorithm") != ALGORITHM:
        raise ValueError(f"{MANIFEST}: not a fullshard manifest with {ALGORITHM} checksums")
    try:
        files = {
            str(n): FileEntry(int(e["rank"]), int(e["size"]), str(e["checksum"])) for n, e in body["files"].items()
        }
        return Manifest(files, int(body["world_size"]), body.get("step"), body.get("optimizer"))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{MANIFEST}: malformed ({type(e).__name__}: {e})") from None


def check(
    directory: Path, hashed: Collection[str] | None = None, here_only: bool = False
) -> tuple[Manifest | None, list[str]]:
    """Check the checkpoint in ``directory`` against its manifest: every listed file present at
    its listed size, and the checksums of the files in ``hashed`` (default: all of them).
    ``here_only``: check only the listed files that are present (a directory per rank or node
    holds only its own ranks' files).

    Returns:
        (the manifest, or None when there is none; the problems found, one string per bad file,
        each naming the file and the rank that wrote it). Without a manifest the only problem
        reported is a missing ``.metadata``; the caller decides what an unverified checkpoint
        is worth.
    """
    try:
        manifest = read(directory)
    except ValueError as e:
        return None, [str(e)]
    if manifest is None:
        return None, [] if (directory / METADATA).is_file() else [f"{METADATA}: missing"]
    problems = []
    for name, entry in sorted(manifest.files.items()):
        if here_only and not (directory / name).exists():
            continue
        problem = _file_problem(directory / name, entry, hashed is None or name in hashed)
        if problem:
            problems.append(f"{name} (written by rank {entry.rank}): {problem}")
    if METADATA not in manifest.files:
        problems.append(f"{METADATA}: not listed in the manifest")
    return manifest, problems


def _file_problem(path: Path, entry: FileEntry, hash_it: bool) -> str | None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"unreadable ({e.strerror})"
    if size != entry.size:
        change = "truncated" if size < entry.size else "longer than written"
        return f"{size} bytes where {entry.size} were written ({change})"
    if hash_it:
        try:
            if checksum(path)[1] != entry.checksum:
                return "checksum mismatch"
        except OSError as e:
            return f"unreadable ({e.strerror})"
    return None


def shares(manifest: Manifest, world: int) -> list[set[str]]:
    """The files each of ``world`` ranks hashes when they verify a checkpoint together: every
    file once, the largest first, each to the rank with the fewest bytes so far (the same
    answer on every rank)."""
    load = [0] * world
    out: list[set[str]] = [set() for _ in range(world)]
    for name, entry in sorted(manifest.files.items(), key=lambda kv: (-kv[1].size, kv[0])):
        r = min(range(world), key=lambda i: (load[i], i))
        out[r].add(name)
        load[r] += entry.size
    return out
