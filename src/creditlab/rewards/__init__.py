"""Rewards built on judges: FORK (F-beta of rubric recall and unit precision)."""

from creditlab.rewards.fork import ForkResult, FORKReward
from creditlab.rewards.items import ForkItem, Rubric, iter_jsonl_items, parse_item

__all__ = ["FORKReward", "ForkItem", "ForkResult", "Rubric", "iter_jsonl_items", "parse_item"]
