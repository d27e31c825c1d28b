"""A coding agent's tool list (OpenAI function tools with JSON-schema parameters, about 2,000
SmolLM2 tokens once rendered) and the scripted turns of one agent's session: which tool it calls
each turn, with what arguments, and what the tool answers."""

from __future__ import annotations

import json
from typing import Any


def _tool(name: str, description: str, props: dict[str, Any], required: list[str]) -> dict:
    params = {"type": "object", "properties": props, "required": required,
              "additionalProperties": False}  # fmt: skip
    return {"type": "function",
            "function": {"name": name, "description": description, "parameters": params}}  # fmt: skip


def _s(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **extra}


def _i(description: str, minimum: int = 0, **extra: Any) -> dict[str, Any]:
    return {"type": "integer", "description": description, "minimum": minimum, **extra}


def _b(description: str) -> dict[str, Any]:
    return {"type": "boolean", "description": description, "default": False}


TOOLS = [
    _tool("run_shell",
          "Run one command in a bash shell in the repository's root and return its standard "
          "output and standard error, cut to the last 400 lines. The shell keeps no state "
          "between calls: change directory inside the command. Use it for builds, tests, git "
          "and package managers; never for reading or editing files, which have their own tools. "
          "Commands that wait for input or run longer than the timeout are stopped.",
          {"command": _s("The command line, as typed in bash."),
           "timeout_s": _i("Seconds before the command is stopped.", 1, maximum=600, default=120),
           "description": _s("Five to ten words saying what the command does, shown to the user.")},
          ["command"]),
    _tool("read_file",
          "Read a text file of the repository and return its lines, each prefixed with its line "
          "number. Long files are returned in pages: pass offset and limit to read further. "
          "Binary files and files over 2 MB are refused. Read a file before editing it.",
          {"path": _s("Path relative to the repository root."),
           "offset": _i("First line to return, counted from 1.", 1, default=1),
           "limit": _i("Most lines to return.", 1, maximum=2000, default=400)},
          ["path"]),
    _tool("write_file",
          "Create a file, or replace a whole file, with the given content. Parent directories "
          "are created. Prefer edit_file to change part of an existing file: rewriting a file "
          "loses what was not read.",
          {"path": _s("Path relative to the repository root."),
           "content": _s("The file's complete new content."),
           "overwrite": _b("Replace the file if it exists; otherwise an existing file is an "
                           "error.")},
          ["path", "content"]),
    _tool("edit_file",
          "Replace an exact piece of text in a file with new text. The old text must appear in "
          "the file exactly once (include enough surrounding lines to make it unique) unless "
          "replace_all is set. Whitespace and indentation must match the file byte for byte.",
          {"path": _s("Path relative to the repository root."),
           "old_text": _s("The text to replace, copied exactly from the file."),
           "new_text": _s("The replacement text."),
           "replace_all": _b("Replace every occurrence instead of exactly one.")},
          ["path", "old_text", "new_text"]),
    _tool("search_code",
          "Search the repository's files for a regular expression (ripgrep syntax) and return "
          "the matching lines with their paths and line numbers, at most 200 matches. Files "
          "ignored by git are skipped.",
          {"pattern": _s("Regular expression to look for."),
           "path": _s("Directory or file to search under, relative to the root.", default="."),
           "glob": _s("Only files whose names match this glob, e.g. '*.py'."),
           "case_sensitive": _b("Match case exactly."),
           "context_lines": _i("Lines of context to show around each match.", maximum=10,
                               default=0)},
          ["pattern"]),
    _tool("list_files",
          "List the files and directories under a path, recursively up to a depth, with sizes "
          "in bytes. Paths ignored by git are left out.",
          {"path": _s("Directory relative to the repository root.", default="."),
           "depth": _i("How many directory levels to descend.", 1, maximum=6, default=2),
           "pattern": _s("Only entries whose names match this glob.")},
          []),
    _tool("run_tests",
          "Run the project's test suite, or a part of it, and return a summary: how many tests "
          "passed, failed and were skipped, and for each failure its name, its assertion and "
          "the last lines of its traceback.",
          {"target": _s("A test file, directory or node id; the whole suite when absent."),
           "keyword": _s("Only tests whose names match this expression."),
           "fail_fast": _b("Stop at the first failure."),
           "timeout_s": _i("Seconds before the run is stopped.", 1, maximum=1800, default=300)},
          []),
    _tool("git_diff",
          "Show the changes of the working tree as a unified diff: against the index, against "
          "HEAD, or between two revisions.",
          {"base": _s("Revision to compare against.", default="HEAD"),
           "head": _s("Second revision; the working tree when absent."),
           "paths": {"type": "array", "items": {"type": "string"},
                     "description": "Only changes to these paths."},
           "staged": _b("Compare the index with the base instead of the working tree.")},
          []),
    _tool("web_fetch",
          "Fetch a web page over HTTPS and return its text as Markdown, at most 20,000 "
          "characters. Use it for documentation and issue threads the user links to; do not "
          "use it to reach services on the local network.",
          {"url": _s("The page's address, starting with https://.", format="uri"),
           "question": _s("What to look for in the page; the answer is quoted first.")},
          ["url"]),
    _tool("update_plan",
          "Record the plan of the task as a list of steps with their states, replacing the "
          "previous one. Keep exactly one step in progress; mark a step done as soon as it is "
          "finished, not in batches.",
          {"steps": {"type": "array", "description": "The steps, in order.", "items": {
              "type": "object", "additionalProperties": False, "required": ["step", "state"],
              "properties": {"step": _s("What the step does, in one line."),
                             "state": _s("Where it stands.",
                                         enum=["pending", "in_progress", "done"])}}},
           "note": _s("Why the plan changed, when it did.")},
          ["steps"]),
    _tool("ask_user",
          "Ask the user a question and wait for the answer. Only for decisions the repository "
          "cannot settle (which behaviour they want, credentials, a choice between designs); "
          "never to ask permission for a step of the task.",
          {"question": _s("The question, in one or two sentences."),
           "choices": {"type": "array", "items": {"type": "string"}, "maxItems": 4,
                       "description": "Answers to offer, when the question has few."}},
          ["question"]),
]  # fmt: skip

SYSTEM = (
    "You are a coding agent working in a Python repository. Work step by step: look before "
    "you change anything, make the smallest change that solves the task, and run the tests "
    "before you say it is done. Call one tool at a time."
)

FILES = ("parser", "cache", "server", "router", "config", "scheduler", "client", "metrics")


def first_message(agent: int) -> str:
    """An agent's task, distinct from every other agent's."""
    name = FILES[agent % len(FILES)]
    return (f"Task {agent}: the function load_{name}_{agent} in src/app/{name}_{agent}.py "
            f"returns None when its input file is empty; it should raise ValueError naming the "
            f"file. Fix it and add a test.")  # fmt: skip


def scripted_call(agent: int, turn: int) -> dict[str, Any]:
    """The call an agent makes at `turn`: search, read, edit, test, then look at the diff."""
    name = f"{FILES[agent % len(FILES)]}_{agent}"
    path = f"src/app/{name}.py"
    steps = [
        ("search_code", {"pattern": f"def load_{name}", "glob": "*.py"}),
        ("read_file", {"path": path, "offset": 1, "limit": 80}),
        (
            "edit_file",
            {
                "path": path,
                "old_text": "    if not data:\n        return None",
                "new_text": "    if not data:\n        raise ValueError(f'{path} is empty')",
            },
        ),  # fmt: skip
        ("run_tests", {"target": f"tests/test_{name}.py", "fail_fast": True}),
        ("git_diff", {"paths": [path]}),
    ]
    tool, args = steps[turn % len(steps)]
    return {"id": f"call_{agent}_{turn}", "type": "function",
            "function": {"name": tool, "arguments": json.dumps(args)}}  # fmt: skip


def tool_result(agent: int, turn: int, lines: int) -> str:
    """What the tool answers: `lines` lines of this agent's code (about 12 tokens a line)."""
    name = f"{FILES[agent % len(FILES)]}_{agent}"
    body = [f"{turn * lines + i + 1:>4}  value_{agent}_{i} = parse_{name}(rows[{i}], "
            f"strict={i % 2 == 0})" for i in range(lines)]  # fmt: skip
    return "\n".join(body)
