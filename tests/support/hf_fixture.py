"""A local HTTP server that speaks the part of the Hugging Face Hub API that huggingface_hub's
`snapshot_download` (and its `dry_run=True`) uses, so the real huggingface_hub talks to it through
HF_ENDPOINT: repo info, the recursive tree listing, HEAD and GET of `resolve/<commit>/<file>`.
Nothing of huggingface_hub is replaced. `listed_sizes` makes a repo claim large files it does not hold
(the sizes the listing and HEAD report), to test the weight-size policy without gigabytes.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


class HubServer:
    def __init__(self, repos: dict[str, dict[str, bytes]], commit: str = "d" * 40,
                 listed_sizes: dict[str, int] | None = None):
        self.repos, self.commit, self.listed_sizes = repos, commit, listed_sizes or {}
        self.requests: list[tuple[str, str]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                server.requests.append((self.command, self.path))
                path = unquote(urlsplit(self.path).path)
                segs = [s for s in path.split("/") if s]
                if segs[:2] == ["api", "models"] and len(segs) >= 6 and segs[4] in ("revision", "tree"):
                    repo = f"{segs[2]}/{segs[3]}"
                    if repo not in server.repos:
                        return self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
                    if segs[4] == "revision":
                        body = {"id": repo, "sha": server.commit,
                                "siblings": [{"rfilename": p} for p in sorted(server.repos[repo])]}
                    else:
                        body = [{"type": "file", "path": p, "size": server.size(repo, p), "oid": server.oid(d)}
                                for p, d in sorted(server.repos[repo].items())]
                    return self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})
                if len(segs) >= 5 and segs[2] == "resolve":
                    repo, file = f"{segs[0]}/{segs[1]}", "/".join(segs[4:])
                    files = server.repos.get(repo)
                    if files is None or file not in files:
                        return self._send(404, b"", {"X-Error-Code": "EntryNotFound"})
                    data = files[file]
                    headers = {"X-Repo-Commit": server.commit, "ETag": f'"{server.oid(data)}"',
                               "Content-Type": "application/octet-stream"}
                    if self.command == "HEAD":
                        headers["Content-Length"] = str(server.size(repo, file))
                        return self._send(200, b"", headers, length=False)
                    return self._send(200, data, headers)
                return self._send(404, b"{}", {"Content-Type": "application/json"})

            do_HEAD = do_GET

            def _send(self, status, body, headers, length=True):
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                if length:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def size(self, repo: str, path: str) -> int:
        return self.listed_sizes.get(f"{repo}/{path}", len(self.repos[repo][path]))

    @staticmethod
    def oid(data: bytes) -> str:
        return hashlib.sha1(data).hexdigest()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
