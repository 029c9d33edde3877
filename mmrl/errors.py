"""Errors meant for people: each names the field, the bad value and what is allowed."""


class ConfigError(ValueError):
    """Bad user input (config key, value, type name, file, env id). The CLI prints it as
    one line and exits with code 2."""

    def __init__(self, field: str, value, allowed: str):
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"{field}: got {value!r}; {allowed}")


class MissingExtraError(ImportError):
    """An optional dependency is not installed; says which extra brings it."""

    def __init__(self, package: str, extra: str, what: str):
        self.extra = extra
        super().__init__(f"{what} needs the '{package}' package: pip install 'mmrl[{extra}]'")


class NonFiniteError(RuntimeError):
    """A reward or loss became NaN/inf; names the step and the component."""


class RolloutWorkerError(RuntimeError):
    """A rollout worker failed or died; names the worker, its env or sampler, the seed and
    the step. The run stops; the last checkpoint is left intact."""
