"""What the backend modules share: package versions and one-line error texts."""

from __future__ import annotations

import importlib.metadata


def dist_version(*names: str) -> str | None:
    """The installed version of the first distribution found among ``names``, else None."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        except Exception:  # broken metadata must not break detection
            continue
    return None


def first_line(text: str | None, limit: int = 200) -> str:
    for line in (text or "").splitlines():
        line = line.strip()
        if line:
            return line if len(line) <= limit else line[: limit - 3] + "..."
    return ""


def exception_chain(exc: BaseException) -> list[BaseException]:
    chain, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


def short_error(exc: BaseException) -> str:
    # The root cause is the informative part ("libhccl.so: cannot open shared object file").
    root = exception_chain(exc)[-1]
    return f"{type(root).__name__}: {first_line(str(root)) or '(no message)'}"
