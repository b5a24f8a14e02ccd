"""Training prompts draftline writes itself, for a real target to answer (`data.prompt_source`, then regenerate).

A drafter learns what its target says; what it is asked decides which of those replies it sees. The prompts here
cover the kinds of request a chat benchmark asks (writing, roleplay, reasoning, maths, coding, extraction, science,
humanities) without any benchmark's text: templates over word lists written for this module, arithmetic with
seeded numbers, and Python's standard library (every machine has it) as the source of coding tasks and of passages to
summarise or extract from. A share of the prompts get a generic second turn, so the drafter also sees a reply
conditioned on its own earlier answer. Deterministic from (count, seed); ids are stable, so regenerate.limit and the
splits take the same prompts on every machine. prepare checks every split against the held-out benchmarks
(draftline.data.contamination).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable

from draftline.target.corpus import DocPair, stdlib_doc_pairs
from draftline.utils import atomic_write_text, stable_hash

TOPICS = (
    "urban gardening", "the history of the bicycle", "deep-sea fishing", "volcanoes", "learning a second language",
    "remote work", "coral reefs", "the printing press", "electric cars", "public libraries", "chess openings",
    "sourdough bread", "night trains", "honeybees", "solar panels", "street food", "the Roman aqueducts", "jazz",
    "lighthouses", "recycling plastics", "mountain hiking", "board games", "the water cycle", "origami",
    "space telescopes", "ancient Egypt", "first aid", "birdwatching", "composting", "the Silk Road", "tea ceremonies",
    "video game design", "glaciers", "personal budgeting", "the metric system", "wind turbines", "public speaking",
    "desert ecosystems", "the invention of paper", "marathon training", "woodworking", "rainforests",
    "the stock market", "photography", "the human heart", "time management", "antique maps", "bridges",
    "vaccines", "renewable energy", "small businesses", "folk music", "the moon landing", "cybersecurity",
    "minimalism", "earthquakes", "pottery", "weather forecasting", "the Renaissance", "sleep", "farmers markets",
    "submarines", "quantum computers", "knitting", "city parks", "the Olympic games", "migratory birds",
    "3D printing", "volunteering", "ocean tides", "the telephone", "camping", "museums", "food waste", "robots",
    "the immune system", "cartoons", "railways", "spices", "meditation", "climate change", "castles", "penguins",
    "open-source software", "the piano", "wildfires", "carpooling", "fossils", "podcasts", "the alphabet",
    "mushrooms", "air travel", "coffee", "scarecrows", "the Great Wall", "kites", "snow", "typewriters",
)
PEOPLE = (
    "a ship's captain", "a medieval blacksmith", "a museum guide", "a detective", "a chef", "a park ranger",
    "a history teacher", "a travel agent", "a librarian", "a personal trainer", "an astronaut", "a gardener",
    "a news reporter", "a tailor", "a street musician", "a lighthouse keeper", "a pirate", "a wizard",
    "a customer support agent", "a tour guide in Rome", "a science fair judge", "a retired pilot", "a baker",
    "a zookeeper", "a career coach", "a mountain guide", "a sports commentator", "a poet", "a robot butler",
)
SITUATIONS = (
    "a visitor asks for directions", "someone wants advice on a hobby", "a customer complains politely",
    "a child asks why the sky is blue", "a friend is nervous before an exam", "a stranger asks for a recommendation",
    "a colleague wants feedback", "a tourist has lost their passport", "someone asks about your daily routine",
    "a student asks how to get started", "a neighbour asks for help moving", "a fan asks for your best story",
)
WRITING = (
    "Write a short story about {topic}.", "Write a poem about {topic}.", "Write a persuasive paragraph about {topic}.",
    "Write a blog post introduction about {topic}.", "Write a product description for something related to {topic}.",
    "Write a friendly email inviting a friend to a talk on {topic}.", "Write a haiku about {topic}.",
    "Write a short speech for a school assembly about {topic}.", "Write a diary entry from someone who loves {topic}.",
    "Write a limerick about {topic}.", "Write an advertisement slogan and a short pitch for {topic}.",
    "Write a letter to the editor about {topic}.", "Write a two-paragraph essay on {topic}.",
    "Write a social media post about {topic}.", "Write the opening scene of a play about {topic}.",
)
EXPLAIN = (
    "Explain {topic} to a ten-year-old.", "What are the main benefits and drawbacks of {topic}?",
    "Give three interesting facts about {topic}.", "How would you introduce a beginner to {topic}?",
    "Summarize the most important ideas about {topic} in a few sentences.", "What are common misconceptions about {topic}?",
    "Why does {topic} matter today?", "Describe how {topic} has changed over time.",
    "List five questions a curious person might ask about {topic}, with short answers.",
    "Compare {topic} with {other}.", "What could the future of {topic} look like?",
    "Give practical tips for someone interested in {topic}.",
)
ROLEPLAY = (
    "Pretend you are {person}. {situation_cap}. Respond in character.",
    "You are {person}. Describe your work to someone who has never heard of it.",
    "Act as {person} and give advice about {topic}.",
    "Imagine you are {person} and {situation}. What do you say?",
)
FOLLOW_UPS = (
    "Can you make that shorter?", "Please explain your answer in more detail.", "Give me an example.",
    "Now rewrite it in a more formal tone.", "Summarize that in one sentence.", "What is the most important point?",
    "Can you turn that into a bulleted list?", "Make it funnier.", "How would you explain that to a beginner?",
    "What would you add if you had more space?", "Now say the same thing for an expert audience.",
)
NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jade", "Kofi", "Lena", "Mateo",
         "Nia", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tove")
ITEMS = ("apples", "pencils", "marbles", "books", "stickers", "cookies", "stamps", "shells", "coins", "cards")


def _writing(rng: random.Random, pairs: list[DocPair]) -> str:
    return rng.choice(WRITING).format(topic=rng.choice(TOPICS))


def _explain(rng: random.Random, pairs: list[DocPair]) -> str:
    topic, other = rng.sample(TOPICS, 2)
    return rng.choice(EXPLAIN).format(topic=topic, other=other)


def _roleplay(rng: random.Random, pairs: list[DocPair]) -> str:
    situation = rng.choice(SITUATIONS)
    return rng.choice(ROLEPLAY).format(person=rng.choice(PEOPLE), situation=situation, topic=rng.choice(TOPICS),
                                       situation_cap=situation[0].upper() + situation[1:])


def _arithmetic(rng: random.Random, pairs: list[DocPair]) -> str:
    a, b = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    x, y, z = rng.randint(3, 60), rng.randint(2, 25), rng.randint(2, 9)
    return rng.choice((
        f"{a} has {x} {item} and gives {y} to {b}. Then {a} buys {z} times as many as are left. How many {item} "
        f"does {a} have now? Show your steps.",
        f"A box holds {z} {item}. How many boxes are needed for {x * z + y} {item}?",
        f"What is {x} multiplied by {y}, minus {z}?", f"Solve for n: {z}n + {y} = {z * x + y}.",
        f"A shop sells {item} at {y} dollars each with a {z * 5}% discount. What do {x} {item} cost?",
        f"The sides of a rectangle are {x} cm and {y} cm. What are its area and its perimeter?",
    ))


def _reasoning(rng: random.Random, pairs: list[DocPair]) -> str:
    a, b, c = rng.sample(NAMES, 3)
    item = rng.choice(ITEMS)
    return rng.choice((
        f"{a} is taller than {b}, and {b} is taller than {c}. Who is the shortest? Explain.",
        f"If every {item[:-1]} in the box is red and this {item[:-1]} is from the box, what colour is it? Why?",
        f"{a} arrived before {b} but after {c}. Who arrived first?",
        f"There are three doors; behind one is a prize. {a} picks one. Explain a fair way to decide who goes next.",
        f"{a} says '{b} is lying'. {b} says '{c} is lying'. {c} says 'both of them are lying'. Who tells the truth?",
    ))


def _coding(rng: random.Random, pairs: list[DocPair]) -> str:
    pair = rng.choice(pairs)
    spec = pair.answer.split(". ")[0].rstrip(".")
    name = pair.key.split(".")[-2]
    return rng.choice((
        f"Write a Python function `{name}` that does the following: {spec}.",
        f"{pair.prompt} Give a short usage example.",
        f"Explain this Python docstring in plain words and say when you would use the function: \"{spec}.\"",
        f"Write a unit test for a Python function described as: {spec}.",
    ))


def _extraction(rng: random.Random, pairs: list[DocPair]) -> str:
    passage = rng.choice(pairs).answer
    return rng.choice((
        f"Summarize the following text in one sentence:\n{passage}",
        f"List the key terms in this text as a JSON array:\n{passage}",
        f"Extract the main action described in this text, and what it acts on:\n{passage}",
        f"Rewrite this text so a non-programmer can follow it:\n{passage}",
    ))


# (category, share of the prompts, maker)
CATEGORIES: tuple[tuple[str, float, Callable[[random.Random, list[DocPair]], str]], ...] = (
    ("writing", 0.16, _writing), ("knowledge", 0.2, _explain), ("roleplay", 0.12, _roleplay),
    ("math", 0.12, _arithmetic), ("reasoning", 0.08, _reasoning), ("coding", 0.18, _coding),
    ("extraction", 0.14, _extraction),
)


def prompt_records(count: int, seed: int, second_turn_fraction: float, corpus_max_bytes: int = 3_000_000) -> list[dict]:
    """`count` distinct prompt records ({"id", "category", "turns"}), the same for the same arguments."""
    pairs = stdlib_doc_pairs(corpus_max_bytes)
    rng = random.Random(stable_hash("prompt-source", seed))
    weights = [share for _, share, _ in CATEGORIES]
    records: list[dict] = []
    seen: set[str] = set()
    attempts = 0
    while len(records) < count:
        attempts += 1
        if attempts > 50 * count:
            raise ValueError(f"data.prompt_source.count={count} is more distinct prompts than the templates make; "
                             f"lower it (about {len(records)} were found)")
        category, _, make = rng.choices(CATEGORIES, weights)[0]
        first = make(rng, pairs)
        if first in seen:
            continue
        seen.add(first)
        turns = [first]
        if rng.random() < second_turn_fraction:
            turns.append(rng.choice(FOLLOW_UPS))
        records.append({"id": f"{category}-{stable_hash(first)[:12]}", "category": category, "turns": turns})
    return records


def write_prompt_source(path: Path, count: int, seed: int, second_turn_fraction: float) -> Path:
    """Write the prompts as jsonl (data.format `prompts`) unless that file is already there."""
    if not path.exists():
        records = prompt_records(count, seed, second_turn_fraction)
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))
    return path
