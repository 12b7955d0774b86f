"""SFT warm-up data for digit-sum-feedback: games that end with a right answer, as JSONL rows
`{"messages": [...]}` (the SFT loss covers the final answer only).

Half of the games are solved at once; the rest first show one or two wrong answers, each followed by
the env's real feedback and closer to the truth in its direction, so the model sees what a
correction looks like. `uv run python -m digit_sum_feedback.transcripts --out data.jsonl`.
"""

from __future__ import annotations

import argparse
import json
import random

from digit_sum_feedback import SYSTEM_PROMPT, feedback, make_examples


def game(rng: random.Random, number: str, answer: int) -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": number}]
    wrong = rng.choices([0, 1, 2], weights=[2, 1.4, 0.6])[0]
    guess = None
    for _ in range(wrong):
        if guess is None:
            guess = max(0, answer + rng.choice([-1, 1]) * rng.randint(1, 4))
        else:  # closer, on the side the feedback pointed to
            guess = guess + (1 if guess < answer else -1) * rng.randint(1, max(1, abs(answer - guess) - 1))
        if guess == answer:
            break
        messages += [
            {"role": "assistant", "content": f"<answer>{guess}</answer>"},
            {"role": "user", "content": feedback(guess, answer)},
        ]
    messages.append({"role": "assistant", "content": f"<answer>{answer}</answer>"})
    return messages


def transcripts(n: int, seed: int, min_digits: int = 2, max_digits: int = 3) -> list[dict]:
    rng = random.Random(seed)
    # Numbers from their own seed: the RL train set (seed 0) and eval set (seed 1) stay unseen.
    rows = make_examples(n, seed + 1000, min_digits, max_digits)
    return [{"messages": game(rng, row["question"], int(row["answer"]))} for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--n", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with open(args.out, "w") as f:
        for row in transcripts(args.n, args.seed):
            f.write(json.dumps(row) + "\n")
    print(f"wrote {args.n} games to {args.out}")


if __name__ == "__main__":
    main()
