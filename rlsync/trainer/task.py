"""The built-in task: generated prompts with a verifiable reward that gives partial credit.

Each prompt asks the model to echo a short random word. The reward is the longest common
subsequence of the word and the answer, over the word's length: a random model scores 0 on most
answers and 0.2-0.4 on some, so a group's rewards differ and GRPO advantages are not all zero.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    text: str
    target: str


def make_prompts(n: int, *, rng: random.Random, word_len: int = 5) -> list[Prompt]:
    prompts = []
    for _ in range(n):
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(word_len))
        prompts.append(Prompt(text=f"Repeat after me: {word}\nAnswer: ", target=word))
    return prompts


def reward(answer: str, target: str) -> float:
    """LCS(answer, target) / len(target): 1.0 for an exact echo, partial credit for pieces of it."""
    return longest_common_subsequence(answer, target) / len(target)


def longest_common_subsequence(a: str, b: str) -> int:
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0]
        for j, cb in enumerate(b):
            cur.append(prev[j] + 1 if ca == cb else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]
