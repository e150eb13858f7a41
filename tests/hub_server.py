"""A local stand-in for the Hugging Face Hub: the routes huggingface_hub 2.x asks for a model repository's revisions.

Served on 127.0.0.1 by ``http.server`` in a thread (``HF_ENDPOINT`` points the client at it). Routes, as the Hub
answers them (read from huggingface_hub's ``hf_api.py`` and ``file_download.py``):

- ``GET /api/models/{repo}/refs``: ``{"branches": [{"name", "ref", "targetCommit"}], "converts": [], "tags": []}``
- ``GET /api/models/{repo}/revision/{rev}``: ``{"id", "sha", "siblings": [{"rfilename"}]}`` (``repo_info``)
- ``GET /api/models/{repo}/tree/{rev}``: ``[{"type": "file", "path", "size", "oid", "lfs"?}]`` (one page)
- ``HEAD|GET /{repo}/resolve/{rev}/{file}``: the bytes, with ``ETag``, ``X-Repo-Commit``, ``Content-Length``;
  404 with ``X-Error-Code: EntryNotFound`` or ``RevisionNotFound`` otherwise.

Every request is logged (``FakeHub.requests``), so that tests can say what was downloaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


class FakeHub:
    """Model repositories with commits (``{file: bytes}``) and refs (``{name: sha}``), served over HTTP."""

    def __init__(self):
        self.commits: dict[str, dict[str, dict[str, bytes]]] = {}  # repo -> sha -> files
        self.refs: dict[str, dict[str, str]] = {}  # repo -> name -> sha
        self.tags: dict[str, set[str]] = {}
        self.requests: list[tuple[str, str]] = []
        self.held: dict[str, threading.Event] = {}  # commit -> its files are served once the event is set
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FakeHub:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def commit(self, repo: str, folder: Path | dict[str, bytes], salt: str = "") -> str:
        """Add a commit holding ``folder``'s files (or the given bytes); its sha (40 hex digits)."""
        files = (
            folder
            if isinstance(folder, dict)
            else {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir()) if p.is_file()}
        )
        digest = hashlib.sha1(salt.encode())
        for name in sorted(files):
            digest.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
        sha = digest.hexdigest()
        self.commits.setdefault(repo, {})[sha] = dict(files)
        return sha

    def point(self, repo: str, name: str, sha: str, tag: bool = False) -> None:
        self.refs.setdefault(repo, {})[name] = sha
        if tag:
            self.tags.setdefault(repo, set()).add(name)

    def files_fetched(self, repo: str) -> list[tuple[str, str]]:
        """(revision, file) of every GET of a file's bytes, in order."""
        prefix = f"/{repo}/resolve/"
        return [
            tuple(path[len(prefix) :].split("/", 1))
            for method, path in self.requests
            if method == "GET" and path.startswith(prefix)
        ]

    def resolve(self, repo: str, rev: str) -> str | None:
        if rev in self.commits.get(repo, {}):
            return rev
        return self.refs.get(repo, {}).get(rev)


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def do_HEAD(self):
            self._answer(body=False)

        def do_GET(self):
            self._answer(body=True)

        def _answer(self, body: bool):
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path))
            if path.startswith("/api/models/"):
                return self._api(path[len("/api/models/") :])
            if "/resolve/" in path:
                repo, rest = path.lstrip("/").split("/resolve/", 1)
                rev, _, filename = rest.partition("/")
                sha = hub.resolve(repo, rev)
                if sha is None:
                    return self._error(404, "RevisionNotFound", f"{rev} not found")
                files = hub.commits[repo][sha]
                if filename not in files:
                    return self._error(404, "EntryNotFound", f"{filename} not found")
                if body and sha in hub.held:  # a slow download: the bytes come when the test lets them
                    hub.held[sha].wait()
                data = files[filename]
                headers = {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Repo-Commit": sha}
                return self._send(200, data, "application/octet-stream", headers, body)
            return self._send(200, b"", "text/plain", {}, body)  # the endpoint's root: what reading/hub.py probes

        def _api(self, rest: str):
            for route in ("/refs", "/revision/", "/tree/"):
                if route in rest:
                    repo, _, rev = rest.partition(route)
                    break
            else:
                return self._error(404, "RepoNotFound", "no such route")
            if repo not in hub.commits:
                return self._error(404, "RepoNotFound", f"Repository {repo} not found")
            if route == "/refs":
                refs = hub.refs.get(repo, {})
                listed = [
                    {"name": n, "ref": f"refs/{'tags' if n in hub.tags.get(repo, ()) else 'heads'}/{n}", "targetCommit": s}
                    for n, s in refs.items()
                ]
                tags = hub.tags.get(repo, set())
                answer = {
                    "branches": [r for r in listed if r["name"] not in tags],
                    "converts": [],
                    "tags": [r for r in listed if r["name"] in tags],
                }
                return self._json(answer)
            sha = hub.resolve(repo, rev.rstrip("/"))
            if sha is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            files = hub.commits[repo][sha]
            if route == "/revision/":
                return self._json(
                    {"id": repo, "modelId": repo, "sha": sha, "siblings": [{"rfilename": n} for n in sorted(files)]}
                )
            entries = []
            for name in sorted(files):
                entry = {"type": "file", "path": name, "size": len(files[name]), "oid": hashlib.sha1(files[name]).hexdigest()}
                if name.endswith(".safetensors") or name.endswith(".bin"):
                    entry["lfs"] = {"oid": hashlib.sha256(files[name]).hexdigest(), "size": len(files[name]), "pointerSize": 130}
                entries.append(entry)
            return self._json(entries)

        def _json(self, value):
            self._send(200, json.dumps(value).encode(), "application/json", {}, self.command == "GET")

        def _error(self, status: int, code: str, message: str):
            data = json.dumps({"error": message}).encode()
            self._send(
                status, data, "application/json", {"X-Error-Code": code, "X-Error-Message": message}, self.command == "GET"
            )

        def _send(self, status: int, data: bytes, kind: str, headers: dict[str, str], body: bool):
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Connection", "close")  # no kept-alive connection outlives stop()
            self.close_connection = True
            self.end_headers()
            if body:
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client went away (Ctrl-C, a timeout)
                    self.wfile.write(data)

    return Handler
