"""Tools for language agents: a registry of tools (:mod:`.tool`), the built-in calculator and
Python executor (:mod:`.builtin`), the sandbox that runs code (:mod:`.sandbox`) and the
tool-call formats (:mod:`.calls`). The env that lets an agent use them is ``env: {type:
tools}`` (``envs/tool_env.py``); docs/agents.md tells the whole story."""
