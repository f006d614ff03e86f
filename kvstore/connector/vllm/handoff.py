"""The vLLM connector's prefill/decode hand-off, scheduler side: what each role does with a request,
the consumer's wait, and the producer's commit.

    pd = HandoffRoles(kv_role, directory, block_size, hash_algo, extra)
    pd.loads / pd.saves / pd.saves_decode          # kv_producer: saves the prompt, never loads;
                                                   # kv_consumer: loads, never saves; kv_both: both
    pd.consumed(request) -> id | None              # the hand-off this request waits for here
    pd.produced(request) -> id | None              # the hand-off this request makes here
    pd.load_keys(request) -> (keys, most tokens)   # what a request may load, and how far
    pd.partial_key(request) -> hex | None          # the store key of the prompt's last, partial block
    pd.partial_plan(request, saved, block_ids)     # a finished producer request: that block's save
    pd.hints(request) -> dict | None               # kv_transfer_params.hints, checked, for its saves
    pd.wait(request, namespace_id, keys) -> HandoffResult | None   # None: still waiting, ask again
    pd.finished(request, handoff, namespace_id, num_tokens, saving) -> kv_transfer_params
    pd.sent(req_ids)                               # their saves are in (finished_sending): commit
    pd.forget(req_id) / pd.take_stats() / pd.flush() / pd.close()

A router picks the hand-off id and sends it to both instances in `kv_transfer_params`
(`{"handoff_id": ID}`; on kv_both instances with vLLM's flags: `do_remote_decode` on the
prefill request, `do_remote_prefill` on the decode one). A producer without an id uses the
request id, and returns in its own `kv_transfer_params` what a router passes on to the consumer.

The producer commits a hand-off once vLLM reports the request's saves finished (the partial last
block's included), so a consumer that hears of it finds every block. A consumer's request is
asked about again every step (vLLM's `None`) until the commit, until every block it needs is
stored, or until its deadline (`handoff_timeout_s`, 30 s); then it loads what is there and
computes the rest. Nothing here ever makes a consumer load KV of another prompt: it loads its
own prompt's keys, whatever a hand-off said.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvstore.client import DirectoryClient
from kvstore.connector.handoff import HandoffResult, HandoffWaits
from kvstore.connector.vllm.worker import BlockPlan
from kvstore.core import specs
from kvstore.core.errors import KVStoreError
from kvstore.core.handoffs import HANDOFF_ID, HandoffCommit

log = logging.getLogger(__name__)
HANDOFF_SERIES = ("handoff_wait_s", "handoff_timeout_s", "handoff_commit_s")
ROLES = ("kv_producer", "kv_consumer", "kv_both")
DEFAULT_TIMEOUT_S = 30.0
MAX_TIMEOUT_S = 600.0


class HandoffRoles:
    def __init__(self, kv_role: str | None, directory: DirectoryClient, block_size: int, hash_algo: str,
                 extra: dict) -> None:
        role = kv_role or "kv_both"
        if role not in ROLES:
            raise KVStoreError("invalid", f"kv_role {role!r}: KVStoreConnector takes {', '.join(ROLES)}")
        self.role = role
        self.loads = role != "kv_producer"
        self.saves = role != "kv_consumer"
        self.saves_decode = role == "kv_both" and bool(extra.get("save_decode", True))  # multi-turn
        self.timeout_s = _timeout(extra.get("handoff_timeout_s"), DEFAULT_TIMEOUT_S)
        self._directory = directory
        self._block_size = block_size
        self._hash_algo = hash_algo
        self._waits = HandoffWaits(directory)
        self._waiting_since: dict[str, float] = {}
        self._resolved: dict[str, HandoffResult] = {}  # until the request finishes (a preemption asks again)
        self._producing: dict[str, tuple[HandoffCommit, float]] = {}  # req_id -> (its commit, finished when)
        self._hints: dict[str, dict | None] = {}  # req_id -> its checked hints, until it finishes
        self._commits = ThreadPoolExecutor(1, thread_name_prefix="kvstore-handoff-commit")
        self._stats: dict[str, list[float]] = {k: [] for k in HANDOFF_SERIES}
        self._lock = threading.Lock()

    # ---- which requests ------------------------------------------------------------------

    def consumed(self, request) -> str | None:
        params = request.kv_transfer_params or {}
        if self.role == "kv_producer" or (self.role == "kv_both" and not params.get("do_remote_prefill")):
            return None
        handoff = params.get("handoff_id")
        return str(handoff) if handoff is not None else None

    def produced(self, request) -> str | None:
        params = request.kv_transfer_params or {}
        if self.role == "kv_consumer" or (self.role == "kv_both" and not params.get("do_remote_decode")):
            return None
        handoff = params.get("handoff_id", request.request_id)
        if not isinstance(handoff, str) or not re.fullmatch(HANDOFF_ID, handoff):
            log.warning("request %s: handoff_id %r is not 1-128 letters, digits or . _ : -; no hand-off is "
                        "committed for it", request.request_id, handoff)
            return None
        return handoff

    def load_keys(self, request) -> tuple[list[str], int]:
        """The store keys a request may load, and the most tokens they may give it. A cache hit
        leaves the prompt's last block to compute; a hand-off's consumer loads every full block
        and the partial last one, and computes only the last token."""
        prompt = len(request.prompt_token_ids or ())
        if self.consumed(request) is None:
            keys = [h.hex() for h in request.block_hashes[:(prompt - 1) // self._block_size]]
            return keys, len(keys) * self._block_size
        keys = [h.hex() for h in request.block_hashes[:prompt // self._block_size]]
        partial = self.partial_key(request)
        return keys + ([partial] if partial else []), prompt - 1

    def partial_plan(self, request, saved: int, block_ids: list[int]) -> BlockPlan | None:
        """The save of a finished request's partial last prompt block, once the prompt is computed
        and its full blocks are saved (the page holds the KV of those tokens, then anything: a
        consumer uses only the first ones)."""
        prompt = len(request.prompt_token_ids or ())
        full = prompt // self._block_size
        if saved < full or len(block_ids) <= full or request.num_computed_tokens < prompt:
            return None
        key = self.partial_key(request)
        if key is None:
            return None
        parent = request.block_hashes[full - 1].hex() if full else None
        return BlockPlan(request.request_id, [key], [block_ids[full]], parent=parent, hints=self.hints(request))

    def hints(self, request) -> dict | None:
        """What the request's `kv_transfer_params.hints` say for the store's policies (session_id,
        retain, priority), checked once per request; a malformed one is dropped with a warning."""
        if request.request_id in self._hints:
            return self._hints[request.request_id]
        given, checked = (request.kv_transfer_params or {}).get("hints"), None
        if given is not None:
            try:
                checked = specs.RequestHints.model_validate(given).model_dump(exclude_defaults=True)
            except ValueError as exc:
                log.warning("request %s: kv_transfer_params.hints ignored: %s", request.request_id, exc)
        self._hints[request.request_id] = checked
        return checked

    def partial_key(self, request) -> str | None:
        """vLLM's hash of the prompt's last, partial block (its parent, its tokens and its extra
        keys, marked as partial: never equal to a full block's); None when the prompt ends on a
        block boundary or carries multimodal inputs."""
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, hash_block_tokens

        prompt = list(request.prompt_token_ids or ())
        full = len(prompt) // self._block_size
        rest = prompt[full * self._block_size:]
        if not rest or request.mm_features:
            return None
        parent = request.block_hashes[full - 1] if full else None
        extra, _ = generate_block_hash_extra_keys(request, full * self._block_size, len(prompt), 0)
        keys = (("kvstore-partial", len(rest)), *(extra or ()))
        return hash_block_tokens(get_hash_fn_by_name(self._hash_algo), parent, rest, keys).hex()

    # ---- the consumer -------------------------------------------------------------------------

    def wait(self, request, namespace_id: str, keys: list[str]) -> HandoffResult | None:
        """The hand-off's outcome once known, else None (the wait goes on in the background)."""
        req_id = request.request_id
        if req_id in self._resolved:
            return self._resolved[req_id]
        if req_id not in self._waiting_since:
            params = request.kv_transfer_params or {}
            foreign = params.get("namespace_id")
            if foreign is not None and foreign != namespace_id:
                log.warning("request %s: hand-off %s was saved under namespace %s, this engine's is %s (another "
                            "model or configuration); computing its prompt", req_id, params.get("handoff_id"),
                            foreign, namespace_id)
                return self._resolve(req_id, HandoffResult("error", 0.0, detail="another namespace"))
            self._waiting_since[req_id] = time.monotonic()
            # a request may wait less than the operator allows, never longer
            timeout_s = min(self.timeout_s, _timeout(params.get("handoff_timeout_s"), self.timeout_s))
            self._waits.start(req_id, namespace_id, self.consumed(request), keys, timeout_s)
            return None
        result = self._waits.result(req_id)
        return None if result is None else self._resolve(req_id, result)

    def _resolve(self, req_id: str, result: HandoffResult) -> HandoffResult:
        since = self._waiting_since.pop(req_id, None)
        waited = time.monotonic() - since if since is not None else result.waited_s
        self._observe("handoff_wait_s", waited)
        if result.outcome == "timeout":
            self._observe("handoff_timeout_s", waited)
            log.warning("request %s: no hand-off within %.1f s; loading what the store has", req_id, waited)
        elif result.outcome == "error":
            log.warning("request %s: hand-off refused (%s); loading what the store has", req_id, result.detail)
        self._resolved[req_id] = result
        return result

    # ---- the producer -------------------------------------------------------------------------

    def finished(self, request, handoff: str, namespace_id: str, num_tokens: int, saving: bool) -> dict[str, Any]:
        """The request's kv_transfer_params for the router; its hand-off commits now if nothing of it
        is being saved, else once `sent` reports its saves. A prompt the engine did not finish
        computing (the request was aborted) commits as failed: its consumer stops waiting."""
        computed = request.num_computed_tokens >= len(request.prompt_token_ids or ())
        commit = HandoffCommit(namespace_id=namespace_id, handoff_id=handoff, num_tokens=num_tokens if computed else 0,
                               failed=not computed, finished_at=time.time())
        if saving:
            with self._lock:
                self._producing[request.request_id] = (commit, time.monotonic())
        else:
            self._commit(commit, time.monotonic())
        return {"handoff_id": handoff, "namespace_id": namespace_id, "num_tokens": commit.num_tokens,
                "do_remote_prefill": True, "do_remote_decode": False}

    def sent(self, req_ids) -> None:
        for req_id in req_ids:
            with self._lock:
                produced = self._producing.pop(req_id, None)
            if produced is not None:
                self._commit(*produced)

    def _commit(self, commit: HandoffCommit, since: float) -> None:
        def run() -> None:
            try:
                self._directory.commit_handoff(commit)
                self._observe("handoff_commit_s", time.monotonic() - since)
            except KVStoreError as exc:  # the consumer's deadline covers it: it loads what is there
                log.warning("hand-off %s not committed: %s", commit.handoff_id, exc)
        self._commits.submit(run)

    # ---- bookkeeping ----------------------------------------------------------------------------

    def forget(self, req_id: str) -> None:
        """The request finished: a wait for it stops, its outcome is forgotten."""
        self._waits.cancel(req_id)
        self._waiting_since.pop(req_id, None)
        self._resolved.pop(req_id, None)
        self._hints.pop(req_id, None)

    def _observe(self, series: str, value: float) -> None:
        with self._lock:
            self._stats[series].append(value)

    def take_stats(self) -> dict[str, list[float]]:
        with self._lock:
            stats, self._stats = self._stats, {k: [] for k in HANDOFF_SERIES}
        return stats

    def flush(self) -> None:
        """Wait for the commits handed out so far."""
        self._commits.submit(lambda: None).result()

    def close(self) -> None:
        self._waits.close()
        self._commits.shutdown(wait=True)


def _timeout(value, default: float) -> float:
    try:
        timeout = float(value) if value is not None else default
    except (TypeError, ValueError):
        timeout = -1.0
    if not 0 < timeout <= MAX_TIMEOUT_S:
        log.warning("handoff_timeout_s %r is not a number of seconds in (0, %g]; using %g", value, MAX_TIMEOUT_S,
                    default)
        return default
    return timeout
