"""The directory starts the way deploy/compose.yaml and docs/operations.md say, on PostgreSQL.

The commands are read from the files themselves, not copied here: the compose file's `migrate`
and `directory` services (command and environment), and every `kvstore directory serve` line
in operations.md's code blocks (shell lines and systemd `ExecStart=`), each with the database
URL the document gives it and after the SQL the document runs to create the role and the
database. They run against a throw-away PostgreSQL cluster on this machine, so only what
loopback forces is changed: a host name is 127.0.0.1 (a wildcard `--host` stays, since the
directory decides by it whether it needs `--advertise-url`), ports are free ones, the URL's host
and port are the cluster's, and files under /etc or /run live in the test's folder. Every other
flag is passed as written. Each directory must answer `/readyz?workers=0` (database reachable,
index built, a leader) and record the URL the other replicas reach it at."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
import yaml

from tests.helpers import REPO, PostgresCluster, free_port, kvstore_cmd, stop, wait_http

OPERATIONS = REPO / "docs" / "operations.md"
COMPOSE = REPO / "deploy" / "compose.yaml"
ENV = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}  # nothing of this shell's
WILDCARDS = ("0.0.0.0", "::", "[::]")
PATH_FLAGS = ("--admin-token-file", "--worker-token-file", "--data-dir", "--config")


# ---- reading the documents -----------------------------------------------------------------------

def code_blocks(text: str) -> list[tuple[int, str, str]]:
    """(offset, language, body) of every fenced block."""
    return [(m.start(), m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)]


def logical_lines(body: str) -> list[str]:
    """Lines with their backslash continuations joined."""
    return body.replace("\\\n", " ").splitlines()


def serve_args(line: str) -> list[str] | None:
    """The arguments after `kvstore directory serve` on a shell or ExecStart= line, else None."""
    line = line.strip().removeprefix("ExecStart=")
    if "directory serve" not in line:
        return None
    words = shlex.split(line, comments=True)
    for i in range(len(words) - 2):
        if words[i].rsplit("/", 1)[-1] == "kvstore" and words[i + 1:i + 3] == ["directory", "serve"]:
            return words[i + 3:]
    return None


def documented_commands(text: str) -> list[tuple[str, list[str], str]]:
    """(where, serve arguments, database URL) of every directory command in the document's code
    blocks; the URL is the KVSTORE_DATABASE_URL the document sets last before the command."""
    found = []
    for offset, _lang, body in code_blocks(text):
        cursor = 0
        for line in logical_lines(body):
            args = serve_args(line)
            if args is None:
                continue
            cursor = body.find("directory serve", cursor) + 1
            at = offset + cursor
            urls = re.findall(r"KVSTORE_DATABASE_URL='?(postgresql\+psycopg://[^'\s]+)", text[:at])
            assert urls, f"operations.md names no PostgreSQL URL before: {line.strip()}"
            found.append((f"operations.md line {text[:at].count(chr(10)) + 1}: {line.strip()}", args, urls[-1]))
    return found


def documented_sql(text: str) -> list[str]:
    """The statements of the block that creates the directory's role and database."""
    blocks = [body for _, lang, body in code_blocks(text) if lang == "sql" and "CREATE DATABASE" in body]
    assert len(blocks) == 1, "operations.md should hold one SQL block that creates the role and the database"
    return [s.strip() for s in re.sub(r"--[^\n]*", "", blocks[0]).split(";") if s.strip()]


# ---- standing in for the hosts -------------------------------------------------------------------

def on_cluster(url: str, cluster: PostgresCluster) -> str:
    """The same role and database on the throw-away cluster."""
    parts = urlsplit(url)
    auth = parts.netloc.rpartition("@")[0]
    return urlunsplit(parts._replace(netloc=f"{auth}@127.0.0.1:{cluster.port}"))


def normalised(args: list[str]) -> list[str]:
    """--flag=value as --flag value."""
    out = []
    for a in args:
        out.extend(a.split("=", 1) if a.startswith("--") and "=" in a else [a])
    return out


def on_loopback(args: list[str], tmp: Path, database_url: str) -> tuple[list[str], int, str]:
    """The arguments with loopback's host, a free port and the test's files; the port and the URL
    the other replicas should be told."""
    args, port = normalised(args), free_port()
    out, host, advertise = [], "127.0.0.1", None
    i = 0
    while i < len(args):
        flag = args[i]
        value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
        if value is None:
            out.append(flag)
            i += 1
            continue
        if flag == "--host":
            host = value if value in WILDCARDS else "127.0.0.1"
            value = host
        elif flag == "--port":
            value = str(port)
        elif flag == "--advertise-url":
            parts = urlsplit(value)
            advertise = value = urlunsplit(parts._replace(netloc=f"127.0.0.1:{port}"))
        elif flag == "--database-url":
            value = database_url
        elif flag in PATH_FLAGS and value.startswith("/"):
            value = str(tmp / value.strip("/").replace("/", "_"))
        out += [flag, value]
        i += 2
    if "--port" not in out:
        out += ["--port", str(port)]  # the default, 8700, may be taken here
    scheme = "https" if "--tls-cert" in out else "http"
    return out, port, advertise or f"{scheme}://{'127.0.0.1' if host in WILDCARDS else host}:{port}"


def run_kvstore(args: list[str], database_url: str, tmp: Path, env: dict | None = None) -> None:
    done = subprocess.run(kvstore_cmd(*args), cwd=tmp, capture_output=True, text=True, timeout=120,
                          env={**ENV, **(env or {}), "KVSTORE_DATABASE_URL": database_url})
    assert done.returncode == 0, f"kvstore {shlex.join(args)}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"


def serves(where: str, args: list[str], database_url: str, cluster: PostgresCluster, tmp: Path,
           env: dict | None = None) -> None:
    """Start the directory as given; it must get ready and lead at the URL it was told."""
    import psycopg

    tmp.mkdir(parents=True, exist_ok=True)
    args, port, advertised = on_loopback(args, tmp, database_url)
    log = tmp / "directory.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(kvstore_cmd("directory", "serve", *args), cwd=tmp, stdout=out,
                                stderr=subprocess.STDOUT,
                                env={**ENV, **(env or {}), "KVSTORE_DATABASE_URL": database_url})
    try:
        try:
            wait_http(f"http://127.0.0.1:{port}/readyz?workers=0", timeout_s=90, proc=proc)
        except (RuntimeError, TimeoutError) as exc:
            pytest.fail(f"{where}\nkvstore directory serve {shlex.join(args)}: {exc}\n{log.read_text()[-3000:]}")
        with psycopg.connect(database_url.replace("postgresql+psycopg://", "postgresql://")) as conn:
            (url,) = conn.execute("SELECT url FROM directory_leader WHERE id = 1").fetchone()
        assert url == advertised, f"{where}: the other replicas would be sent to {url}"
        for flag in ("--admin-token-file", "--worker-token-file"):
            if flag in args:
                assert Path(args[args.index(flag) + 1]).read_text().startswith("kvs_"), f"{where}: {flag}"
    finally:
        stop(proc)


@pytest.fixture
def cluster():
    c = PostgresCluster().start()
    yield c
    c.stop()


# ---- the tests -----------------------------------------------------------------------------------

@pytest.mark.postgres
def test_the_compose_directory_starts_as_the_compose_file_says(cluster, tmp_path):
    import psycopg

    services = yaml.safe_load(COMPOSE.read_text())["services"]
    pg = services["postgres"]["environment"]
    with psycopg.connect(f"host=127.0.0.1 port={cluster.port} user=postgres dbname=postgres",
                         autocommit=True) as conn:  # what the postgres image makes of its environment
        conn.execute(f"CREATE ROLE {pg['POSTGRES_USER']} LOGIN SUPERUSER")
        conn.execute(f"CREATE DATABASE {pg['POSTGRES_DB']} OWNER {pg['POSTGRES_USER']}")

    migrate, directory = services["migrate"], services["directory"]
    for service in (migrate, directory):
        assert service["environment"]["KVSTORE_DATABASE_URL"].startswith("postgresql+psycopg://")
    url = on_cluster(directory["environment"]["KVSTORE_DATABASE_URL"], cluster)
    env = {k: str(v) for k, v in directory["environment"].items() if k != "KVSTORE_DATABASE_URL"}
    run_kvstore(list(migrate["command"]), url, tmp_path)  # the one-shot migration service
    command = list(directory["command"])
    assert command[:2] == ["directory", "serve"]
    serves("deploy/compose.yaml, service directory", command[2:], url, cluster, tmp_path / "directory", env)


@pytest.mark.postgres
def test_every_directory_command_in_operations_md_starts_on_postgresql(cluster, tmp_path):
    import psycopg

    text = OPERATIONS.read_text()
    with psycopg.connect(f"host=127.0.0.1 port={cluster.port} user=postgres dbname=postgres",
                         autocommit=True) as conn:
        for statement in documented_sql(text):  # as the superuser, the way the guide runs it
            conn.execute(statement)
    commands = documented_commands(text)
    assert len(commands) >= 3, "operations.md should show the directory's command lines"
    migrated = set()
    for i, (where, args, url) in enumerate(commands):
        url = on_cluster(url, cluster)
        if url not in migrated:  # `kvstore db upgrade` as the guide runs it: with the directory's role
            run_kvstore(["db", "upgrade"], url, tmp_path)
            migrated.add(url)
        serves(where, args, url, cluster, tmp_path / f"directory-{i}")


def documented_cli_lines(text: str) -> list[tuple[str, list[str]]]:
    """(line, arguments) of every `kvstore COMMAND ...` in the document's shell and unit blocks."""
    import typer

    from kvstore.cli.main import app

    commands = set(typer.main.get_command(app).commands)
    found = []
    for _offset, lang, body in code_blocks(text):
        if lang not in ("bash", "ini", ""):
            continue
        for line in logical_lines(body):
            if "..." in line:  # an outline, not a command
                continue
            shell = re.sub(r"\$\([^)]*\)", "VALUE", line.strip().removeprefix("ExecStart="))
            try:
                words = shlex.split(shell, comments=True)
            except ValueError:
                continue
            for stop_word in ("&&", "||", "|", ";"):
                if stop_word in words:
                    words = words[:words.index(stop_word)]
            for i, word in enumerate(words[:-1]):
                if word.rsplit("/", 1)[-1] == "kvstore" and words[i + 1] in commands:
                    found.append((line.strip(), words[i + 1:]))
                    break
    return found


def test_every_kvstore_command_in_operations_md_parses_with_the_cli():
    from typer._click.exceptions import ClickException

    from tests.unit.test_deploy import parse_cli

    lines = documented_cli_lines(OPERATIONS.read_text())
    assert len(lines) >= 10
    wrong = []
    for line, args in lines:
        try:
            parse_cli(args)
        except ClickException as exc:
            wrong.append(f"{line}\n    {exc.format_message()}")
    assert not wrong, "\n".join(wrong)


def test_the_kubernetes_image_is_one_operations_md_builds():
    import kvstore

    kustomization = yaml.safe_load((REPO / "deploy/k8s/kustomization.yaml").read_text())
    (image,) = [i for i in kustomization["images"] if i["name"] == "kvstore"]
    assert image["newTag"] == kvstore.__version__, "the tag is the version the Dockerfile's wheel carries"
    built = re.findall(r"docker build (?:--\S+ \S+ )*-t (\S+) \.", OPERATIONS.read_text())
    assert f"{image['newName']}:{image['newTag']}" in built, built
