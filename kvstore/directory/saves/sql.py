"""The save path's own SQL. Its blocks and replicas are inserted by
`db.direct.insert_blocks` / `insert_replicas`, straight through the database
driver (see there why), once per save with one row per block.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from kvstore.directory.db.direct import chunks, marks, rows


def depths(session: Session, namespace_id: str, hashes: list[str]) -> dict[str, int]:
    """hash -> depth of the blocks the directory has."""
    found: dict[str, int] = {}
    for chunk in chunks(hashes):
        found.update(rows(session, f"SELECT hash, depth FROM blocks WHERE namespace_id = ? AND hash IN "
                          f"({marks(len(chunk))})", (namespace_id, *chunk)))
    return found
