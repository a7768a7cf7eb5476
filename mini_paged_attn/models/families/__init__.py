"""One module per model family, each declaring its :class:`~..family.Family` as ``FAMILY``
(and an MoE family's expert config reader); ``models/registry.py`` lists them."""
