"""Prompts for the benchmarks, generated here from topics and instruction forms (no data set is
downloaded): varied, deterministic, and as many as a benchmark asks for."""

from __future__ import annotations

TOPICS = [
    "the history of the printing press", "how volcanoes form", "a recipe for bread",
    "the rules of chess", "why leaves change colour", "the life of honeybees",
    "how a bicycle works", "the water cycle", "the invention of the telephone",
    "a journey across the desert", "the planets of the solar system", "how to learn a language",
    "the causes of tides", "a day in a busy harbour", "the structure of a cell",
    "the first flight", "how glass is made", "the music of the baroque era",
    "a lighthouse keeper's routine", "how rainbows appear", "the ancient city of Rome",
    "the migration of birds", "how computers store numbers", "a winter in the mountains",
    "the discovery of penicillin", "how bridges carry weight", "the deep ocean",
    "a market in the morning", "the speed of light", "how tea is grown",
    "the northern lights", "an old library at night",
]  # fmt: skip

FORMS = [
    "Write a detailed essay about {}.",
    "Explain {} to a ten-year-old.",
    "Write a short story involving {}.",
    "List five surprising facts about {}.",
    "Write a poem about {}.",
    "Describe {} in the style of a travel guide.",
    "What are the most common misconceptions about {}?",
]


def instructions(n: int) -> list[str]:
    """``n`` distinct instructions (topic-major, then form), cycling if more are asked for."""
    pairs = [(form, topic) for form in FORMS for topic in TOPICS]
    return [pairs[i % len(pairs)][0].format(pairs[i % len(pairs)][1]) for i in range(n)]
