"""The interpreter service's NDJSON mapping, checked without a kernel: Jupyter messages in, the
lines `crates/image/interp/server.py` streams out, parsed by the real SDK's own parser."""

import datetime
import importlib.util
import json
import os
from pathlib import Path

from e2b_code_interpreter.models import Execution, parse_output

SERVER = Path(__file__).resolve().parents[2] / "crates" / "image" / "interp" / "server.py"
spec = importlib.util.spec_from_file_location("cordon_interp_server", SERVER)
server = importlib.util.module_from_spec(spec)
spec.loader.exec_module(server)  # the module imports jupyter_client and tornado only when serving


def msg(kind, content, date=None):
    return {
        "msg_type": kind,
        "header": {"msg_type": kind, "date": date or datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)},
        "parent_header": {"msg_id": "m1"},
        "content": content,
    }


def run_through_sdk(messages):
    """What the SDK makes of the lines the server would stream for `messages`."""
    execution = Execution()
    lines = []
    for m in messages:
        out, finished = server.translate(m)
        lines.extend(out)
        if finished:
            break
    lines.append({"type": "end_of_execution"})
    for line in lines:
        parse_output(execution, json.dumps(line))
    return execution, lines


def test_a_whole_cell():
    execution, lines = run_through_sdk(
        [
            msg("status", {"execution_state": "busy"}),
            msg("execute_input", {"code": "x", "execution_count": 7}),
            msg("stream", {"name": "stdout", "text": "out\n"}),
            msg("stream", {"name": "stderr", "text": "warn\n"}),
            msg("display_data", {"data": {"image/png": "iVBORw0K", "text/plain": "<Figure>"}, "metadata": {}}),
            msg("execute_result", {"data": {"text/plain": "'quoted'", "text/html": "<b>q</b>"}, "execution_count": 7}),
            msg("status", {"execution_state": "idle"}),
            msg("stream", {"name": "stdout", "text": "after idle: never sent\n"}),
        ]
    )
    assert [l["type"] for l in lines] == ["number_of_executions", "stdout", "stderr", "result", "result", "end_of_execution"]
    assert lines[1]["timestamp"] == "2026-01-02T03:04:05+00:00"
    assert execution.execution_count == 7
    assert execution.logs.stdout == ["out\n"] and execution.logs.stderr == ["warn\n"]
    figure, main = execution.results
    assert (figure.png, figure.text, figure.is_main_result) == ("iVBORw0K", "<Figure>", False)
    assert (main.text, main.html, main.is_main_result) == ("quoted", "<b>q</b>", True)
    assert execution.text == "quoted"
    assert execution.error is None


def test_error_and_every_mime_key():
    execution, lines = run_through_sdk(
        [
            msg(
                "display_data",
                {
                    "data": {
                        "text/markdown": "**m**",
                        "image/svg+xml": "<svg/>",
                        "image/jpeg": "/9j/",
                        "application/pdf": "JVBE",
                        "text/latex": "$x$",
                        "application/json": {"a": 1},
                        "application/javascript": "1;",
                        "e2b/data": {"d": [1]},
                        "application/vnd.custom+json": {"c": 2},
                    }
                },
            ),
            msg("error", {"ename": "ValueError", "evalue": "bad", "traceback": ["Traceback (most recent call last):", "ValueError: bad"]}),
            msg("status", {"execution_state": "idle"}),
        ]
    )
    [r] = execution.results
    assert (r.markdown, r.svg, r.jpeg, r.pdf, r.latex, r.json, r.javascript, r.data) == (
        "**m**", "<svg/>", "/9j/", "JVBE", "$x$", {"a": 1}, "1;", {"d": [1]},
    )
    assert r.extra == {"application/vnd.custom+json": {"c": 2}}
    assert execution.error.name == "ValueError" and execution.error.value == "bad"
    assert execution.error.traceback == "Traceback (most recent call last):\nValueError: bad"


def test_quotes_are_stripped_only_around_a_string_repr():
    assert server.result_line({"text/plain": "'a'"}, True)["text"] == "a"
    assert server.result_line({"text/plain": "'"}, True)["text"] == "'"
    assert server.result_line({"text/plain": '"a"'}, True)["text"] == '"a"'
    assert "extra" not in server.result_line({"text/plain": "1"}, False)


def test_base64_has_no_trailing_newline():
    line = server.result_line({"image/png": "iVBORw0KGgo=\n", "image/jpeg": "/9j/\n", "text/html": "<p>\n"}, False)
    assert (line["png"], line["jpeg"], line["html"]) == ("iVBORw0KGgo=", "/9j/", "<p>\n")


def test_languages():
    assert server.normalize_language(None) == "python"
    assert server.normalize_language(" PYTHON ") == "python"
    assert server.normalize_language("js") is None
    assert server.normalize_language(3) is None


def test_env_code_sets_and_restores(monkeypatch):
    monkeypatch.setenv("CORDON_T_OLD", "before")
    monkeypatch.delenv("CORDON_T_NEW", raising=False)
    ns = {}
    weird = "quote ' \" backslash \\ newline \n unicode é"
    exec(server.env_setup_code({"CORDON_T_OLD": "during", "CORDON_T_NEW": weird}), ns)
    assert os.environ["CORDON_T_OLD"] == "during" and os.environ["CORDON_T_NEW"] == weird
    exec(server.ENV_RESTORE_CODE, ns)
    assert os.environ["CORDON_T_OLD"] == "before" and "CORDON_T_NEW" not in os.environ
    assert not [k for k in ns if k.startswith("_cordon_") and k != "_cordon_os"]


def test_env_vars_are_checked():
    assert server.check_env_vars(None) is None
    assert server.check_env_vars({"A": "1"}) is None
    assert server.check_env_vars(["A"]) is not None
    assert server.check_env_vars({"A": 1}) is not None
    assert server.check_env_vars({"A=B": "1"}) is not None
    assert server.check_env_vars({"": "1"}) is not None


def test_death_is_explained():
    assert "memory" in server.describe_death(-9)
    assert "SIGTERM" in server.describe_death(-15)
    assert "status 1" in server.describe_death(1)
