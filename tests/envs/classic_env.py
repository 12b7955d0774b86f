"""A classic (verifiers < 0.4) env, as users' envs were written before v1: `load_environment`. It is
never loaded, only named: verifiers 0.4 has no classic API."""


def load_environment(**kwargs):
    raise NotImplementedError("a classic env")
