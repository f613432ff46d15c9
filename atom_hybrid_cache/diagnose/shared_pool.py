"""The verdict on the vLLM plugin's lines: states are pages of vLLM's one pool.

There is no state pool to grow apart: a state and its KV share the pool's
pages and leave it in units. So the question is what the lost tokens lacked.
``lost_unrecoverable`` tokens had their KV prefix cut from the pool before
the next turn came back (memory is short, or admission let new prefills
evict it); ``lost_to_checkpoint`` tokens still had their KV, but no state
where they could resume (a state never placed there, or taken first).
"""

from __future__ import annotations

from .log_lines import TAG_GATE, TAG_POOLS, TAG_SHARED, TAG_STATS
from .verdict import Diagnosis, count, detail_lines, hit_lines

# Both factors at least this: nothing worth acting on.
NO_PRESSURE = 0.999


def diagnose_shared_pool(s: dict) -> Diagnosis:
    stats, pools, shared = s[TAG_STATS], s[TAG_POOLS], s[TAG_SHARED]
    paged_hit, state_hit = float(pools["paged_hit"]), float(pools["state_hit"])
    lost_ckpt, lost_kv = stats["lost_to_checkpoint"], stats["lost_unrecoverable"]
    lines, ceiling = hit_lines(s)
    lines.append(
        f"shared pool at the last report: {count(shared['pages'])} pages, "
        f"{count(shared['used'])} used, {count(shared['free'])} free"
        + (f"; {count(shared['states_written'])} states written, "
           f"{count(shared['states_read'])} resumes read one"
           if "states_written" in shared and "states_read" in shared else ""))
    gate = s.get(TAG_GATE)
    if stats["reusable"] == 0 or (paged_hit >= NO_PRESSURE and state_hit >= NO_PRESSURE):
        binds = "neither"
        lines.append("binds: neither - the pool keeps what is reused at this load")
    elif lost_ckpt > lost_kv:
        binds = "state"
        lines.append(
            "binds: state - KV prefixes were held with no state at their end; in vLLM's one "
            "pool a state leaves with its KV, so these states were never placed there or were "
            "taken first: keep the cold checkpoints and floor states on (ATOM_STATE_CHECKPOINT_COLD, "
            "ATOM_STATE_CHECKPOINT_FLOOR; where a request slot's share of the pool is under 32 "
            "checkpoints' worth the server goes without them), or add states inside long prompts (ATOM_STATE_CHECKPOINT_SPAN=0.5,0.875)")
    else:
        binds = "kv"
        lines.append(
            "binds: kv - the pool cut prefixes before their next turn came back; more KV cache "
            "memory is the lever (a larger --gpu-memory-utilization, a smaller --max-model-len "
            "or --max-num-seqs)"
            + ("" if gate is not None else
               ", and the admission gate, off here (ATOM_ADMISSION_GATE=on forces it)"))
    if gate is not None:
        lines.append(f"the admission gate held {count(gate.get('holds', 0))} waiting requests "
                     f"over {count(gate.get('held_steps', 0))} steps (longest hold "
                     f"{count(gate.get('longest_hold', 0))} steps)")
    lines += detail_lines(s)
    return Diagnosis(binds, ceiling, None, lines, s, "plugin")
