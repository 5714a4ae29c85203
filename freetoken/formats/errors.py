"""The one error type every file-format problem raises."""

from __future__ import annotations

import os


class FormatError(ValueError):
    """A model file is malformed, unsupported or inconsistent.

    The message always names the file and, where known, the tensor or metadata key, and says
    what was expected.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike | None = None,
        tensor: str | None = None,
        key: str | None = None,
    ) -> None:
        self.path = None if path is None else os.fspath(path)
        self.tensor = tensor
        self.key = key
        where = []
        if self.path is not None:
            where.append(self.path)
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        if key is not None:
            where.append(f"key {key!r}")
        prefix = ", ".join(where)
        super().__init__(f"{prefix}: {message}" if prefix else message)
