"""The S3 tier: one object per block at `<prefix>/<namespace_id>/<hash>`, moved with NIXL OBJ.

    tier = S3Tier(settings)          # checks the bucket with boto3 at start (NIXL only fails at first I/O)
    tier.register(agent)             # the OBJ backend is created by the worker's agent
    tier.rows(name, nbytes, runs)    # (object offset, len, devId) rows; the object is registered once
    tier.claim(name, token)          # a move under `token` is about to write the object
    tier.delete(name, token) / survivors()   # boto3: what NIXL does not do

An object's name is its block's, so a later copy of a block writes the same
key as an earlier one. A delete names the move token of the copy it gives back
and is skipped when another move has claimed the key since: a late delete of a
failed copy never removes the object a newer copy wrote (claims are kept in
memory for the last MAX_CLAIMS objects written; after a restart deletes go
through as asked).

Reads past the end of an object succeed silently in NIXL OBJ, so object sizes
come from the directory and every read is checked against the block checksum.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict

import numpy as np

from kvstore.core import specs
from kvstore.core.errors import KVStoreError

log = logging.getLogger(__name__)
MAX_CLAIMS = 1 << 16  # objects whose last writer is remembered (a late delete arrives within seconds)


class S3Tier:
    def __init__(self, endpoint: str | None, bucket: str, prefix: str, region: str, virtual_addressing: bool) -> None:
        import boto3
        import botocore.config
        import botocore.exceptions

        self.endpoint, self.bucket, self.prefix, self.region = endpoint, bucket, prefix.strip("/"), region
        self.virtual_addressing = virtual_addressing
        style = "virtual" if virtual_addressing else "path"
        self._s3 = boto3.client("s3", endpoint_url=endpoint, region_name=region,
                                config=botocore.config.Config(s3={"addressing_style": style},
                                                              retries={"max_attempts": 3}))
        try:
            self._s3.head_bucket(Bucket=bucket)
        except botocore.exceptions.ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "?")
            raise KVStoreError("unavailable", f"S3 bucket {bucket!r} is not usable at {endpoint or 'AWS'} "
                               f"({code}); create it or fix the credentials", bucket=bucket) from None
        except botocore.exceptions.BotoCoreError as exc:
            raise KVStoreError("unavailable", f"cannot reach S3 at {endpoint or 'AWS'}: {exc}",
                               bucket=bucket) from None
        self._probe = boto3.client("s3", endpoint_url=endpoint, region_name=region,
                                   config=botocore.config.Config(s3={"addressing_style": style}, connect_timeout=1,
                                                                 read_timeout=2, retries={"max_attempts": 1}))
        self._healthy_until = 0.0
        self._agent = None
        self._dev_ids: dict[str, int] = {}
        self._next_dev = itertools.count(1)
        self._lock = threading.Lock()
        self._writers: OrderedDict[str, str] = OrderedDict()  # object name -> token of the move last to claim it
        self._deleting: set[str] = set()  # objects a delete is under way for
        self._claimed = threading.Condition(self._lock)

    def unreachable(self) -> str | None:
        """Why the endpoint cannot take a transfer now, or None. NIXL OBJ retries an endpoint that is
        down for many seconds per object, so moves ask this first (a HEAD, cached 2 s when fine)."""
        import botocore.exceptions

        if time.monotonic() < self._healthy_until:
            return None
        try:
            self._probe.head_bucket(Bucket=self.bucket)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            return f"S3 endpoint {self.endpoint or 'AWS'} bucket {self.bucket!r} unreachable: {exc}"
        self._healthy_until = time.monotonic() + 2.0
        return None

    def backend_params(self) -> dict[str, str]:
        params = {"bucket": self.bucket, "region": self.region, "req_checksum": "required",
                  "use_virtual_addressing": "true" if self.virtual_addressing else "false"}
        if self.endpoint:
            scheme, _, host = self.endpoint.partition("://")
            params.update(endpoint_override=self.endpoint, scheme=scheme.lower())
        credentials = self._s3._request_signer._credentials
        if credentials is not None:  # the same credentials boto3 found (env, profile, ...)
            frozen = credentials.get_frozen_credentials()
            params.update(access_key=frozen.access_key, secret_key=frozen.secret_key)
            if frozen.token:
                params["session_token"] = frozen.token
        return params

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def rows(self, agent, name: str, nbytes: int, dram_rows: np.ndarray) -> np.ndarray:
        """OBJ rows matching `dram_rows` one to one: consecutive ranges of the object."""
        dev = self._dev_id(agent, name, nbytes)
        offsets = np.concatenate([[0], np.cumsum(dram_rows[:, 1])[:-1]]).astype(np.uint64)
        return np.stack([offsets, dram_rows[:, 1], np.full(len(dram_rows), dev, dtype=np.uint64)], axis=1)

    def _dev_id(self, agent, name: str, nbytes: int) -> int:
        with self._lock:
            if name not in self._dev_ids:  # OBJ: devId is the lookup key; each key registered once
                dev = next(self._next_dev)
                agent.register_object(dev, nbytes, self.key(name))
                self._dev_ids[name] = dev
            return self._dev_ids[name]

    def claim(self, name: str, token: str) -> None:
        """A move under `token` is about to write object `name`: deletes of other copies skip it."""
        with self._lock:
            self._claimed.wait_for(lambda: name not in self._deleting)  # a delete of it under way ends first
            self._writers[name] = token
            self._writers.move_to_end(name)
            while len(self._writers) > MAX_CLAIMS:
                self._writers.popitem(last=False)

    def delete(self, name: str, token: str | None = None) -> None:
        """Delete object `name`, given back by the copy under `token`, unless another move has
        claimed it since (it holds that copy's bytes now)."""
        with self._lock:
            if token is not None and self._writers.get(name) not in (None, token):
                log.info("s3 object %s was written again by another move: kept", self.key(name))
                return
            self._deleting.add(name)  # a claim of it waits: the check above holds until the delete is done
        try:
            self._s3.delete_object(Bucket=self.bucket, Key=self.key(name))
        except Exception as exc:  # noqa: BLE001 — a failed delete leaves garbage, never wrong data
            log.warning("deleting s3 object %s failed: %s", self.key(name), exc)
        finally:
            with self._lock:
                self._deleting.discard(name)
                self._claimed.notify_all()

    def survivors(self) -> list[specs.Survivor]:
        """Objects under the prefix named `<namespace_id>/<hash>`; the directory keeps what it knows."""
        found = []
        pages = self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.key(""))
        for page in pages:
            for obj in page.get("Contents", []):
                name = obj["Key"][len(self.key("")):]
                namespace_id, _, block_hash = name.partition("/")
                if namespace_id and block_hash and "/" not in block_hash:
                    found.append(specs.Survivor(kind="s3", token=name, runs=[], namespace_id=namespace_id,
                                                hash=block_hash, nbytes=obj["Size"]))
        return found
