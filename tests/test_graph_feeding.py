"""StageGraph feeds a starving stage: while a stage waits for input (`starving`), the stages
with an edge into it get extra passes at the start of the next step (after the round's
outputs went out), each until it has spent as long as that round's longest pass, has nothing
to do, or the consumer has what it waits for.

Toy stages on a fake clock: a producer makes one item per pass per request (1 ms a pass), a
consumer takes `need` items per pass and its passes cost 50 ms."""

from __future__ import annotations

from dataclasses import dataclass

from omnistage.graph import CLIENT, MAX_FEED_PASSES, Edge, StageGraph
from omnistage.stage_messages import StageOutput
from omnistage.stages.base import Stage


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Item:
    request_id: str
    last: bool


class Producer(Stage):
    """`total` items per request, one per pass; each pass costs `cost_s`."""

    def __init__(self, clock: Clock, total: int, cost_s: float = 0.001):
        self.name, self.dead, self.clock = "producer", None, clock
        self.total, self.cost_s = total, cost_s
        self.made: dict[str, int] = {}
        self.passes = 0

    def add(self, request_id: str) -> None:
        self.made[request_id] = 0

    def step(self) -> list[StageOutput]:
        self.passes += 1
        self.clock.now += self.cost_s
        out = []
        for rid in list(self.made):
            self.made[rid] += 1
            last = self.made[rid] == self.total
            out.append(StageOutput(self.name, rid, Item(rid, last), final=last))
            if last:
                del self.made[rid]
        return out

    def abort(self, request_id: str) -> None:
        self.made.pop(request_id, None)

    def has_work(self) -> bool:
        return bool(self.made)

    def num_requests(self) -> int:
        return len(self.made)

    def close(self) -> None:
        pass


class Consumer(Stage):
    """Takes `need` items of a request per pass (fewer only at the request's end); each pass
    costs `cost_s`. Starving while a request has fewer than `need` items and more will come."""

    def __init__(self, clock: Clock, need: int, cost_s: float = 0.05, starves: bool = True):
        self.name, self.dead, self.clock = "consumer", None, clock
        self.need, self.cost_s, self.starves = need, cost_s, starves
        self.held: dict[str, list[Item]] = {}
        self.passes = 0

    def add(self, item: Item) -> None:
        self.held.setdefault(item.request_id, []).append(item)

    def _ready(self, items: list[Item]) -> bool:
        return len(items) >= self.need or (bool(items) and items[-1].last)

    def step(self) -> list[StageOutput]:
        self.passes += 1
        self.clock.now += self.cost_s
        out = []
        for rid, items in list(self.held.items()):
            if self._ready(items):
                taken, self.held[rid] = items[:self.need], items[self.need:]
                done = taken[-1].last
                out.append(StageOutput(self.name, rid, len(taken), final=done))
                if done:
                    del self.held[rid]
        return out

    def starving(self) -> bool:
        return self.starves and any(not self._ready(items) for items in self.held.values())

    def abort(self, request_id: str) -> None:
        self.held.pop(request_id, None)

    def has_work(self) -> bool:
        return any(self._ready(items) for items in self.held.values())

    def num_requests(self) -> int:
        return len(self.held)

    def close(self) -> None:
        pass


class Router:
    def __init__(self):
        self.edges = [Edge("producer", "consumer"), Edge("consumer", CLIENT)]
        self.live: set[str] = set()

    def start(self, request_id: str) -> list[tuple[str, object]]:
        self.live.add(request_id)
        return [("producer", request_id)]

    def route(self, out: StageOutput) -> list[tuple[str, object]]:
        if out.stage == "producer":
            return [("consumer", out.payload)]
        if out.final:
            self.live.discard(out.request_id)
        return []

    def forget(self, request_id: str) -> None:
        self.live.discard(request_id)

    def unfinished(self) -> set[str]:
        return set(self.live)


def graph(need: int, total: int = 100, producer_cost: float = 0.001, starves: bool = True):
    clock = Clock()
    producer, consumer = Producer(clock, total, producer_cost), Consumer(clock, need, starves=starves)
    g = StageGraph([producer, consumer], Router(), clock=clock)
    return g, producer, consumer


def steps(g: StageGraph, n: int) -> None:
    for _ in range(n):
        g.step()


def test_a_starving_stage_is_fed_before_the_next_round():
    g, producer, consumer = graph(need=10)
    g.add_request("a", "a")
    steps(g, 9)          # the consumer has no pass yet: no long pass to match, one item a round
    assert producer.passes == 9
    g.step()             # item 10: the consumer takes all 10 (50 ms) and starves
    assert producer.passes == 10 and consumer.held["a"] == []
    g.step()             # fed 10 first, then the round: item 11, the consumer takes 10
    assert producer.passes == 21
    assert len(consumer.held["a"]) == 1
    g.step()             # fed 9, then the round
    assert producer.passes == 31


def test_feeding_stops_at_the_longest_pass():
    """Producer passes of 20 ms against the consumer's 50: 2 extra passes after a round where
    the consumer stepped (the producer's time then passes 50 ms), none after a round where it
    did not (the producer's own pass was the longest)."""
    g, producer, consumer = graph(need=10, producer_cost=0.02)
    g.add_request("a", "a")
    steps(g, 10)
    assert producer.passes == 10
    g.step()
    assert producer.passes == 13 and len(consumer.held["a"]) == 3
    g.step()
    assert producer.passes == 14


def test_no_extra_passes_without_starving():
    g, producer, consumer = graph(need=10, starves=False)
    g.add_request("a", "a")
    steps(g, 25)
    assert producer.passes == 25


def test_feeding_is_bounded_and_the_request_completes():
    need = 10 * MAX_FEED_PASSES
    g, producer, consumer = graph(need=need, total=2 * need, producer_cost=1e-6)
    g.add_request("a", "a")
    steps(g, need + 1)
    assert producer.passes == need + 1 + MAX_FEED_PASSES
    for _ in range(2 * need):
        if not g.has_unfinished_requests():
            break
        g.step()
    assert not g.has_unfinished_requests()
    assert producer.passes == 2 * need


class Relay(Stage):
    """Between producer and consumer (a talker between thinker and vocoder): one item out per
    item in, one per pass per request (1 ms a pass); starving while a request waits for input."""

    def __init__(self, clock: Clock):
        self.name, self.dead, self.clock = "relay", None, clock
        self.inbox: dict[str, list[Item]] = {}
        self.passes = 0

    def add(self, item: Item) -> None:
        self.inbox.setdefault(item.request_id, []).append(item)

    def step(self) -> list[StageOutput]:
        self.passes += 1
        self.clock.now += 0.001
        out = []
        for rid, items in list(self.inbox.items()):
            if items:
                item = items.pop(0)
                out.append(StageOutput(self.name, rid, item, final=item.last))
                if item.last:
                    del self.inbox[rid]
        return out

    def starving(self) -> bool:
        return any(not items for items in self.inbox.values())

    def abort(self, request_id: str) -> None:
        self.inbox.pop(request_id, None)

    def has_work(self) -> bool:
        return any(self.inbox.values())

    def num_requests(self) -> int:
        return len(self.inbox)

    def close(self) -> None:
        pass


class ChainRouter(Router):
    """The stages of `chain` in a line, the last one's outputs to the client."""

    def __init__(self, chain: tuple[str, ...] = ("producer", "relay", "consumer")):
        super().__init__()
        self.chain = chain
        self.edges = [Edge(a, b) for a, b in zip(chain, chain[1:])] + [Edge(chain[-1], CLIENT)]

    def start(self, request_id: str) -> list[tuple[str, object]]:
        self.live.add(request_id)
        return [(self.chain[0], request_id)]

    def route(self, out: StageOutput) -> list[tuple[str, object]]:
        i = self.chain.index(out.stage)
        if i + 1 < len(self.chain):
            return [(self.chain[i + 1], out.payload)]
        return super().route(out)


def test_a_pulled_stage_that_starves_pulls_its_own_producer():
    """producer -> relay -> consumer: while the consumer starves, the relay's extra passes
    need the producer's (each relay item waits for one from the producer), so both get them,
    the producer's first in each feeding pass; a starving relay whose consumer does not
    starve pulls nothing (the relay's own extra passes alone would have nothing to do)."""
    for starves in (True, False):
        clock = Clock()
        producer, relay = Producer(clock, 1000), Relay(clock)
        consumer = Consumer(clock, need=10, starves=starves)
        g = StageGraph([producer, relay, consumer], ChainRouter(), clock=clock)
        g.add_request("a", "a")
        steps(g, 10)         # the consumer's first pass (50 ms) in round 10 takes 10 items
        assert producer.passes == relay.passes == 10 and relay.starving()
        g.step()
        if starves:          # fed in pairs until the consumer has its 10, then the round
            assert producer.passes == relay.passes == 10 + 10 + 1
        else:
            assert producer.passes == relay.passes == 11


def test_a_pulled_stage_keeps_pace_with_its_puller_past_its_own_budget():
    """producer (10 ms a pass) -> relay (1 ms) -> consumer (50 ms, 10 items a pass): the
    producer's extra passes go on while the relay that pulls it is within the round's longest
    pass, not only while its own time is (each relay item waits for one from the producer; cut
    at the producer's own time, the relay stalled after one pass and the consumer waited 9
    rounds for its first 10 items, then got 5 a round). So every round after the first feeds
    the consumer the 10 items of its next pass."""
    clock = Clock()
    producer, relay = Producer(clock, 1000, cost_s=0.01), Relay(clock)
    consumer = Consumer(clock, need=10)
    g = StageGraph([producer, relay, consumer], ChainRouter(), clock=clock)
    g.add_request("a", "a")
    g.step()
    for _ in range(3):
        before = producer.passes, relay.passes, consumer.passes
        g.step()
        assert (producer.passes - before[0], relay.passes - before[1], consumer.passes - before[2]) == (10, 10, 1)


class Head(Stage):
    """An encoder: a new request's one item goes on after one pass of `cost_s` (20 ms)."""

    def __init__(self, clock: Clock, log: list[str], cost_s: float = 0.02):
        self.name, self.dead, self.clock, self.log, self.cost_s = "head", None, clock, log, cost_s
        self.held: list[str] = []

    def add(self, request_id: str) -> None:
        self.held.append(request_id)

    def step(self) -> list[StageOutput]:
        self.log.append(self.name)
        self.clock.now += self.cost_s
        out, self.held = [StageOutput(self.name, rid, Item(rid, False), final=False) for rid in self.held], []
        return out

    def abort(self, request_id: str) -> None:
        if request_id in self.held:
            self.held.remove(request_id)

    def has_work(self) -> bool:
        return bool(self.held)

    def num_requests(self) -> int:
        return len(self.held)

    def close(self) -> None:
        pass


class Decoder(Relay):
    """A thinker: one item a pass for every request it has begun (5 ms a pass), never
    starving (its requests wait for nothing once begun)."""

    def __init__(self, clock: Clock, log: list[str]):
        super().__init__(clock)
        self.name, self.log = "decoder", log

    def step(self) -> list[StageOutput]:
        self.log.append(self.name)
        self.passes += 1
        self.clock.now += 0.005
        return [StageOutput(self.name, rid, Item(rid, False), final=False) for rid in self.inbox]

    def starving(self) -> bool:
        return False

    def has_work(self) -> bool:
        return bool(self.inbox)


def test_a_newcomer_at_the_head_goes_first_in_the_feeding_passes():
    """head (an encoder, 20 ms) -> decoder (a thinker, 5 ms, not starving) -> consumer (a
    vocoder, 50 ms a pass of 10 items): while the consumer starves for request a, the decoder
    it pulls takes extra passes; a request b that arrives at the head then is passed on at the
    start of those passes, not after them (the head has work of its own, and the decoder's
    passes would carry b too), so b's items reach the consumer with a's. Cut off from the
    extra passes, b waited for the round after them: eight Realtime sessions of 15 s
    committing together, seven waited ~0.17 s while the thinker and talker fed the eighth."""
    clock, log = Clock(), []
    head, decoder = Head(clock, log), Decoder(clock, log)
    consumer = Consumer(clock, need=10)
    g = StageGraph([head, decoder, consumer], ChainRouter(("head", "decoder", "consumer")), clock=clock)
    g.add_request("a", "a")
    steps(g, 8)              # fed: every round now brings the consumer a's next 10 items
    passes = consumer.passes
    g.add_request("b", "b")
    del log[:]
    g.step()
    assert log[:2] == ["head", "decoder"] and log.count("decoder") == 10, log
    assert consumer.passes == passes + 1 and consumer.held == {"a": [], "b": []}
