"""The tasks the test envs share: a prompt per example, as the classic test envs' rows were."""

import verifiers.v1 as vf


def tasks(task_cls, config, prompts: list[str], **fields):
    for prompt in prompts:
        yield task_cls(task_cls.data_type()(prompt=prompt, **fields), config.task)


class Config(vf.TasksetConfig):
    num_examples: int = 20
