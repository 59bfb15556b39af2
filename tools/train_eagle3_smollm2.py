# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Train the bundled EAGLE3 head for SmolLM2-135M-Instruct by self-distillation.

Stages (each resumable; outputs under --work-dir):
  prompts   varied chat prompts from templates x fillers; fillers of the held-out prompts never
            appear in a training prompt (heldout_prompts.json is shipped with the head)
  generate  SmolLM2's own greedy answers (this engine, batched, fp32)
  features  one HF transformers forward per sequence (batched, right-padded): the aux taps and
            the final hidden state (after the model's norm, what its LM head reads), as fp16
  heldout   the same two for the held-out prompts: train measures its TTT steps' top-1
            agreement with the target there (about the acceptance rate per draft position)
  train     EAGLE3 with training-time test: TTT_STEPS unrolled draft steps, each feeding back
            the draft's own hidden state, loss = KL to the target's distribution over the draft
            vocabulary (the most frequent answer tokens), checkpointed periodically
  export    the speculators format (config.json with speculators_model_type "eagle3",
            model.safetensors in bf16 with d2t / t2d; no embedding: the target's is shared)
  eval      the exported head's acceptance on the held-out prompts, K = 1..4 (greedy, or
            sampled with --temperature)
  plot      the run's training curve (held-out and training agreement per draft step)

    python tools/train_eagle3_smollm2.py all [--work-dir DIR] [--out vllm/model_zoo/...]
        [--num-chunks N] [--first-chunk F] [--sample-share S] [--epochs E]
        [--init HEAD_DIR] [--lr LR] [--threads N] [--layers L]

--first-chunk F --num-chunks N: generate / featurize / train on chunks F .. F + N - 1 (a run
continued with --init on chunks the first runs never saw); --sample-share S: that share of
the answers sampled at SAMPLE_TEMPERATURE (seeded) instead of greedy; --layers L: a head of L
decoder layers (EAGLE3's first layer, then plain Llama layers; --init from a shallower head
starts the extra layers afresh).

The shipped head is three runs (all in its model card, vllm/model_zoo/smollm2-135m-eagle3):
the defaults (seed SEED, NUM_CHUNKS, EPOCHS, lr 1e-3) are the first; the second continues from
it (--init) on 20 chunks, 10 epochs, lr 6e-4; the third from the second on chunks 20-81
(--first-chunk 20 --num-chunks 62, answers generated with --sample-share 0.5), 3 epochs,
lr 6e-4.

Tap convention (as vLLM and speculators): layer id L is the residual stream entering target
decoder layer L, which is HF's `output_hidden_states[L]` for L < num_hidden_layers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SEED = 1234
AUX_LAYERS = (2, 15, 27)
DRAFT_VOCAB = 8192
TTT_STEPS = 3
# Share of the positions at which the later TTT steps are trained (each step is a full layer
# forward + backward; step 0 runs everywhere).
LATER_STEP_FRACTION = 0.35
MAX_ANSWER_TOKENS = 128
# generate --sample-share S: that share of the prompts answered by sampling at this temperature
SAMPLE_TEMPERATURE = 0.7
CHUNK = 128  # prompts per generate / features file
FEATURE_BATCH = 16  # sequences per HF forward in `features`
HELDOUT_EVERY = 100  # train: held-out agreement every this many steps (when feat_heldout/ exists)
# The shipped head's first run: the first NUM_CHUNKS chunks of the (seeded, shuffled) training
# prompts, EPOCHS epochs (its second run: --num-chunks 20 --epochs 10 --lr 6e-4 --init FIRST).
# A chunk costs ~40 s of generation and ~45 s of features on a quiet 2-core AVX512-BF16 EPYC;
# on a 2-core AVX2-only one ~180 s and ~150 s with the two stages side by side, each on one
# core (OMP_NUM_THREADS=1 taskset -c 0 ... generate, taskset -c 1 ... features --follow: two
# processes of two threads each took up to 460 s per generate chunk, not measured quietly). A
# training step (2048 tokens, one layer, 2 threads) ~2.5 s there: 82 chunks are ~780 steps per
# epoch (the shipped run: 191 over 20 chunks). On the AVX512-BF16 one, four one-thread
# processes (two `generate` and two `features --follow` over disjoint --first-chunk ranges)
# did the 62 chunks after the first 20 in 76 min; a two-layer step took ~1.5 s (577 per epoch).
NUM_CHUNKS = 5
EPOCHS = 5.0
DEFAULT_OUT = ROOT / "vllm" / "model_zoo" / "smollm2-135m-eagle3"

# ---------------------------------------------------------------------------- prompts

TOPICS = """photosynthesis; black holes; the water cycle; volcanoes; the French Revolution;
the Roman Empire; machine learning; the internet; climate change; the human heart; DNA;
plate tectonics; the solar system; electricity; magnetism; gravity; the immune system;
vaccines; renewable energy; solar panels; wind turbines; nuclear power; the stock market;
inflation; democracy; the printing press; the industrial revolution; ancient Egypt; the Moon;
Mars; rainbows; earthquakes; coral reefs; rainforests; deserts; glaciers; honey bees;
dinosaurs; evolution; the periodic table; atoms; chemical reactions; acids and bases;
sound waves; light; lasers; computers; smartphones; social media; cybersecurity; passwords;
cloud computing; databases; programming languages; Python; algorithms; sorting; recursion;
the Great Wall of China; the pyramids; the Renaissance; Leonardo da Vinci; Shakespeare;
classical music; jazz; the guitar; painting; photography; chess; football; basketball;
the Olympic Games; marathon running; yoga; sleep; nutrition; vitamins; exercise; meditation;
stress; friendship; leadership; time management; public speaking; negotiation; budgeting;
saving money; credit cards; taxes; recycling; plastic pollution; oceans; whales; sharks;
penguins; elephants; cats; dogs; horses; birds migrating; butterflies; trees; mushrooms;
bread baking; coffee; tea; chocolate; cheese; pizza; rice; spices; the Silk Road;
the Vikings; World War I; the Cold War; the space race; the International Space Station;
satellites; GPS; maps; weather forecasting; hurricanes; tornadoes; clouds; snow; the seasons;
time zones; calendars; clocks; money; banks; trade; languages; writing systems; libraries;
museums; universities; the scientific method; statistics; probability; geometry; fractions;
prime numbers; the number zero; infinity; bridges; skyscrapers; trains; airplanes; cars;
electric cars; bicycles; ships; rockets; robots; artificial intelligence; virtual reality;
3D printing; batteries; semiconductors; the human brain; memory; emotions; habits;
gardening; composting; volcanic islands; the Amazon river; the Sahara; Mount Everest;
the Arctic; Antarctica; the Pacific Ocean; Japan; India; Brazil; Canada; Australia; Kenya"""

TOPIC_TEMPLATES = (
    "Explain {t} in simple terms.",
    "What is {t}?",
    "Why is {t} important?",
    "Give me three interesting facts about {t}.",
    "Write a short paragraph about {t}.",
    "How does {t} work?",
    "What are the pros and cons of {t}?",
    "Summarize the history of {t}.",
    "Describe {t} to a ten-year-old.",
    "List five key terms related to {t} and define each.",
    "What is a common misconception about {t}?",
    "Write a short quiz with three questions about {t}.",
    "How would you teach {t} to a beginner?",
    "What would happen if {t} did not exist?",
)

CODE_TASKS = """adds two numbers; reverses a string; checks if a number is prime; computes the
factorial of n; returns the nth Fibonacci number; counts the vowels in a string; finds the
largest element of a list; removes duplicates from a list; checks if a word is a palindrome;
sorts a list of dictionaries by a key; merges two sorted lists; converts Celsius to
Fahrenheit; reads a text file and counts its lines; computes the average of a list; flattens a
nested list; returns the greatest common divisor of two numbers; capitalizes every word in a
sentence; checks whether two strings are anagrams; generates a random password; finds the
second largest number in a list; computes the sum of the digits of a number; converts a list
of strings to uppercase; returns the intersection of two lists; counts word frequencies in a
text; validates an email address; computes compound interest; implements binary search;
transposes a matrix; checks if a year is a leap year; finds the longest word in a sentence;
rotates a list by k positions; computes the median of a list; groups words by their first
letter; computes the power set of a list; parses a date string; squares every number in a
list"""

CODE_TEMPLATES = (
    "Write a Python function that {t}.",
    "Write a JavaScript function that {t}.",
    "How do I write a program that {t}? Show the code.",
    "Write a Python function that {t}, with a docstring and an example.",
)

THINGS = """the ocean; autumn leaves; a rainy day; the city at night; a cup of coffee; the moon;
a mountain lake; a lost key; an old bookshop; spring flowers; a train journey; the first snow;
a busy kitchen; a quiet library; a summer storm; a lighthouse; a morning run; a sleeping cat;
a birthday party; the desert wind; a garden in June; a school bus; a campfire; a violin;
a red balloon; fresh bread; a thunderstorm; a river at dawn; a windmill; a snowman"""

WRITING_TEMPLATES = (
    "Write a haiku about {t}.",
    "Write a short poem about {t}.",
    "Write a two-sentence story about {t}.",
    "Describe {t} using vivid details.",
    "Write a short diary entry about {t}.",
)

DISHES = """pancakes; tomato soup; fried rice; a green salad; banana bread; spaghetti
carbonara; guacamole; chocolate chip cookies; lemonade; vegetable curry; an omelette;
chicken noodle soup; hummus; apple pie; a smoothie; garlic bread; lentil soup; tacos;
mashed potatoes; pesto pasta"""

SKILLS = """writing; cooking; drawing; public speaking; math; chess; memory; focus; typing;
running; swimming; singing; coding; reading speed; handwriting; photography; gardening;
negotiation; listening; sleep"""

PLACES = """Paris; Tokyo; New York; London; Rome; a beach; the mountains; a rainforest; Iceland;
Egypt; a ski resort; a desert; Canada in winter; a small village; Barcelona; Sydney"""

MISC_TEMPLATES = (
    ("Give me a simple recipe for {t}.", "DISHES"),
    ("What ingredients do I need for {t}?", "DISHES"),
    ("How can I improve my {t}?", "SKILLS"),
    ("Give me a weekly plan to practice {t}.", "SKILLS"),
    ("What should I pack for a trip to {t}?", "PLACES"),
    ("Plan a three-day trip to {t}.", "PLACES"),
)


# The second head's extra data (extra_prompts()): more fillers, templates and kinds of request.
TOPICS_2 = """octopuses; wolves; ants; frogs; owls; dolphins; tigers; bats; spiders; snakes;
the Milky Way; comets; the Sun; eclipses; stars; telescopes; microscopes; bacteria; viruses;
cells; the skeleton; muscles; the lungs; digestion; blood; allergies; antibiotics; hospitals;
first aid; dentists; the ancient Greeks; the Maya; the Aztecs; the Middle Ages; castles; knights;
samurai; the Ottoman Empire; the American Revolution; the Moon landing; the steam engine; the
telephone; radio; television; the light bulb; electric motors; engines; tides; rivers; lakes;
caves; fossils; minerals; gold; diamonds; steel; glass; paper; cotton; wool; farming; wheat;
potatoes; apples; bananas; honey; salt; sugar; water purification; sewers; roads; tunnels;
dams; canals; ports; airports; elections; laws; courts; newspapers; advertising; marketing;
startups; small businesses; interviews; resumes; teamwork; remote work; email etiquette;
spreadsheets; word processors; operating systems; Linux; web browsers; HTML; CSS; JavaScript;
APIs; encryption; blockchain; open source software; version control; unit testing; debugging;
compilers; data structures; linked lists; hash tables; graphs; neural networks; chatbots;
search engines; video games; board games; puzzles; magic tricks; origami; knitting; pottery;
theater; ballet; opera; movies; animation; comic books; poetry; novels; fairy tales; myths;
philosophy; ethics; logic; psychology; economics; supply and demand; unemployment;
globalization; tourism; volunteering; kindness; gratitude; curiosity; creativity; motivation;
procrastination; goal setting; note taking; studying for exams; learning a language; grammar;
punctuation; vocabulary; handwriting; sign language; Braille; the metric system; temperature;
pressure; friction; energy; heat; steam; ice; lightning; fog; air pollution; forests; wetlands;
soil; seeds; flowers; cactuses; bamboo; the Nile; the Alps; the Himalayas; Iceland's volcanoes;
Mexico; Italy; Germany; China; Egypt's pyramids; Greece; Peru; South Africa; New Zealand;
Norway; Spain; the United Nations; the Red Cross; the Internet of Things; smart homes;
drones; self-driving cars; quantum computers; space telescopes; the Big Bang; dark matter"""

TOPIC_TEMPLATES_2 = (
    "Give me a step-by-step explanation of {t}.",
    "What are the main parts of {t}?",
    "Write a tweet about {t}.",
    "Create an outline for an essay on {t}.",
    "Explain {t} using an analogy.",
    "Tell me a fun fact about {t}.",
    "Write the opening paragraph of a blog post about {t}.",
    "What questions do people often ask about {t}? Answer two of them.",
    "Explain {t} in one sentence, then in one paragraph.",
    "What are the benefits of learning about {t}?",
)

CODE_TASKS_2 = """returns the minimum of three numbers; counts how many times a character appears
in a string; checks if a list is sorted; converts a binary string to an integer; converts an
integer to a Roman numeral; returns the last n elements of a list; removes whitespace from a
string; checks if a string contains only digits; splits a sentence into words; joins a list of
words with commas; finds the index of an element in a list; computes the area of a circle;
computes the distance between two points; returns the keys of a dictionary sorted by value;
counts the words in a file; checks if a number is a perfect square; returns all even numbers
from a list; generates the multiplication table of a number; simulates rolling a die; shuffles
a list; converts kilometers to miles; returns the first non-repeating character of a string;
implements a stack; implements a queue; checks balanced parentheses; computes the running sum
of a list; zips two lists into a dictionary; finds the mode of a list; converts a string to
title case; truncates a string to n characters"""

CODE_TEMPLATES_2 = (
    "Write a function in Python that {t}, and explain how it works.",
    "Write a short Python program that {t}, with comments.",
)

THINGS_2 = """a city park; a winter morning; an old clock; a summer festival; a sailboat; a quiet
beach; a forest path; a field of sunflowers; a night sky full of stars; a crowded market; a
paper airplane; a broken umbrella; a grandmother's kitchen; a puppy; a mountain village; the
last day of school; a football match; a rainy window; a hot air balloon; an empty street"""

DISHES_2 = """french toast; a fruit salad; pumpkin soup; grilled cheese; a vegetable stir-fry;
oatmeal; brownies; a tuna sandwich; roasted vegetables; potato salad; iced tea; popcorn"""

SKILLS_2 = """time management; patience; confidence; budgeting; problem solving; spelling;
drawing faces; juggling; cycling; meditation"""

PLACES_2 = """Berlin; Lisbon; Cairo; Seoul; a national park; a lake house; Mexico City; Prague;
a tropical island; Scotland"""

MISC_TEMPLATES_2 = (
    ("How long does it take to make {t}?", "DISHES"),
    ("Give me a healthier version of {t}.", "DISHES"),
    ("What are common mistakes when learning {t}?", "SKILLS"),
    ("Give me three tips for {t}.", "SKILLS"),
    ("What is the best time of year to visit {t}?", "PLACES"),
    ("Write a short travel guide for {t}.", "PLACES"),
)

SENTENCES = """the meeting was moved to friday because many people was sick; i think we should
go to the park tomorrow if it dont rain; Our company has grown a lot in the last five years; The
movie was long but the ending made it worth watching; Please send me the report as soon as you
can; The new phone is faster, lighter and cheaper than the old one; She runs every morning before
work; We are sorry for the delay in delivering your order; The cat sat on the warm windowsill
all afternoon; Learning a new language takes time and practice; The train was late, so I missed
the start of the concert; Our team finished the project two weeks early; Can you help me move
the table into the kitchen; The weather today is cold and windy; He forgot his umbrella and got
wet on the way home; Reading before bed helps me relax; The store will be closed on Monday for
repairs; I really enjoyed the book you gave me; Exercise is good for both the body and the mind;
The children built a sandcastle on the beach"""

REWRITE_TEMPLATES = (
    "Rewrite this sentence to sound more formal: {s}",
    "Fix the grammar and spelling in this sentence: {s}",
    "Make this sentence more polite: {s}",
    "Translate this sentence into French: {s}",
    "Rewrite this sentence for a child: {s}",
    "Turn this sentence into a question: {s}",
)

CATEGORIES = """fruits; vegetables; countries in Europe; programming languages; board games;
musical instruments; animals that live in the ocean; famous scientists; kitchen tools; sports;
colors; planets; jobs; hobbies; breakfast foods; things to do on a rainy day; ways to save
energy at home; healthy snacks; books for children; study tips"""

LIST_TEMPLATES = (
    "List ten {c}.",
    "Name five {c} and say one thing about each.",
    "Make a numbered list of {c}.",
)

WORDS = """serendipity; resilience; ephemeral; algorithm; democracy; empathy; metaphor;
photosynthesis; entropy; nostalgia; ambiguous; sustainable; hypothesis; curiosity; bandwidth"""

WORD_TEMPLATES = (
    "What does the word '{w}' mean? Use it in a sentence.",
    "Give me three synonyms for '{w}'.",
)

SNIPPETS = (
    "for i in range(5):\n    print(i * i)",
    "def f(xs):\n    return [x for x in xs if x % 2 == 0]",
    "s = 'hello'\nprint(s[::-1])",
    "total = 0\nfor n in [3, 5, 7]:\n    total += n\nprint(total)",
    "def greet(name):\n    return f'Hello, {name}!'",
    "import random\nprint(random.randint(1, 6))",
    "words = text.split()\nprint(len(words))",
    "d = {'a': 1, 'b': 2}\nfor k, v in d.items():\n    print(k, v)",
    "const add = (a, b) => a + b;\nconsole.log(add(2, 3));",
    "SELECT name FROM users WHERE age > 30 ORDER BY name;",
)

SNIPPET_TEMPLATES = (
    "Explain what this code does:\n{code}",
    "Is there a bug in this code? \n{code}",
)


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.replace("\n", " ").split(";") if x.strip()]


def _math_prompts(rng: random.Random, n: int) -> list[str]:
    forms = (
        "What is {a} plus {b}?",
        "What is {a} times {b}?",
        "If I have {a} apples and give away {b}, how many are left?",
        "A train travels {a} kilometers in {b} hours. What is its average speed?",
        "What is {a} percent of {b}?",
        "Is {a} an even or an odd number? Explain.",
    )
    return [rng.choice(forms).format(a=rng.randint(2, 99), b=rng.randint(2, 20)) for _ in range(n)]


def build_prompts(seed: int = SEED, num_heldout: int = 48) -> tuple[list[str], list[str]]:
    """(training prompts, held-out prompts): held-out fillers (topics, tasks, things, ...) and
    held-out math prompts never occur in a training prompt.

    The first part of the training list (and the whole held-out list) is the first head's set,
    unchanged; the extra prompts of `extra_prompts()` follow it."""
    train, heldout, held_fillers = _base_prompts(seed, num_heldout)
    extra = extra_prompts(seed, held_fillers, set(train) | set(heldout))
    return train + extra, heldout


def _base_prompts(seed: int, num_heldout: int) -> tuple[list[str], list[str], list[str]]:
    rng = random.Random(seed)
    pools = {
        "TOPICS": (_split(TOPICS), TOPIC_TEMPLATES),
        "CODE": (_split(CODE_TASKS), CODE_TEMPLATES),
        "THINGS": (_split(THINGS), WRITING_TEMPLATES),
    }
    misc_pools = {"DISHES": _split(DISHES), "SKILLS": _split(SKILLS), "PLACES": _split(PLACES)}
    train: list[str] = []
    heldout: list[str] = []
    held_fillers: list[str] = []
    for fillers, templates in pools.values():
        fillers = fillers[:]
        rng.shuffle(fillers)
        k = max(2, len(fillers) // 8)
        held, rest = fillers[:k], fillers[k:]
        held_fillers.extend(held)
        for f in rest:
            for tpl in rng.sample(templates, min(len(templates), 5)):
                train.append(tpl.format(t=f))
        for f in held:
            heldout.append(rng.choice(templates).format(t=f))
    for name, fillers in misc_pools.items():
        fillers = fillers[:]
        rng.shuffle(fillers)
        held, rest = fillers[:2], fillers[2:]
        held_fillers.extend(held)
        tpls = [t for t, pool in MISC_TEMPLATES if pool == name]
        for f in rest:
            for tpl in tpls:
                train.append(tpl.format(t=f))
        heldout.extend(rng.choice(tpls).format(t=f) for f in held)
    math_all = list(dict.fromkeys(_math_prompts(rng, 140)))
    heldout.extend(math_all[:8])
    train.extend(math_all[8:])
    train = sorted(set(train) - set(heldout))
    rng.shuffle(train)
    rng.shuffle(heldout)
    return train, heldout[:num_heldout], held_fillers + math_all[:8]


def _mentions(prompt: str, fillers: list[str]) -> bool:
    low = prompt.lower()
    return any(re.search(r"\b" + re.escape(f.lower()) + r"\b", low) for f in fillers)


def extra_prompts(seed: int, held_fillers: list[str], taken: set[str]) -> list[str]:
    """More training prompts (the second head's data): every topic template for every training
    topic, new fillers for every pool, new kinds of request (rewriting, lists, comparisons,
    outlines, reading or debugging code snippets, word meanings) and more arithmetic. No prompt
    mentions a held-out filler; shuffled with a seed of its own, so the first list is not
    disturbed."""
    rng = random.Random(seed + 1)
    out: list[str] = []
    topics = [t for t in _split(TOPICS) + _split(TOPICS_2) if not _mentions(t, held_fillers)]
    for t in topics:
        out.extend(tpl.format(t=t) for tpl in TOPIC_TEMPLATES + TOPIC_TEMPLATES_2)
    for a, b in zip(topics, rng.sample(topics, len(topics))):
        if a != b:
            out.append(f"Compare {a} and {b}.")
    tasks = _split(CODE_TASKS) + _split(CODE_TASKS_2)
    out.extend(tpl.format(t=t) for t in tasks for tpl in CODE_TEMPLATES + CODE_TEMPLATES_2)
    things = _split(THINGS) + _split(THINGS_2)
    out.extend(tpl.format(t=t) for t in things for tpl in WRITING_TEMPLATES)
    misc = {
        "DISHES": _split(DISHES) + _split(DISHES_2),
        "SKILLS": _split(SKILLS) + _split(SKILLS_2),
        "PLACES": _split(PLACES) + _split(PLACES_2),
    }
    for tpl, pool in MISC_TEMPLATES + MISC_TEMPLATES_2:
        out.extend(tpl.format(t=f) for f in misc[pool])
    for s in _split(SENTENCES):
        out.extend(tpl.format(s=s) for tpl in REWRITE_TEMPLATES)
    for c in _split(CATEGORIES):
        out.extend(tpl.format(c=c) for tpl in LIST_TEMPLATES)
    for w in _split(WORDS):
        out.extend(tpl.format(w=w) for tpl in WORD_TEMPLATES)
    for snippet in SNIPPETS:
        out.extend(tpl.format(code=snippet) for tpl in SNIPPET_TEMPLATES)
    out.extend(_math_prompts(rng, 400))
    out = [p for p in dict.fromkeys(out) if p not in taken and not _mentions(p, held_fillers)]
    rng.shuffle(out)
    return out


def stage_prompts(work: Path) -> None:
    train, heldout = build_prompts()
    (work / "prompts.json").write_text(json.dumps({"train": train, "heldout": heldout}, indent=1))
    print(f"prompts: {len(train)} training, {len(heldout)} held out")


# ---------------------------------------------------------------------------- generate


def _conversation(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def _split_dirs(work: Path, split: str) -> tuple[Path, Path]:
    """(answers, features) folders of a split: gen/ and feat/ for "train", gen_heldout/ and
    feat_heldout/ for "heldout" (used only to measure the head while it trains)."""
    suffix = "" if split == "train" else f"_{split}"
    return work / f"gen{suffix}", work / f"feat{suffix}"


def stage_generate(
    work: Path,
    target: str,
    num_chunks: int | None = None,
    chunk: int = CHUNK,
    split: str = "train",
    first_chunk: int = 0,
    sample_share: float = 0.0,
) -> None:
    """This engine's answers, in chunks saved as they finish (resumable): num_chunks chunks of
    the split's prompts from chunk first_chunk (default all). Greedy, except a seeded
    sample_share of the prompts, answered at SAMPLE_TEMPERATURE (each with a seed of its own),
    so that the head also learns what the target's sampled text looks like."""

    from vllm import LLM, SamplingParams

    prompts = json.loads((work / "prompts.json").read_text())[split]
    out_dir = _split_dirs(work, split)[0]
    out_dir.mkdir(exist_ok=True)
    starts = _chunk_starts(len(prompts), chunk, first_chunk, num_chunks)
    todo = [i for i in starts if not (out_dir / f"{i:05d}.json").exists()]
    if not todo:
        return
    llm = LLM(model=target, dtype="float32", max_model_len=512, max_num_seqs=chunk, seed=SEED)
    try:
        for i in todo:
            t0 = time.time()
            batch = prompts[i : i + chunk]
            # which prompts are sampled depends on the chunk alone (resumable, reproducible)
            pick = random.Random(SEED + i)
            temps = [SAMPLE_TEMPERATURE if pick.random() < sample_share else 0.0 for _ in batch]
            sps = [
                SamplingParams(temperature=t, seed=SEED + i + j, max_tokens=MAX_ANSWER_TOKENS)
                if t > 0
                else SamplingParams(temperature=0, max_tokens=MAX_ANSWER_TOKENS)
                for j, t in enumerate(temps)
            ]
            outs = llm.chat([_conversation(p) for p in batch], sps, use_tqdm=False)
            rows = [
                {
                    "prompt": p,
                    "temperature": t,
                    "prompt_ids": list(o.prompt_token_ids),
                    "answer_ids": list(o.outputs[0].token_ids),
                }
                for p, t, o in zip(batch, temps, outs)
            ]
            tmp = out_dir / f"{i:05d}.json.tmp"
            tmp.write_text(json.dumps(rows))
            tmp.rename(out_dir / f"{i:05d}.json")
            n = sum(len(r["answer_ids"]) for r in rows)
            n_s = sum(t > 0 for t in temps)
            dt = time.time() - t0
            print(f"generate {i}: {n} tokens ({n_s} sampled) in {dt:.0f}s", flush=True)
    finally:
        llm.shutdown()


def _chunk_starts(n_prompts: int, chunk: int, first: int, num: int | None) -> list[int]:
    """Prompt offsets of chunks first .. first + num - 1 (to the end when num is None)."""
    starts = list(range(0, n_prompts, chunk))
    return starts[first:] if num is None else starts[first : first + num]


# ---------------------------------------------------------------------------- features


def stage_features(
    work: Path,
    target: str,
    follow: bool = False,
    num_chunks: int | None = None,
    split: str = "train",
    first_chunk: int = 0,
) -> None:
    """One HF forward per sequence -> {aux [T, 3H], final [T, H]} fp16 per generate chunk.

    follow: keep polling for chunks while `generate` runs in another process."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    n_layers = model.config.num_hidden_layers
    if max(AUX_LAYERS) >= n_layers:
        raise ValueError(f"aux layers {AUX_LAYERS} must be below {n_layers}")
    gen_dir, feat_dir = _split_dirs(work, split)
    feat_dir.mkdir(exist_ok=True)
    n_prompts = len(json.loads((work / "prompts.json").read_text())[split])
    wanted = {f"{i:05d}" for i in _chunk_starts(n_prompts, CHUNK, first_chunk, num_chunks)}
    while True:
        done_any = False
        for g in sorted(gen_dir.glob("*.json")):
            out = feat_dir / (g.stem + ".pt")
            if out.exists() or g.stem not in wanted:
                continue
            t0 = time.time()
            rows = json.loads(g.read_text())
            seqs: list[dict | None] = [None] * len(rows)
            order = sorted(range(len(rows)), key=lambda i: -_seq_len(rows[i]))
            with torch.inference_mode():
                # batches of similar length, right-padded: a causal model's states at the real
                # positions do not depend on the padding after them
                for j in range(0, len(order), FEATURE_BATCH):
                    part = order[j : j + FEATURE_BATCH]
                    n_max = _seq_len(rows[part[0]])
                    ids = torch.zeros(len(part), n_max, dtype=torch.long)
                    mask = torch.zeros(len(part), n_max, dtype=torch.long)
                    for b, i in enumerate(part):
                        r = rows[i]
                        n = _seq_len(r)
                        ids[b, :n] = torch.tensor(r["prompt_ids"] + r["answer_ids"])
                        mask[b, :n] = 1
                    o = model.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
                    hs = o.hidden_states
                    aux = torch.cat([hs[i] for i in AUX_LAYERS], dim=-1)
                    for b, i in enumerate(part):
                        n = _seq_len(rows[i])
                        seqs[i] = {
                            "ids": ids[b, :n].to(torch.int32),
                            "prompt_len": len(rows[i]["prompt_ids"]),
                            "aux": aux[b, :n].to(torch.float16),
                            # after the final norm: what the LM head reads
                            "final": o.last_hidden_state[b, :n].to(torch.float16),
                        }
            torch.save(seqs, str(out) + ".tmp")
            os.replace(str(out) + ".tmp", out)
            ntok = sum(len(s["ids"]) for s in seqs)
            print(f"features {g.stem}: {ntok} tokens in {time.time() - t0:.0f}s", flush=True)
            done_any = True
        n_done = len({f.stem for f in feat_dir.glob("*.pt")} & wanted)
        if not follow or n_done >= len(wanted):
            return
        if not done_any:
            time.sleep(20)


def _seq_len(row: dict) -> int:
    return len(row["prompt_ids"]) + len(row["answer_ids"])


# ---------------------------------------------------------------------------- train


def load_features(work: Path, num_chunks: int | None, first_chunk: int = 0) -> list[dict]:
    import torch

    have = {int(f.stem): f for f in (work / "feat").glob("*.pt")}
    if num_chunks is None:
        wanted = sorted(i for i in have if i >= first_chunk * CHUNK)
    else:
        wanted = [(first_chunk + j) * CHUNK for j in range(num_chunks)]
    missing = [i // CHUNK for i in wanted if i not in have]
    if missing:
        raise SystemExit(f"no features for chunks {missing} (--first-chunk / --num-chunks)")
    files = [have[i] for i in wanted]
    seqs: list[dict] = []
    for f in files:
        seqs.extend(torch.load(f, weights_only=True))
    return seqs


def draft_vocabulary(seqs: list[dict], vocab_size: int, size: int):
    """The `size` most frequent answer tokens, sorted by id: (d2t, t2d, share of the answer
    tokens they cover)."""
    import torch

    counts = torch.zeros(vocab_size, dtype=torch.int64)
    prompt_counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in seqs:
        ids = s["ids"].long()
        counts += torch.bincount(ids[s["prompt_len"] :], minlength=vocab_size)
        prompt_counts += torch.bincount(ids[: s["prompt_len"]], minlength=vocab_size)
    # Ties (mostly tokens never seen in an answer): prompt frequency, then the lower id (BPE
    # merges come roughly in order of frequency).
    order = sorted(range(vocab_size), key=lambda i: (-int(counts[i]), -int(prompt_counts[i]), i))[
        :size
    ]
    ids = torch.tensor(sorted(order), dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    covered = int(counts[ids].sum()) / max(1, int(counts.sum()))
    return ids - torch.arange(size), t2d, covered


def _rms(x, w, eps):
    import torch

    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, cos, sin):
    import torch

    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


def head_config(target_config: dict, layers: int = 1) -> dict:
    """DraftHead's cfg from the target's config.json: its layer shapes, layers decoder layers."""
    t = target_config
    return {
        "hidden_size": t["hidden_size"],
        "intermediate_size": t["intermediate_size"],
        "num_attention_heads": t["num_attention_heads"],
        "num_key_value_heads": t["num_key_value_heads"],
        "head_dim": t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"],
        "rms_norm_eps": t["rms_norm_eps"],
        "rope_theta": t["rope_parameters"]["rope_theta"],
        "num_layers": layers,
    }


class DraftHead:
    """The EAGLE3 head being trained, in plain torch (weights named as in the speculators
    format). forward() unrolls the training-time test over a padded batch.

    cfg["num_layers"] (default 1): layer 0 is EAGLE3's (its attention reads
    [input_layernorm(embedding); hidden_norm(hidden)], norm_before_residual); layers 1.. are
    plain pre-norm Llama layers over the stream, as speculators and the engine stack them."""

    def __init__(self, cfg: dict, embed, lm_rows, seed: int) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        h, inter = cfg["hidden_size"], cfg["intermediate_size"]
        nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        self.cfg = cfg
        self.eps = cfg["rms_norm_eps"]
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.num_layers = int(cfg.get("num_layers", 1))

        def lin(out_f: int, in_f: int):
            return (torch.randn(out_f, in_f, generator=g) / in_f**0.5).requires_grad_()

        def ones(n: int):
            return torch.ones(n).requires_grad_()

        self.params = {"fc.weight": lin(h, len(AUX_LAYERS) * h)}
        for i in range(self.num_layers):
            pre = f"layers.{i}."
            in_f = 2 * h if i == 0 else h
            self.params[pre + "input_layernorm.weight"] = ones(h)
            if i == 0:
                self.params[pre + "hidden_norm.weight"] = ones(h)
            self.params |= {
                pre + "post_attention_layernorm.weight": ones(h),
                pre + "self_attn.q_proj.weight": lin(nh * hd, in_f),
                pre + "self_attn.k_proj.weight": lin(nkv * hd, in_f),
                pre + "self_attn.v_proj.weight": lin(nkv * hd, in_f),
                pre + "self_attn.o_proj.weight": lin(h, nh * hd),
                pre + "mlp.gate_proj.weight": lin(inter, h),
                pre + "mlp.up_proj.weight": lin(inter, h),
                pre + "mlp.down_proj.weight": lin(h, inter),
            }
            with torch.no_grad():
                self.params[pre + "self_attn.o_proj.weight"] *= 0.1
                self.params[pre + "mlp.down_proj.weight"] *= 0.1
        self.params["norm.weight"] = ones(h)
        # Frozen, as speculators trains: the target's embedding and its LM-head rows of the
        # draft vocabulary (the shipped lm_head starts as, and stays, those rows).
        self.embed = embed
        self.lm_head = lm_rows
        inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
        self.inv_freq = inv

    def _qkv(self, layer: int, emb, stream, positions):
        """The start of layer `layer` on rows [..., H]: (q, k, v, residual). Layer 0 reads
        the token's embedding and the hidden state fed to the head; later layers the stream."""
        p = self.params
        pre = f"layers.{layer}."
        if layer == 0:
            residual = _rms(stream, p[pre + "hidden_norm.weight"], self.eps)
            x = torch_cat([_rms(emb, p[pre + "input_layernorm.weight"], self.eps), residual])
        else:
            residual, x = stream, _rms(stream, p[pre + "input_layernorm.weight"], self.eps)
        shape = x.shape[:-1]
        q = (x @ p[pre + "self_attn.q_proj.weight"].T).view(*shape, self.nh, self.hd)
        k = (x @ p[pre + "self_attn.k_proj.weight"].T).view(*shape, self.nkv, self.hd)
        v = (x @ p[pre + "self_attn.v_proj.weight"].T).view(*shape, self.nkv, self.hd)
        cos, sin = self._cos_sin(positions)
        rep = self.nh // self.nkv
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        return q, k.repeat_interleave(rep, -2), v.repeat_interleave(rep, -2), residual

    def _cos_sin(self, positions):
        import torch

        f = positions[..., None].float() * self.inv_freq
        emb = torch.cat([f, f], dim=-1)
        return emb.cos()[..., None, :], emb.sin()[..., None, :]  # broadcast over heads

    def _finish(self, layer: int, residual, att):
        """o_proj + residual, then the MLP block: the stream after layer `layer`."""
        import torch

        p = self.params
        pre = f"layers.{layer}."
        h1 = residual + att.flatten(-2) @ p[pre + "self_attn.o_proj.weight"].T
        y = _rms(h1, p[pre + "post_attention_layernorm.weight"], self.eps)
        mlp = torch.nn.functional.silu(y @ p[pre + "mlp.gate_proj.weight"].T) * (
            y @ p[pre + "mlp.up_proj.weight"].T
        )
        return h1 + mlp @ p[pre + "mlp.down_proj.weight"].T

    def _logits(self, stream):
        return _rms(stream, self.params["norm.weight"], self.eps) @ self.lm_head.T

    def forward(self, aux, next_ids, valid, steps: int, rows=None, rows0=None):
        """The training-time test over a padded batch (norm_before_residual).

        aux [B, T, 3H]; next_ids [B, T + steps - 1] (the token after each position, then the
        teacher-forced continuation); valid [B, T] key mask. Step 0's keys and values come
        from every position, its output (the last layer's attention output, MLP and logits)
        only at `rows0` ((b, t) index pair, default every valid position: the positions a loss
        reads - a prompt position's output is never used); steps >= 1 run only at `rows`
        (a subset of rows0; default rows0): step k at (b, t) needs only its own step k - 1
        there plus the step-0 keys of sequence b (each layer its own), so a subset is an
        unbiased, cheaper estimate of the later steps' loss. Returns step 0 logits [N0, Vd]
        at rows0 and, per later step, logits [N, Vd] at rows."""
        import torch

        p = self.params
        B, T, _ = aux.shape
        scale = self.hd**-0.5
        pos = torch.arange(T)[None].expand(B, T)
        emb = self.embed[next_ids[:, :T]]
        mask0 = torch.ones(T, T, dtype=torch.bool).tril()[None, None] & valid[:, None, None, :]
        if rows0 is None:
            rows0 = torch.nonzero(valid, as_tuple=True)
        stream = aux @ p["fc.weight"].T
        k0s, v0s = [], []  # each layer's step-0 keys / values [B, nh, T, hd]
        last = self.num_layers - 1
        for layer in range(self.num_layers):
            q, k0, v0, res = self._qkv(layer, emb, stream, pos)
            q, k0, v0 = q.transpose(1, 2), k0.transpose(1, 2), v0.transpose(1, 2)
            s0 = ((q @ k0.transpose(-1, -2)) * scale).masked_fill(~mask0, float("-inf"))
            att = (s0.softmax(-1) @ v0).transpose(1, 2)
            if layer == last:  # only the rows whose output is read
                res, att = res[rows0], att[rows0]
            stream = self._finish(layer, res, att)
            k0s.append(k0)
            v0s.append(v0)
        out = [self._logits(stream)]
        if steps == 1:
            return out
        if rows is None:
            rows = rows0
        b, t = rows
        at0 = torch.full((B, T), -1, dtype=torch.long)
        at0[rows0] = torch.arange(len(rows0[0]))
        where = at0[b, t]
        if bool((where < 0).any()):
            raise ValueError("rows must be a subset of rows0")
        hidden = stream[where]
        row_mask = mask0[b, 0, t]  # [N, T]: step-0 keys row (b, t) may attend
        keys: list[list] = [[] for _ in range(self.num_layers)]
        values: list[list] = [[] for _ in range(self.num_layers)]
        for k in range(1, steps):
            emb_k = self.embed[next_ids[b, t + k]]
            for layer in range(self.num_layers):
                q, kk, vv, res = self._qkv(layer, emb_k, hidden, t + k)
                keys[layer].append(kk)
                values[layer].append(vv)
                qf = q.new_zeros(B, T, self.nh, self.hd).index_put((b, t), q)
                s0 = (qf.transpose(1, 2) @ k0s[layer].transpose(-1, -2)).transpose(1, 2)[b, t]
                s0 = s0.masked_fill(~row_mask[:, None, :], float("-inf")) * scale  # [N, nh, T]
                diag = torch.stack([(q * kj).sum(-1) * scale for kj in keys[layer]], -1)
                w = torch.cat([s0, diag], -1).softmax(-1)
                wf = w.new_zeros(B, T, self.nh, T).index_put((b, t), w[..., :T])
                att = (wf.transpose(1, 2) @ v0s[layer]).transpose(1, 2)[b, t]  # [N, nh, hd]
                for j, vj in enumerate(values[layer]):
                    att = att + w[..., T + j : T + j + 1] * vj
                hidden = self._finish(layer, res, att)
            out.append(self._logits(hidden))
        return out


def torch_cat(xs):
    import torch

    return torch.cat(xs, dim=-1)


def _batches(seqs: list[dict], tokens_per_batch: int, rng: random.Random) -> list[list[int]]:
    """Length-bucketed batches of sequence indices, shuffled."""
    order = sorted(range(len(seqs)), key=lambda i: (len(seqs[i]["ids"]), rng.random()))
    batches, cur, cur_max = [], [], 0
    for i in order:
        n = len(seqs[i]["ids"])
        if cur and max(cur_max, n) * (len(cur) + 1) > tokens_per_batch:
            batches.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, n)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def _collate(seqs: list[dict], idx: list[int], steps: int, lm_rows):
    """Padded tensors for one batch: aux [B,T,3H], next_ids [B,T+steps-1], valid [B,T],
    target distributions per step [B,T,Vd] and their loss masks."""
    import torch

    T = max(len(seqs[i]["ids"]) for i in idx) - 1
    B = len(idx)
    H3 = seqs[idx[0]]["aux"].shape[-1]
    aux = torch.zeros(B, T, H3)
    nxt = torch.zeros(B, T + steps - 1, dtype=torch.long)
    valid = torch.zeros(B, T, dtype=torch.bool)
    final = torch.zeros(B, T + steps, seqs[idx[0]]["final"].shape[-1])
    answer = torch.zeros(B, T + steps, dtype=torch.bool)  # position j predicts an answer token
    for b, i in enumerate(idx):
        s = seqs[i]
        n = len(s["ids"])
        aux[b, : n - 1] = s["aux"][: n - 1].float()
        nxt[b, : n - 1] = s["ids"][1:].long()
        valid[b, : n - 1] = True
        final[b, :n] = s["final"].float()
        answer[b, s["prompt_len"] : n] = True
    with torch.no_grad():
        # The target's log-probabilities where a loss reads them (answer positions; 0 at the
        # others, which every mask leaves out).
        tgt_lp = torch.zeros(B, T + steps, lm_rows.shape[0])
        tgt_lp[answer] = (final[answer] @ lm_rows.T).log_softmax(-1)
    targets, masks = [], []
    for k in range(steps):
        # step k at index t predicts what the target predicts at position t + 1 + k
        targets.append(tgt_lp[:, 1 + k : 1 + k + T])
        masks.append(answer[:, 1 + k : 1 + k + T] & valid)
    return aux, nxt, valid, targets, masks


def stage_train(
    work: Path,
    target: str,
    num_chunks: int | None = None,
    epochs: float = EPOCHS,
    tokens_per_batch: int = 2048,
    lr: float = 1e-3,
    init: Path | None = None,
    bf16: bool = False,
    first_chunk: int = 0,
    layers: int = 1,
) -> None:
    """EAGLE3 training with training-time test (TTT_STEPS unrolled steps, the draft's own
    hidden fed back), KL to the target over the draft vocabulary, checkpoints every 10 min.

    init: a head folder (speculators format) whose layer weights start the run (its draft
    vocabulary is not reused: the LM-head rows are the target's, frozen, so the vocabulary can
    be chosen afresh from the data; a head of more layers than init's starts its extra layers
    from random weights, their output projections scaled down). layers: the head's decoder
    layers (DraftHead). bf16: the head's matmuls under bf16 autocast (fp32 master
    weights and loss): measured ~1.25x faster per step on an AVX512-BF16 CPU (the shipped
    head was trained in fp32)."""
    import torch
    from safetensors.torch import load_file

    torch.manual_seed(SEED)
    seqs = load_features(work, num_chunks, first_chunk)
    tcfg = json.loads((Path(target) / "config.json").read_text())
    tw = load_file(str(Path(target) / "model.safetensors"))
    embed = tw["model.embed_tokens.weight"].float()
    head_w = tw.get("lm_head.weight", embed).float()
    d2t, t2d, covered = draft_vocabulary(seqs, tcfg["vocab_size"], DRAFT_VOCAB)
    lm_rows = head_w[t2d].contiguous()
    ntok = sum(len(s["ids"]) for s in seqs)
    nans = sum(len(s["ids"]) - s["prompt_len"] for s in seqs)
    print(
        f"train: {len(seqs)} sequences, {ntok} tokens ({nans} answer tokens); draft vocab "
        f"{DRAFT_VOCAB} covers {covered:.1%} of answer tokens",
        flush=True,
    )
    head = DraftHead(head_config(tcfg, layers), embed, lm_rows, SEED)
    if init is not None:
        start = load_file(str(Path(init) / "model.safetensors"))
        fresh = [k for k in head.params if k not in start]
        with torch.no_grad():
            for k, v in head.params.items():
                if k in start:
                    v.copy_(start[k].float())
        print(f"train: weights from {init}; {len(fresh)} tensors start fresh", flush=True)
    opt = torch.optim.AdamW(list(head.params.values()), lr=lr, weight_decay=0.0)
    ckpt = work / "train_ckpt.pt"
    run = {
        "num_sequences": len(seqs),
        "first_chunk": first_chunk,
        "epochs": epochs,
        "tokens_per_batch": tokens_per_batch,
        "lr": lr,
        "seed": SEED,
        "init": None if init is None else str(init),
        "bf16": bf16,
        "layers": layers,
    }
    state = {"step": 0, "run": run, "log": []}
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=False)
        if saved["state"].get("run") != run:
            raise SystemExit(
                f"{ckpt} is from another run ({saved['state'].get('run')}, now {run}); "
                "move it away to start over"
            )
        for k, v in saved["params"].items():
            head.params[k].data.copy_(v)
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        print(f"resumed at step {state['step']}", flush=True)
    per_epoch = len(_batches(seqs, tokens_per_batch, random.Random(0)))
    total_steps = int(per_epoch * epochs)
    held_dir = _split_dirs(work, "heldout")[1]
    held = [x for f in sorted(held_dir.glob("*.pt")) for x in torch.load(f, weights_only=True)]

    def measure_heldout() -> None:
        if held:
            accs = heldout_agreement(head, held, lm_rows, tokens_per_batch)
            state.setdefault("heldout", []).append([state["step"], *accs])
            print(
                f"held-out agreement at step {state['step']}: "
                + " ".join(f"{a:.3f}" for a in accs),
                flush=True,
            )

    if state["step"] == 0:
        measure_heldout()
    warmup = max(1, total_steps // 20)
    t_start, t_ckpt = time.time(), time.time()
    epoch_rngs: dict[int, list[list[int]]] = {}
    while state["step"] < total_steps:
        step = state["step"]
        epoch, j = divmod(step, per_epoch)
        if epoch not in epoch_rngs:  # each epoch's batch order from (seed, epoch): resumable
            epoch_rngs = {epoch: _batches(seqs, tokens_per_batch, random.Random(SEED + epoch))}
        idx = epoch_rngs[epoch][j]
        t_step = time.time()
        frac = step / max(1, total_steps)
        cur_lr = lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * frac))
        for gr in opt.param_groups:
            gr["lr"] = cur_lr
        aux, nxt, valid, targets, masks = _collate(seqs, idx, TTT_STEPS, lm_rows)
        # Later steps at a seeded random subset of the positions step 1 is trained on.
        g = torch.Generator().manual_seed(SEED * 100_003 + step)
        cand = torch.nonzero(masks[1], as_tuple=True) if TTT_STEPS > 1 else None
        rows = None
        if cand is not None:
            keep = torch.rand(len(cand[0]), generator=g) < LATER_STEP_FRACTION
            rows = (cand[0][keep], cand[1][keep])
        rows0 = _output_rows(masks)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = head.forward(aux, nxt, valid, TTT_STEPS, rows=rows, rows0=rows0)
        logits = [x.float() for x in logits]
        loss = torch.zeros(())
        accs = []
        for k in range(TTT_STEPS):
            lp = logits[k].log_softmax(-1)
            tk, m = _step_targets(targets, masks, k, rows0 if k == 0 else rows)
            kl = (tk.exp() * (tk - lp)).sum(-1)
            loss = loss + (kl * m).sum() / m.sum().clamp(min=1)
            with torch.no_grad():
                h, c = _top1_hits(logits[k], tk, m)
                accs.append(h / max(1, c))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(head.params.values()), 1.0)
        opt.step()
        state["step"] = step + 1
        state["seconds"] = state.get("seconds", 0.0) + time.time() - t_step
        state["log"].append([step, float(loss.detach()), *accs])
        if step % 10 == 0:
            el = time.time() - t_start
            print(
                f"step {step}/{total_steps} epoch {epoch} loss {float(loss.detach()):.3f} "
                f"acc {' '.join(f'{a:.2f}' for a in accs)} lr {cur_lr:.2e} {el:.0f}s",
                flush=True,
            )
        if state["step"] % HELDOUT_EVERY == 0 or state["step"] == total_steps:
            measure_heldout()
        if time.time() - t_ckpt > 600 or state["step"] == total_steps:
            _save_ckpt(ckpt, head, opt, state)
            t_ckpt = time.time()
    torch.save(
        {
            "params": {k: v.detach().clone() for k, v in head.params.items()},
            "lm_head": lm_rows,
            "d2t": d2t,
            "t2d": t2d,
            "covered": covered,
            "num_sequences": len(seqs),
            "num_tokens": ntok,
            "num_answer_tokens": nans,
            "log": state["log"],
            "heldout": state.get("heldout", []),
            "run": run,
            "train_seconds": state.get("seconds"),
        },
        work / "trained.pt",
    )
    print(f"train: done in {time.time() - t_start:.0f}s", flush=True)


def _output_rows(masks):
    """The positions whose step-0 output is read: step 0's loss positions and those the later
    steps start from (a step-1 position can be one before step 0's first)."""
    import torch

    return torch.nonzero(masks[0] | masks[1] if len(masks) > 1 else masks[0], as_tuple=True)


def _step_targets(targets, masks, k: int, rows):
    """TTT step k's target log-probabilities and loss mask at `rows` (the positions step k
    ran at: step 0's loss positions, then the later steps' subset)."""
    return targets[k][rows], masks[k][rows]


def _top1_hits(logits, tk, m) -> tuple[int, int]:
    """(positions where the draft's argmax is the target's, positions counted) under mask m."""
    return int(((logits.argmax(-1) == tk.argmax(-1)) & m).sum()), int(m.sum())


def heldout_agreement(head: DraftHead, seqs: list[dict], lm_rows, tokens_per_batch: int):
    """Top-1 agreement of each TTT step with the target on the held-out answers (teacher
    forced, the draft's own hidden fed back as in inference): about the conditional acceptance
    rate at each draft position. Returns [step 0, step 1, ...]."""
    import torch

    hits = [0] * TTT_STEPS
    counts = [0] * TTT_STEPS
    with torch.no_grad():
        for idx in _batches(seqs, tokens_per_batch, random.Random(0)):
            aux, nxt, valid, targets, masks = _collate(seqs, idx, TTT_STEPS, lm_rows)
            rows = torch.nonzero(masks[1], as_tuple=True)
            rows0 = _output_rows(masks)
            logits = head.forward(aux, nxt, valid, TTT_STEPS, rows=rows, rows0=rows0)
            for k in range(TTT_STEPS):
                at = rows0 if k == 0 else rows
                h, c = _top1_hits(logits[k], *_step_targets(targets, masks, k, at))
                hits[k] += h
                counts[k] += c
    return [h / max(1, c) for h, c in zip(hits, counts)]


def _save_ckpt(path: Path, head: DraftHead, opt, state: dict) -> None:
    import torch

    tmp = str(path) + ".tmp"
    torch.save(
        {
            "params": {k: v.detach() for k, v in head.params.items()},
            "opt": opt.state_dict(),
            "state": state,
        },
        tmp,
    )
    os.replace(tmp, path)


# ---------------------------------------------------------------------------- export


def stage_export(work: Path, target: str, out: Path) -> None:
    """Write the trained head in the speculators format (bf16 weights, int64 d2t, bool t2d)."""
    import torch
    from safetensors.torch import save_file

    tr = torch.load(work / "trained.pt", weights_only=False)
    tcfg = json.loads((Path(target) / "config.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    w = {k: v.to(torch.bfloat16).contiguous() for k, v in tr["params"].items()}
    w["lm_head.weight"] = tr["lm_head"].to(torch.bfloat16).contiguous()
    w["d2t"] = tr["d2t"].to(torch.int64)
    w["t2d"] = tr["t2d"]
    save_file(w, str(out / "model.safetensors"), {"format": "pt"})
    layer = {
        k: tcfg[k]
        for k in (
            "attention_bias",
            "head_dim",
            "hidden_act",
            "hidden_size",
            "intermediate_size",
            "max_position_embeddings",
            "mlp_bias",
            "num_attention_heads",
            "num_key_value_heads",
            "rms_norm_eps",
            "rope_parameters",
            "vocab_size",
        )
    }
    layers = int(tr["run"].get("layers", 1))
    layer.update(model_type="llama", num_hidden_layers=layers, tie_word_embeddings=False)
    cfg = {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "dtype": "bfloat16",
        "transformer_layer_config": layer,
        "draft_vocab_size": DRAFT_VOCAB,
        "target_hidden_size": tcfg["hidden_size"],
        "eagle_aux_hidden_state_layer_ids": list(AUX_LAYERS),
        "norm_before_residual": True,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": TTT_STEPS,
                    "accept_tolerance": 0.0,
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": {
                "name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
                "architectures": ["LlamaForCausalLM"],
            },
        },
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    heldout = json.loads((work / "prompts.json").read_text())["heldout"]
    (out / "heldout_prompts.json").write_text(json.dumps(heldout, indent=1) + "\n")
    print(f"export: {out} ({sum(v.numel() * v.element_size() for v in w.values()) / 1e6:.1f} MB)")


# ---------------------------------------------------------------------------- eval


def stage_eval(
    work: Path,
    target: str,
    head: Path,
    max_tokens: int = 96,
    temperature: float = 0.0,
    ks: tuple[int, ...] = (1, 2, 3, 4),
) -> None:
    """Acceptance of the exported head on every held-out prompt, each K of ks (batch 16; greedy,
    or sampled at `temperature` with a seed per prompt): mean acceptance length and
    per-position acceptance rates, written to WORK/eval.json (eval_T<temperature>.json)."""
    from vllm import LLM, SamplingParams

    prompts = json.loads((head / "heldout_prompts.json").read_text())
    convs = [_conversation(p) for p in prompts]
    sp = [
        SamplingParams(temperature=temperature, seed=SEED + i, max_tokens=max_tokens)
        for i in range(len(prompts))
    ]
    result = {
        "num_prompts": len(prompts),
        "max_tokens": max_tokens,
        "temperature": temperature,
        "k": {},
    }
    for k in ks:
        llm = LLM(
            model=target,
            dtype="float32",
            max_model_len=512,
            max_num_seqs=16,
            speculative_config={
                "model": str(head),
                "num_speculative_tokens": k,
                "adaptive_num_speculative_tokens": False,  # K drafts every step
            },
        )
        try:
            llm.chat(convs, sp, use_tqdm=False)
            m = {x.name: x for x in llm.get_metrics()}
        finally:
            llm.shutdown()
        drafts = m["vllm:spec_decode_num_drafts"].value
        acc = m["vllm:spec_decode_num_accepted_tokens"].value
        rates = [v / drafts for v in m["vllm:spec_decode_num_accepted_tokens_per_pos"].values]
        result["k"][k] = {"mean_acceptance_length": 1 + acc / drafts, "per_position": rates}
        print(
            f"eval T={temperature} K={k}: mean acceptance length {1 + acc / drafts:.2f}, "
            "per position " + " ".join(f"{r:.2f}" for r in rates),
            flush=True,
        )
    name = "eval.json" if temperature == 0 else f"eval_T{temperature}.json"
    (work / name).write_text(json.dumps(result, indent=1))


# ---------------------------------------------------------------------------- plot


def stage_plot(work: Path, out: Path) -> None:
    """The run's curve (WORK/trained.pt) as a PNG: held-out top-1 agreement of each TTT step
    (measured every HELDOUT_EVERY steps) and the training batches' agreement (mean of 50
    steps), against the training step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    t = torch.load(work / "trained.pt", weights_only=False)
    log, held = t["log"], t["heldout"]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for k in range(TTT_STEPS):
        color = f"C{k}"
        if held:
            ax.plot(
                [h[0] for h in held],
                [h[1 + k] for h in held],
                "o-",
                color=color,
                label=f"draft step {k + 1}, held out",
            )
        w = 50
        xs = [log[i][0] for i in range(w - 1, len(log))]
        ys = [sum(r[2 + k] for r in log[i - w + 1 : i + 1]) / w for i in range(w - 1, len(log))]
        ax.plot(xs, ys, "--", color=color, alpha=0.6, label=f"draft step {k + 1}, training")
    run = t["run"]
    ax.set_xlabel("training step")
    ax.set_ylabel("top-1 agreement with the target")
    ax.set_title(
        f"EAGLE3 head for SmolLM2-135M: {t['num_sequences']} sequences, "
        f"{run['epochs']} epochs, lr {run['lr']}" + (", continued" if run.get("init") else ""),
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot: {out}")


# ---------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "stage",
        choices=[
            "prompts",
            "generate",
            "features",
            "heldout",
            "train",
            "export",
            "eval",
            "plot",
            "all",
        ],
    )
    ap.add_argument("--work-dir", default="/tmp/eagle3-smollm2")
    ap.add_argument("--target", default=None, help="SmolLM2 HF folder (default: convert)")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--follow", action="store_true", help="features: wait for generate chunks")
    ap.add_argument(
        "--num-chunks",
        type=int,
        default=NUM_CHUNKS,
        help="generate / featurize / train on N chunks of 128 training prompts",
    )
    ap.add_argument(
        "--first-chunk", type=int, default=0, help="... starting at this chunk (default 0)"
    )
    ap.add_argument(
        "--sample-share",
        type=float,
        default=0.0,
        help=f"generate: this share of the answers sampled at T = {SAMPLE_TEMPERATURE}",
    )
    ap.add_argument("--epochs", type=float, default=EPOCHS)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--init", default=None, help="train: start from this head folder's weights")
    ap.add_argument("--bf16", action="store_true", help="train: bf16 autocast for the matmuls")
    ap.add_argument("--layers", type=int, default=1, help="train: the head's decoder layers")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="eval: sample at this temperature"
    )
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4], help="eval: these K")
    ap.add_argument(
        "--plot",
        default=str(ROOT / "benchmarks" / "eagle3_smollm2_training.png"),
        help="plot: where the training curve goes",
    )
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    if args.target is None:
        from vllm.model_zoo import smollm2_path

        args.target = smollm2_path(work / "smollm2-135m-instruct")
    stages = ["prompts", "generate", "features", "heldout", "train", "export", "eval"]
    run = stages if args.stage == "all" else [args.stage]
    for s in run:
        if s == "prompts":
            stage_prompts(work)
        elif s == "generate":
            stage_generate(
                work,
                args.target,
                num_chunks=args.num_chunks,
                first_chunk=args.first_chunk,
                sample_share=args.sample_share,
            )
        elif s == "features":
            stage_features(
                work,
                args.target,
                follow=args.follow,
                num_chunks=args.num_chunks,
                first_chunk=args.first_chunk,
            )
        elif s == "heldout":
            stage_generate(work, args.target, split="heldout")
            stage_features(work, args.target, split="heldout")
        elif s == "train":
            stage_train(
                work,
                args.target,
                num_chunks=args.num_chunks,
                epochs=args.epochs,
                lr=args.lr,
                init=None if args.init is None else Path(args.init),
                bf16=args.bf16,
                first_chunk=args.first_chunk,
                layers=args.layers,
            )
        elif s == "export":
            stage_export(work, args.target, Path(args.out))
        elif s == "eval":
            stage_eval(
                work, args.target, Path(args.out), temperature=args.temperature, ks=tuple(args.k)
            )
        elif s == "plot":
            stage_plot(work, Path(args.plot))


if __name__ == "__main__":
    main()
