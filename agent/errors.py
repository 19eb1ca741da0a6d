"""Errors the CLI turns into one line on stderr and a distinct exit code."""

from __future__ import annotations

# Exit codes (also documented in README.md).
EXIT_OK = 0
EXIT_FAILED = 1          # the recipe still fails after the repair rounds
EXIT_USAGE = 2           # bad command line / bad input path or link
EXIT_UNSUPPORTED = 3     # architecture or checkpoint the migrator cannot serve
EXIT_ENVIRONMENT = 4     # requested device not usable (e.g. --device npu without NPU)
EXIT_NEEDS_WEIGHTS = 5   # weights too large to download: pass --weights PATH
EXIT_OOM = 6             # the model does not fit on one card: report written
EXIT_VENDOR = 7          # vendoring produced code that violates the recipe contract
EXIT_STANDIN_UNCOVERED = 8  # under the npu stand-in, a torch_npu op without a reference kernel was called
EXIT_BUSY = 75           # another run of the same recipe / migration holds its lock (EX_TEMPFAIL)
EXIT_INTERNAL = 70       # a bug in the migrator: traceback saved to a file (EX_SOFTWARE)
EXIT_INTERRUPTED = 130   # SIGINT (Ctrl-C): the run's process tree is stopped; --resume continues
EXIT_TERMINATED = 143    # SIGTERM: the same


class MigratorError(Exception):
    exit_code = EXIT_FAILED

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class InputError(MigratorError):
    exit_code = EXIT_USAGE


class UnsupportedModelError(MigratorError):
    exit_code = EXIT_UNSUPPORTED


class EnvironmentProblem(MigratorError):
    exit_code = EXIT_ENVIRONMENT


class VendorError(MigratorError):
    exit_code = EXIT_VENDOR
