"""The engine behind a process boundary: the ``EngineCore`` loop that steps an ``LLMEngine``,
its messages, and the clients a frontend holds (on a thread, in a child process). The files:
docs/architecture.md, ``engine/process/``.
"""
