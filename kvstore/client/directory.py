"""Typed client of the directory's /v1 HTTP API."""

from __future__ import annotations

import os
from collections.abc import Sequence
from urllib.parse import quote

from kvstore.client.http import JsonHttp
from kvstore.core import credentials, specs
from kvstore.core.handoffs import HandoffCommit, HandoffState, HandoffWait
from kvstore.core.inspection import InspectRequest, InspectResult
from kvstore.core.keys import Namespace
from kvstore.core.namespaces import NamespaceInfo


class DirectoryClient(JsonHttp):
    """`token` defaults to $KVSTORE_TOKEN, `ca_file` to $KVSTORE_CA_FILE."""

    def __init__(self, base_url: str | Sequence[str], timeout_s: float = 30.0, token: str | None = None,
                 ca_file: str | None = None) -> None:
        super().__init__(base_url, timeout_s, token or os.environ.get("KVSTORE_TOKEN") or None,
                         ca_file or os.environ.get("KVSTORE_CA_FILE") or None)

    def register_namespace(self, namespace: Namespace) -> str:
        body = {"namespace": namespace.to_dict()}
        return self.call_raw("POST", "/v1/namespaces", body)["namespace_id"]

    def namespaces(self) -> list[NamespaceInfo]:
        return [NamespaceInfo.model_validate(n) for n in self.call_raw("GET", "/v1/namespaces")]

    def set_policy(self, namespace_id: str, policy: specs.NamespacePolicy) -> specs.NamespacePolicy:
        """Sends only the fields `policy` was given: the others keep their values."""
        answer = self.call_raw("PUT", f"/v1/namespaces/{quote(namespace_id, safe='')}/policy",
                               policy.model_dump(exclude_unset=True))
        return specs.NamespacePolicy.model_validate(answer)

    def register_worker(self, body: specs.WorkerRegistration) -> specs.Registered:
        return self.call("POST", "/v1/workers", body, specs.Registered)

    def heartbeat(self, worker: str, epoch: int) -> None:
        self.call_raw("POST", f"/v1/workers/{quote(worker, safe='')}/heartbeat", specs.Heartbeat(epoch=epoch))

    def deregister(self, worker: str, epoch: int) -> None:
        self.call_raw("POST", f"/v1/workers/{quote(worker, safe='')}/deregister", specs.Heartbeat(epoch=epoch))

    def worker(self, name: str) -> specs.WorkerInfo:
        return specs.WorkerInfo.model_validate(self.call_raw("GET", f"/v1/workers/{quote(name, safe='')}"))

    def workers(self) -> list[specs.WorkerInfo]:
        return [specs.WorkerInfo.model_validate(w) for w in self.call_raw("GET", "/v1/workers")]

    def drain(self, name: str) -> specs.WorkerInfo:
        return specs.WorkerInfo.model_validate(self.call_raw("POST", f"/v1/workers/{quote(name, safe='')}/drain", {}))

    def undrain(self, name: str) -> specs.WorkerInfo:
        return specs.WorkerInfo.model_validate(self.call_raw("POST", f"/v1/workers/{quote(name, safe='')}/undrain", {}))

    def commit_handoff(self, body: HandoffCommit) -> HandoffState:
        return self.call("POST", "/v1/handoffs", body, HandoffState)

    def wait_handoff(self, body: HandoffWait) -> HandoffState:
        """Blocks up to body.timeout_s (the directory answers `pending` then)."""
        return self.call("POST", "/v1/handoffs/wait", body, HandoffState, timeout_s=body.timeout_s + self.timeout_s)

    def renew(self, token: str) -> specs.Renewed:
        return self.call("POST", "/v1/leases/renew", specs.TokenBody(token=token), specs.Renewed)

    def prepare_store(self, body: specs.PrepareStore) -> specs.StorePrepared:
        return self.call("POST", "/v1/store/prepare", body, specs.StorePrepared)

    def complete_store(self, body: specs.CompleteStore) -> specs.StoreCompleted:
        return self.call("POST", "/v1/store/complete", body, specs.StoreCompleted)

    def abort_store(self, token: str) -> None:
        self.call_raw("POST", "/v1/store/abort", specs.TokenBody(token=token))

    def lookup(self, namespace_id: str, hashes: list[str], locations: bool = False) -> specs.LookupResult:
        """The leading hits and their count per tier; each hit's location too with `locations`."""
        body = specs.LookupRequest(namespace_id=namespace_id, hashes=hashes, locations=locations)
        return self.call("POST", "/v1/lookup", body, specs.LookupResult)

    def lookup_tokens(self, namespace_id: str, token_ids: list[int],
                      hash_seed: str | None = None) -> specs.TokenLookupResult:
        body = specs.TokenLookupRequest(namespace_id=namespace_id, token_ids=token_ids, hash_seed=hash_seed)
        return self.call("POST", "/v1/lookup/tokens", body, specs.TokenLookupResult)

    def inspect(self, body: InspectRequest) -> InspectResult:
        return self.call("POST", "/v1/admin/inspect", body, InspectResult)

    def prepare_load(self, body: specs.PrepareLoad) -> specs.LoadPrepared:
        return self.call("POST", "/v1/load/prepare", body, specs.LoadPrepared)

    def prepare_loads(self, body: specs.PrepareLoads) -> specs.LoadsPrepared:
        return self.call("POST", "/v1/load/prepare-batch", body, specs.LoadsPrepared)

    def complete_load(self, body: specs.CompleteLoad) -> specs.LoadCompleted:
        return self.call("POST", "/v1/load/complete", body, specs.LoadCompleted)

    def tiers(self) -> list[specs.TierUsage]:
        return [specs.TierUsage.model_validate(t) for t in self.call_raw("GET", "/v1/tiers")]

    def stats(self) -> specs.Stats:
        return specs.Stats.model_validate(self.call_raw("GET", "/v1/admin/stats"))

    def create_token(self, body: credentials.TokenCreate) -> credentials.TokenCreated:
        return self.call("POST", "/v1/admin/tokens", body, credentials.TokenCreated)

    def tokens(self) -> list[credentials.TokenInfo]:
        return [credentials.TokenInfo.model_validate(t) for t in self.call_raw("GET", "/v1/admin/tokens")]

    def revoke_token(self, token_id: str) -> credentials.TokenInfo:
        path = f"/v1/admin/tokens/{quote(token_id, safe='')}/revoke"
        return credentials.TokenInfo.model_validate(self.call_raw("POST", path, {}))

    def evict(self, namespace_id: str | None = None) -> int:
        """Drop every replica of a namespace (or, with None, of every namespace)."""
        body = specs.EvictRequest(namespace_id=namespace_id, all=namespace_id is None)
        return self.call("POST", "/v1/admin/evict", body, specs.Evicted).replicas

    def evict_tier(self, body: specs.EvictRequest) -> specs.Evicted:
        return self.call("POST", "/v1/admin/evict", body, specs.Evicted)
