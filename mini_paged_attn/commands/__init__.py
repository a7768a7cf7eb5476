"""Sub-commands of the ``mini-paged-attn`` CLI, one module each (see ``cli.py``).

A command module must import only argparse-level things at module import; heavy imports
(torch models, transformers, uvicorn) go inside ``run``.
"""
