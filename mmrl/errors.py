"""Errors meant for people: each names the field, the bad value and what is allowed."""

from contextlib import contextmanager


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
    the step. The run stops; the last checkpoint is left intact. ``remote_traceback``: the
    worker process's traceback where it sent one (the CLI prints it with ``MMRL_DEBUG=1``)."""

    remote_traceback: str | None = None


class UserCodeError(RuntimeError):
    """Code the user brought raised while mmrl called it: a simulator's ``env.reset`` /
    ``env.step`` (with the env wrappers around it) or a reward component. Raised where mmrl
    makes the call (:func:`call_user_code`), chained ``from`` the original exception, and
    completed on its way out by the layers it passes (:func:`fault_context`): the env or
    sampler, the env index and its reset seed, the run's seed, the update, the groups.

    The CLI prints it as one line and exits with code 1 (``MMRL_DEBUG=1``: the traceback
    first). An exception in mmrl's own code never becomes one and keeps its traceback."""

    # what the message shows, in this order: key -> how (other keys follow as "key value")
    _SHOWN = {
        "reward": "{}", "source": "{}", "env_index": "env index {}", "reset_seed": "reset seed {}", "seed": "seed {}",
        "phase": "{}", "update": "update {}", "groups": "groups {}", "task": "task {!r}",
    }

    def __init__(self, call: str, error: BaseException | str, **where):
        self.call = call  # what mmrl called: "env.step", "env.reset", "reward 'math_answer'"
        self.error = error if isinstance(error, str) else _first_line(error)
        self.where: dict = {}
        self.add(**where)
        super().__init__(call, self.error)  # (call, error): what unpickling rebuilds it from

    def add(self, **where) -> "UserCodeError":
        """Fill in context the raiser did not know (what it set first stays); returns self."""
        for key, value in where.items():
            if value is not None:
                self.where.setdefault(key, value)
        return self

    def context(self, skip: tuple[str, ...] = ()) -> str:
        """The context as shown in the message, without the keys in ``skip``."""
        keys = [k for k in self._SHOWN if k in self.where] + [k for k in self.where if k not in self._SHOWN]
        return ", ".join(self._SHOWN.get(k, f"{k} {{}}").format(self.where[k]) for k in keys if k not in skip)

    def __str__(self) -> str:
        context = self.context()
        return f"{self.call} ({context}) raised {self.error}" if context else f"{self.call} raised {self.error}"


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


# mmrl's own errors meant for people pass through a user-code call as they are
_PASSED_THROUGH = (UserCodeError, ConfigError, MissingExtraError, NonFiniteError)


def call_user_code(call: str, fn, *args, where: dict | None = None, **kwargs):
    """``fn(*args, **kwargs)``, where ``fn`` is code the user brought; an exception from it
    becomes a :class:`UserCodeError` naming ``call`` and ``where``, chained from it (mmrl's
    own errors for people, such as a ConfigError, pass as they are)."""
    try:
        return fn(*args, **kwargs)
    except _PASSED_THROUGH:
        raise
    except Exception as e:
        raise UserCodeError(call, e, **(where or {})) from e


@contextmanager
def fault_context(**where):
    """Adds ``where`` (e.g. ``update=3, groups="0-3"``) to a :class:`UserCodeError` that
    passes through the block."""
    try:
        yield
    except UserCodeError as e:
        e.add(**where)
        raise


def run_source(cfg) -> str:
    """What a run (a train config) samples, for messages: ``env 'id'`` or ``sampler 'type'``."""
    env = getattr(cfg, "env", None)
    return f"env {env.id or env.type!r}" if env is not None else f"sampler {cfg.sampler.type!r}"
