"""The one input step of a workflow run: what the CLI checked, as the state and config the graph runs on.

* `host_environment(device)`: the environment record of this host (engine.environment) with whether a
  stand-in run can happen here (npu_standin.availability): `migrator env` and the detect_env node.
"""

from __future__ import annotations

from agent.errors import EnvironmentProblem
from engine.environment import DeviceUnavailableError, detect_environment


def host_environment(device: str = "auto") -> dict:
    """The environment of the device `device` names; one it cannot have is exit 4 (EnvironmentProblem)."""
    from npu_standin import availability

    try:
        return {**detect_environment(device), "npu_standin": availability()}
    except DeviceUnavailableError as exc:
        raise EnvironmentProblem(str(exc)) from exc
