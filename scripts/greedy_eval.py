"""Greedy accuracy of a model folder on an env's eval examples, with HF generate (no server needed).

    uv run python scripts/greedy_eval.py models/sum_digits-teacher sum-digits --num 100

It renders each eval prompt with the model's chat template, decodes greedily, and scores the reply
with the env's own rubric (plain functions of `completion` and `answer`, as single-turn example envs
have), as the orchestrator's eval does: used to put a teacher's accuracy beside
the student's `eval/<env>/reward/mean` (docs/algorithms.md).
"""

import argparse

import torch
import verifiers as vf
from transformers import AutoModelForCausalLM, AutoTokenizer

from prime_rl.orchestrator.envs.rewards import rubrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("env_id")
    parser.add_argument("--num", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    env = vf.load_environment(args.env_id)
    rows = env.get_eval_dataset(n=args.num)
    funcs = [(f, w) for r in rubrics(env.rubric) for f, w in zip(r.funcs, r.weights, strict=True) if w]
    total = 0.0
    for row in rows:
        prompt = list(row["prompt"])
        ids = tokenizer.apply_chat_template(
            prompt, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with torch.inference_mode():
            out = model.generate(**ids, max_new_tokens=args.max_tokens, do_sample=False)
        reply = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
        completion = [{"role": "assistant", "content": reply}]
        total += sum(w * f(completion=completion, answer=row["answer"]) for f, w in funcs)
    print(
        f"{args.model} on {args.env_id}: greedy reward {total / len(rows):.3f} over {len(rows)} eval examples"
    )


if __name__ == "__main__":
    main()
