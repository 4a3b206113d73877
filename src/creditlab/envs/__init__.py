"""Worlds with known answers, vectorised over a batch, where each silent failure can be measured.

* ``creditlab.envs.chain``: the hard-prerequisite chain (``T`` steps, ``C`` causal ones), the
  smallest world where the shape of credit matters (the coverage lab).
* ``creditlab.envs.toolshop``: a multi-turn tool-use world with a relational store, a terminal
  state verifier and a scripted agent (the toolshop, mismatch and granularity labs).
* ``creditlab.envs.bagofunits``: the bag-of-units world of FORK, responses as sets of units with
  known truth (the fork lab).

Layer: imports ``core`` only; no trainer, no lab.
"""
