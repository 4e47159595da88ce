"""Where a tune's helper processes come from (fa2tune.tune.processes): forked from a server that imported torch once,
with the environment of the process that asked for them.

This module imports no torch at its top, so a child that finds torch imported got it from the fork server.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fa2tune.tune import processes


def _report(environment: dict[str, str] | None, name: str, answers) -> None:
    """In a child: whether torch and fa2tune.tune.job were imported before this ran, and the variable's value."""
    preloaded = "torch" in sys.modules and "fa2tune.tune.job" in sys.modules
    if environment is not None:
        processes.adopt(environment)
    answers.put((preloaded, os.environ.get(name)))


def _ask_child(context, environment, name):
    answers = context.Queue()
    child = context.Process(target=_report, args=(environment, name, answers))
    child.start()
    answer = answers.get(timeout=120)
    child.join(timeout=60)
    assert child.exitcode == 0
    return answer


@pytest.mark.skipif(sys.platform != "linux", reason="the fork server is used where fork is (Linux)")
def test_children_start_with_torch_imported_and_the_asking_process_s_environment(monkeypatch):
    context = processes.context()
    assert context.get_start_method() == "forkserver"
    monkeypatch.setenv("FA2TUNE_TEST_SET_AFTER_THE_SERVER", "here")  # the server started without it
    preloaded, value = _ask_child(context, dict(os.environ), "FA2TUNE_TEST_SET_AFTER_THE_SERVER")
    assert preloaded, "the fork server did not preload torch and fa2tune.tune.job"
    assert value == "here"
    # Why children adopt their parent's environment: one that does not has the server's.
    assert _ask_child(context, None, "FA2TUNE_TEST_SET_AFTER_THE_SERVER")[1] is None


@pytest.mark.skipif(sys.platform != "linux", reason="the fork server is used where fork is (Linux)")
def test_a_server_that_imported_triton_in_the_other_mode_is_not_used(monkeypatch):
    processes.context()  # the server runs, started with this process's TRITON_INTERPRET
    other = "0" if os.environ.get("TRITON_INTERPRET") == "1" else "1"
    monkeypatch.setenv("TRITON_INTERPRET", other)
    assert processes.context().get_start_method() == "spawn"
    monkeypatch.undo()
    assert processes.context().get_start_method() == "forkserver"


def test_importing_the_package_and_the_command_line_does_not_import_torch():
    # `fa2tune tune` starts the fork server before this process spends seconds importing torch: that needs a
    # package and a CLI (its parser, --head-dim and --dtype checks, the known-GPU list) that import no torch.
    code = (
        "import sys, fa2tune, fa2tune.cli, fa2tune.tune.processes; fa2tune.cli.build_parser(); "
        "fa2tune.cli.arguments.head_dim('128'); print(sorted(m for m in ('torch', 'triton') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_package_s_names_import_on_first_use():
    import fa2tune

    assert fa2tune.attention is fa2tune.api.attention.attention
    assert fa2tune.get_kernel is fa2tune.api.attention_kernel.get_kernel
    assert set(fa2tune.__all__) <= set(dir(fa2tune))
    with pytest.raises(AttributeError, match="no_such_name"):
        fa2tune.no_such_name  # noqa: B018
