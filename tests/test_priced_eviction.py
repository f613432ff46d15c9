"""core/priced_eviction.py: the unit prices, and the priced free order
against a readable reference (a list sorted by key) and against vLLM's
FIFO at weight 0."""

from __future__ import annotations

import dataclasses
import random

import pytest

from atom_hybrid_cache.config import ConfigError, load_settings, server_defaults
from atom_hybrid_cache.core.eviction import FreedState, KVPages, freed_order, freed_units
from atom_hybrid_cache.core.page_pool import FifoFreeOrder, PagePool
from atom_hybrid_cache.core.policy import CheckpointPolicy
from atom_hybrid_cache.core.slot_share import SlotShare
from atom_hybrid_cache.core.priced_eviction import (PricedFreeOrder, pages_per_token,
                                                    resolved_weight, span_prices)


def test_a_units_price_is_its_tokens_over_its_pages_raised_to_the_unit_above():
    # above every state: 2 pages; the state at 1280 with 1 KV page over
    # 1280 - 680 tokens: 300 a page; the state at 680 with 3 KV pages over
    # 680 tokens (170 a page) is raised to the 300 of the unit above it
    spans = [(0, 2, None), (2, 4, 1280), (4, 8, 680)]
    assert span_prices(spans) == [(0, 2, 0.0), (2, 4, 300.0), (4, 8, 300.0)]
    # a cheaper unit above does not lower the one below
    assert span_prices([(0, 0, None), (0, 2, 1280), (2, 4, 1000)]) == [
        (0, 0, 0.0), (0, 2, 140.0), (2, 4, 500.0)]


def test_the_spans_cover_the_release_order():
    """freed_order's spans (one KV group, no object a page) are those of
    freed_units (several groups): the slices of the same order."""
    states = [FreedState("S640", 640, True), FreedState("S256", 256, True),
              FreedState("R", 0, False)]
    kv = KVPages(128, [f"K{i}" for i in range(7)], [True] * 6 + [False])
    spans_fast, spans_units = [], []
    order = freed_order(states, [kv], spans_fast)
    assert order == freed_units(states, [kv]).order(spans_units)
    assert spans_fast == spans_units == [(2, 3, None), (3, 7, 640), (7, 10, 256)]
    assert order == ["K6", "R", "K5", "S640", "K4", "K3", "K2", "S256", "K1", "K0"]


def test_a_priced_unit_outlives_cheaper_pages_freed_after_it():
    """Freed in the order A (a state and its KV, 320 tokens a page), then
    B (KV above every state: no resume reads it): vLLM's FIFO hands A out
    first, the priced order B first while A's 320 pages of life last."""
    def popped(weight):
        pool = PagePool(6, price_weight=weight)
        pages = pool.allocate(5)
        for p in pages[:4]:
            pool.index_page(p, 100 + p)
        a, b = pages[:2], pages[2:4]
        pool.free_order.set_prices(a, [(0, 2, 320.0)])
        pool.free(a)
        pool.free(b)
        pool.free(pages[4:])                 # unindexed: handed out first
        return pool.allocate(5), a, b, pages[4]
    got, a, b, plain = popped(0.0)
    assert got == [plain] + a + b
    got, a, b, plain = popped(1.0)
    assert got == [plain] + b + a


class ReferenceOrder:
    """The priced order as its definition says it: front pages first (the
    last pushed first), then by key = clock + round(weight * price), the
    clock counting the pages handed out; equal keys, the first freed."""

    def __init__(self, pages, weight):
        self.weight, self.clock, self.freed = weight, 0, 0
        self.front = list(pages)
        self.keyed: dict = {}
        self.price: dict = {}

    def push_front(self, pages):
        self.front = list(pages) + self.front

    def push_back(self, pages):
        for p in pages:
            off = int(self.weight * self.price.get(p, 0.0) + 0.5)
            self.keyed[p] = (self.clock + off, self.freed)
            self.freed += 1

    def remove(self, p):
        if p in self.keyed:
            del self.keyed[p]
        else:
            self.front.remove(p)

    def in_order(self):
        return self.front + sorted(self.keyed, key=self.keyed.get)

    def pop_n(self, n):
        out = self.in_order()[:n]
        for p in out:
            self.remove(p)
            self.price.pop(p, None)
        self.clock += n
        return out


def _random_ops(rng, weight, make):
    """The same random operations on `make(pages, weight)` and the
    reference; yields both after each."""
    n = 60
    order, ref = make(range(1, n), weight), ReferenceOrder(range(1, n), weight)
    held: list = []
    for _ in range(400):
        op = rng.random()
        free = ref.in_order()
        if op < 0.35 and free:
            k = rng.randint(1, min(6, len(free)))
            got = order.pop_n(k)
            assert got == ref.pop_n(k)
            held += got
        elif op < 0.5 and free:
            p = rng.choice(free)                 # a hit on a free page
            order.remove(p)
            ref.remove(p)
            held.append(p)
        elif held:
            rng.shuffle(held)
            k = rng.randint(1, len(held))
            out, held = held[:k], held[k:]
            prices = [(0, k, rng.choice([0.0, 7.4, 12.5, 30.0, 640.0]))]
            order.set_prices(out, prices)
            for p in out:
                ref.price[p] = prices[0][2]
            if rng.random() < 0.3:
                order.push_front(out)
                ref.push_front(out)
            else:
                order.push_back(out)
                ref.push_back(out)
        yield order, ref


@pytest.mark.parametrize("weight", [0.0, 0.5, 1.0, 4.0])
def test_the_priced_order_is_its_definition(weight):
    for seed in range(20):
        for order, ref in _random_ops(random.Random(seed), weight, lambda pages, w: (
                PricedFreeOrder(60, pages, w) if w else _Fifo(pages))):
            assert order.in_order() == ref.in_order()
            assert len(order) == len(ref.in_order())


class _Fifo(FifoFreeOrder):
    def __init__(self, pages):
        super().__init__((p, None) for p in pages)


def test_at_weight_0_the_priced_order_is_vllms_fifo():
    """Weight 0 gives every page key = its turn: the FIFO's order."""
    for seed in range(10):
        a = _random_ops(random.Random(seed), 0.0, lambda pages, w: PricedFreeOrder(60, pages, w))
        b = _random_ops(random.Random(seed), 0.0, lambda pages, w: _Fifo(pages))
        for (priced, _), (fifo, _) in zip(a, b):
            assert priced.in_order() == fifo.in_order()


def test_a_hit_on_a_class_head_refiles_it():
    """The heap holds one entry a price class: a hit on its head leaves a
    stale entry that is refiled at the class's next page when it surfaces."""
    order = PricedFreeOrder(8, [5, 6], 1.0)
    assert order.pop_n(2) == [5, 6]       # the clock at 2
    order.set_prices([1, 2, 3, 4], [(0, 2, 3.0), (2, 4, 0.0)])
    order.push_back([1, 2, 3])            # keys 5, 5, 2
    order.pop_n(1)                        # 3; the clock at 3
    order.push_back([4])                  # key 3
    assert [order.key(p) for p in (1, 2, 4)] == [5, 5, 3]
    order.remove(1)
    assert order.pop_n(2) == [4, 2]
    assert len(order) == 0 and order.price[2] == 0.0
    with pytest.raises(KeyError):
        order.remove(2)
    with pytest.raises(ValueError):
        order.pop_n(1)


def test_the_setting_is_in_pool_traversals():
    """ATOM_EVICTION_PRICE_WEIGHT=0.5 in 600 pages of 640 tokens: a unit
    costing 640 tokens a page stays 300 pages longer; in 150 pages, 75."""
    assert pages_per_token(0.5, 600, 640) * 640 == 300
    assert pages_per_token(0.5, 150, 640) * 640 == 75


@pytest.mark.parametrize("raw", ["-1", "nan", "inf", "x"])
def test_a_bad_weight_stops_start_up_naming_the_variable(raw):
    with pytest.raises(ConfigError, match="ATOM_EVICTION_PRICE_WEIGHT"):
        load_settings(None, server_defaults(), environ={"ATOM_EVICTION_PRICE_WEIGHT": raw})


def test_auto_prices_in_full_under_32_checkpoints_and_fades_out_by_120():
    """A checkpoint the KV of 384 tokens: a slot's share of up to 32
    checkpoints' worth is priced at 0.25, of 76 at half that, of 120 and
    more not at all; a set weight stands at any size."""
    assert server_defaults().placement.eviction_price_weight is None
    for raw in ("auto", ""):
        settings = load_settings(None, server_defaults(),
                                 environ={"ATOM_EVICTION_PRICE_WEIGHT": raw})
        assert settings.placement.eviction_price_weight is None
    assert [resolved_weight(None, n * 384, 384) for n in (9, 31, 32, 54, 76, 98, 120, 640)] \
        == [0.25, 0.25, 0.25, 0.1875, 0.125, 0.0625, 0.0, 0.0]
    assert resolved_weight(None, 31 * 384, 0) == 0.0     # a checkpoint's cost unknown
    assert resolved_weight(0.0, 31 * 384, 384) == 0.0
    assert resolved_weight(0.5, 320 * 384, 384) == 0.5
    # the policy carries the resolved weight; lru eviction has no units to price
    placement = server_defaults().placement
    def small():
        return dict(block_size=128, share=SlotShare(124 * 384, 384, 4, in_flight=4))
    assert CheckpointPolicy(placement, **small()).eviction_price_weight == 0.25
    assert CheckpointPolicy(dataclasses.replace(placement, eviction="lru"),
                            **small()).eviction_price_weight == 0.0


def test_auto_prices_from_the_step_whose_requests_in_flight_leave_a_small_share():
    """124 checkpoints' worth, max_num_seqs 256: one request in flight holds
    the whole pool (past the fade: no price), three 41.3 each (priced at
    0.25 x (1 - 9.3 / 88)), four 31 each (under 32: 0.25): the weight moves
    at the steps that see a third and a fourth, and stays when they
    leave."""
    policy = CheckpointPolicy(server_defaults().placement, block_size=128,
                              share=SlotShare(124 * 384, 384, 256))
    assert policy.eviction_price_weight == 0.0
    three = 0.25 * (1 - (124 * 384 // 3 / 384 - 32) / 88)
    assert [(policy.observe_in_flight(n), policy.eviction_price_weight)
            for n in (1, 3, 3, 4, 2, 8)] == [
        (False, 0.0), (True, three), (False, three), (True, 0.25), (False, 0.25),
        (False, 0.25)]
    assert policy.eviction_price_weight == 0.25 and policy.kv_share_tokens == 8 * 744
    # a pool whose share at max_num_seqs is the line's prices at the fade's top
    roomy = CheckpointPolicy(server_defaults().placement, block_size=128,
                             share=SlotShare(128 * 384, 384, 4))
    # (four in flight leave 32 a request: the floors' pool share goes, the
    # weight is the fade's top)
    assert roomy.observe_in_flight(4) and roomy.eviction_price_weight == 0.25
