"""Read the history rows of an offline W&B run file (run-<id>.wandb) without the network.

wandb 0.31 writes the file from its Go core (the Python DataStore reader of older versions is
gone). Format: a 7-byte header (b":W&B", uint16 LE 0xBEE1, uint8 version), then 32 KiB blocks of
chunks [uint32 LE crc32 | uint16 LE length | uint8 type (1 full, 2 first, 3 middle, 4 last)]
+ data, crc = crc32(data) seeded with crc32 of the type byte; fewer than 7 bytes left in a block
are padding. Each record is a wandb.proto.wandb_internal_pb2.Record; history items carry the key
in `nested_key` (0.31) or `key` (older) and the value as JSON. A file cut short by kill -9 ends at
its last whole chunk.
"""
from __future__ import annotations

import json
import struct
import zlib

BLOCK = 32768
HEADER = struct.Struct("<4sHB")
CHUNK = struct.Struct("<IHB")


def records(path: str):
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    magic, ident, _ = HEADER.unpack_from(data, 0)
    if magic != b":W&B" or ident != 0xBEE1:
        raise ValueError(f"{path} is not a W&B run file")
    pos, parts = HEADER.size, None
    while True:
        if BLOCK - pos % BLOCK < CHUNK.size:
            pos += BLOCK - pos % BLOCK
        if pos + CHUNK.size > len(data):
            return
        crc, length, kind = CHUNK.unpack_from(data, pos)
        body = data[pos + CHUNK.size: pos + CHUNK.size + length]
        if kind not in (1, 2, 3, 4) or len(body) < length or zlib.crc32(body, zlib.crc32(bytes([kind]))) != crc:
            return  # end of what was written
        pos += CHUNK.size + length
        if kind == 1:
            whole = body
        elif kind == 2:
            parts, whole = bytearray(body), None
        else:
            if parts is None:
                continue
            parts += body
            whole, parts = (bytes(parts), None) if kind == 4 else (None, parts)
        if whole is not None:
            rec = pb.Record()
            rec.ParseFromString(whole)
            yield rec


def history(path: str) -> list[dict]:
    """One {key: value} per logged row (W&B's own _step / _runtime / _timestamp removed)."""
    rows = []
    for rec in records(path):
        if rec.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in rec.history.item:
            key = "/".join(item.nested_key) if item.nested_key else item.key
            if not key.startswith("_"):
                row[key] = json.loads(item.value_json)
        rows.append(row)
    return rows


def run_id(path: str) -> str:
    for rec in records(path):
        if rec.WhichOneof("record_type") == "run":
            return rec.run.run_id
    raise ValueError(f"{path} has no run record")
