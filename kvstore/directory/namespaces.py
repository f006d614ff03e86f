"""Namespaces: a model, its layout and its tenant, registered once; held in memory on every replica.

    namespaces.register(data, tenants) -> namespace id   # the caller's tenants (None: any)
    namespaces.get(namespace_id, tenants) -> Namespace   # another tenant's is "not found"
    namespaces.listed(tenants) -> [NamespaceInfo]        # with replicas and bytes per tier, from SQL
    namespaces.set_policy(namespace_id, policy)          # write-through, replicas
    namespaces.load(session)                             # at a start, and when a follower hears of one
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvstore.core import specs
from kvstore.core.errors import KVStoreError
from kvstore.core.keys import Namespace
from kvstore.core.namespaces import NamespaceInfo
from kvstore.directory.db import repository as repo
from kvstore.directory.db.writer import Tx, Write

if TYPE_CHECKING:
    from kvstore.directory.db.engine import Session, sessionmaker


class Namespaces:
    def __init__(self, write: Write, sessions: sessionmaker[Session], clock: Callable[[], float] = time.time) -> None:
        self._write = write
        self._sessions = sessions
        self._clock = clock
        self._by_id: dict[str, Namespace] = {}

    def load(self, session: Session) -> None:
        self._by_id.update({row.id: Namespace.from_dict(row.spec) for row in repo.namespace_rows(session)})

    def register(self, data: dict, tenants: frozenset[str] | None = None) -> str:
        """`tenants`: those of the caller (None: any); a namespace of another tenant is refused."""
        namespace = Namespace.from_dict(data)
        if foreign(namespace, tenants):
            raise KVStoreError("forbidden", f"this token may register namespaces of tenants {sorted(tenants)} "
                               f"only, not {namespace.tenant!r}", tenant=namespace.tenant)
        if namespace.namespace_id not in self._by_id:
            def job(tx: Tx) -> None:
                if repo.namespace(tx.session, namespace.namespace_id) is None:
                    repo.add_namespace(tx.session, namespace.namespace_id, namespace.to_dict(), self._clock())
            self._write(job)
            self._by_id[namespace.namespace_id] = namespace
        return namespace.namespace_id

    def get(self, namespace_id: str, tenants: frozenset[str] | None = None) -> Namespace:
        """The namespace, if it exists and belongs to one of `tenants` (None: any). Another tenant's
        namespace gets the same answer as one that does not exist."""
        namespace = self._by_id.get(namespace_id)
        if namespace is None or foreign(namespace, tenants):
            raise KVStoreError("not_found", "unknown namespace; register it first (POST /v1/namespaces)",
                               namespace_id=namespace_id)
        return namespace

    def listed(self, tenants: frozenset[str] | None = None) -> list[NamespaceInfo]:
        """Every namespace the caller's tenants hold (None: all), with its replicas and bytes per tier."""
        with self._sessions() as session:
            usage = repo.namespace_usage(session)
            rows = repo.namespace_rows(session)
        out = []
        for row in rows:
            ns = Namespace.from_dict(row.spec)
            if foreign(ns, tenants):
                continue
            held = usage.get(row.id, {})
            out.append(NamespaceInfo(namespace_id=row.id, tenant=ns.tenant, model_id=ns.model_id,
                                     model_revision=ns.model_revision, hash_scheme=ns.hash_scheme,
                                     block_tokens=ns.block_tokens, block_nbytes=ns.block_nbytes,
                                     write_through=bool(row.write_through), replicas=row.replicas or 1,
                                     blocks={k: n for k, (n, _) in held.items()},
                                     bytes={k: b for k, (_, b) in held.items()}))
        return out

    def set_policy(self, namespace_id: str, policy: specs.NamespacePolicy) -> specs.NamespacePolicy:
        """Changes the fields the body names (the others keep their values); returns the whole policy."""
        self.get(namespace_id)

        def job(tx: Tx) -> specs.NamespacePolicy:
            row = repo.namespace(tx.session, namespace_id)
            for name in policy.model_fields_set:
                setattr(row, name, getattr(policy, name))
            return specs.NamespacePolicy(write_through=bool(row.write_through), replicas=row.replicas or 1)
        return self._write(job)


def foreign(namespace: Namespace, tenants: frozenset[str] | None) -> bool:
    """Whether the namespace belongs to none of `tenants` (None: the caller may use every tenant's)."""
    return tenants is not None and namespace.tenant not in tenants
