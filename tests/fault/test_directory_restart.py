"""The directory is SIGKILLed and restarted during a steady loop of saves and loads: no committed
block is lost, a reservation open at the crash is rolled back at start, and the worker and the
client carry on by themselves (during the outage a save stores nothing and a load is a miss)."""

from __future__ import annotations

import numpy as np

from kvstore.connector import KVStoreClient
from kvstore.core import specs
from kvstore.core.errors import KVStoreError
from tests.fault.prompts import BLOCKS_PER_PROMPT, NS, load, prompt, save

ROUNDS, KILL_AT, DOWN_FOR = 24, 8, 3


def test_a_directory_crash_under_load_loses_no_committed_block(stack):
    client = KVStoreClient(stack.url, NS, staging_bytes=BLOCKS_PER_PROMPT * NS.block_nbytes)
    held, outage_saves, outage_loads = {}, [], []
    try:
        for r in range(ROUNDS):
            if r == KILL_AT:
                open_reservation = client.directory.prepare_store(specs.PrepareStore(
                    namespace_id=NS.namespace_id, blocks=[specs.BlockToStore(
                        hash=prompt(999)[0][0].hex(), nbytes=NS.block_nbytes)]))
                assert stack.client.stats().reservations == 1
                stack.kill(stack.directory)
            if r == KILL_AT + DOWN_FOR:
                stack.start_directory()
            down = KILL_AT <= r < KILL_AT + DOWN_FOR
            hashes, blocks = prompt(r)
            stored = save(client, hashes, blocks)
            if down:
                outage_saves.append(stored)
            elif stored == BLOCKS_PER_PROMPT:
                held[r] = blocks
            for seed, expected in list(held.items())[-3:]:  # read back recent prompts as we go
                n, out = load(client, prompt(seed)[0])
                if down:
                    outage_loads.append(n)
                else:
                    assert n == BLOCKS_PER_PROMPT and all(np.array_equal(a, b) for a, b in zip(out, expected))
        assert outage_saves == [0] * DOWN_FOR and set(outage_loads) == {0}
        assert len(held) == ROUNDS - DOWN_FOR  # every save outside the outage was committed
        for seed, expected in held.items():  # committed before or after the crash: all still there, exact
            n, out = load(client, prompt(seed)[0])
            assert n == BLOCKS_PER_PROMPT, seed
            assert all(np.array_equal(a, b) for a, b in zip(out, expected))
        try:
            client.directory.complete_store(specs.CompleteStore(token=open_reservation.token, blocks=[]))
            raise AssertionError("a reservation open at the crash must not complete")
        except KVStoreError as exc:
            assert exc.kind == "conflict"
        assert stack.client.worker("w0").epoch == 1  # the worker never had to register again
    finally:
        client.close()
    stack.settled()
