"""The one error the kernel launchers raise on inputs they cannot take (kernels import
nothing of Folio, so this is not a folio.worker.errors type; it is a ValueError)."""


class KernelInputError(ValueError):
    """A tensor's layout, dtype or shape that the op does not support."""
