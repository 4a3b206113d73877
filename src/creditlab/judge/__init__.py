"""FORK judges: the `Judge` protocol, an OpenAI-compatible HTTP judge, an offline embedding judge.

``creditlab.judge.testing`` holds a loopback chat-completions server used by the tests and the
benchmark in place of a remote model.
"""

from creditlab.judge.base import STAGES, Judge, JudgeError, Usage, current_usage, track_usage
from creditlab.judge.cache import JudgeCache, cache_key
from creditlab.judge.offline import EmbeddingJudge, split_units
from creditlab.judge.openai_compat import OpenAIJudge

__all__ = [
    "STAGES",
    "EmbeddingJudge",
    "Judge",
    "JudgeCache",
    "JudgeError",
    "OpenAIJudge",
    "Usage",
    "cache_key",
    "current_usage",
    "split_units",
    "track_usage",
]
