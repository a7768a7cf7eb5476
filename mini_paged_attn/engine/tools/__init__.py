"""Tool calling (OpenAI's ``tools`` / ``tool_choice``): the specs checked and turned into a
constraint, and tool calls read back from a model's output. The files: docs/architecture.md,
``engine/tools/``.
"""
