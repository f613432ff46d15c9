"""A speculative proposer for tests (vLLM's `custom_class` method): it
drafts the reference continuation of each request, with planted errors,
so a test sees full accepts and rejections at known rates.

Why: the tiny random model never repeats itself, so vLLM's n-gram proposer
drafts nothing on it (measured: 0 drafts in 240 verify steps), and the
verify paths a rejected draft takes would go untested.

The references come from `ORACLE_FILE` (JSON: a list of full token
sequences, prompt + greedy continuation), written by the test before the
engine starts. A request is matched to the reference that starts with its
tokens. At position L (tokens so far) the draft is ref[L:L + k], with draft
j = L % k replaced by a wrong token when L % 3 == 0: about two windows in
three are right, the others are rejected at a varying depth.
"""

from __future__ import annotations

import json
import os

ORACLE_FILE = "ATOMHC_TEST_ORACLE_DRAFTS"
WRONG_TOKEN = 3


class OracleDrafter:
    def __init__(self, vllm_config) -> None:
        self.k = vllm_config.speculative_config.num_speculative_tokens
        with open(os.environ[ORACLE_FILE]) as f:
            self.references = [list(r) for r in json.load(f)]

    def _reference(self, tokens: list) -> list:
        for ref in self.references:
            if len(ref) > len(tokens) and ref[:len(tokens)] == tokens:
                return ref
        return []

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        drafts = []
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:
                drafts.append([])
                continue
            n = int(num_tokens_no_spec[i])
            ref = self._reference(token_ids_cpu[i, :n].tolist())
            draft = ref[n:n + self.k]
            if draft and n % 3 == 0:
                j = n % len(draft)
                draft[j] = WRONG_TOKEN if draft[j] != WRONG_TOKEN else WRONG_TOKEN + 1
            drafts.append(draft)
        return drafts

    def load_model(self, *args, **kwargs) -> None:
        pass
