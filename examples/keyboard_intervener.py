"""A keyboard intervener for mmrl (``sampler.intervener``, mmrl/interventions.py): a person
takes over one env with keys that move the end effector by a 2-D or 3-D delta, as in
HIL-SERL's teleop interventions.

UNTESTED WITHOUT HARDWARE. mmrl's tests exercise the intervention machinery with the
scripted intervener (tests/train/test_interventions.py); this file has not been run against a
keyboard and a robot. Read it as a starting point for your device, check the axes and signs
against your controller before you trust it near a real arm.

Use it from a run config, with this directory on the import path
(``PYTHONPATH=examples mmrl train --config my_run.yaml``):

```yaml
env: {type: maniskill, id: PushCube-v1, num_envs: 1, kwargs: {control_mode: pd_ee_delta_pos}}
algo: {loss: {type: sac}}
sampler:
  type: env
  intervener: {type: "keyboard_intervener:KeyboardIntervener", kwargs: {dims: 3, speed: 1.0}}
```

Keys, with ``pynput`` installed (``pip install pynput``; on Linux it needs a display, on macOS
the terminal needs the accessibility permission): hold ``space`` to take over, and while it
is held ``w``/``s`` move +x/−x, ``a``/``d`` +y/−y, ``r``/``f`` +z/−z (``dims: 3``); ``g``
toggles the gripper (the action value after the delta, ``gripper: true``). Release ``space``
and the policy acts again. Without ``pynput`` the terminal is read instead (POSIX only, the
terminal in which ``mmrl train`` runs): each movement key takes over for
``hold_decisions`` decisions, as held keys cannot be seen there.

The person drives env ``env_index`` (real robots run one env); the other envs, and the
action values it does not set, keep the policy's proposal.
"""

from __future__ import annotations

import sys

import numpy as np

_AXES = {"w": (0, 1.0), "s": (0, -1.0), "a": (1, 1.0), "d": (1, -1.0), "r": (2, 1.0), "f": (2, -1.0)}


class KeyboardIntervener:
    """Takes over env ``env_index`` while the person holds the takeover key; its action is
    ``speed`` × the held keys' direction in the first ``dims`` values (the rest: the policy's)."""

    def __init__(self, dims: int = 3, speed: float = 1.0, env_index: int = 0, gripper: bool = False, hold_decisions: int = 3):
        if dims not in (2, 3):
            raise ValueError(f"dims must be 2 or 3 (an end-effector delta), got {dims}")
        self.dims, self.speed, self.env_index, self.gripper = dims, speed, env_index, gripper
        self.gripper_closed = False
        try:
            self.keys = _HeldKeys()
        except ImportError:
            self.keys = _TerminalKeys(hold_decisions)

    def intervene(self, observations, proposed, step, env):
        pressed = self.keys.poll()
        if "g" in pressed.toggled:
            self.gripper_closed = not self.gripper_closed
        if not pressed.engaged:
            return None
        actions = np.array(proposed.detach().cpu().numpy() if hasattr(proposed, "detach") else proposed, dtype=np.float32)
        delta = np.zeros(self.dims, np.float32)
        for key in pressed.held:
            if key in _AXES and _AXES[key][0] < self.dims:
                axis, sign = _AXES[key]
                delta[axis] += sign * self.speed
        actions[self.env_index, :, : self.dims] = delta  # the same delta over the whole chunk
        if self.gripper and actions.shape[-1] > self.dims:
            actions[self.env_index, :, self.dims] = -1.0 if self.gripper_closed else 1.0
        rows = np.zeros(actions.shape[0], dtype=bool)
        rows[self.env_index] = True
        return rows, actions

    def close(self) -> None:
        self.keys.close()


class _Pressed:
    def __init__(self, engaged: bool, held: set, toggled: set):
        self.engaged, self.held, self.toggled = engaged, held, toggled


class _HeldKeys:
    """Keys held down now, from a pynput listener thread."""

    def __init__(self):
        from pynput import keyboard

        self._keyboard = keyboard
        self.held: set = set()
        self.toggled: set = set()
        self.listener = keyboard.Listener(on_press=self._press, on_release=self._release)
        self.listener.start()

    def _name(self, key) -> str:
        if key == self._keyboard.Key.space:
            return "space"
        return getattr(key, "char", None) or ""

    def _press(self, key) -> None:
        name = self._name(key)
        if name == "g" and name not in self.held:
            self.toggled.add(name)
        self.held.add(name)

    def _release(self, key) -> None:
        self.held.discard(self._name(key))

    def poll(self) -> _Pressed:
        toggled, self.toggled = self.toggled, set()
        held = set(self.held)
        return _Pressed("space" in held, held, toggled)

    def close(self) -> None:
        self.listener.stop()


class _TerminalKeys:
    """Key presses from the terminal (no key-up events there): a movement key takes over
    for the next ``hold`` decisions."""

    def __init__(self, hold: int):
        import termios
        import tty

        if not sys.stdin.isatty():
            raise RuntimeError("the keyboard intervener reads the terminal without pynput: run mmrl train in one, or pip install pynput")
        self.hold, self.left, self.direction = hold, 0, set()
        self._fd = sys.stdin.fileno()
        self._saved = termios.tcgetattr(self._fd)
        tty.setcbreak(self._fd)

    def poll(self) -> _Pressed:
        import select

        toggled, typed = set(), set()
        while select.select([sys.stdin], [], [], 0)[0]:
            char = sys.stdin.read(1).lower()
            if char == "g":
                toggled.add(char)
            elif char in _AXES:
                typed.add(char)
        if typed:
            self.left, self.direction = self.hold, typed
        engaged = self.left > 0
        self.left = max(0, self.left - 1)
        return _Pressed(engaged, self.direction if engaged else set(), toggled)

    def close(self) -> None:
        import termios

        termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved)
