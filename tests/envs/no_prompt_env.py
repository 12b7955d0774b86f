"""A test env whose dataset lacks a prompt column."""

import verifiers as vf
from datasets import Dataset


def load_environment() -> vf.Environment:
    return vf.SingleTurnEnv(dataset=Dataset.from_list([{"text": "a"}]), rubric=vf.Rubric(funcs=[]))
