"""Generate the synthetic demo chat dataset and its offline tokenizer.

Everything here is made by this script from a seed: no downloads, no third-party text. The data
mixes many short chats (arithmetic, word games) with some long multi-turn chats whose later
turns refer to earlier ones, so the length profile exercises packing. The structure is very
repetitive on purpose, so that a tiny model's loss falls within a hundred or so steps.

Usage::

    python examples/make_demo_data.py            # writes examples/data and examples/tokenizer
    python examples/make_demo_data.py --seed 1 --records 3000 --out-dir /tmp/demo
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

WORDS = ["apple", "river", "stone", "cloud", "garden", "pencil", "window", "rocket", "forest", "candle", "mirror", "bridge", "planet", "ladder", "silver", "orange", "tiger", "violin", "harbor", "meadow", "button", "castle", "dragon", "falcon", "jacket", "lemon", "marble", "needle", "ocean", "pepper", "quartz", "saddle", "tunnel", "velvet", "wagon", "yellow", "anchor", "basket", "copper", "desert", "engine", "feather", "glacier", "hammer", "island", "jungle", "kettle", "lantern", "magnet", "nickel", "olive", "puzzle", "rabbit", "summer", "ticket", "umbrella", "valley", "winter"]

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a careful assistant that answers briefly.",
    "You are a friendly tutor for arithmetic and words.",
)

TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{% generation %}{{- message['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Chat template with generation tags around each assistant turn (content + end of turn)."""

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]


def _msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def _maybe_system(rng: random.Random) -> list[dict[str, str]]:
    return [_msg("system", rng.choice(SYSTEM_PROMPTS))] if rng.random() < 0.3 else []


def arithmetic_qa(rng: random.Random) -> tuple[str, str]:
    """One arithmetic question and its worked answer."""
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    op = rng.choice("+-*")
    result = {"+": a + b, "-": a - b, "*": a * b}[op]
    name = {"+": "plus", "-": "minus", "*": "times"}[op]
    question = rng.choice(
        (f"What is {a} {op} {b}?", f"Compute {a} {name} {b}.", f"Please calculate {a} {op} {b}.")
    )
    return question, f"{a} {op} {b} = {result}. The answer is {result}."


def word_qa(rng: random.Random) -> tuple[str, str]:
    """One word-manipulation question and its answer."""
    word = rng.choice(WORDS)
    task = rng.randrange(5)
    if task == 0:
        return f"Reverse the word {word}.", f"The word {word} reversed is {word[::-1]}."
    if task == 1:
        return f"Write {word} in capital letters.", f"In capital letters, {word} is {word.upper()}."
    if task == 2:
        return f"How many letters are in {word}?", f"The word {word} has {len(word)} letters."
    if task == 3:
        return f"Spell the word {word}.", f"{word} is spelled {'-'.join(word)}."
    letter = word[0]
    return (
        f"What is the first letter of {word}?",
        f"The first letter of {word} is {letter}.",
    )


def short_chat(rng: random.Random) -> dict[str, Any]:
    q, a = arithmetic_qa(rng) if rng.random() < 0.5 else word_qa(rng)
    return {"messages": [*_maybe_system(rng), _msg("user", q), _msg("assistant", a)]}


def memory_chat(rng: random.Random) -> dict[str, Any]:
    """A few turns where the last question refers back to the first turn."""
    word, number = rng.choice(WORDS), rng.randint(1, 999)
    msgs = [*_maybe_system(rng)]
    msgs += [
        _msg("user", f"Remember the word {word} and the number {number}."),
        _msg("assistant", f"Got it. I will remember the word {word} and the number {number}."),
    ]
    for _ in range(rng.randint(0, 3)):
        q, a = arithmetic_qa(rng) if rng.random() < 0.5 else word_qa(rng)
        msgs += [_msg("user", q), _msg("assistant", a)]
    if rng.random() < 0.5:
        msgs += [
            _msg("user", "Which word did I ask you to remember?"),
            _msg("assistant", f"You asked me to remember the word {word}."),
        ]
    else:
        msgs += [
            _msg("user", "What number did I ask you to remember? Add 1 to it."),
            _msg("assistant", f"You asked me to remember {number}. {number} + 1 = {number + 1}."),
        ]
    return {"messages": msgs}


def running_total_chat(rng: random.Random, turns: int) -> dict[str, Any]:
    """A long chat keeping a running total; every answer depends on all earlier turns."""
    total = rng.randint(0, 50)
    msgs = [*_maybe_system(rng)]
    msgs += [
        _msg("user", f"Let us keep a running total. Start at {total}."),
        _msg("assistant", f"Starting the running total at {total}."),
    ]
    for _ in range(turns):
        step = rng.randint(1, 30)
        if rng.random() < 0.6:
            new = total + step
            msgs += [
                _msg("user", f"Add {step}."),
                _msg("assistant", f"{total} + {step} = {new}. The total is now {new}."),
            ]
        else:
            new = total - step
            msgs += [
                _msg("user", f"Subtract {step}."),
                _msg("assistant", f"{total} - {step} = {new}. The total is now {new}."),
            ]
        total = new
    msgs += [
        _msg("user", "What is the total now?"),
        _msg("assistant", f"The running total is {total}."),
    ]
    return {"messages": msgs}


def instruction_record(rng: random.Random) -> dict[str, Any]:
    """An instruction-style chat: a list of words to sort, written as messages."""
    words = rng.sample(WORDS, rng.randint(3, 8))
    return {
        "messages": [
            *_maybe_system(rng),
            _msg("user", f"Sort these words alphabetically: {', '.join(words)}."),
            _msg("assistant", f"In alphabetical order: {', '.join(sorted(words))}."),
        ]
    }


def make_records(seed: int, n: int) -> list[dict[str, Any]]:
    """Build ``n`` records deterministically from ``seed`` with a mixed length profile."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        r = rng.random()
        if r < 0.55:
            records.append(short_chat(rng))
        elif r < 0.75:
            records.append(memory_chat(rng))
        elif r < 0.88:
            records.append(instruction_record(rng))
        elif r < 0.97:
            records.append(running_total_chat(rng, rng.randint(4, 20)))
        else:
            records.append(running_total_chat(rng, rng.randint(30, 48)))
    return records


def train_tokenizer(records: list[dict[str, Any]], out_dir: Path, vocab_size: int) -> None:
    """Train a byte-level BPE on the records and save it as a fast tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = (m["content"] for rec in records for m in rec["messages"])
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token=None,
    )
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(out_dir))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--records", type=int, default=3000)
    parser.add_argument("--vocab-size", type=int, default=3000)
    parser.add_argument("--out-dir", type=Path, default=HERE)
    parser.add_argument("--no-tokenizer", action="store_true", help="only write the data")
    args = parser.parse_args(argv)

    records = make_records(args.seed, args.records)
    data_dir = args.out_dir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / "demo_chat.jsonl"
    with path.open("w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    print(f"wrote {len(records)} records to {path} ({path.stat().st_size / 1e6:.2f} MB)")
    if not args.no_tokenizer:
        tok_dir = args.out_dir / "tokenizer"
        train_tokenizer(records, tok_dir, args.vocab_size)
        print(f"wrote tokenizer to {tok_dir}")


if __name__ == "__main__":
    main()
