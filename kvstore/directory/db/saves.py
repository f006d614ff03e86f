"""The save path's own SQL. Its blocks and replicas are inserted by
`db.direct.insert_blocks` / `insert_replicas`, straight through the database
driver (see there why), once per save with one row per block. Which blocks are
there is the lookup index's answer (`Index.ids`): no SQL index serves hashes.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from kvstore.directory.db.direct import chunks, marks, rows


def depths(session: Session, ids: dict[str, int]) -> dict[str, int]:
    """hash -> depth of the blocks named in `ids` (hash -> block id) that are still there."""
    by_id: dict[int, int] = {}
    for chunk in chunks(sorted(set(ids.values()))):
        by_id.update(rows(session, f"SELECT id, depth FROM blocks WHERE id IN ({marks(len(chunk))})", tuple(chunk)))
    return {h: by_id[i] for h, i in ids.items() if i in by_id}
