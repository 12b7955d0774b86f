"""A test env that imports but has no tasks: it fails to load (an `EnvError` naming it)."""

import verifiers.v1 as vf


class EmptyTaskset(vf.Taskset[vf.Task, vf.TasksetConfig]):
    def load(self):
        return iter(())


__all__ = ["EmptyTaskset"]
