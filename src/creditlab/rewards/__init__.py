"""Rewards: FORK (F-beta of rubric recall and unit precision) driven by a judge, and process rewards.

``creditlab.rewards.fork`` runs a judge over responses and applies the FORK math of
``creditlab.core.precision``; ``creditlab.rewards.items`` parses its input records;
``creditlab.rewards.process`` scores the turns of tool-use trajectories apart from the outcome
verifier.
"""

from creditlab.rewards.fork import ForkResult, FORKReward
from creditlab.rewards.items import ForkItem, Rubric, iter_jsonl_items, parse_item

__all__ = ["FORKReward", "ForkItem", "ForkResult", "Rubric", "iter_jsonl_items", "parse_item"]
