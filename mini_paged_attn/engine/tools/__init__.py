"""Tool calling (OpenAI's ``tools`` / ``tool_choice``): ``choice`` checks a request's function
specs and turns its ``tool_choice`` into a constraint for the engine; ``parsers`` reads tool calls
back out of a model's output (``hermes``, ``llama3_json``).
"""
