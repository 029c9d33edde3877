"""A stand-in for the Hugging Face hub on 127.0.0.1: it answers the few calls that
``huggingface_hub.snapshot_download`` makes (the revision's info, its file tree, each file's
metadata and contents) for repositories the test wrote to local folders, so the download path
runs offline. Give its ``url`` as ``HF_ENDPOINT``.

``FakeHub({"org/name": {"main": folder, "v1": other_folder}})``: each revision is a folder and
gets a commit sha of its own. ``requests`` records the paths asked; while ``drop_over`` is set, a file
larger than that many bytes is sent half-way and the connection dropped. A ``Range`` request
(a resumed download) gets the rest."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


class FakeHub:
    def __init__(self, repos: dict[str, dict[str, Path]]):
        self.repos = {repo: {rev: Path(folder) for rev, folder in revs.items()} for repo, revs in repos.items()}
        self.shas = {repo: {rev: hashlib.sha1(f"{repo}@{rev}".encode()).hexdigest() for rev in revs} for repo, revs in repos.items()}
        self.requests: list[str] = []
        self.drop_over: int | None = None
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                hub._handle(self, body=True)

            def do_HEAD(self):
                hub._handle(self, body=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    # ------------------------------------------------------------------ answers

    def _revision(self, repo: str, rev: str) -> tuple[str, Path] | None:
        revs = self.repos.get(repo)
        if revs is None:
            return None
        for name, folder in revs.items():
            if rev in (name, self.shas[repo][name]):
                return self.shas[repo][name], folder
        return None

    def _files(self, folder: Path) -> list[Path]:
        return sorted(p for p in folder.rglob("*") if p.is_file())

    def _handle(self, request: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(request.path).path)
        self.requests.append(f"{request.command} {path}")
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"]:
            return self._api(request, parts[2:])
        if "resolve" in parts:
            i = parts.index("resolve")
            repo, rev, name = "/".join(parts[:i]), parts[i + 1], "/".join(parts[i + 2:])
            found = self._revision(repo, rev)
            if found is None or not (found[1] / name).is_file():
                return self._error(request, 404, "EntryNotFound" if found else "RepoNotFound")
            data = (found[1] / name).read_bytes()
            start = 0
            ranged = request.headers.get("Range", "")
            if ranged.startswith("bytes=") and ranged[6:].split("-")[0].isdigit():  # a resumed download
                start = int(ranged[6:].split("-")[0])
            request.send_response(206 if start else 200)
            if start:
                request.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            data_len = len(data)
            data = data[start:]
            request.send_header("X-Repo-Commit", found[0])
            request.send_header("ETag", f'"{hashlib.sha256((found[1] / name).read_bytes()).hexdigest()}"')
            request.send_header("Content-Length", str(len(data)))
            request.end_headers()
            if body:
                if self.drop_over is not None and data_len > self.drop_over:
                    request.wfile.write(data[: len(data) // 2])  # then the connection drops
                    request.close_connection = True
                    return
                request.wfile.write(data)
            return None
        return self._error(request, 404, "RepoNotFound")

    def _api(self, request, parts: list[str]) -> None:
        # org/name/revision/<rev>  or  org/name/tree/<rev>[/path]
        for key in ("revision", "tree"):
            if key in parts:
                i = parts.index(key)
                repo, rev = "/".join(parts[:i]), parts[i + 1]
                break
        else:
            repo, rev, key = "/".join(parts), "main", "revision"
        found = self._revision(repo, rev)
        if found is None:
            kind = "RevisionNotFound" if repo in self.repos else "RepoNotFound"
            return self._error(request, 404, kind)
        sha, folder = found
        files = [p.relative_to(folder).as_posix() for p in self._files(folder)]
        if key == "revision":
            payload = {"id": repo, "modelId": repo, "sha": sha, "siblings": [{"rfilename": f} for f in files], "private": False}
        else:
            payload = [{"type": "file", "path": f, "size": (folder / f).stat().st_size, "oid": hashlib.sha1((folder / f).read_bytes()).hexdigest()} for f in files]
        data = json.dumps(payload).encode()
        request.send_response(200)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)
        return None

    def _error(self, request, status: int, code: str) -> None:
        data = json.dumps({"error": code}).encode()
        request.send_response(status)
        request.send_header("X-Error-Code", code)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        if request.command != "HEAD":
            request.wfile.write(data)
