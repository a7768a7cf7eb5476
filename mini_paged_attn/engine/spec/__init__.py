"""Speculative decoding: proposals (prompt lookup or a draft model) verified by the target
model in one forward, exact outputs. The configuration (``config.py``), which requests
speculate and the counters (``speculator.py``), the draft model's own runner and KV blocks
(``draft.py``), the verification's accept / resample rule (``verify.py``); the steps that
carry proposals are the scheduler's (``core/scheduler.py``). See docs/architecture.md,
"Speculative decoding".
"""
