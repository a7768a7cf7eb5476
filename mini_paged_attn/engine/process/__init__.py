"""The engine behind a process boundary: the ``EngineCore`` busy loop (``core``) that steps an
``LLMEngine``, the ``messages`` it exchanges with its client, and the clients a frontend holds:
``InprocEngineClient`` (``client``: the core on a thread) and ``MPEngineClient`` (``mp_client``:
the core in the child process of ``child``).
"""
