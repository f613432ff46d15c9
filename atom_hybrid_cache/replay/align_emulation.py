"""An emulation of vLLM 0.32's own hybrid prefix caching ("align" mode).

What it keeps of vLLM: the attention block size is raised until one
layer's KV page holds one layer's recurrent state, layers are grouped so one
page id spans a group, and a state of every linear layer takes one page id
per linear-layer group (3 for Qwen3.5-27B), all from one unified pool shared
with KV pages (see geometry.shared_pool_layout); a state is kept only where a prefill chunk ends on
a block boundary (chunks are rounded down to whole pages, the last one
excepted) and at the prompt tail (the last page boundary before the final
token); a finished request's pages go back to one LRU, attention pages
first, then state pages, each group tail first, as vLLM's coordinator frees
its managers in group order. What it leaves out: the kernels, the exact
page size (rounded up to a whole multiple of the replay's block size, e.g.
448 instead of vLLM's 400 tokens for Qwen3.5-27B, so pages hold whole
blocks), and the cost of the tail cut. It reads the same prompts as the core
(block hashes of `block_size` tokens) and groups them into pages, so both
see identical content.
"""

from __future__ import annotations

from ..core.kv_pool import KVBlockPool
from ..core.manager import Admission
from ..core.placement import resume_cap_blocks
from ..core.stats import CacheStats

_STATE_SALT = 0x5A5A_5A5A_5A5A_5A5A


class AlignEmulationManager:
    def __init__(self, num_pages: int, page_tokens: int, block_size: int, max_num_seqs: int,
                 pages_per_state: int = 1) -> None:
        self.pages_per_state = pages_per_state
        if page_tokens % block_size:
            raise ValueError(f"page size {page_tokens} must be a multiple of the block size {block_size}")
        self._state_keys: dict = {}  # page key -> its state's key
        self._live_states: set = set()
        self.pool = KVBlockPool(num_pages, on_drop=self._on_drop)
        self.page = page_tokens
        self.sub = page_tokens // block_size
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.stats = CacheStats()
        self.writes = 0
        self.evicted_states = 0
        self.reads = 0
        self._seen: set = set()
        self._pages: dict = {}  # request id -> (kv pages, state pages)

    # keys: a page is named by the chained hash of its last block, which
    # already stands for the whole prefix up to it.
    def _kv_key(self, req, j: int) -> int:
        return req.block_hashes[(j + 1) * self.sub - 1]

    def _state_key(self, req, j: int) -> int:
        return self._kv_key(req, j) ^ _STATE_SALT

    def _on_drop(self, h: int) -> None:
        base = self._state_keys.pop(h, None)
        if base is not None and base in self._live_states:
            # a state is lost with any of its pages; count it once
            self._live_states.discard(base)
            self.evicted_states += 1

    def admit(self, req):
        P = self.page
        L = req.prompt_len
        n_pages = -(-L // P)
        cap = resume_cap_blocks(L, P, 1)
        full = min(cap, len(req.block_hashes) // self.sub)
        keys = [self._kv_key(req, j) for j in range(full)]
        hit_pages = self.pool.prefix_blocks(keys, keys, full)
        kv_reach_pages = len(hit_pages)
        usable = 0
        idx = self.pool.hash_to_block
        k = self.pages_per_state
        for j in range(kv_reach_pages, 0, -1):
            sk = keys[j - 1] ^ _STATE_SALT
            if all(sk + g in idx for g in range(k)):
                usable = j
                break
        state_pages = ([idx[(keys[usable - 1] ^ _STATE_SALT) + g] for g in range(k)]
                       if usable else [])
        free_hits = sum(1 for b in hit_pages + state_pages if self.pool.ref_cnt[b] == 0)
        # KV pages of the prompt plus the working state's pages
        need_new = n_pages - kv_reach_pages + k
        if need_new > self.pool.num_free - free_hits:
            return None
        self.pool.acquire(hit_pages)
        states = []
        if state_pages:
            self.pool.acquire(state_pages)
            states += state_pages
            self.reads += 1
        kv_pages = hit_pages + self.pool.allocate(n_pages - kv_reach_pages)
        states += self.pool.allocate(k)
        self._pages[req.request_id] = (kv_pages, states)
        hit = usable * P
        req.hit_tokens = hit
        req.num_computed = hit
        req.blocks = kv_pages
        reusable_blocks = 0
        for h in req.block_hashes[:resume_cap_blocks(L, self.block_size, 1)]:
            if h not in self._seen:
                break
            reusable_blocks += 1
        # The emulation can only resume at page granularity: `wanted` is the
        # KV prefix at block granularity rounded down to a page.
        kv_reach_blocks = self._kv_prefix_blocks(req)
        reusable = max(reusable_blocks * self.block_size, kv_reach_blocks * self.block_size)
        kv_reach_tok = kv_reach_blocks * self.block_size
        wanted = min(kv_reach_pages * P, kv_reach_tok)
        self.stats.record_admission(L, reusable, kv_reach_tok, wanted, min(hit, wanted))
        return Admission(hit, reusable, kv_reach_tok, wanted, "chunk-end" if usable else None)

    def _kv_prefix_blocks(self, req) -> int:
        """KV prefix in blocks: pages are all-or-nothing, so whole pages."""
        n = 0
        idx = self.pool.hash_to_block
        for j in range(len(req.block_hashes) // self.sub):
            if self._kv_key(req, j) not in idx:
                break
            n += 1
        cap = resume_cap_blocks(req.prompt_len, self.block_size, 1)
        return min(n * self.sub, cap)

    def next_chunk(self, req, budget: int) -> int:
        P = self.page
        L = req.prompt_len
        start = req.num_computed
        end = start + budget
        if end >= L:
            tail = (L - 1) // P * P
            # the prompt tail's page boundary is a chunk end of its own
            end = tail if tail > start else L
        else:
            end = end // P * P
        return max(0, end - start)

    def prefill_done(self, req, n: int) -> None:
        if n == 0:
            return
        P = self.page
        start = req.num_computed
        end = start + n
        kv_pages, states = self._pages[req.request_id]
        for j in range(start // P, end // P):
            key = self._kv_key(req, j) if (j + 1) * self.sub <= len(req.block_hashes) else None
            if key is not None:
                parent = self._kv_key(req, j - 1) if j else 0
                self.pool.commit(kv_pages[j], key, parent, key)
                self._seen.update(req.block_hashes[j * self.sub:(j + 1) * self.sub])
        req.num_computed = end
        if end % P == 0 and end < req.prompt_len + 1 and (end // P) * self.sub <= len(req.block_hashes):
            skey = self._state_key(req, end // P - 1)
            k = self.pages_per_state
            if skey not in self.pool.hash_to_block and self.pool.num_free >= k:
                for g, page in enumerate(self.pool.allocate(k)):
                    self.pool.commit(page, skey + g, 0, skey + g)
                    self._state_keys[skey + g] = skey
                    states.append(page)
                self._live_states.add(skey)
                self.writes += 1
        if end == req.prompt_len:
            # blocks of a partial last page stay uncached, as in vLLM
            for h in req.block_hashes[(end // P) * self.sub:end // self.block_size]:
                self._seen.add(h)

    def append_tokens(self, req, n: int) -> bool:
        P = self.page
        new = req.num_tokens + n
        kv_pages, _ = self._pages[req.request_id]
        need = -(-new // P) - len(kv_pages)
        if need > 0:
            if need > self.pool.num_free:
                return False
            kv_pages.extend(self.pool.allocate(need))
        req.num_tokens = new
        req.num_computed = new
        return True

    def finish(self, req) -> None:
        kv_pages, states = self._pages.pop(req.request_id)
        self.pool.release(reversed(kv_pages))
        self.pool.release(reversed(states))
        req.blocks = []

    def preempt(self, req) -> None:
        self.finish(req)
        req.rewind_to_prompt(self.block_size)

    def fates(self) -> dict:
        return dict(kept=self.writes, dropped=0, evicted=self.evicted_states, orphaned=0,
                    read=self.reads)
