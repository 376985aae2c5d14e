"""A Hugging Face Hub on 127.0.0.1 for tests: the few routes `huggingface_hub`'s downloads use.

`FakeHub(repos)` serves each repo (`org/name` -> {revision -> {file name -> bytes}}) under
`url`, and records every file body it sent (`downloads`), so a test can check what a client
fetched. Routes: `GET /api/models/<repo>/revision/<rev>` (the commit), `GET
/api/models/<repo>/tree/<commit>` (the listing), `HEAD`/`GET /<repo>/resolve/<commit>/<file>`.
Unknown repos, revisions and files answer 404 with the hub's `X-Error-Code`.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

Files = dict[str, bytes]


def commit_of(revision: str, files: Files) -> str:
    """A 40-hex commit id for one revision's contents (stable, as a real commit's)."""
    digest = hashlib.sha1(revision.encode())
    for name in sorted(files):
        digest.update(name.encode() + hashlib.sha1(files[name]).digest())
    return digest.hexdigest()


class FakeHub:
    def __init__(self, repos: dict[str, dict[str, Files]]) -> None:
        self.commits: dict[str, dict[str, str]] = {}  # repo -> revision or commit -> commit
        self.files: dict[tuple[str, str], Files] = {}  # (repo, commit) -> files
        for repo, revisions in repos.items():
            for revision, files in revisions.items():
                commit = commit_of(revision, files)
                self.commits.setdefault(repo, {}).update({revision: commit, commit: commit})
                self.files[repo, commit] = files
        self.downloads: list[str] = []  # "repo/file" of every body sent
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hub._answer(self, body=True)

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _answer(self, request: BaseHTTPRequestHandler, body: bool) -> None:
        parts = [unquote(p) for p in urlsplit(request.path).path.strip("/").split("/")]
        if parts[:2] == ["api", "models"] and len(parts) >= 6:
            repo, route, revision = "/".join(parts[2:4]), parts[4], parts[5]
            commit = self._commit(request, repo, revision, body)
            if commit is None:
                return
            if route == "revision":
                siblings = [{"rfilename": name} for name in self.files[repo, commit]]
                self._send(request, 200, json.dumps({"id": repo, "sha": commit,
                                                     "siblings": siblings}).encode(), body)
            else:  # tree, recursive: every file
                tree = [{"type": "file", "path": name, "size": len(data),
                         "oid": hashlib.sha1(data).hexdigest()}
                        for name, data in self.files[repo, commit].items()]
                self._send(request, 200, json.dumps(tree).encode(), body)
            return
        if len(parts) >= 5 and parts[2] == "resolve":
            repo, name = "/".join(parts[:2]), "/".join(parts[4:])
            commit = self._commit(request, repo, parts[3], body)
            if commit is None:
                return
            data = self.files[repo, commit].get(name)
            if data is None:
                self._send(request, 404, b"", body, error="EntryNotFound")
                return
            headers = {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha1(data).hexdigest()}"'}
            if body:
                self.downloads.append(f"{repo}/{name}")
            self._send(request, 200, data, body, headers=headers)
            return
        self._send(request, 404, b"", body, error="RepoNotFound")

    def _commit(self, request: BaseHTTPRequestHandler, repo: str, revision: str,
                body: bool) -> str | None:
        if repo not in self.commits:
            self._send(request, 404, b"", body, error="RepoNotFound")
            return None
        commit = self.commits[repo].get(revision)
        if commit is None:
            self._send(request, 404, b"", body, error="RevisionNotFound")
        return commit

    @staticmethod
    def _send(request: BaseHTTPRequestHandler, status: int, data: bytes, body: bool,
              error: str | None = None, headers: dict[str, str] | None = None) -> None:
        request.send_response(status)
        request.send_header("Content-Length", str(len(data)))
        if error is not None:
            request.send_header("X-Error-Code", error)
        for key, value in (headers or {}).items():
            request.send_header(key, value)
        request.end_headers()
        if body:
            request.wfile.write(data)
