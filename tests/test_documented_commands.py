"""Every `python -m benchmarks.X` / `python -m experiments.X` command that the pages (README.md and every page under
docs/) show runs, with the flags as documented, at toy sizes.

`REGISTRY` holds each documented command (as the docs write it, continuation lines joined, comments dropped) and
how it is checked: run here as `python -m` runs it (`runpy`, in a fresh folder, so its default output paths are
the documented ones) with its documented arguments (placeholders filled in) followed by toy-size flags, or by an
existing test that already runs it with those flags. A command the docs show that the registry lacks fails
`test_every_documented_command_is_registered`, so a newly documented command cannot go untested; each module's
default path is reached by a test of the default suite, heavier variants are `slow`.
"""
import ast
import glob
import pathlib
import re
import runpy
import sys

import pytest
from documented_cases import ALL_PAGES, PLACEHOLDERS, REGISTRY, ROOT, documented, module_of



def test_every_documented_command_is_registered():
  """Each command the pages show has a case, and each case a command the pages show (none left stale)."""
  shown = documented()
  assert sorted(set(shown) - set(REGISTRY)) == [], "documented but not in REGISTRY (add how it is tested)"
  assert sorted(set(REGISTRY) - set(shown)) == [], "in REGISTRY but no longer documented"


def test_cases_keep_the_documented_flags():
  """A case runs its command's documented arguments (placeholders filled in) first; toy-size flags only follow."""
  for command, case in REGISTRY.items():
    if case.argv is not None:
      documented_args = [PLACEHOLDERS.get(a, a) for a in command.split()[3:]]
      assert list(case.argv[: len(documented_args)]) == documented_args, command


def _test_names(path: pathlib.Path) -> dict[str, bool]:
  """{test function: whether it is marked slow} of a test file."""
  names = {}
  for node in ast.parse(path.read_text()).body:
    if isinstance(node, ast.FunctionDef):
      names[node.name] = any(ast.unparse(d) == "pytest.mark.slow" for d in node.decorator_list)
  return names


def test_covered_commands_name_a_test_that_runs_by_default():
  """A command checked elsewhere names a test that exists, and runs in the default suite unless the case is slow."""
  for command, case in REGISTRY.items():
    if case.covered:
      path, name = case.covered.split("::")
      names = _test_names(ROOT / path)
      assert name in names, (command, case.covered)
      assert case.slow or not names[name], command
    assert (case.argv is None) != (not case.covered), f"{command}: run here (argv) or covered, not both"
    assert case.why or (case.argv is not None and not case.slow), f"{command}: say why it is slow or covered"


def test_each_module_reaches_its_default_path_by_default():
  """Every module the pages show has a case of the default suite (run here, or by a default-suite test), or a
  slow case whose `reached_by` default-suite test runs the module with other toy flags."""
  modules = {module_of(c) for c in REGISTRY if module_of(c) != "benchmarks.X"}
  by_default = {module_of(c) for c, case in REGISTRY.items() if not case.slow or case.reached_by}
  assert sorted(modules - by_default) == []
  for command, case in REGISTRY.items():
    if case.reached_by:
      path, name = case.reached_by.split("::")
      assert _test_names(ROOT / path).get(name) is False, (command, case.reached_by)  # exists, not slow


def _run(command: str, capsys) -> str:
  """`command`'s case run as `python -m` runs it, in the current folder: what it printed."""
  case = REGISTRY[command]
  module = module_of(command)
  argv = [a for arg in case.argv for a in (glob.glob(arg) if "*" in arg else [arg])]
  old = sys.argv
  sys.argv = [module, *argv]
  try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
  except SystemExit as exit_:
    assert exit_.code in (0, None), f"{command} exited with {exit_.code}"
  finally:
    sys.argv = old
  return capsys.readouterr().out


@pytest.mark.parametrize("command", [pytest.param(c, marks=[pytest.mark.slow] if case.slow else [], id=c[10:80])
                                     for c, case in REGISTRY.items() if case.argv is not None])
def test_documented_command_runs(command, tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)  # default output folders (runs/...) as the docs name them
  for first in REGISTRY[command].before:
    _run(first, capsys)
  out = _run(command, capsys)
  assert REGISTRY[command].expect in out


ANY_COMMAND = re.compile(r"python -m ((?:benchmarks|experiments|jaxcomp)\.\w+)(.*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def _shown_flags() -> dict[str, dict[str, str]]:
  """{module: {--flag: the page that shows it first}} over every command of README.md and docs/**/*.md."""
  shown: dict[str, dict[str, str]] = {}
  for command, page in documented(ALL_PAGES, ANY_COMMAND).items():
    own = re.split(r";|\|\||&&|\s\|\s", command)[0]  # this command's own arguments
    for flag in FLAG.findall(own):
      shown.setdefault(module_of(command), {}).setdefault(flag, page)
  return shown


def _help_flags(module: str, capsys) -> set[str]:
  """The flags `python -m module --help` prints."""
  old = sys.argv
  sys.argv = [module, "--help"]
  try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
  except SystemExit:
    pass
  finally:
    sys.argv = old
  return set(FLAG.findall(capsys.readouterr().out))


def test_every_flag_the_docs_show_is_a_flag_of_its_command(capsys):
  """A documented `--flag` that the command's own `--help` does not list (renamed, removed, never there) fails
  here with the page that shows it: a stale flag cannot sit in the docs."""
  stale = []
  for module, flags in sorted(_shown_flags().items()):
    if module.endswith(".X"):
      continue
    known = _help_flags(module, capsys)
    stale += [f"{page}: python -m {module} {flag}" for flag, page in flags.items() if flag not in known]
  assert stale == [], "documented flags the command does not have"
