"""Per-file checksums of a checkpoint directory, written when it is saved and verified before it is
loaded, so a flipped byte in a shard (bad disk, a truncated copy, a partial overwrite) is one line
naming the file instead of silently wrong weights or Adam moments.

`checksums.json` in the directory maps every other file's relative path to its SHA-256 and size.
The work is split over the ranks that save (or load) it: `share(files, rank, world)` gives each
rank its files, the digests are gathered (`record`, `verify_before_parse` take the
torch.distributed module when there is a process group). SHA-256 through hashlib releases the
GIL and runs at ~1 GB/s per core with SHA extensions; bench/bench_checkpoint.py measures save and
load with and without it.

Every loader (resume, model.load, score --load, gspo-convert mcore-to-hf, Megatron-LM/Bridge roots
through megatron_dirs.resolve) calls `verify_before_parse` before it parses a file of the folder:
first the small files that say what the checkpoint is (metadata.json, .metadata, common.pt,
hf_config/, run_config.yaml, rng/, ...: `data=False`, cheap, on every process that parses them),
then, before any tensor is read, the data files too (`data=True`, split over the ranks). A folder
without checksums.json (an earlier version's, or another tool's) is loaded with one warning naming
it, or refused with `require=True` (checkpoint.require_checksums, --require-checksums).
Checksums are integrity, not authenticity: whoever can write the folder can rewrite them; what a
crafted checkpoint cannot do is run code (safe_metadata.py, megatron_load.py)."""
from __future__ import annotations

import hashlib
import json
import logging
import os

log = logging.getLogger("gspo_megatron.checkpoint")

CHECKSUM_FILE = "checksums.json"
ALGORITHM = "sha256"
_BUF = 8 * 1024 * 1024


class IntegrityError(Exception):
    """A file of a checkpoint does not match the checksum recorded when it was saved (one line)."""


def list_files(directory: str) -> list[str]:
    """Relative paths of every regular file under `directory` but the checksum file, sorted."""
    out = []
    for dirpath, _, names in os.walk(directory):
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), directory)
            if rel != CHECKSUM_FILE:
                out.append(rel)
    return sorted(out)


def share(files: list[str], rank: int, world: int) -> list[str]:
    """This rank's files of a sorted list (round robin, so large shard files spread over ranks)."""
    return files[rank::world]


def digest(path: str) -> str:
    h = hashlib.new(ALGORITHM)
    with open(path, "rb") as f:
        while True:
            b = f.read(_BUF)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def compute(directory: str, files: list[str]) -> dict[str, dict]:
    return {rel: {ALGORITHM: digest(os.path.join(directory, rel)), "size": os.path.getsize(os.path.join(directory, rel))}
            for rel in files}


def write(directory: str, entries: dict[str, dict]) -> None:
    """Write checksums.json (temp file + rename: never half a file)."""
    path = os.path.join(directory, CHECKSUM_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"algorithm": ALGORITHM, "files": dict(sorted(entries.items()))}, f, indent=0)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read(directory: str) -> dict[str, dict] | None:
    """The recorded entries, or None for a checkpoint saved without them (an earlier version)."""
    path = os.path.join(directory, CHECKSUM_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        files = data["files"] if isinstance(data, dict) else None
        if not isinstance(data, dict) or data.get("algorithm") != ALGORITHM or not isinstance(files, dict):
            raise ValueError("not a {algorithm: sha256, files: {...}} object")
        for rel, e in files.items():
            if (not rel or os.path.isabs(rel) or os.path.normpath(rel).split(os.sep)[0] == ".."
                    or not isinstance(e, dict) or type(e.get("size")) is not int or type(e.get(ALGORITHM)) is not str):
                raise ValueError(f"bad entry {rel!r}")
    except (OSError, ValueError, KeyError, TypeError) as e:  # UnicodeDecodeError is a ValueError
        raise IntegrityError(f"{path}: unreadable checksum file ({str(e).splitlines()[0] if str(e) else e!r})") from None
    return files


def verify(directory: str, recorded: dict[str, dict], files: list[str], missing_ok: bool = False) -> str | None:
    """Check `files` (relative paths, a share of `recorded`) against the record; the first
    mismatch as one line naming the file, or None. `missing_ok`: a file that is not there is
    skipped (nothing of it can be parsed; the reader that needs it says it is missing)."""
    for rel in files:
        want = recorded[rel]
        path = os.path.join(directory, rel)
        if not os.path.isfile(path):
            if missing_ok:
                continue
            return f"{path}: missing (listed in {CHECKSUM_FILE})"
        size = os.path.getsize(path)
        if size != want.get("size"):
            return f"{path}: {size} bytes, {want.get('size')} when saved (truncated or overwritten)"
        if digest(path) != want.get(ALGORITHM):
            return f"{path}: contents differ from the checksum recorded when it was saved (corrupted)"
    return None


DATA_SUFFIX = ".distcp"  # DCP data files (torch/distributed/checkpoint/filesystem.py DEFAULT_SUFFIX)
_warned: set[str] = set()  # folders without checksums.json already named in a warning (this process)


def _is_data(rel: str) -> bool:
    return rel.endswith(DATA_SUFFIX)


def _rank(dist) -> int:
    if dist is not None:
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def verify_before_parse(directory: str, *, data: bool, require: bool = False, dist=None) -> bool:
    """Check checkpoint `directory` against its checksums.json before any of its files is parsed.

    data=False: every recorded file but the tensor data files (*.distcp): what a reader parses to
    learn what the checkpoint is; a listed file that is absent is left to the reader that needs
    it (its own line names it missing). data=True: every recorded file, each one present (before
    tensors are read).
    dist: the torch.distributed module when a process group exists: collective, every rank hashes
    its share and the first mismatch is raised on every rank. True when verified; False when the
    folder has no checksums.json (one warning naming it, once per process, from rank 0), unless
    `require`: then refused. A mismatch, a missing file or an unreadable checksums.json: one
    CheckpointError line naming the file."""
    from gspo_megatron.errors import CheckpointError

    directory = os.fspath(directory)
    try:
        recorded, err = read(directory), None
    except IntegrityError as e:
        recorded, err = {}, str(e)
    if recorded is None:
        if require:
            raise CheckpointError(f"{directory}: no {CHECKSUM_FILE}, and checksums are required "
                                  "(checkpoint.require_checksums / --require-checksums): its files cannot be "
                                  "verified, refusing to load it")
        key = os.path.realpath(directory)
        if key not in _warned:
            _warned.add(key)
            if _rank(dist) == 0:
                log.warning("%s: no %s (saved by an earlier version or another tool): its files are loaded "
                            "unverified; checkpoint.require_checksums=true (--require-checksums) refuses such "
                            "checkpoints", directory, CHECKSUM_FILE)
        return False
    files = sorted(rel for rel in recorded if data or not _is_data(rel))
    if err is None:
        mine = share(files, _rank(dist), dist.get_world_size()) if dist is not None else files
        err = verify(directory, recorded, mine, missing_ok=not data)
    if dist is not None:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, err)
        err = next((e for e in errors if e), None)
    if err:
        raise CheckpointError(err)
    return True


def check_listed(directory: str, files) -> None:
    """Every file of `files` (relative paths a checkpoint's metadata points into) is listed in its
    checksums.json, when it has one: a data file added to a folder after it was saved (e.g. the
    storage of a crafted `.metadata` entry) is one CheckpointError line, not read unverified."""
    from gspo_megatron.errors import CheckpointError

    try:
        recorded = read(directory)
    except IntegrityError as e:
        raise CheckpointError(str(e)) from None
    if recorded is None:
        return
    for rel in sorted(set(files)):
        if os.path.normpath(rel) not in recorded:
            raise CheckpointError(f"{os.path.join(directory, rel)}: named in the checkpoint's metadata but not "
                                  f"listed in its {CHECKSUM_FILE} (added after it was saved?); refusing to read it")


def record(directory: str, dist=None) -> None:
    """Write checksums.json of every file in `directory` (collective with `dist`: each rank hashes
    its share, rank 0 writes; the files must be complete and visible to every rank)."""
    files = list_files(directory)
    if dist is None:
        write(directory, compute(directory, files))
        return
    mine = compute(directory, share(files, dist.get_rank(), dist.get_world_size()))
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    if dist.get_rank() == 0:
        merged: dict = {}
        for p in parts:
            merged.update(p)
        write(directory, merged)
