from helpers.tiny_models import tiny_model_factory  # noqa: F401  (the session fixture)
