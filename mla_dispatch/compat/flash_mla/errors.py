"""The error FlashMLA's own asserts correspond to."""

__all__ = ["FlashMLAArgumentError"]


class FlashMLAArgumentError(ValueError, AssertionError):
    """An argument FlashMLA (or sgl-flash-mla / vLLM's copy) would reject with ``assert``; also a ``ValueError``.

    Its message names the argument. What the original accepts but mla_dispatch does not provide raises
    ``NotImplementedError`` instead, naming the argument too.
    """
