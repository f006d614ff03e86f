"""Synthetic prefix-cache traces for policy evaluation, in the format bench/hit_ratio.py reads.

    python bench/synth_trace.py --kind chat|rag|scan|mixed --requests 20000 --seed 1 --out PATH
        [--hint-accuracy 0.8]

One JSON object per line: `timestamp` (ms) and `hash_ids` (block ids in request order; equal ids
are equal prefixes, as with chained block hashes), and what an application would say about the
request: `session_id`, `turn` (0, 1, ...) and `retain`. A chat application says `turn` when it
knows the conversation goes on (an agent with a tool call pending, a user typing) and `none` when
it knows it ends, with probability `--hint-accuracy`, else `session` (it does not know); RAG
questions and batch prompts are one-shot (`none`). The hints come from their own random stream:
the block ids are the same whatever the accuracy. The generators model what prefix caches see:
- chat: multi-turn sessions (a geometric number of turns, each re-sending the whole conversation
  plus new blocks after a think time) behind a few shared system prompts of Zipf popularity;
- rag: a system prompt, then one of many documents of Zipf popularity, then a unique question;
- scan: chat traffic interleaved with long one-off prompts (batch jobs) that are never reused;
- mixed: all three at once;
- sessions / sessions-docs: multi-turn sessions behind a few shared system prompts, some of them
  about a document of Zipf popularity that other sessions read too, and now and then a long
  one-off scan; a save ends on a full block, which the session's next turn extends.
  `sessions-docs` is the second mix (most sessions about one of fewer documents, more scans,
  longer and fewer turns).
Nothing here is fitted to a particular trace; the parameters are round numbers.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
import sys


class Blocks:
    """Block ids, session ids, and the hints' own random stream (`accuracy`: how often the
    application knows whether a conversation goes on)."""

    def __init__(self, seed: int = 0, accuracy: float = 0.8) -> None:
        self._next = itertools.count(1)
        self._sessions = itertools.count()
        self._hints = random.Random(seed + 1_000_003)
        self.accuracy = accuracy

    def new(self, n: int) -> list[int]:
        return [next(self._next) for _ in range(n)]

    def session(self, kind: str) -> str:
        return f"{kind}-{next(self._sessions)}"

    def retain(self, continues: bool) -> str:
        if self._hints.random() < self.accuracy:
            return "turn" if continues else "none"
        return "session"


def zipf_weights(n: int, a: float) -> list[float]:
    return [1 / (rank ** a) for rank in range(1, n + 1)]


def chat(rng: random.Random, blocks: Blocks, rate_per_s: float = 4.0, prompts: int = 8,
         continue_p: float = 0.6, think_s: float = 60.0):
    """Yields (time_ms, hash_ids) forever; sessions interleave through an event queue."""
    system = [blocks.new(rng.randint(1, 4)) for _ in range(prompts)]
    weights = zipf_weights(prompts, 1.2)
    queue: list = []
    now, ids = 0.0, itertools.count()
    while True:
        now += rng.expovariate(rate_per_s)
        history = rng.choices(system, weights)[0] + blocks.new(rng.randint(1, 12))
        heapq.heappush(queue, (now, next(ids), history, blocks.session("chat"), 0))
        while queue and queue[0][0] <= now:
            at, _, history, session, turn = heapq.heappop(queue)
            hints = {"session_id": session, "turn": turn, "retain": "session"}
            yield at, history + blocks.new(1), hints  # the last block is the partial one: never reused
            continues = rng.random() < continue_p
            hints["retain"] = blocks.retain(continues)  # what the application knew when it sent it
            if continues:
                grown = history + blocks.new(rng.randint(1, 6))
                heapq.heappush(queue, (at + rng.expovariate(1 / think_s), next(ids), grown, session, turn + 1))


def rag(rng: random.Random, blocks: Blocks, rate_per_s: float = 4.0, documents: int = 5000):
    system = blocks.new(2)
    docs = [blocks.new(rng.randint(4, 32)) for _ in range(documents)]
    weights = zipf_weights(documents, 0.9)
    now = 0.0
    while True:
        now += rng.expovariate(rate_per_s)
        yield now, system + rng.choices(docs, weights)[0] + blocks.new(rng.randint(1, 2)), \
            {"session_id": blocks.session("rag"), "turn": 0, "retain": "none"}


def scan(rng: random.Random, blocks: Blocks, scan_share: float = 0.1):
    talk = chat(rng, blocks)
    for at, hash_ids, hints in talk:
        if rng.random() < scan_share:
            yield at, blocks.new(rng.randint(64, 256)), {"session_id": blocks.session("batch"), "turn": 0,
                                                          "retain": "none"}
        yield at, hash_ids, hints


def mixed(rng: random.Random, blocks: Blocks):
    sources = [chat(rng, blocks, rate_per_s=2.0), rag(rng, blocks, rate_per_s=1.5), scan(rng, blocks, 0.05)]
    heads = [next(s) for s in sources]
    while True:
        i = min(range(len(heads)), key=lambda j: heads[j][0])
        yield heads[i]
        heads[i] = next(sources[i])


def sessions(rng: random.Random, blocks: Blocks, rate_per_s: float = 2.0, prompts: int = 4,
             documents: int = 400, doc_share: float = 0.4, scan_share: float = 0.06,
             scan_blocks: tuple[int, int] = (64, 256), continue_p: float = 0.75, think_s: float = 30.0,
             turn_blocks: tuple[int, int] = (2, 8), partial: bool = False):
    """Yields (time_ms, hash_ids, hints) forever. A session: one of `prompts` system prompts (Zipf),
    then with `doc_share` one of `documents` documents (Zipf 1.0, shared by every session that
    picks it), then its turns, each re-sending the whole conversation plus `turn_blocks` new blocks
    after a think time. A save ends on a full block that the next turn extends (engines that cache
    only full blocks save them so); with `partial`, on a block of its own that is never read again.
    With `scan_share` an arrival is instead a one-off prompt of `scan_blocks` new blocks."""
    system = [blocks.new(rng.randint(2, 6)) for _ in range(prompts)]
    prompt_weights = zipf_weights(prompts, 1.0)
    docs = [blocks.new(rng.randint(8, 32)) for _ in range(documents)]
    doc_weights = zipf_weights(documents, 1.0)
    queue: list = []
    now, ids = 0.0, itertools.count()
    while True:
        now += rng.expovariate(rate_per_s)
        if rng.random() < scan_share:
            yield now, blocks.new(rng.randint(*scan_blocks)), {"session_id": blocks.session("scan"), "turn": 0,
                                                               "retain": "none"}
            continue
        history = list(rng.choices(system, prompt_weights)[0])
        if rng.random() < doc_share:
            history += rng.choices(docs, doc_weights)[0]
        history += blocks.new(rng.randint(*turn_blocks))
        heapq.heappush(queue, (now, next(ids), history, blocks.session("session"), 0))
        while queue and queue[0][0] <= now:
            at, _, history, session, turn = heapq.heappop(queue)
            hints = {"session_id": session, "turn": turn, "retain": "session"}
            yield at, history + blocks.new(1) if partial else history, hints
            continues = rng.random() < continue_p
            hints["retain"] = blocks.retain(continues)  # what the application knew when it sent it
            if continues:
                grown = history + blocks.new(rng.randint(*turn_blocks))
                heapq.heappush(queue, (at + rng.expovariate(1 / think_s), next(ids), grown, session, turn + 1))


def sessions_docs(rng: random.Random, blocks: Blocks):
    """The second mix: most sessions about a document (100, Zipf), more and longer scans, longer
    turns, fewer of them."""
    return sessions(rng, blocks, documents=100, doc_share=0.8, scan_share=0.1, scan_blocks=(64, 256),
                    continue_p=0.6, think_s=45.0, turn_blocks=(4, 16))


KINDS = {"chat": chat, "rag": rag, "scan": scan, "mixed": mixed, "sessions": sessions,
         "sessions-docs": sessions_docs}


def generate(kind: str, requests: int, seed: int, hint_accuracy: float = 0.8) -> list[dict]:
    rng = random.Random(seed)
    stream = KINDS[kind](rng, Blocks(seed, hint_accuracy))
    emitted = list(itertools.islice(stream, requests))  # a chat turn's hints are settled after it is emitted
    return [{"timestamp": int(at * 1000), "hash_ids": ids, **hints} for at, ids, hints in emitted]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", choices=sorted(KINDS), default="mixed")
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--hint-accuracy", type=float, default=0.8,
                        help="how often a chat application knows whether its conversation goes on (0-1)")
    args = parser.parse_args()
    if args.requests <= 0 or not 0 <= args.hint_accuracy <= 1:
        sys.exit("error: --requests must be positive and --hint-accuracy between 0 and 1")
    rows = generate(args.kind, args.requests, args.seed, args.hint_accuracy)
    try:
        with open(args.out, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    except OSError as exc:
        sys.exit(f"error: cannot write {args.out}: {exc}")
    distinct = len({k for row in rows for k in row["hash_ids"]})
    print(f"{args.kind}: {len(rows)} requests, {sum(len(r['hash_ids']) for r in rows)} block accesses, "
          f"{distinct} distinct blocks -> {args.out}")


if __name__ == "__main__":
    main()
