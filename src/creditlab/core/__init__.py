"""Pure tensor functions: no I/O, no config objects, no globals.

Advantages and PRM mixing (``advantages``), credit geometries (``credit``), execution-mismatch
correction and InterQ-RL (``correction``), policy and distillation losses (``losses``), the FORK math
(``precision``), credit diagnostics and learning-curve fingerprints (``diagnostics``), segments of
policy tokens (``masks``) and schedules (``schedules``). Every other layer stands on this one; it
imports nothing of creditlab but ``errors``.

Shapes: ``B`` trajectories, ``G`` group size, ``L`` tokens, ``S`` segments, ``T`` steps/turns.
"""
