"""Custom reward functions for tests: verifiers-style, taking the rubric arguments they name plus the
keyword arguments of their config."""


def text(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


def chars_over(completion, limit: int, per_char: float = 1.0) -> float:
    """`per_char` for every character of the reply past `limit`."""
    return per_char * max(0, len(text(completion)) - limit)


async def answer_bonus(completion, answer, bonus: float, **kwargs) -> float:
    """`bonus` when the reply starts as the answer does (async, and takes **kwargs: verifiers then
    passes it every rubric object)."""
    return bonus if text(completion).startswith(str(answer)[:1]) else 0.0


def group_rank(completions, scale: float) -> list[float]:
    """One call per group: `scale` times the rank of each reply's length in its group."""
    lengths = [len(text(c)) for c in completions]
    return [scale * sorted(lengths).index(n) for n in lengths]
