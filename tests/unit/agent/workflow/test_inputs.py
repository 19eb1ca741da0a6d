"""agent/workflow/inputs.py, the one input step: what the user gave checked once into the state and the run
options, kept apart; a target kind the output folder cannot hold refused."""

from __future__ import annotations

import pytest


# ---- the input step ----------------------------------------------------------------------
def test_the_input_step_gives_the_state_and_the_run_options_apart(tiny_checkpoints, tmp_path):
    """`migrator run` is checked once into the state the graph runs on; the run options go to the
    graph's config (agent.workflow.state.RunOptions), never into the stored state."""
    from agent.cli import _parser
    from agent.workflow import inputs
    from agent.workflow.state import OPTION_KEYS, MigrationState, run_options

    checkpoint = tiny_checkpoints("llama")
    args = _parser().parse_args(["run", str(checkpoint), "--output-dir", str(tmp_path / "out"), "--max-rounds", "2",
                                 "--timeout", "30", "--device", "cpu"])
    state, options = inputs.validate_run(args)
    assert options == {"max_rounds": 2, "timeout_s": 30, "device": "cpu"}
    assert not set(OPTION_KEYS) & set(state) and not set(OPTION_KEYS) & set(MigrationState.__annotations__)
    assert state["target"] == str(checkpoint.resolve()) and state["recipe_target"] == "standalone"
    assert (tmp_path / "out").is_dir()                       # the output dir was checked by making it
    assert run_options({"configurable": options}) == options
    from engine import defaults

    assert run_options(None) == {"max_rounds": defaults.MAX_ROUNDS, "timeout_s": None, "device": "auto"}


def test_the_input_step_refuses_a_target_kind_the_output_dir_cannot_hold(tiny_checkpoints, tmp_path):
    from agent import errors
    from agent.cli import _parser
    from agent.workflow import inputs

    args = _parser().parse_args(["run", str(tiny_checkpoints("llama")), "--output-dir", str(tmp_path / "out"),
                                 "--target", "framework"])
    with pytest.raises(errors.InputError, match="--target framework needs --output-dir inside a cann-recipes-infer"):
        inputs.validate_run(args)


def test_a_reference_python_given_as_a_relative_path_is_kept_absolute(tiny_checkpoints, tmp_path, monkeypatch):
    """`--reference-python .venv-tf5.0/bin/python` (as the README writes it): the recipe's runs and the precision
    check start it from other folders, so the state holds it against the folder it was typed in; a bare name
    stays a name (looked up on PATH)."""
    from agent.cli import _parser
    from agent.workflow import inputs

    monkeypatch.chdir(tmp_path)
    checkpoint = tiny_checkpoints("llama")
    for given, kept in ((".venv-tf5.0/bin/python", str(tmp_path / ".venv-tf5.0" / "bin" / "python")),
                        ("python3", "python3"), (None, None)):
        args = _parser().parse_args(["run", str(checkpoint), "--output-dir", str(tmp_path / "out"),
                                     *(["--reference-python", given] if given else [])])
        state, _ = inputs.validate_run(args)
        assert state["reference_python"] == kept
