"""A local HTTP server that speaks the part of the ModelScope hub API that `modelscope.snapshot_download`
uses (file listing and file download), so the real `modelscope` library fills a real ModelScope cache
here, where modelscope.cn cannot be reached. Nothing of modelscope is replaced: the tests point
MODELSCOPE_ENDPOINT at this server, let the library download, then go offline and read its cache.

    GET /api/v1/models/{owner}/{name}                       repo info
    GET /api/v1/models/{owner}/{name}/repo/files?Revision=  {"Data": {"Files": [{Path, Type, Size, Sha256}]}}
    GET /api/v1/models/{owner}/{name}/repo?Revision=&FilePath=   the file's bytes
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit


class ModelScopeServer:
    def __init__(self, repos: dict[str, dict[str, dict[str, bytes]]], listed_sizes: dict[str, int] | None = None):
        """repos: {"Org/Name": {revision: {path: bytes}}}; the default branch is "master". listed_sizes:
        {"Org/Name/path": size} the listing claims instead of the real size (a large repo in a few bytes)."""
        self.repos = repos
        self.listed_sizes = listed_sizes or {}
        self.requests: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                server.requests.append(self.path)
                parts = urlsplit(self.path)
                query = {k: v[0] for k, v in parse_qs(parts.query).items()}
                segs = [unquote(s) for s in parts.path.split("/") if s]
                if segs[:3] != ["api", "v1", "models"] or len(segs) < 5:
                    return self._json(404, {"Code": 404, "Success": False, "Message": "not found"})
                repo_id, rest = f"{segs[3]}/{segs[4]}", segs[5:]
                revisions = server.repos.get(repo_id)
                if revisions is None:
                    return self._json(404, {"Code": 10010205001, "Success": False,
                                            "Message": f"model {repo_id} not found"})
                if not rest:
                    return self._json(200, {"Code": 200, "Success": True,
                                            "Data": {"Path": segs[3], "Name": segs[4], "Revision": "master"}})
                files = revisions.get(query.get("Revision") or "master")
                if files is None:
                    return self._json(404, {"Code": 404, "Success": False, "Message": "revision not found"})
                if rest == ["repo", "files"]:
                    listing = [{"Name": p.rsplit("/", 1)[-1], "Path": p, "Type": "blob",
                                "Size": server.listed_sizes.get(f"{repo_id}/{p}", len(d)),
                                "Sha256": hashlib.sha256(d).hexdigest()} for p, d in sorted(files.items())]
                    return self._json(200, {"Code": 200, "Success": True, "Data": {"Files": listing}})
                if rest == ["repo"] and query.get("FilePath") in files:
                    data = files[query["FilePath"]]
                    self.send_response(200)
                    self.send_header("Content-Type", "application/octet-stream")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                    return None
                return self._json(404, {"Code": 404, "Success": False, "Message": "file not found"})

            do_HEAD = do_GET

            def _json(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


FILL = r"""
import sys
from modelscope import snapshot_download
print(snapshot_download(sys.argv[1], revision=sys.argv[2] or None, allow_patterns=sys.argv[3:] or None))
"""


def modelscope_env(cache: Path, endpoint: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MODELSCOPE_", "HF_"))}
    env.update(MODELSCOPE_CACHE=str(cache), HOME=str(cache.parent / "home"))
    if endpoint:
        env["MODELSCOPE_ENDPOINT"] = endpoint
    return env


def fill_cache(server: ModelScopeServer, cache: Path, repo_id: str, revision: str | None = None,
               patterns: list[str] | None = None) -> Path:
    """Let the real modelscope library download `repo_id` from `server` into `cache`; its snapshot dir."""
    proc = subprocess.run([sys.executable, "-c", FILL, repo_id, revision or "", *(patterns or [])],
                          env=modelscope_env(cache, server.url), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(proc.stdout.strip().splitlines()[-1])
