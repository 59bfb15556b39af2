# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The vllm-pp-spec contributors
"""Train the bundled EAGLE3 head for SmolLM2-135M-Instruct by self-distillation.

Stages (each resumable; outputs under --work-dir):
  prompts   varied chat prompts from templates x fillers; fillers of the held-out prompts never
            appear in a training prompt (heldout_prompts.json is shipped with the head)
  generate  SmolLM2's own greedy answers (this engine, batched, fp32)
  features  one HF transformers forward per sequence: the aux taps and the final hidden state
            (after the model's norm, what its LM head reads), cached as fp16
  train     EAGLE3 with training-time test: TTT_STEPS unrolled draft steps, each feeding back
            the draft's own hidden state, loss = KL to the target's distribution over the draft
            vocabulary (the most frequent answer tokens), checkpointed periodically
  export    the speculators format (config.json with speculators_model_type "eagle3",
            model.safetensors in bf16 with d2t / t2d; no embedding: the target's is shared)

    python tools/train_eagle3_smollm2.py all [--work-dir DIR] [--out vllm/model_zoo/...]

Tap convention (as vLLM and speculators): layer id L is the residual stream entering target
decoder layer L, which is HF's `output_hidden_states[L]` for L < num_hidden_layers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
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
MAX_ANSWER_TOKENS = 128
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
    held-out math prompts never occur in a training prompt."""
    rng = random.Random(seed)
    pools = {
        "TOPICS": (_split(TOPICS), TOPIC_TEMPLATES),
        "CODE": (_split(CODE_TASKS), CODE_TEMPLATES),
        "THINGS": (_split(THINGS), WRITING_TEMPLATES),
    }
    misc_pools = {"DISHES": _split(DISHES), "SKILLS": _split(SKILLS), "PLACES": _split(PLACES)}
    train: list[str] = []
    heldout: list[str] = []
    for fillers, templates in pools.values():
        fillers = fillers[:]
        rng.shuffle(fillers)
        k = max(2, len(fillers) // 8)
        held, rest = fillers[:k], fillers[k:]
        for f in rest:
            for tpl in rng.sample(templates, min(len(templates), 5)):
                train.append(tpl.format(t=f))
        for f in held:
            heldout.append(rng.choice(templates).format(t=f))
    for name, fillers in misc_pools.items():
        fillers = fillers[:]
        rng.shuffle(fillers)
        held, rest = fillers[:2], fillers[2:]
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
    return train, heldout[:num_heldout]


def stage_prompts(work: Path) -> None:
    train, heldout = build_prompts()
    (work / "prompts.json").write_text(json.dumps({"train": train, "heldout": heldout}, indent=1))
    print(f"prompts: {len(train)} training, {len(heldout)} held out")


# ---------------------------------------------------------------------------- generate


def _conversation(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def stage_generate(work: Path, target: str, chunk: int = 128) -> None:
    """Greedy answers from this engine, in chunks saved as they finish (resumable)."""
    import torch

    from vllm import LLM, SamplingParams

    torch.set_num_threads(1)  # on a shared 2-core machine one thread per process is fastest
    prompts = json.loads((work / "prompts.json").read_text())["train"]
    out_dir = work / "gen"
    out_dir.mkdir(exist_ok=True)
    todo = [i for i in range(0, len(prompts), chunk) if not (out_dir / f"{i:05d}.json").exists()]
    if not todo:
        return
    llm = LLM(model=target, dtype="float32", max_model_len=512, max_num_seqs=64, seed=SEED)
    sp = SamplingParams(temperature=0, max_tokens=MAX_ANSWER_TOKENS)
    try:
        for i in todo:
            t0 = time.time()
            batch = prompts[i : i + chunk]
            outs = llm.chat([_conversation(p) for p in batch], sp, use_tqdm=False)
            rows = [
                {
                    "prompt": p,
                    "prompt_ids": list(o.prompt_token_ids),
                    "answer_ids": list(o.outputs[0].token_ids),
                }
                for p, o in zip(batch, outs)
            ]
            tmp = out_dir / f"{i:05d}.json.tmp"
            tmp.write_text(json.dumps(rows))
            tmp.rename(out_dir / f"{i:05d}.json")
            n = sum(len(r["answer_ids"]) for r in rows)
            print(f"generate {i}: {n} tokens in {time.time() - t0:.0f}s", flush=True)
    finally:
        llm.shutdown()


# ---------------------------------------------------------------------------- features


def stage_features(work: Path, target: str, follow: bool = False) -> None:
    """One HF forward per sequence -> {aux [T, 3H], final [T, H]} fp16 per generate chunk.

    follow: keep polling for chunks while `generate` runs in another process."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    n_layers = model.config.num_hidden_layers
    if max(AUX_LAYERS) >= n_layers:
        raise ValueError(f"aux layers {AUX_LAYERS} must be below {n_layers}")
    gen_dir, feat_dir = work / "gen", work / "feat"
    feat_dir.mkdir(exist_ok=True)
    total = len(json.loads((work / "prompts.json").read_text())["train"])
    while True:
        done_any = False
        for g in sorted(gen_dir.glob("*.json")):
            out = feat_dir / (g.stem + ".pt")
            if out.exists():
                continue
            t0 = time.time()
            rows = json.loads(g.read_text())
            seqs = []
            with torch.inference_mode():
                for r in rows:
                    ids = torch.tensor([r["prompt_ids"] + r["answer_ids"]])
                    o = model.model(input_ids=ids, output_hidden_states=True)
                    hs = o.hidden_states
                    aux = torch.cat([hs[i][0] for i in AUX_LAYERS], dim=-1)
                    seqs.append(
                        {
                            "ids": ids[0].to(torch.int32),
                            "prompt_len": len(r["prompt_ids"]),
                            "aux": aux.to(torch.float16),
                            # after the final norm: what the LM head reads
                            "final": o.last_hidden_state[0].to(torch.float16),
                        }
                    )
            torch.save(seqs, str(out) + ".tmp")
            os.replace(str(out) + ".tmp", out)
            ntok = sum(len(s["ids"]) for s in seqs)
            print(f"features {g.stem}: {ntok} tokens in {time.time() - t0:.0f}s", flush=True)
            done_any = True
        n_done = len(list(feat_dir.glob("*.pt")))
        if not follow or n_done * 128 >= total:
            return
        if not done_any:
            time.sleep(20)


# ---------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("stage", choices=["prompts", "generate", "features", "train", "export", "all"])
    ap.add_argument("--work-dir", default="/tmp/eagle3-smollm2")
    ap.add_argument("--target", default=None, help="SmolLM2 HF folder (default: convert)")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--follow", action="store_true", help="features: wait for generate chunks")
    args = ap.parse_args()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    if args.target is None:
        from vllm.model_zoo import smollm2_path

        args.target = smollm2_path(work / "smollm2-135m-instruct")
    stages = ["prompts", "generate", "features", "train", "export"]
    run = stages if args.stage == "all" else [args.stage]
    for s in run:
        if s == "prompts":
            stage_prompts(work)
        elif s == "generate":
            stage_generate(work, args.target)
        elif s == "features":
            stage_features(work, args.target, follow=args.follow)
        elif s == "train":
            stage_train(work, args.target)
        elif s == "export":
            stage_export(work, args.target, Path(args.out))


if __name__ == "__main__":
    main()
