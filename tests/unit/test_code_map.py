"""The code's map stays true: docs/architecture.md names every module, and the directory's SQL
stays in its one home, `kvstore.directory.db`."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvstore"
DIRECTORY = PACKAGE / "directory"
SESSION_CALLS = re.compile(r"\b(?:session|_?conn)\.(query|execute|scalar|scalars|get|add|add_all|flush|delete|merge)\(")
SQL_HOME = "kvstore.directory.db"


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" and "__pycache__" not in p.parts)


def test_the_architecture_names_every_module():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`([a-z0-9_/]+(?:\.py|/))`", doc))
    missing = []
    for path in modules():
        relative = path.relative_to(PACKAGE).as_posix()
        folders = {relative.rsplit("/", i)[0] + "/" for i in range(1, relative.count("/") + 1)}
        if relative not in named and not folders & named - {"directory/", "core/"}:
            missing.append(relative)
    assert not missing, f"docs/architecture.md does not name {missing}"


def _sql_home(path: Path) -> bool:
    return path.relative_to(DIRECTORY).as_posix().startswith("db/")


def _runtime_imports(tree: ast.Module) -> list[str]:
    """Modules imported outside `if TYPE_CHECKING:` blocks."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def test_sql_only_in_the_directory_s_db_package():
    outside = [p for p in DIRECTORY.rglob("*.py") if not _sql_home(p) and "__pycache__" not in p.parts]
    assert len(outside) > 20  # the walk found the directory's modules
    offenders = []
    for path in outside:
        source = path.read_text()
        sql_imports = [m for m in _runtime_imports(ast.parse(source)) if m.split(".")[0] == "sqlalchemy"]
        queries = SESSION_CALLS.findall(source)
        if sql_imports or queries:
            offenders.append((path.relative_to(DIRECTORY).as_posix(), sql_imports, queries))
    assert not offenders, offenders


def test_the_sql_check_would_catch_a_query_or_an_import():
    tree = ast.parse("import sqlalchemy\nif TYPE_CHECKING:\n    from sqlalchemy.orm import Session\n")
    assert _runtime_imports(tree) == ["sqlalchemy"]
    assert SESSION_CALLS.search("rows = tx.session.query(Block).all()")
    assert SESSION_CALLS.search("tx.session.get(Worker, 1)")
    for write in ("tx.session.add(row)", "session.flush()", "tx.session.delete(row)", "self._conn.execute('SELECT 1')"):
        assert SESSION_CALLS.search(write), write
    assert not SESSION_CALLS.search("repo.worker(tx.session, 1)")
    assert not SESSION_CALLS.search("repo.flush(tx.session)")


def _package(path: Path) -> str:
    """The importable name of a module or package folder under kvstore/."""
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def test_the_import_contract_keeps_sqlalchemy_in_db_for_every_module():
    """import-linter's forbidden contract names its source modules one by one: every package and
    module of kvstore but kvstore.directory.db must be among them (or under one), so that a module
    added later is checked too."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in contracts if c["type"] == "forbidden" and "sqlalchemy" in c["forbidden_modules"]
                   and any(m.startswith("kvstore.directory.") for m in c["source_modules"])]
    assert {"sqlalchemy", "alembic"} <= set(contract["forbidden_modules"])
    sources = set(contract["source_modules"])
    assert SQL_HOME not in sources and not any(s.startswith(SQL_HOME + ".") for s in sources)
    uncovered = []
    for path in modules():
        name = _package(path)
        parts = name.split(".")
        if name.startswith(SQL_HOME + ".") or name == SQL_HOME:
            continue
        if not any(".".join(parts[:i]) in sources for i in range(1, len(parts) + 1)):
            uncovered.append(name)
    assert not uncovered, f"add these to the contract in pyproject.toml: {uncovered}"


PRIVATE_OF_SERVICE = re.compile(r"\bservice(?:\.[a-z]\w*)*\.(_[a-z]\w*)")


def test_tests_touch_no_private_attribute_of_the_directory_service():
    """Tests read the service and its parts through what they offer, so that its inside can change."""
    found = [(path.relative_to(ROOT).as_posix(), m.group(0))
             for path in sorted((ROOT / "tests").rglob("*.py")) if path.name != "test_code_map.py"
             for m in PRIVATE_OF_SERVICE.finditer(path.read_text())]
    assert not found, found
    assert PRIVATE_OF_SERVICE.search("stack.service.writer._queue.qsize()")
    assert PRIVATE_OF_SERVICE.search("service._reclaim")
    assert not PRIVATE_OF_SERVICE.search("stack.service.writer.queued")
