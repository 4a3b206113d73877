"""The ``--reward.remote_url`` file of the OpenRLHF recipe: FORK as OpenRLHF's ``reward_func(queries, prompts,
labels)``. OpenRLHF loads this file in its vLLM engine actors and passes no options to the function, so the
judge is read from the environment the run script gives those actors (``JUDGE_URL``, ``JUDGE_MODEL``). The
rubrics are each sample's label (``--data.label_key rubrics``: a list of ``{"criterion", "points"}``)."""

import os

from creditlab.integrations.openrlhf import fork_reward

reward_func = fork_reward("openai", base_url=os.environ.get("JUDGE_URL", "http://localhost:8000/v1"),
                          model=os.environ.get("JUDGE_MODEL", "Qwen/Qwen2.5-72B-Instruct"))
