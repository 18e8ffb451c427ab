"""A local stand-in for the Hugging Face hub's file API, and a hub-shaped cache folder, for tests of model names
(loader/hub.py). `HF_ENDPOINT` pointed at `HubStandIn.url` makes huggingface_hub download from it.

What huggingface_hub asks (snapshot_download and hf_hub_download in the installed version): the revision's commit
(`GET /api/models/ORG/NAME/revision/REV`), the commit's file list (`GET /api/models/ORG/NAME/tree/SHA`), and each
file (`HEAD` then `GET /ORG/NAME/resolve/SHA/PATH`, whose headers carry the commit and the file's etag). An unknown
repository is a 404 with `X-Error-Code: RepoNotFound`, as the hub answers.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


class HubStandIn:
    def __init__(self, repos: dict[str, dict[str, bytes]]) -> None:
        # repo id -> (commit, files); one commit per repository, on the branch "main"
        self.repos = {repo: (hashlib.sha1(repo.encode()).hexdigest(), files) for repo, files in repos.items()}
        self.requests: list[str] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                return

            def do_HEAD(self) -> None:
                stand_in._answer(self, body=False)

            def do_GET(self) -> None:
                stand_in._answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> HubStandIn:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()

    def _answer(self, handler: BaseHTTPRequestHandler, *, body: bool) -> None:
        path = unquote(urlparse(handler.path).path)
        self.requests.append(f"{handler.command} {path}")
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6:
            repo, kind, revision = "/".join(parts[2:4]), parts[4], parts[5]
            if repo not in self.repos:
                return self._send(handler, 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
            commit, files = self.repos[repo]
            if revision not in ("main", commit):
                return self._send(handler, 404, b'{"error": "Revision not found"}',
                                  {"X-Error-Code": "RevisionNotFound"})
            if kind == "revision":
                info = {"id": repo, "modelId": repo, "sha": commit, "private": False,
                        "siblings": [{"rfilename": name} for name in sorted(files)]}
                return self._send(handler, 200, json.dumps(info).encode(), {"Content-Type": "application/json"})
            if kind == "tree":
                tree = [{"type": "file", "path": name, "size": len(data), "oid": _etag(data)}
                        for name, data in sorted(files.items())]
                return self._send(handler, 200, json.dumps(tree).encode(), {"Content-Type": "application/json"})
        if len(parts) >= 5 and parts[2] == "resolve":
            repo, revision, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            if repo not in self.repos:
                return self._send(handler, 404, b"Repository not found", {"X-Error-Code": "RepoNotFound"})
            commit, files = self.repos[repo]
            if revision not in ("main", commit) or name not in files:
                return self._send(handler, 404, b"Entry not found", {"X-Error-Code": "EntryNotFound"})
            data = files[name]
            headers = {"X-Repo-Commit": commit, "ETag": f'"{_etag(data)}"', "Content-Type": "application/octet-stream"}
            return self._send(handler, 200, data if body else b"", headers, length=len(data))
        return self._send(handler, 404, b"not a route of the stand-in", {})

    @staticmethod
    def _send(handler: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict[str, str],
              length: int | None = None) -> None:
        handler.send_response(status)
        for key, value in headers.items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(data) if length is None else length))
        handler.end_headers()
        if data:
            handler.wfile.write(data)


def _etag(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


def hub_cache_with(cache: Path, repo_id: str, source: Path, *, revision: str = "main",
                   commit: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """Lay `source`'s files out as the hub cache holds a downloaded repository: blobs, a snapshot of links to
    them, and `refs/<revision>` naming the commit. Returns the snapshot folder."""
    storage = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    for file in sorted(p for p in source.rglob("*") if p.is_file()):
        data = file.read_bytes()
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / file.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path("../" * len(file.relative_to(source).parts)) / ".." / "blobs" / blob.name)
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / revision).write_text(commit)
    return snapshot
