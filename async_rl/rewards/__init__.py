"""Rewards: reward functions by name, called in their style (the library's, TRL's or
verl's), run in worker processes under a hard timeout."""

from async_rl.rewards.adapters import Reward, Row, style_of
from async_rl.rewards.code_tests import code_tests_all_reward, code_tests_reward
from async_rl.rewards.registry import REWARD_FNS, RewardFn, resolve_reward_fn
from async_rl.rewards.sandbox import Isolation, SandboxResult, isolation, run_sandboxed
from async_rl.rewards.service import RewardService, RewardTask

__all__ = [
    "REWARD_FNS",
    "Isolation",
    "Reward",
    "RewardFn",
    "RewardService",
    "RewardTask",
    "Row",
    "SandboxResult",
    "code_tests_all_reward",
    "code_tests_reward",
    "isolation",
    "resolve_reward_fn",
    "run_sandboxed",
    "style_of",
]
