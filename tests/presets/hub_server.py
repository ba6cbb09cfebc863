"""A Hugging Face Hub stand-in on loopback: the routes huggingface_hub's
downloads and commits use, over an in-memory store of model repositories.

Downloads: `GET /api/models/{repo}/revision/{rev}` (repo_info),
`GET /api/models/{repo}/tree/{rev}` (file listing), `HEAD`/`GET
/{repo}/resolve/{rev}/{path}` (headers `X-Repo-Commit`, `ETag`,
`Content-Length`; errors carry `X-Error-Code`). Publishing:
`POST /api/repos/create`, `POST /api/models/{repo}/preupload/{rev}` (every
file "regular", so the commit carries the bytes) and `POST
/api/models/{repo}/commit/{rev}` (ndjson, base64 files).
"""

import base64
import hashlib
import http.server
import json
import threading
import urllib.parse


def _git_blob_oid(data):
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    def __init__(self):
        self.repos = {}  # repo_id -> {"refs": {branch: commit}, "commits": {commit: {path: bytes}}}
        self.requests = []  # (method, path, authorization header)
        self.private = {}  # repo_id -> the token that may read it
        self._server = None

    # --- store ---------------------------------------------------------

    def commit(self, repo_id, files, branch="main"):
        """Adds a commit of `files` ({path: bytes}) on top of `branch`; returns its hash."""
        repo = self.repos.setdefault(repo_id, {"refs": {}, "commits": {}})
        parent = repo["refs"].get(branch)
        tree = {**repo["commits"].get(parent, {}), **files}
        digest = hashlib.sha1(repr((parent, sorted(tree.items()))).encode()).hexdigest()
        repo["commits"][digest] = tree
        repo["refs"][branch] = digest
        return digest

    def _resolve(self, repo_id, revision, authorization=None):
        repo = self.repos.get(repo_id)
        # As the Hub does, a private repository is "not found" without its token.
        if repo is None or (
            repo_id in self.private and authorization != f"Bearer {self.private[repo_id]}"
        ):
            return None, None
        commit = repo["refs"].get(revision, revision)
        return repo, (commit if commit in repo["commits"] else None)

    # --- server --------------------------------------------------------

    def start(self):
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()
        return self

    def stop(self):
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _Handler(http.server.BaseHTTPRequestHandler):
    hub = None
    # One request per connection: a stopped server leaves no kept-alive
    # connection behind that would go on answering.
    protocol_version = "HTTP/1.0"

    def log_message(self, *args):
        pass

    def _send(self, status, body=b"", headers=None, head=False):
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
            headers = {"Content-Type": "application/json", **(headers or {})}
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _error(self, code, message, head=False):
        self._send(
            404, {"error": message}, {"X-Error-Code": code, "X-Error-Message": message}, head
        )

    def _route(self, method):
        parsed = urllib.parse.urlsplit(self.path)
        parts = [urllib.parse.unquote(p) for p in parsed.path.strip("/").split("/")]
        self.hub.requests.append((method, parsed.path, self.headers.get("authorization")))
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        head = method == "HEAD"
        if parts[:2] == ["api", "repos"] and parts[2:] == ["create"] and method == "POST":
            return self._create(json.loads(body))
        if parts[:2] == ["api", "models"] and len(parts) >= 6:
            repo_id, action, revision = "/".join(parts[2:4]), parts[4], parts[5]
            repo, commit = self.hub._resolve(repo_id, revision, self.headers.get("authorization"))
            if repo is None:
                return self._error("RepoNotFound", f"Repository {repo_id} not found")
            if action == "preupload" and method == "POST":
                files = json.loads(body)["files"]
                return self._send(
                    200,
                    {
                        "files": [
                            {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                            for f in files
                        ]
                    },
                )
            if action == "commit" and method == "POST":
                return self._commit(repo_id, revision, body)
            if commit is None:
                return self._error("RevisionNotFound", f"Invalid rev id: {revision}")
            tree = repo["commits"][commit]
            if action == "revision":
                siblings = [{"rfilename": p} for p in sorted(tree)]
                return self._send(
                    200, {"id": repo_id, "sha": commit, "siblings": siblings, "private": False}
                )
            if action == "tree":
                return self._send(
                    200,
                    [
                        {"type": "file", "path": p, "size": len(d), "oid": _git_blob_oid(d)}
                        for p, d in sorted(tree.items())
                    ],
                )
        if len(parts) >= 5 and parts[2] == "resolve" and method in ("GET", "HEAD"):
            repo_id, revision, path = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            repo, commit = self.hub._resolve(repo_id, revision, self.headers.get("authorization"))
            if repo is None:
                return self._error("RepoNotFound", f"Repository {repo_id} not found", head)
            if commit is None:
                return self._error("RevisionNotFound", f"Invalid rev id: {revision}", head)
            data = repo["commits"][commit].get(path)
            if data is None:
                return self._error("EntryNotFound", f"{path} does not exist", head)
            headers = {"X-Repo-Commit": commit, "ETag": f'"{_git_blob_oid(data)}"'}
            return self._send(200, data, headers, head)
        return self._send(404, {"error": f"no route {method} {parsed.path}"})

    def _create(self, payload):
        repo_id = f"{payload['organization']}/{payload['name']}"
        if repo_id in self.hub.repos:
            return self._send(409, {"error": "You already created this model repo"})
        self.hub.repos[repo_id] = {"refs": {}, "commits": {}}
        self.hub.commit(repo_id, {})
        return self._send(200, {"url": f"{self.hub.url}/{repo_id}", "name": repo_id})

    def _commit(self, repo_id, revision, body):
        files = {}
        for line in body.splitlines():
            item = json.loads(line)
            if item["key"] == "file":
                value = item["value"]
                files[value["path"]] = base64.b64decode(value["content"])
        commit = self.hub.commit(repo_id, files, branch=revision)
        return self._send(
            200,
            {
                "commitUrl": f"{self.hub.url}/{repo_id}/commit/{commit}",
                "commitOid": commit,
                "pullRequestUrl": None,
            },
        )

    def do_GET(self):
        self._route("GET")

    def do_HEAD(self):
        self._route("HEAD")

    def do_POST(self):
        self._route("POST")
