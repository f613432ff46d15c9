"""Worker (ReplaySSM with prefix caching): vLLM's page moves in align mode,
for runners whose state groups are ReplaySSM pages.

In align mode vLLM keeps a request's running state in the page of its
current block and, under speculative decoding, moves it by the accepted
count: before a step it copies "the state of token a - 1" (page column
+ a - 1, and the conv buffer shifted by a - 1) into the new block's page,
and after a step its fused kernels copy the state of the token that ended a
block into that block's page. Both read speculative pages a ReplaySSM
request does not have, and the fused kernels are Triton, which vLLM's CPU
build cannot run.

A ReplaySSM page needs none of it: its records carry absolute positions,
so a page copied whole is still right, and the scheduler ends every verify
window at a page boundary (`scheduler`), so the page of a full block was
last written by the window that ended there and holds its state. Three
runner methods therefore take another path where the runner's groups are
ReplaySSM pages, and vLLM's everywhere else:

- `_get_mamba_state_copy_funcs`: every state tensor copied whole;
- `_get_mamba_bufs`: no fused post-step kernels;
- `_update_states_after_model_execute`: the accepted counts only (vLLM's
  path without align mode).

vLLM chooses these from the model runner's own methods, with no registry,
so they are patched (`registration.PATCHES`); the names are in
`private_api`.
"""

from __future__ import annotations

import functools

from vllm.model_executor.layers.mamba.mamba_utils import MambaCopySpec

from .spec import AtomReplaySSMSpec


def whole_page_copy(state, block_ids, cur_block_idx: int, num_accepted_tokens: int):
    """vLLM's copy-function signature: the whole page of the running block
    (the accepted count is in the page's records, not in which slice)."""
    src = state[block_ids[cur_block_idx]]
    return MambaCopySpec(start_addr=src.data_ptr(), num_elements=src.numel())


def replayssm_groups(kv_cache_config) -> list:
    from vllm.v1.worker import mamba_utils
    return [s for s in mamba_utils.get_mamba_groups(kv_cache_config)
            if isinstance(s, AtomReplaySSMSpec)]


def runs_replayssm(runner) -> bool:
    """Asked twice a step: the answer is kept on the runner once its KV
    cache config exists (it does not change afterwards)."""
    known = runner.__dict__.get("atom_runs_replayssm")
    if known is not None:
        return known
    config = getattr(runner, "kv_cache_config", None)
    if config is None:
        return False
    runner.atom_runs_replayssm = (runner.cache_config.mamba_cache_mode == "align"
                                  and bool(replayssm_groups(config)))
    return runner.atom_runs_replayssm


# vLLM's names, read and set with getattr / setattr (listed in private_api)
COPY_FUNCS, BUFS, AFTER_STEP = ("_get_mamba_state_copy_funcs", "_get_mamba_bufs",
                                "_update_states_after_model_execute")


@functools.cache
def patch_model_runner() -> None:
    """Idempotent; each patched method calls vLLM's where the runner's
    state groups are not ReplaySSM pages."""
    from vllm.v1.worker import mamba_utils
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    vllm_copy_funcs = getattr(GPUModelRunner, "_get_mamba_state_copy_funcs")
    vllm_bufs = getattr(GPUModelRunner, "_get_mamba_bufs")
    vllm_after_step = getattr(GPUModelRunner, "_update_states_after_model_execute")

    def copy_funcs(self):
        if not runs_replayssm(self):
            return vllm_copy_funcs(self)
        if getattr(self, "_mamba_state_copy_funcs") is None:
            setattr(self, "_mamba_state_copy_funcs", {
                spec.mamba_type: (whole_page_copy,) * len(spec.shapes)
                for spec in replayssm_groups(self.kv_cache_config)})
        return getattr(self, "_mamba_state_copy_funcs")

    def mamba_bufs(self):
        if not runs_replayssm(self):
            return vllm_bufs(self)
        if getattr(self, "_mamba_bufs") is None:
            setattr(self, "_mamba_bufs", mamba_utils.MambaBuffers.create(
                max_num_reqs=self.max_num_reqs, kv_cache_config=self.kv_cache_config,
                copy_funcs=copy_funcs(self), make_buffer=getattr(self, "_make_buffer"),
                device=self.device, with_postprocess_align=False))
        return getattr(self, "_mamba_bufs")

    def after_step(self, output_token_ids, scheduler_output):
        if not (self.speculative_config and runs_replayssm(self)):
            return vllm_after_step(self, output_token_ids, scheduler_output)
        num_reqs = output_token_ids.size(0)
        # accepted tokens are contiguous from 0: count the non-rejected
        self.num_accepted_tokens.gpu[:num_reqs] = (output_token_ids != -1).sum(dim=1)
        self.input_batch.num_accepted_tokens_cpu_tensor[:num_reqs].copy_(
            self.num_accepted_tokens.gpu[:num_reqs], non_blocking=True)
        self.num_accepted_tokens_event.record()

    for name, method, vllm_method in ((COPY_FUNCS, copy_funcs, vllm_copy_funcs),
                                      (BUFS, mamba_bufs, vllm_bufs),
                                      (AFTER_STEP, after_step, vllm_after_step)):
        method.__wrapped__ = vllm_method
        setattr(GPUModelRunner, name, method)
